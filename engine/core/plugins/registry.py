"""Plugin discovery, validation and platform resolution.

Plugins are found only through entry points of the ``engine.plugins`` group, so the
in-tree plugins prove the path third parties use. Loading a plugin never crashes the
engine: an import error marks it *broken*, a wrong or missing API version marks it
*refused*, and both are listed with the reason. Only plugins with status *ok* stay
registered in the pluggy manager, so later registries may call any hook freely.
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from engine.core.interfaces import PLUGIN_API_VERSION, Platform, ProbeResult
from engine.core.plugins import hookspecs

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "engine.plugins"
ALLOWLIST_ENV = "ENGINE_PLUGINS"  # comma-separated plugin names; unset: all plugins


class PluginStatus(str, enum.Enum):
    OK = "ok"
    REFUSED = "refused"  # loaded, but declares an unsupported (or no) plugin API version
    BROKEN = "broken"  # failed to import, to register, or to answer a hook


@dataclass
class PluginInfo:
    """One entry point of the ``engine.plugins`` group and what became of it."""

    name: str  # the entry point name (what ENGINE_PLUGINS lists)
    module: str  # the entry point value, e.g. "engine.plugins.cpu"
    distribution: str | None  # the installed distribution that declares the entry point
    version: str | None
    status: PluginStatus = PluginStatus.OK
    reason: str = ""
    api_version: Any = None  # what the plugin declared, as declared
    platforms: list[str] = field(default_factory=list)

    @property
    def dist_label(self) -> str:
        if self.distribution is None:
            return "(unknown distribution)"
        return f"{self.distribution}=={self.version}"


@dataclass
class PlatformInfo:
    """A registered Platform class, the plugin that provides it and its probe result."""

    platform_cls: type[Platform]
    plugin: str
    probe: ProbeResult

    @property
    def name(self) -> str:
        return self.platform_cls.name

    @property
    def priority(self) -> int:
        return self.platform_cls.priority

    @property
    def device_type(self) -> str:
        return self.platform_cls.device_type

    @property
    def available(self) -> bool:
        return self.probe.available


def parse_allowlist(value: str | None) -> list[str] | None:
    """``ENGINE_PLUGINS`` -> plugin names; None (all plugins) when unset or empty."""
    if value is None:
        return None
    names = [part.strip() for part in value.split(",") if part.strip()]
    return names or None


def _safe_probe(cls: type[Platform]) -> ProbeResult:
    """Run ``cls.probe()``; a probe that breaks its no-raise contract is unavailable."""
    try:
        result = cls.probe()
    except Exception as exc:  # noqa: BLE001 - a plugin bug must not break the engine
        return ProbeResult.unavailable(f"probe raised {type(exc).__name__}: {exc}")
    if not isinstance(result, ProbeResult):
        return ProbeResult.unavailable(f"probe returned {result!r}, not a ProbeResult")
    return result


def _platform_class_problem(obj: Any) -> str | None:
    """Why ``obj`` is not a usable Platform class (None when it is)."""
    if not (inspect.isclass(obj) and issubclass(obj, Platform)):
        return f"{obj!r} is not a Platform subclass"
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        return f"{obj.__qualname__} leaves abstract methods unimplemented: {missing}"
    for attr in ("name", "device_type"):
        value = getattr(obj, attr, None)
        if not isinstance(value, str) or not value:
            return f"{obj.__qualname__}.{attr} must be a non-empty string, got {value!r}"
    if not isinstance(obj.priority, int):
        return f"{obj.__qualname__}.priority must be an int, got {obj.priority!r}"
    return None


class PluginRegistry:
    """All installed plugins of one process, their platforms, and platform resolution."""

    def __init__(self, allowlist: Sequence[str] | None = None, group: str = PLUGIN_GROUP):
        self.group = group
        self.allowlist = list(allowlist) if allowlist is not None else None
        self.warnings: list[str] = []  # configuration problems (plugin failures: plugins())
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._plugins: list[PluginInfo] = []
        self._platform_classes: list[tuple[type[Platform], str]] = []
        self._platforms: list[PlatformInfo] | None = None  # probed lazily, then cached
        self._instances: dict[type[Platform], Platform] = {}
        self._discover()

    @classmethod
    def from_env(cls) -> PluginRegistry:
        return cls(allowlist=parse_allowlist(os.environ.get(ALLOWLIST_ENV)))

    # -- discovery ----------------------------------------------------------------------
    def _discover(self) -> None:
        eps = sorted(entry_points(group=self.group), key=lambda ep: (ep.name, ep.value))
        installed = sorted({ep.name for ep in eps})
        if self.allowlist is not None:
            unknown = [name for name in self.allowlist if name not in installed]
            if unknown:
                self._warn(
                    f"{ALLOWLIST_ENV} names {', '.join(map(repr, unknown))}, which "
                    f"{'is' if len(unknown) == 1 else 'are'} not installed; installed "
                    f"plugins: {', '.join(installed) or '(none)'}"
                )
            eps = [ep for ep in eps if ep.name in self.allowlist]
        for ep in eps:
            self._plugins.append(self._load(ep))

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        logger.warning(message)

    def _load(self, ep: EntryPoint) -> PluginInfo:
        dist = ep.dist
        meta = dist.metadata if dist is not None else None  # parsed once: name and version
        info = PluginInfo(
            name=ep.name,
            module=ep.value,
            distribution=meta["Name"] if meta is not None else None,
            version=meta["Version"] if meta is not None else None,
        )
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is listed, not fatal
            return self._mark(info, PluginStatus.BROKEN, f"import failed: {_describe(exc)}")
        return self._admit(plugin, info)

    def add_plugin(self, plugin: Any, name: str, distribution: str | None = None,
                   version: str | None = None) -> PluginInfo:
        """Load an already-imported plugin object as if an entry point named ``name``
        declared it (same validation; for embedding and tests). Returns its info."""
        module = getattr(plugin, "__name__", None) or type(plugin).__qualname__
        info = PluginInfo(name=name, module=module, distribution=distribution, version=version)
        self._plugins.append(self._admit(plugin, info))
        self._platforms = None  # re-probe with the new plugin's platforms
        return info

    def _admit(self, plugin: Any, info: PluginInfo) -> PluginInfo:
        try:
            self.pm.register(plugin, name=info.name)
        except Exception as exc:  # noqa: BLE001 - pluggy validation / duplicate name
            return self._mark(info, PluginStatus.BROKEN, f"cannot register: {_describe(exc)}")
        refusal = self._check_api_version(plugin, info)
        if refusal is not None:
            self.pm.unregister(plugin)
            return self._mark(info, PluginStatus.REFUSED, refusal)
        problem = self._unknown_hooks(plugin) or self._collect_platforms(plugin, info)
        if problem is not None:
            self.pm.unregister(plugin)
            return self._mark(info, PluginStatus.BROKEN, problem)
        return info

    def _mark(self, info: PluginInfo, status: PluginStatus, reason: str) -> PluginInfo:
        info.status, info.reason = status, reason
        logger.warning("plugin %r (%s) is %s: %s", info.name, info.dist_label, status.value, reason)
        return info

    def _call_one(self, plugin: Any, hook_name: str, **kwargs: Any) -> list[Any]:
        """Results of ``hook_name`` from ``plugin`` alone (pluggy semantics preserved)."""
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)

    def _check_api_version(self, plugin: Any, info: PluginInfo) -> str | None:
        """Why the plugin is refused for its declared API version (None: accepted)."""
        who = f"plugin {info.name!r} (distribution {info.dist_label})"
        try:
            answers = self._call_one(plugin, "engine_plugin_api_version")
        except Exception as exc:  # noqa: BLE001
            return f"{who}: engine_plugin_api_version() raised {_describe(exc)}"
        if not answers:
            return (
                f"{who} does not declare engine_plugin_api_version(); this engine "
                f"supports plugin API version {PLUGIN_API_VERSION}"
            )
        declared = info.api_version = answers[0]
        if type(declared) is not int or declared != PLUGIN_API_VERSION:
            return (
                f"{who} declares plugin API version {declared!r}, but this engine "
                f"supports plugin API version {PLUGIN_API_VERSION}; install a release of "
                f"{info.distribution or info.name} built for API version {PLUGIN_API_VERSION}"
            )
        return None

    def _unknown_hooks(self, plugin: Any) -> str | None:
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.spec is None and not any(
                impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin
            ):
                known = ", ".join(name for name in dir(hookspecs) if name.startswith("engine_"))
                return f"implements unknown hook {caller.name!r}; known hooks: {known}"
        return None

    def _collect_platforms(self, plugin: Any, info: PluginInfo) -> str | None:
        try:
            answers = self._call_one(plugin, "engine_register_platforms")
        except Exception as exc:  # noqa: BLE001
            return f"engine_register_platforms() raised {_describe(exc)}"
        classes: list[type[Platform]] = []
        for answer in answers:
            if not isinstance(answer, (list, tuple)):
                return f"engine_register_platforms() must return a list, got {answer!r}"
            for cls in answer:
                problem = _platform_class_problem(cls)
                if problem is not None:
                    return f"engine_register_platforms(): {problem}"
                classes.append(cls)
        for cls in classes:
            self._platform_classes.append((cls, info.name))
            info.platforms.append(cls.name)
        return None

    def prepare_worker_process(self) -> None:
        """Every installed platform's ``prepare_worker_process`` (no probing: it runs
        before a probe may import torch); a failing one is logged, never fatal."""
        for cls, plugin in self._platform_classes:
            try:
                cls.prepare_worker_process()
            except Exception as exc:  # noqa: BLE001 - a plugin's setup never stops the core
                logger.warning("platform %r (plugin %r): prepare_worker_process() raised %s",
                               cls.name, plugin, _describe(exc))

    # -- queries ------------------------------------------------------------------------
    def plugins(self) -> list[PluginInfo]:
        return list(self._plugins)

    def plugin(self, name: str) -> PluginInfo:
        for info in self._plugins:
            if info.name == name:
                return info
        raise KeyError(name)

    def platforms(self) -> list[PlatformInfo]:
        """Every registered platform with its probe result (probed once, then cached).

        Platform names are unique: when two plugins provide the same name, the one with
        the higher priority wins (the first registered on a tie) and the other is listed
        as unavailable, shadowed, without being probed.
        """
        if self._platforms is None:
            winners: dict[str, tuple[type[Platform], str]] = {}
            for cls, plugin in self._platform_classes:
                best = winners.get(cls.name)
                if best is None or cls.priority > best[0].priority:
                    winners[cls.name] = (cls, plugin)
            result = []
            for cls, plugin in self._platform_classes:
                win_cls, win_plugin = winners[cls.name]
                if win_cls is cls and win_plugin == plugin:
                    probe = _safe_probe(cls)
                else:
                    probe = ProbeResult.unavailable(
                        f"shadowed by platform {cls.name!r} of plugin {win_plugin!r} "
                        f"(priority {win_cls.priority})"
                    )
                result.append(PlatformInfo(cls, plugin, probe))
            self._platforms = result
        return list(self._platforms)

    def auto_platform(self) -> PlatformInfo | None:
        """What ``--device auto`` picks: the highest-priority available platform."""
        available = [p for p in self.platforms() if p.available]
        if not available:
            return None
        # max() keeps the first of equal priorities: registration (plugin name) order.
        return max(available, key=lambda p: p.priority)

    def resolve_platform(self, device: str = "auto") -> Platform:
        """The Platform for ``--device``: "auto" or a platform name.

        Raises ValueError listing every installed platform and why it is unavailable.
        """
        if not isinstance(device, str) or not device.strip():
            raise ValueError(f"device must be 'auto' or a platform name, got {device!r}")
        wanted = device.strip().lower()
        if wanted == "auto":
            chosen = self.auto_platform()
            if chosen is None:
                raise ValueError("no platform is available for --device auto.\n" + self.describe())
        else:
            matches = [p for p in self.platforms() if p.name.lower() == wanted]
            if not matches:
                raise ValueError(f"unknown device {device!r}.\n" + self.describe())
            usable = [p for p in matches if p.available]
            if not usable:
                raise ValueError(
                    f"device {device!r} is not available here: {matches[0].probe.reason}.\n"
                    + self.describe()
                )
            chosen = usable[0]
        return self._instance(chosen.platform_cls)

    def instance(self, info: PlatformInfo) -> Platform:
        """The (shared) instance of an available platform."""
        if not info.available:
            raise ValueError(f"platform {info.name!r} is not available: {info.probe.reason}")
        return self._instance(info.platform_cls)

    def _instance(self, cls: type[Platform]) -> Platform:
        if cls not in self._instances:
            self._instances[cls] = cls()
        return self._instances[cls]

    def describe(self) -> str:
        """Human-readable list of installed platforms and non-loaded plugins."""
        lines = ["Installed platforms:"]
        for p in self.platforms():
            dist = self.plugin(p.plugin).dist_label
            state = "available" if p.available else "unavailable"
            detail = f" - {p.probe.reason}" if p.probe.reason else ""
            lines.append(
                f"  {p.name} (plugin {p.plugin}, {dist}, priority {p.priority}): {state}{detail}"
            )
        if len(lines) == 1:
            lines.append("  (none)")
        failed = [i for i in self._plugins if i.status is not PluginStatus.OK]
        if failed:
            lines.append("Plugins not loaded:")
            lines.extend(
                f"  {i.name} ({i.dist_label}): {i.status.value} - {i.reason}" for i in failed
            )
        if self.allowlist is not None:
            lines.append(f"{ALLOWLIST_ENV}={','.join(self.allowlist)} limits the plugins loaded.")
        lines.append("Choose one with --device NAME, or --device auto.")
        return "\n".join(lines)

    # -- extension hooks, for later registries ------------------------------------------
    def hook_results(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """``(plugin name, answer)`` for every loaded plugin implementing ``hook_name``.

        A plugin that raises is reported by name (RuntimeError chained to its error).
        """
        results = []
        for info in self._plugins:
            if info.status is not PluginStatus.OK:
                continue
            plugin = self.pm.get_plugin(info.name)
            try:
                answers = self._call_one(plugin, hook_name, **kwargs)
            except Exception as exc:
                raise RuntimeError(
                    f"plugin {info.name!r} ({info.dist_label}) failed in {hook_name}(): "
                    f"{_describe(exc)}"
                ) from exc
            results.extend((info.name, answer) for answer in answers)
        return results

    def attention_backends(self) -> list[tuple[str, type]]:
        """``(plugin, backend class)`` from engine_register_attention_backends."""
        return _flatten(self.hook_results("engine_register_attention_backends"))

    def quant_methods(self) -> list[tuple[str, type]]:
        """``(plugin, quant method class)`` from engine_register_quant_methods."""
        return _flatten(self.hook_results("engine_register_quant_methods"))

    def kv_connectors(self) -> list[tuple[str, type]]:
        """``(plugin, connector class)`` from engine_register_kv_connectors."""
        return _flatten(self.hook_results("engine_register_kv_connectors"))

    def register_models(self, registry: Any) -> None:
        """Let every plugin add model architectures to ``registry``.

        When ``registry`` has ``for_plugin(name)`` (the engine's ModelRegistry), each
        plugin is handed ``registry.for_plugin(<its name>)``, so the registry records who
        registered each architecture (and refuses a name two plugins claim).
        """
        self._register_into("engine_register_models", registry)

    def register_tool_parsers(self, registry: Any) -> None:
        """Let every plugin add tool-call parsers to ``registry`` (as
        :meth:`register_models`: each plugin is handed ``registry.for_plugin(<its name>)``)."""
        self._register_into("engine_register_tool_parsers", registry)

    def _register_into(self, hook_name: str, registry: Any) -> None:
        for_plugin = getattr(registry, "for_plugin", None)
        for info in self._plugins:
            if info.status is not PluginStatus.OK:
                continue
            plugin = self.pm.get_plugin(info.name)
            target = for_plugin(info.name) if callable(for_plugin) else registry
            try:
                self._call_one(plugin, hook_name, registry=target)
            except Exception as exc:
                raise RuntimeError(
                    f"plugin {info.name!r} ({info.dist_label}) failed in "
                    f"{hook_name}(): {_describe(exc)}"
                ) from exc

    def attention_backend_classes(self) -> dict[str, tuple[str, type]]:
        """Plugin-contributed attention backends by name: ``{name: (plugin, class)}``
        (ValueError when two plugins contribute the same name)."""
        return contributions_by_name("attention backend", self.attention_backends())

    def attention_backend(self, name: str) -> type | None:
        """The plugin-contributed attention backend called ``name`` (None: no plugin
        contributes one)."""
        found = self.attention_backend_classes().get(name)
        return None if found is None else found[1]

    def select_attention_backend(self, platform: Platform, name: str | None = None) -> type:
        """What ``--attention-backend`` picks on ``platform``: the platform's preferred
        backend (``name`` None), the platform's own backend called ``name``, else the
        plugin-contributed one; ValueError listing both otherwise."""
        own = list(platform.attention_backends())
        if name is None or any(getattr(b, "name", None) == name for b in own):
            return platform.get_attention_backend(name)
        contributed = self.attention_backend_classes()
        if name in contributed:
            return contributed[name][1]
        offered = ", ".join(getattr(b, "name", repr(b)) for b in own) or "(none)"
        extra = ", ".join(f"{n} (plugin {p})" for n, (p, _) in sorted(contributed.items()))
        raise ValueError(
            f"attention backend {name!r} is not offered by platform {platform.name!r} "
            f"(offered: {offered}) nor contributed by a plugin "
            f"(contributed: {extra or '(none)'})"
        )


def contributions_by_name(kind: str, pairs: Sequence[tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
    """``{item.name: (plugin, item)}`` from ``(plugin, item)`` pairs; a name claimed by two
    plugins (with different items) is a ValueError naming both plugins."""
    found: dict[str, tuple[str, Any]] = {}
    for plugin, item in pairs:
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"plugin {plugin!r} contributes {kind} {item!r} without a name")
        if name in found and found[name][1] is not item:
            raise ValueError(f"{kind} {name!r} is contributed by both plugin "
                             f"{found[name][0]!r} and plugin {plugin!r}")
        found.setdefault(name, (plugin, item))
    return found


def _flatten(results: list[tuple[str, Any]]) -> list[tuple[str, type]]:
    return [(plugin, item) for plugin, answer in results for item in (answer or [])]


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
