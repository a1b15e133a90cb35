"""Reading a PEFT LoRA adapter directory: ``adapter_config.json`` + the adapter's tensors.

PEFT saves, for every adapted linear ``<module>`` of the base model, ``base_model.model.
<module>.lora_A.weight [r, in]`` and ``...lora_B.weight [out, r]``; the layer computes
``W x + scaling * B (A x)`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` for rsLoRA),
``r`` and ``alpha`` per module from ``rank_pattern`` / ``alpha_pattern`` (keys matched
against the end of the module's name, PEFT's rule) or the defaults.

What the engine cannot serve is refused here, by name, before anything runs: DoRA
(a per-output magnitude that rescales the merged weight), trained biases, adapters on
embeddings or the LM head, extra trained modules (``modules_to_save``), other PEFT
methods, ranks above ``max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
_PREFIX = "base_model.model."
# <module>.lora_A.weight, or with the adapter's name kept: <module>.lora_A.<name>.weight
_LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_REFUSED_TENSORS = (
    ("lora_magnitude_vector", "DoRA (use_dora) adapters are not supported"),
    ("lora_embedding_", "adapters on embeddings are not supported"),
    (".bias", "adapters with trained biases are not supported"),
)


@dataclass(frozen=True)
class PEFTConfig:
    """The parts of ``adapter_config.json`` that decide what the adapter computes."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    @classmethod
    def read(cls, adapter_dir: Path) -> PEFTConfig:
        path = adapter_dir / CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"LoRA adapter {str(adapter_dir)!r} has no {CONFIG_FILE}")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"LoRA adapter {str(adapter_dir)!r}: cannot read {CONFIG_FILE}: "
                             f"{exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"LoRA adapter {str(adapter_dir)!r}: {CONFIG_FILE} is not a "
                             "JSON object")
        return cls.from_dict(raw, str(adapter_dir))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> PEFTConfig:
        def refuse(why: str) -> ValueError:
            return ValueError(f"LoRA adapter {where!r}: {why}")

        peft_type = str(raw.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise refuse(f"PEFT type {peft_type} is not LoRA")
        if raw.get("use_dora"):
            raise refuse("DoRA (use_dora) adapters are not supported")
        if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
            raise refuse(f"adapters with trained biases (bias={raw.get('bias')!r}, "
                         f"lora_bias={raw.get('lora_bias')!r}) are not supported")
        if raw.get("modules_to_save"):
            raise refuse(f"extra trained modules (modules_to_save={raw['modules_to_save']!r})"
                         " are not supported")
        if raw.get("target_parameters"):
            raise refuse("adapters on parameters (target_parameters) are not supported")
        if raw.get("trainable_token_indices"):
            raise refuse("trainable token indices are not supported")
        targets = raw.get("target_modules") or ()
        if isinstance(targets, str):
            targets = (targets,)
        refused = sorted(t for t in targets if t.rsplit(".", 1)[-1] in _UNSUPPORTED_TARGETS)
        if refused:
            raise refuse(f"target modules {refused} (embeddings and the LM head) are not "
                         "supported")
        try:
            r = int(raw["r"])
            alpha = float(raw.get("lora_alpha", r))
            rank_pattern = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
            alpha_pattern = {str(k): float(v)
                             for k, v in (raw.get("alpha_pattern") or {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise refuse(f"malformed r / lora_alpha / patterns ({exc})") from None
        if r < 1:
            raise refuse(f"rank r={r} must be >= 1")
        return cls(r, alpha, bool(raw.get("use_rslora", False)), rank_pattern, alpha_pattern,
                   raw.get("base_model_name_or_path"))

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def scaling(self, module: str) -> float:
        """``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``) of ``module`` with its patterns."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module),
                                       self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


_UNSUPPORTED_TARGETS = frozenset({"embed_tokens", "lm_head", "wte", "embed_in", "embed_out",
                                  "word_embeddings", "tok_embeddings", "output"})


def _pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    """PEFT's rule: the first pattern key matching the end of the module name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass
class AdapterModule:
    """One adapted linear: ``y += scaling * lora_b @ (lora_a @ x)``."""

    name: str  # the base model's module, e.g. "model.layers.0.self_attn.q_proj"
    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class PEFTAdapter:
    config: PEFTConfig
    modules: dict[str, AdapterModule]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def _weights_file(adapter_dir: Path) -> Path:
    for name in (SAFETENSORS_FILE, PICKLE_FILE):
        if (adapter_dir / name).is_file():
            return adapter_dir / name
    raise ValueError(f"LoRA adapter {str(adapter_dir)!r} has neither {SAFETENSORS_FILE} nor "
                     f"{PICKLE_FILE}")


def _adapter_dir(path: str) -> Path:
    adapter_dir = Path(path).expanduser()
    if not adapter_dir.is_dir():
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    return adapter_dir


def _module_names(names: list[str], where: str) -> dict[str, dict[str, str]]:
    """Checkpoint names -> {module: {"A": name, "B": name}}; anything else refused."""
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        match = _LORA_TENSOR.match(name)
        if match is None:
            why = next((why for key, why in _REFUSED_TENSORS if key in name),
                       "only lora_A / lora_B weights of linear layers are supported")
            raise ValueError(f"LoRA adapter {where!r}: tensor {name!r}: {why}")
        module = match["module"].removeprefix(_PREFIX)
        modules.setdefault(module, {})[match["which"]] = name
    for module, pair in modules.items():
        if len(pair) != 2:
            raise ValueError(f"LoRA adapter {where!r}: module {module!r} has lora_"
                             f"{next(iter(pair))} without its other half")
    if not modules:
        raise ValueError(f"LoRA adapter {where!r} holds no LoRA weights")
    return modules


def _check_pair(where: str, module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                max_lora_rank: int | None) -> None:
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        raise ValueError(f"LoRA adapter {where!r}: module {module!r} has lora_A {a_shape} "
                         f"and lora_B {b_shape}, not [r, in] and [out, r]")
    if max_lora_rank is not None and a_shape[0] > max_lora_rank:
        raise ValueError(f"LoRA adapter {where!r}: module {module!r} has rank {a_shape[0]}, "
                         f"above max_lora_rank={max_lora_rank} (raise --max-lora-rank)")


def check_adapter(path: str, max_lora_rank: int | None = None) -> PEFTConfig:
    """The adapter's config, after checking everything that needs no model: the config,
    the tensor names and shapes (read from the file header, not the data), the ranks."""
    adapter_dir = _adapter_dir(path)
    config = PEFTConfig.read(adapter_dir)
    weights = _weights_file(adapter_dir)
    if weights.name != SAFETENSORS_FILE:
        read_adapter(path, max_lora_rank)  # no header to read: load it whole
        return config
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"LoRA adapter {path!r}: cannot read {weights.name}: {exc}") from None
    for module, pair in _module_names(list(shapes), path).items():
        _check_pair(path, module, shapes[pair["A"]], shapes[pair["B"]], max_lora_rank)
    return config


def read_adapter(path: str, max_lora_rank: int | None = None) -> PEFTAdapter:
    """Load and check the adapter at ``path`` (tensors on the host, as saved)."""
    adapter_dir = _adapter_dir(path)
    config = PEFTConfig.read(adapter_dir)
    weights = _weights_file(adapter_dir)
    try:
        if weights.name == SAFETENSORS_FILE:
            from safetensors.torch import load_file

            tensors = load_file(str(weights))
        else:
            tensors = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"LoRA adapter {path!r}: cannot read {weights.name}: {exc}") from None
    modules = {}
    for module, pair in _module_names(list(tensors), path).items():
        a, b = tensors[pair["A"]], tensors[pair["B"]]
        _check_pair(path, module, tuple(a.shape), tuple(b.shape), max_lora_rank)
        modules[module] = AdapterModule(module, a, b, config.scaling(module))
    return PEFTAdapter(config, modules)
