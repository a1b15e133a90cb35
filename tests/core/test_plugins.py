"""Plugin discovery, refusal and platform resolution, through real entry points.

Third-party plugins are real distributions: a module plus a ``.dist-info`` directory
(METADATA and entry_points.txt, what pip writes) in a temp directory put on sys.path.
"""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from engine.core.interfaces import PLUGIN_API_VERSION
from engine.core.plugins import (
    ALLOWLIST_ENV,
    PluginStatus,
    current_platform,
    get_plugin_manager,
    get_plugin_registry,
    parse_allowlist,
    reset_plugin_registry,
    resolve_platform,
    set_current_platform,
)
from engine.plugins.cpu.platform import CPUPlatform

IN_TREE = ["cpu", "cuda", "rocm", "xpu"]
ACCELERATOR_PRESENT = torch.cuda.is_available() or (
    hasattr(torch, "xpu") and torch.xpu.is_available()
)
no_accelerator = pytest.mark.skipif(ACCELERATOR_PRESENT, reason="an accelerator is present")

PLATFORM_SOURCE = """
from engine.core.interfaces import Platform, ProbeResult
from engine.core.plugins import hookimpl


class {cls}(Platform):
    name = {platform!r}
    device_type = "cpu"
    priority = {priority}

    @classmethod
    def probe(cls):
        {probe}

    def supported_dtypes(self):
        import torch
        return [torch.float32]

    def total_memory_bytes(self):
        return 1 << 30

    def available_memory_bytes(self):
        return 1 << 30

    def kv_cache_bytes(self, cache_config, weights_bytes):
        return 1 << 20

    def attention_backends(self):
        return []

    def communicator_cls(self):
        from engine.distributed import GlooCommunicator
        return GlooCommunicator
"""

HOOKS_SOURCE = """
@hookimpl
def engine_plugin_api_version():
    return {api_version}


@hookimpl
def engine_register_platforms():
    return [{cls}]
"""


