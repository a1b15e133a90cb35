"""Snapshots of transformers configs, so a warm start need not import transformers'
config modules.

Why: transformers 5 builds a config class through a chain of imports (``type_validators``
-> ``activations`` -> hub kernels -> ``core_model_loading`` -> ``torch.distributed.tensor``)
that costs ~1 s of every start on a 2-core CPU, for an object the engine only reads
attributes from. The first load of a model directory goes through ``AutoConfig``; every
attribute value of the resulting config is written to ``$ENGINE_CACHE_DIR/hf_configs``
under a key of the ``config.json`` bytes and the transformers version. Later loads of the
same bytes get a ``ConfigSnapshot`` with those values.

A snapshot is exact where it answers and defers where it cannot: attribute values that
JSON cannot hold (objects other than dtypes, sets and tuples) and every method of the
config class are served by the real config, loaded on first such use (with the
snapshot's own attribute changes replayed onto it). Only text configs are snapshotted
(``get_text_config()`` is the config itself); vision-language and composite configs
always load through transformers, as does any model the Transformers backend runs or
that ``--hf-overrides`` changes (``load_model_files`` asks for the real config then: a
config class's properties recompute from what an override changes, a snapshot's values
would not).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.core.cache_paths import cache_dirs, entry_key, read_entries, write_entry

logger = logging.getLogger(__name__)

FORMAT = 1
CACHE_ENV = "ENGINE_CONFIG_SNAPSHOTS"  # "0" turns snapshots off (always AutoConfig)
_TAG = "__engine_value__"


def snapshots_enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1") != "0"


def _encode(value: Any) -> Any:
    """A JSON form of ``value`` (TypeError when there is none)."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "value": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "value": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {_TAG: type(value).__name__, "value": [_encode(v) for v in sorted(value)]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            # JSON keys are strings: int-keyed maps (id2label) keep their key types.
            return {_TAG: "items", "value": [[_encode(k), _encode(v)] for k, v in value.items()]}
        if _TAG in value:
            raise TypeError(f"a dict with the key {_TAG!r}")
        return {k: _encode(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} has no JSON form")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: _decode(v) for k, v in value.items()}
    inner = value["value"]
    if tag == "dtype":
        import torch

        return getattr(torch, inner)
    if tag == "tuple":
        return tuple(_decode(v) for v in inner)
    if tag == "set":
        return {_decode(v) for v in inner}
    if tag == "frozenset":
        return frozenset(_decode(v) for v in inner)
    if tag == "items":
        return {_decode(k): _decode(v) for k, v in inner}
    raise ValueError(f"unknown snapshot value tag {tag!r}")


class ConfigSnapshot:
    """The recorded attributes of one transformers config (see the module docstring)."""

    def __init__(self, path: Path, class_name: str, values: dict[str, Any],
                 deferred: list[str], aliases: dict[str, str],
                 load_real: Callable[[Path], Any]) -> None:
        state = self.__dict__
        state["_snapshot_path"] = path
        state["_snapshot_class"] = class_name
        state["_snapshot_deferred"] = frozenset(deferred)
        state["_snapshot_aliases"] = dict(aliases)
        state["_snapshot_load_real"] = load_real
        state["_snapshot_real"] = None
        state["_snapshot_changes"] = {}
        state["_snapshot_lock"] = threading.Lock()
        state.update(values)

    def real_config(self) -> Any:
        """The transformers config this snapshot was taken of (loaded once, with every
        attribute set on the snapshot since applied to it too)."""
        state = self.__dict__
        with state["_snapshot_lock"]:
            if state["_snapshot_real"] is None:
                real = state["_snapshot_load_real"](state["_snapshot_path"])
                for name, value in state["_snapshot_changes"].items():
                    setattr(real, name, value)
                state["_snapshot_real"] = real
            return state["_snapshot_real"]

    def get_text_config(self, *args: Any, **kwargs: Any) -> ConfigSnapshot:
        """Only text configs are snapshotted: the text config is the config itself."""
        return self

    def __getattr__(self, name: str) -> Any:
        # Reached only for names not recorded: dunders (pickle's probes) and private names
        # stay absent; deferred values and the config class's methods come from the real one.
        if name.startswith(("__", "_snapshot_")):
            raise AttributeError(name)
        target = self.__dict__["_snapshot_aliases"].get(name)
        if target is not None and target in self.__dict__:  # attribute_map, as transformers
            return self.__dict__[target]
        if name in self.__dict__["_snapshot_deferred"]:
            return getattr(self.real_config(), name)
        raise AttributeError(
            f"'{self.__dict__['_snapshot_class']}' snapshot has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        aliases = self.__dict__["_snapshot_aliases"]
        target = aliases.get(name, name)
        self.__dict__[target] = value
        for alias, aliased in aliases.items():
            if aliased == target:
                self.__dict__[alias] = value
        self.__dict__["_snapshot_changes"][target] = value
        real = self.__dict__["_snapshot_real"]
        if real is not None:
            setattr(real, target, value)

    def __dir__(self) -> list[str]:
        """The config's names (recorded, deferred, methods), not the snapshot's own."""
        names = {n for n in self.__dict__ if not n.startswith("_snapshot_")}
        return sorted(names | self.__dict__["_snapshot_deferred"] | {"get_text_config"})

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_snapshot_real"] = None  # workers load their own when they need it
        del state["_snapshot_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_snapshot_lock"] = threading.Lock()

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self.__dict__['_snapshot_class']}, {self._snapshot_path})"


