"""Every contribution point goes through the plugin registry, built-ins included.

Third-party plugins here are registered programmatically (``PluginRegistry.add_plugin``)
into a registry that also holds the real installed entry points, and installed as the
process's registry, so the engine finds them on exactly the paths it finds built-ins.
"""

from __future__ import annotations

import json
import types

import pytest
from click.testing import CliRunner
from torch import nn

import engine.core.plugins as plugins_mod
from engine.cli import main
from engine.core.config import EngineConfig
from engine.core.interfaces import PLUGIN_API_VERSION
from engine.core.plugins import (
    ALLOWLIST_ENV,
    PluginRegistry,
    PluginStatus,
    hookimpl,
    reset_plugin_registry,
)
from engine.core.plugins.builtin_models import BUILTINS
from engine.model_executor.models.registry import MODEL_REGISTRY, ModelRegistry
from engine.plugins.cpu.attention import CPUAttentionBackend
from engine.plugins.cpu.platform import CPUPlatform
from engine.quantization import registered_formats
from engine.quantization.fp8 import Fp8Config

# the in-tree plugins only (other installed plugins are not these tests' subject)
IN_TREE = ["cpu", "cuda", "rocm", "xpu", "quantization", "kv_transfer", "models"]


class FancyModel(nn.Module):
    pass


class FancyAttention(CPUAttentionBackend):
    name = "fancy_attn"


class FancyQuant(Fp8Config):
    name = "fancy_quant"


def _plugin(arch: str = "FancyForCausalLM", attention=FancyAttention, quant=FancyQuant):
    mod = types.ModuleType(f"fancy_plugin_{arch}")

    @hookimpl
    def engine_plugin_api_version():
        return PLUGIN_API_VERSION

    @hookimpl
    def engine_register_models(registry):
        registry.register(arch, FancyModel)

    @hookimpl
    def engine_register_attention_backends():
        return [attention]

    @hookimpl
    def engine_register_quant_methods():
        return [quant]

    for fn in (engine_plugin_api_version, engine_register_models,
               engine_register_attention_backends, engine_register_quant_methods):
        setattr(mod, fn.__name__, fn)
    return mod


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    reset_plugin_registry()
    yield
    reset_plugin_registry()


@pytest.fixture
def with_plugins(monkeypatch: pytest.MonkeyPatch):
    """``install(*(name, plugin))`` -> the process registry: installed + these plugins."""

    def install(*extra):
        registry = PluginRegistry(allowlist=IN_TREE)
        for name, plugin in extra:
            info = registry.add_plugin(plugin, name, distribution=f"{name}-dist", version="1.0")
            assert info.status is PluginStatus.OK, info.reason
        monkeypatch.setattr(plugins_mod, "_registry", registry)
        return registry

    return install


def test_builtin_architectures_come_from_the_models_plugin(with_plugins) -> None:
    with_plugins()
    contributions = dict(MODEL_REGISTRY.contributions())
    assert {arch: contributions[arch] for arch in BUILTINS} == {a: "models" for a in BUILTINS}
    assert MODEL_REGISTRY.plugin_of("LlamaForCausalLM") == "models"


def test_fake_plugin_found_through_the_builtin_paths(with_plugins) -> None:
    registry = with_plugins(("fancy", _plugin()))
    # architecture: the engine's own registry, next to the built-ins
    assert MODEL_REGISTRY.resolve(["FancyForCausalLM"]) is FancyModel
    assert MODEL_REGISTRY.plugin_of("FancyForCausalLM") == "fancy"
    assert MODEL_REGISTRY.plugin_of("LlamaForCausalLM") == "models"
    # quant method: what resolve_quantization looks formats up in
    formats = registered_formats()
    assert formats["fancy_quant"] is FancyQuant and "fp8" in formats
    # attention backend: what load_platform_model selects with
    platform = CPUPlatform()
    assert registry.select_attention_backend(platform, "fancy_attn") is FancyAttention
    assert registry.select_attention_backend(platform, "cpu") is CPUAttentionBackend
    assert registry.select_attention_backend(platform, None) is platform.attention_backends()[0]
    assert registry.attention_backend("fancy_attn") is FancyAttention
    with pytest.raises(ValueError, match=r"'nope'.*offered: cpu.*fancy_attn \(plugin fancy\)"):
        registry.select_attention_backend(platform, "nope")


def test_plugin_models_forgotten_with_their_registry(with_plugins) -> None:
    with_plugins(("fancy", _plugin()))
    assert "FancyForCausalLM" in MODEL_REGISTRY
    with_plugins()  # a rebuilt process registry, without the fancy plugin
    assert "FancyForCausalLM" not in MODEL_REGISTRY
    assert "LlamaForCausalLM" in MODEL_REGISTRY