class Site:
    """A directory on sys.path into which tests 'install' distributions."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def install(self, dist: str, source: str, ep_name: str, version: str = "1.2.3") -> str:
        """Write module + dist-info declaring entry point ``ep_name``; return the module."""
        module = f"{dist.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[engine.plugins]\n{ep_name} = {module}\n")
        self.modules.append(module)
        reset_plugin_registry()
        return module

    def install_platform(
        self,
        dist: str,
        ep_name: str,
        platform: str,
        priority: int = 50,
        api_version: object = PLUGIN_API_VERSION,
        probe: str = 'return ProbeResult.ok("test device")',
    ) -> str:
        cls = f"{platform.capitalize()}Platform"
        source = PLATFORM_SOURCE.format(cls=cls, platform=platform, priority=priority, probe=probe)
        source += HOOKS_SOURCE.format(api_version=api_version, cls=cls)
        return self.install(dist, source, ep_name)


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    reset_plugin_registry()
    yield
    reset_plugin_registry()


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    s = Site(root)
    yield s
    for module in s.modules:
        sys.modules.pop(module, None)


def _by_name(items):
    return {item.name: item for item in items}


# -- the in-tree plugins ------------------------------------------------------------------
def test_in_tree_plugins_come_from_the_engine_distribution() -> None:
    plugins = _by_name(get_plugin_registry().plugins())
    version = importlib.metadata.version("engine")
    for name in IN_TREE:
        info = plugins[name]
        assert info.status is PluginStatus.OK, info.reason
        assert (info.distribution, info.version) == ("engine", version)
        assert info.module == f"engine.plugins.{name}"
        assert info.api_version == PLUGIN_API_VERSION
        assert info.platforms == [name]


def test_probe_results_match_this_torch_build() -> None:
    platforms = _by_name(get_plugin_registry().platforms())
    v = torch.__version__
    assert platforms["cpu"].available and platforms["cpu"].priority == 0
    assert all(platforms[n].priority > 0 for n in ("cuda", "rocm", "xpu"))

    cuda = platforms["cuda"]
    if torch.version.cuda is None and torch.version.hip is None:
        assert cuda.probe == cuda.probe.unavailable(f"torch {v} was built without CUDA")
    elif torch.version.cuda is not None and not torch.cuda.is_available():
        assert cuda.probe.reason.startswith("no CUDA device visible")
    assert cuda.available == (torch.version.hip is None and torch.cuda.is_available())

    rocm = platforms["rocm"]
    if torch.version.hip is None:
        assert not rocm.available
        assert rocm.probe.reason == (
            f"torch {v} is not a ROCm build (ROCm torch wheels come from the PyTorch ROCm index)"
        )
    assert rocm.device_type == "cuda"

    xpu = platforms["xpu"]
    assert xpu.available == (hasattr(torch, "xpu") and torch.xpu.is_available())
    if not xpu.available:
        assert "XPU" in xpu.probe.reason


def test_probes_run_once_per_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = CPUPlatform.probe.__func__
    monkeypatch.setattr(
        CPUPlatform, "probe", classmethod(lambda cls: calls.append(1) or original(cls))
    )
    registry = get_plugin_registry()
    registry.platforms()
    registry.platforms()
    resolve_platform("cpu")
    assert len(calls) == 1


@no_accelerator
def test_auto_resolves_to_cpu_and_is_cached() -> None:
    platform = resolve_platform("auto")
    assert isinstance(platform, CPUPlatform)
    assert resolve_platform("cpu") is platform
    assert resolve_platform(" CPU ") is platform
    assert current_platform() is platform
    assert get_plugin_registry().auto_platform().name == "cpu"


@no_accelerator
def test_unavailable_device_error_lists_every_platform_and_reason() -> None:
    with pytest.raises(ValueError) as err:
        resolve_platform("cuda")
    message = str(err.value)
    assert message.startswith("device 'cuda' is not available here:")
    for p in get_plugin_registry().platforms():
        assert f"{p.name} (plugin {p.plugin}, " in message  # plugin's distribution==version
        assert p.probe.reason in message
    assert "--device auto" in message


def test_unknown_or_empty_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown device 'tpu'(.|\n)*cpu \(plugin cpu"):
        resolve_platform("tpu")
    with pytest.raises(ValueError, match="'auto' or a platform name"):
        resolve_platform("")


def test_set_current_platform_and_reset() -> None:
    chosen = set_current_platform("cpu")
    assert current_platform() is chosen
    reset_plugin_registry()
    fresh = current_platform()
    assert fresh is not chosen  # a new registry made a new instance


# -- ENGINE_PLUGINS -----------------------------------------------------------------------
def test_parse_allowlist() -> None:
    assert parse_allowlist(None) is None
    assert parse_allowlist(" , ") is None
    assert parse_allowlist("cpu, xpu,,") == ["cpu", "xpu"]


def test_allowlist_filters_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOWLIST_ENV, "cpu,xpu")
    registry = get_plugin_registry()
    assert [p.name for p in registry.plugins()] == ["cpu", "xpu"]
    assert registry.warnings == []
    assert not get_plugin_manager().has_plugin("cuda")
    with pytest.raises(ValueError, match=r"unknown device 'cuda'(.|\n)*ENGINE_PLUGINS=cpu,xpu"):
        resolve_platform("cuda")


def test_allowlist_with_uninstalled_name_warns_with_installed_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ALLOWLIST_ENV, "cpu,cdua")
    registry = get_plugin_registry()
    assert [p.name for p in registry.plugins()] == ["cpu"]
    (warning,) = registry.warnings
    assert "'cdua'" in warning
    installed = warning.split("installed plugins: ", 1)[1].split(", ")
    assert {"cpu", "cuda", "kv_transfer", "models", "quantization", "rocm", "xpu"} <= set(
        installed) and installed == sorted(installed)


# -- third-party plugins ------------------------------------------------------------------
def test_third_party_platform_is_listed_and_chosen_by_auto_and_name(site: Site) -> None:
    module = site.install_platform("acme-engine-plugin", "acme", "acme", priority=500)
    registry = get_plugin_registry()
    info = registry.plugin("acme")
    assert (info.status, info.distribution, info.version) == (
        PluginStatus.OK,
        "acme-engine-plugin",
        "1.2.3",
    )
    assert info.module == module and info.platforms == ["acme"]
    assert registry.auto_platform().name == "acme"
    auto = resolve_platform("auto")
    assert type(auto).__module__ == module
    assert resolve_platform("acme") is auto
    assert isinstance(resolve_platform("cpu"), CPUPlatform)


def test_unsupported_api_version_is_refused_with_a_clear_message(site: Site) -> None:
    site.install_platform("future-plugin", "future", "future", priority=900, api_version=99)
    registry = get_plugin_registry()
    info = registry.plugin("future")
    assert info.status is PluginStatus.REFUSED
    assert info.api_version == 99 and info.platforms == []
    assert info.reason == (
        "plugin 'future' (distribution future-plugin==1.2.3) declares plugin API version 99, "
        f"but this engine supports plugin API version {PLUGIN_API_VERSION}; install a release "
        f"of future-plugin built for API version {PLUGIN_API_VERSION}"
    )
    assert not get_plugin_manager().has_plugin("future")
    assert "future" not in [p.name for p in registry.platforms()]
    with pytest.raises(ValueError, match=r"(?s)unknown device 'future'.*future \(future-plugin"):
        resolve_platform("future")
    assert registry.plugin("cpu").status is PluginStatus.OK


@pytest.mark.parametrize("declared", ["'1'", "True", "None"])
def test_api_version_must_be_the_int(site: Site, declared: str) -> None:
    site.install_platform("odd-plugin", "odd", "odd", api_version=declared)
    assert get_plugin_registry().plugin("odd").status is PluginStatus.REFUSED


def test_missing_api_version_is_refused(site: Site) -> None:
    site.install(
        "silent-plugin",
        "from engine.core.plugins import hookimpl\n\n"
        "@hookimpl\ndef engine_register_platforms():\n    return []\n",
        "silent",
    )
    info = get_plugin_registry().plugin("silent")
    assert info.status is PluginStatus.REFUSED
    assert "does not declare engine_plugin_api_version()" in info.reason
    assert "silent-plugin==1.2.3" in info.reason


def test_plugin_that_fails_to_import_is_broken_not_fatal(site: Site) -> None:
    site.install("vendor-plugin", "raise RuntimeError('vendor SDK missing')\n", "vendor")
    registry = get_plugin_registry()
    info = registry.plugin("vendor")
    assert info.status is PluginStatus.BROKEN
    assert info.reason == "import failed: RuntimeError: vendor SDK missing"
    assert isinstance(resolve_platform("cpu"), CPUPlatform)


def test_non_platform_answer_makes_the_plugin_broken(site: Site) -> None:
    source = (
        "from engine.core.plugins import hookimpl\n\n"
        "@hookimpl\ndef engine_plugin_api_version():\n    return 1\n\n"
        "@hookimpl\ndef engine_register_platforms():\n    return [object]\n"
    )
    site.install("junk-plugin", source, "junk")
    info = get_plugin_registry().plugin("junk")
    assert info.status is PluginStatus.BROKEN
    assert "is not a Platform subclass" in info.reason
    assert not get_plugin_manager().has_plugin("junk")


def test_unknown_hook_makes_the_plugin_broken(site: Site) -> None:
    source = (
        "from engine.core.plugins import hookimpl\n\n"
        "@hookimpl\ndef engine_plugin_api_version():\n    return 1\n\n"
        "@hookimpl\ndef engine_register_platfroms():\n    return []\n"
    )
    site.install("typo-plugin", source, "typo")
    info = get_plugin_registry().plugin("typo")
    assert info.status is PluginStatus.BROKEN
    assert "unknown hook 'engine_register_platfroms'" in info.reason


def test_probe_that_raises_is_unavailable(site: Site) -> None:
    site.install_platform("flaky-plugin", "flaky", "flaky", probe="raise OSError('driver gone')")
    platform = _by_name(get_plugin_registry().platforms())["flaky"]
    assert not platform.available
    assert platform.probe.reason == "probe raised OSError: driver gone"
    with pytest.raises(ValueError, match="device 'flaky' is not available here: probe raised"):
        resolve_platform("flaky")


def test_same_platform_name_higher_priority_shadows(site: Site) -> None:
    module = site.install_platform("fast-cpu", "fastcpu", "cpu", priority=5)
    platforms = [p for p in get_plugin_registry().platforms() if p.name == "cpu"]
    winner = [p for p in platforms if p.available]
    assert [p.plugin for p in winner] == ["fastcpu"]
    (loser,) = [p for p in platforms if p.plugin == "cpu"]
    assert loser.probe.reason == "shadowed by platform 'cpu' of plugin 'fastcpu' (priority 5)"
    assert type(resolve_platform("cpu")).__module__ == module


def test_extension_hooks_reach_loaded_plugins(site: Site) -> None:
    source = """
    from engine.core.plugins import hookimpl

    class FancyAttention:
        name = "fancy"

    @hookimpl
    def engine_plugin_api_version():
        return 1

    @hookimpl
    def engine_register_attention_backends():
        return [FancyAttention]

    @hookimpl
    def engine_register_models(registry):
        registry.register("FancyForCausalLM", "fancy_models:Fancy")
    """
    module = site.install("fancy-plugin", source, "fancy")
    registry = get_plugin_registry()
    backends = registry.attention_backends()
    assert [(plugin, cls.name) for plugin, cls in backends] == [("fancy", "fancy")]
    assert backends[0][1].__module__ == module
    from engine.model_executor.models.registry import ModelRegistry

    models = ModelRegistry()
    registry.register_models(models)
    assert ("FancyForCausalLM", "fancy") in models.contributions()
    # fancy contributes no formats: the built-in ones come through the same hook (and an
    # installed out-of-tree plugin's, e.g. the example package's)
    plugins = {plugin for plugin, _ in registry.quant_methods()}
    assert "quantization" in plugins and "fancy" not in plugins


def test_failing_extension_hook_names_the_plugin(site: Site) -> None:
    source = """
    from engine.core.plugins import hookimpl

    @hookimpl
    def engine_plugin_api_version():
        return 1

    @hookimpl
    def engine_register_quant_methods():
        raise KeyError("fp3")
    """
    site.install("bad-quant", source, "badquant")
    with pytest.raises(RuntimeError, match=r"plugin 'badquant' \(bad-quant==1.2.3\) failed in"):
        get_plugin_registry().quant_methods()