def _public_values(config: Any) -> tuple[dict[str, Any], list[str], list[str]]:
    """(JSON-able attribute values, names whose values are not, method names)."""
    values: dict[str, Any] = {}
    deferred: list[str] = []
    methods: list[str] = []
    for name in dir(config):
        if name.startswith("__"):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 (a property that refuses: the real one answers)
            deferred.append(name)
            continue
        if callable(value):
            methods.append(name)
            continue
        try:
            values[name] = _encode(value)
        except TypeError:
            deferred.append(name)
    return values, deferred, methods


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Keeps transformers' deprecation warnings (``torch_dtype``, ``use_return_dict``) out
    of the log while every attribute is read."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class ConfigSnapshotStore:
    """Reads and writes the snapshots of one cache directory list."""

    def __init__(self, directories: list[Path] | None = None) -> None:
        self.directories = directories if directories is not None else cache_dirs("hf_configs")

    @staticmethod
    def key(config_bytes: bytes) -> str:
        return entry_key([config_bytes], FORMAT)

    def load(self, path: Path, load_real: Callable[[Path], Any]) -> ConfigSnapshot | None:
        """The snapshot of ``path/config.json``, or None when none is stored (or it is
        unreadable: it is then rebuilt)."""
        try:
            key = self.key((path / "config.json").read_bytes())
        except OSError:
            return None
        for text in read_entries(self.directories, f"{key}.json"):
            try:
                return self._from_record(path, json.loads(text), load_real)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                logger.debug("config snapshot of %s is unusable (%s): rebuilding it", path, exc)
        return None

    @staticmethod
    def _from_record(path: Path, record: dict[str, Any],
                     load_real: Callable[[Path], Any]) -> ConfigSnapshot:
        if record.get("format") != FORMAT:
            raise ValueError(f"format {record.get('format')}")
        values = {name: _decode(value) for name, value in record["values"].items()}
        for name in ("_name_or_path", "name_or_path"):  # the same bytes, another directory
            if name in values:
                values[name] = str(path)
        deferred = list(record["deferred"]) + list(record["methods"])
        return ConfigSnapshot(path, record["class"], values, deferred, record["aliases"],
                              load_real)

    def save(self, path: Path, config: Any, load_real: Callable[[Path], Any]) -> bool:
        """Record ``config`` (just loaded from ``path``) when a snapshot can stand for it:
        a text config whose every recorded value reads back equal. False otherwise."""
        try:
            if config.get_text_config() is not config:
                return False  # composite (vision-language, encoder-decoder) configs
            with _quiet_transformers():
                values, deferred, methods = _public_values(config)
            aliases = dict(getattr(config, "attribute_map", None) or {})
            record = {
                "format": FORMAT,
                "class": type(config).__name__,
                "values": values,
                "deferred": deferred,
                "methods": methods,
                "aliases": aliases,
            }
            text = json.dumps(record, sort_keys=True)
            snapshot = self._from_record(path, json.loads(text), load_real)
            with _quiet_transformers():
                for name in values:
                    if getattr(snapshot, name) != getattr(config, name):
                        logger.debug("config snapshot of %s: %s reads back different", path, name)
                        return False
            key = self.key((path / "config.json").read_bytes())
        except (OSError, TypeError, ValueError, AttributeError) as exc:
            logger.debug("no config snapshot for %s: %s", path, exc)
            return False
        return write_entry(self.directories, f"{key}.json", text) is not None