def test_load_platform_model_takes_a_plugin_attention_backend(with_plugins, llama_dir) -> None:
    from engine.core.engine_args import EngineArgs
    from engine.model_executor.worker import load_platform_model

    with_plugins(("fancy", _plugin()))
    config: EngineConfig = EngineArgs(model=str(llama_dir), device="cpu",
                                      attention_backend="fancy_attn").create_engine_config()
    platform = plugins_mod.resolve_platform("cpu")
    _, backend = load_platform_model(config, platform)
    assert type(backend) is FancyAttention


def test_architecture_collision_names_both_plugins(with_plugins) -> None:
    with_plugins(("fancy", _plugin()), ("rival", _plugin()))
    with pytest.raises(RuntimeError, match=r"'FancyForCausalLM' is contributed by both "
                                           r"plugin 'fancy' and plugin 'rival'"):
        MODEL_REGISTRY.resolve(["FancyForCausalLM"])


def test_builtin_architecture_collision_names_both_plugins(with_plugins) -> None:
    with_plugins(("fancy", _plugin(arch="LlamaForCausalLM")))
    with pytest.raises(RuntimeError, match=r"'LlamaForCausalLM' is contributed by both "
                                           r"plugin 'models' and plugin 'fancy'"):
        MODEL_REGISTRY.supported_architectures()


def test_attention_and_quant_collisions_name_both_plugins(with_plugins) -> None:
    class OtherAttention(CPUAttentionBackend):
        name = "fancy_attn"

    class OtherFp8(Fp8Config):
        name = "fp8"

    registry = with_plugins(("fancy", _plugin()), ("rival", _plugin(arch="Other",
                                                                    attention=OtherAttention,
                                                                    quant=OtherFp8)))
    with pytest.raises(ValueError, match=r"attention backend 'fancy_attn' is contributed by "
                                         r"both plugin 'fancy' and plugin 'rival'"):
        registry.select_attention_backend(CPUPlatform(), "fancy_attn")
    with pytest.raises(ValueError, match=r"quantization method 'fp8' is contributed by both "
                                         r"plugin 'quantization' and plugin 'rival'"):
        registered_formats()


def test_model_registry_hands_each_plugin_its_name() -> None:
    seen = []

    class FakePlugins:
        def register_models(self, registry):
            view = registry.for_plugin("a")
            seen.append(view.plugin)
            view.register("X", FancyModel)
            registry.for_plugin("a").register("X", FancyModel)  # same plugin: a replacement
            registry.for_plugin("b").register("Y", FancyModel)

    registry = ModelRegistry(plugins=FakePlugins())
    assert registry.contributions() == [("X", "a"), ("Y", "b")]
    assert seen == ["a"]
    with pytest.raises(ValueError, match="both plugin 'a' and plugin 'b'"):
        registry.for_plugin("b").register("X", FancyModel)


def test_cli_json_lists_contributions_with_their_plugins(with_plugins) -> None:
    with_plugins(("fancy", _plugin()))
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    c = report["contributions"]
    archs = {e["name"]: e["plugin"] for e in c["model_architectures"]}
    assert archs["LlamaForCausalLM"] == "models" and archs["FancyForCausalLM"] == "fancy"
    assert {"name": "fancy_attn", "plugin": "fancy"} in c["attention_backends"]
    quant = {e["name"]: e["plugin"] for e in c["quant_methods"]}
    assert quant["fp8"] == "quantization" and quant["fancy_quant"] == "fancy"
    assert {"name": "SharedStorageConnector", "plugin": "kv_transfer"} in c["kv_connectors"]
    assert {"name": "cpu", "plugin": "cpu", "available": True} in c["platforms"]
    assert report["contribution_errors"] == []
    (cpu,) = next(p for p in report["plugins"] if p["name"] == "cpu")["platforms"]
    components = cpu["components"]
    assert components["attention_backends"][0] == "cpu"
    assert set(components) == {"attention_backends", "dense_gemm_kernels",
                               "quantized_gemm_kernels", "fused_moe_kernels", "fused_ops",
                               "forward_graph_capturer"}
    assert all(isinstance(n, str) for n in components["dense_gemm_kernels"])
    rocm = next(p for p in report["plugins"] if p["name"] == "rocm")["platforms"][0]
    if not rocm["available"]:
        assert rocm["components"] == {}  # unavailable platforms are not asked


def test_cli_reports_a_collision_instead_of_raising(with_plugins) -> None:
    with_plugins(("fancy", _plugin()), ("rival", _plugin()))
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "both plugin 'fancy' and plugin 'rival'" in result.output
