"""Checkpoint formats come through the plugin registry: the built-ins from the in-tree
``quantization`` plugin (entry point ``quantization = engine.quantization.plugin``), a third
party's exactly the same way (a distribution declaring an ``engine.plugins`` entry point
whose module implements ``engine_register_quant_methods``)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from engine.core.plugins import ALLOWLIST_ENV, get_plugin_registry, reset_plugin_registry
from engine.quantization import registered_formats, resolve_quantization
from engine.quantization.awq import AWQConfig
from engine.quantization.compressed_tensors import CompressedTensorsConfig
from engine.quantization.fp8 import Fp8Config
from engine.quantization.gptq import GPTQConfig
from tests.core.test_plugins import site  # noqa: F401  (a fixture: a throwaway site-packages)
from tests.quantization import refs

BUILTINS = {"compressed-tensors": CompressedTensorsConfig, "gptq": GPTQConfig,
            "awq": AWQConfig, "fp8": Fp8Config}


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    reset_plugin_registry()
    yield
    reset_plugin_registry()


def test_builtin_formats_come_from_the_quantization_plugin():
    (ep,) = [e for e in importlib.metadata.entry_points(group="engine.plugins")
             if e.name == "quantization"]
    assert ep.value == "engine.quantization.plugin"
    by_plugin = {(plugin, cls) for plugin, cls in get_plugin_registry().quant_methods()}
    assert {("quantization", cls) for cls in BUILTINS.values()} <= by_plugin
    formats = registered_formats()
    for name, cls in BUILTINS.items():
        assert formats[name] is cls and cls.name == name


def test_without_the_quantization_plugin_nothing_is_registered(monkeypatch):
    monkeypatch.setenv(ALLOWLIST_ENV, "cpu")
    reset_plugin_registry()
    assert registered_formats() == {}
    config = refs.load_hf_config(refs.fixture_dir("gptq-desc-act-g64"))
    with pytest.raises(ValueError, match=r"quantization method 'gptq' is not supported; "
                                         r"installed: none \(ENGINE_PLUGINS=cpu limits the "
                                         r"plugins loaded; the built-in formats come from the "
                                         r"'quantization' plugin\)"):
        resolve_quantization(config)


# A third party's format: int8 codes per output row with one float32 scale per row
# ("acme-int8"), implemented on the engine's public quantization API.
ACME_SOURCE = '''
import torch
from engine.core.interfaces import (PLUGIN_API_VERSION, QuantizedLayerSpec, QuantizedWeights,
                                    QuantMethod)
from engine.core.plugins import hookimpl
from engine.model_executor.layers.linear import ParamLayout
from engine.quantization.base import QuantizedLinearMethod, add_param


class AcmeLinear(QuantizedLinearMethod):
    scheme = "acme-int8"
    scale_params = ("row_scale",)

    def create_weights(self, layer, in_features, out_features, params_dtype):
        add_param(layer, "qweight_rowwise", (out_features, in_features), torch.int8,
                  ParamLayout(0, 1))
        add_param(layer, "row_scale", (out_features, 1), torch.float32,
                  ParamLayout(output_dim=0, input_dim=None))

    def decode(self, layer):
        codes = (layer.qweight_rowwise.detach().to(torch.int16) + 128).to(torch.uint8)
        spec = QuantizedLayerSpec(scheme=self.scheme, encoding="int", weight_bits=8,
                                  group_size=layer.in_features, in_features=layer.in_features,
                                  out_features=layer.out_features, act_dtype=layer.params_dtype)
        return QuantizedWeights(spec, codes, layer.row_scale.detach().float().clone(), None,
                                None, None, tuple(layer.shard_sizes.values()))


class AcmeInt8(QuantMethod):
    name = "acme-int8"

    def __init__(self):
        self._method = AcmeLinear()

    @classmethod
    def from_config(cls, quant_config):
        if quant_config.get("bits", 8) != 8:
            raise ValueError("acme-int8 checkpoints have 8-bit codes")
        return cls()

    def linear_method(self, prefixes):
        return None if prefixes == ("lm_head",) else self._method


@hookimpl
def engine_plugin_api_version():
    return PLUGIN_API_VERSION


@hookimpl
def engine_register_quant_methods():
    return [AcmeInt8]
'''


def _acme_quantize(prefix: str, w: torch.Tensor):
    """The acme-int8 format, written here from its definition (symmetric per row,
    ``scale = max|row| / 127``)."""
    scale = (w.double().abs().amax(dim=1, keepdim=True) / 127).float()
    q = torch.round(w.double() / scale.double()).clamp(-127, 127)
    return ({"qweight_rowwise": q.to(torch.int8), "row_scale": scale},
            (q * scale.double()).float())


def test_third_party_format_is_discovered_and_selectable(site, tmp_path):
    site.install("acme-quant", ACME_SOURCE, "acmequant")
    owners = {cls.name: plugin for plugin, cls in get_plugin_registry().quant_methods()}
    assert owners["acme-int8"] == "acmequant"
    assert owners["gptq"] == "quantization"  # the built-ins are still there
    assert "acme-int8" in registered_formats()

    shape = "llama-160"
    path, reference = refs.write_quantized_checkpoint(
        tmp_path / "acme", refs.base_model(shape), _acme_quantize,
        {"quant_method": "acme-int8", "bits": 8})
    tokens = refs.synthetic_prompt(shape)
    want = refs.hf_logits(reference, tokens)
    for requested in (None, "acme-int8"):  # found from config.json, and asked for by name
        model = refs.engine_model(path, quantization=requested)
        assert refs.count_quantized_layers(model) == refs.NUM_QUANTIZED_LAYERS
        assert {m.quant_method.scheme for m in model.modules()
                if getattr(m, "quant_kernel", None) is not None} == {"acme-int8"}
        assert refs.rel_diff(refs.engine_logits(model, tokens), want) <= 1e-3
    assert refs.rel_diff(want, refs.hf_logits(refs.base_model(shape), tokens)) >= 1e-2

    # its name is among the installed ones and is checked against checkpoints like any
    with pytest.raises(ValueError, match=r"installed: acme-int8, awq, compressed-tensors"):
        refs.engine_model(path, quantization="acme-int9")
    with pytest.raises(ValueError, match="--quantization acme-int8 contradicts the "
                                         "checkpoint, which is quantized with gptq"):
        refs.engine_model(refs.fixture_dir("gptq-desc-act-g64"), quantization="acme-int8")
