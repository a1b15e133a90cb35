"""Clear errors for quantized checkpoints that cannot run: no kernel for the scheme (every
kernel's refusal listed), a ``--quantization`` that contradicts the checkpoint or is
unknown, missing / misshapen / corrupt scale tensors, unsupported schemes. Each is a
ValueError (a clean ``Error:`` line from the CLI), raised at load, never a crash or
garbage output."""

from __future__ import annotations

import re

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from engine.cli import main
from engine.core.interfaces import QuantizedGemmKernel
from tests.helpers.hf_reference import cpu_llm
from tests.quantization import packers, refs


def _cli(*args: str):
    return CliRunner().invoke(main, ["generate", "Hello", "--device", "cpu", "--max-tokens",
                                     "2", *args])


def _assert_clean_cli_error(result, *needles: str) -> None:
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception  # not a crash
    assert "Traceback" not in result.output
    assert result.output.startswith("Error: "), result.output
    for needle in needles:
        assert needle in result.output, result.output


def _copy_fixture(tmp_path: Path, name: str,
                  tensors: Callable[[dict], dict] | None = None,
                  config: Callable[[dict], None] | None = None) -> Path:
    """A copy of fixture ``name`` with its tensors and / or config.json changed."""
    src = refs.fixture_dir(name)
    out = tmp_path / f"{name}-changed"
    out.mkdir()
    for file in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        shutil.copy(src / file, out / file)
    if config is not None:
        doc = json.loads((out / "config.json").read_text())
        config(doc)
        (out / "config.json").write_text(json.dumps(doc))
    if tensors is None:
        (out / "model.safetensors").symlink_to(src / "model.safetensors")
    else:
        changed = {k: v.contiguous() for k, v in tensors(refs.read_tensors(src)).items()}
        save_file(changed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ----------------------------------------------------------------------------- no kernel


class RefusesGroupScales(QuantizedGemmKernel):
    name = "test_channel_only"

    @classmethod
    def can_implement(cls, spec):
        if spec.group_size != spec.in_features:
            return f"needs per-channel scales, not groups of {spec.group_size}"
        return None

    def prepare(self, layer, weights):
        raise AssertionError("never chosen")

    def apply(self, layer, x, bias=None):
        raise AssertionError("never chosen")


class RefusesZeroPoints(RefusesGroupScales):
    name = "test_symmetric_only"

    @classmethod
    def can_implement(cls, spec):
        return "cannot apply zero points" if spec.has_zero_points else None


def test_no_kernel_accepts_the_layer_lists_every_refusal():
    path = refs.fixture_dir("ct-w4a16-asym-g64")  # group 64 with zero points
    with pytest.raises(ValueError) as info:
        refs.engine_model(path, kernels=[RefusesGroupScales, RefusesZeroPoints])
    message = str(info.value)
    assert message.startswith("model.layers.0.self_attn.qkv_proj: no kernel can run this "
                              "compressed-tensors")
    assert "int 4-bit weights, 512x256, group 64" in message
    assert "test_channel_only: needs per-channel scales, not groups of 64" in message
    assert "test_symmetric_only: cannot apply zero points" in message


def test_no_quantized_kernels_at_all():
    with pytest.raises(ValueError, match="the platform offers no quantized-GEMM kernels"):
        refs.engine_model(refs.fixture_dir("ct-fp8-static"), kernels=[])


@pytest.mark.parametrize(("name", "family"), [("gptq-desc-act-g64", "gptq_marlin"),
                                              ("awq-gemm-g64", "awq_marlin")])
def test_marlin_family_on_cpu_says_why(name, family):
    """vLLM's ``--quantization gptq_marlin`` on the CPU platform, which has no Marlin
    kernel: the message names the request and the kernels the platform does have."""
    expected = (f"--quantization {family} asks for a marlin kernel: none of the platform's "
                "quantized kernels")
    with pytest.raises(ValueError, match=expected):
        cpu_llm(refs.fixture_dir(name), quantization=family)
    result = _cli("--model", str(refs.fixture_dir(name)), "--quantization", family)
    _assert_clean_cli_error(result, expected, "torch_reference")


# ----------------------------------------------------------------------------- --quantization


CONTRADICTIONS = [
    ("gptq-desc-act-g64", "awq", "--quantization awq contradicts the checkpoint, which is "
                                 "quantized with gptq"),
    ("awq-gemm-g64", "gptq", "--quantization gptq contradicts the checkpoint, which is "
                             "quantized with awq"),
    ("ct-fp8-static", "fp8", "--quantization fp8 contradicts the checkpoint, which is "
                             "quantized with compressed-tensors"),
    ("ct-w4a16-g64", "gptq_marlin", "--quantization gptq_marlin runs gptq checkpoints, not a "
                                    "compressed-tensors checkpoint"),
    ("base", "gptq", "--quantization gptq needs a gptq checkpoint; this one is unquantized"),
    ("base", "awq_marlin", "--quantization awq_marlin runs awq checkpoints, not an "
                           "unquantized checkpoint"),
]


@pytest.mark.parametrize(("name", "requested", "expected"), CONTRADICTIONS,
                         ids=[f"{r}-on-{n}" for n, r, _ in CONTRADICTIONS])
def test_quantization_contradicting_the_checkpoint(name, requested, expected):
    with pytest.raises(ValueError, match=expected):
        cpu_llm(refs.fixture_dir(name), quantization=requested)


def test_contradiction_through_cli():
    result = _cli("--model", str(refs.fixture_dir("gptq-desc-act-g64")), "-q", "awq")
    _assert_clean_cli_error(result, "--quantization awq contradicts the checkpoint")


def _installed_formats() -> str:
    """Every format the installed plugins register (the built-ins, and e.g. the example
    package's when it is installed), as the error lists them."""
    from engine.core.plugins import get_plugin_registry

    return ", ".join(sorted(cls.name for _, cls in get_plugin_registry().quant_methods()))


def test_unknown_quantization_name_lists_the_registered_ones():
    assert {"awq", "compressed-tensors", "fp8", "gptq"} <= set(_installed_formats().split(", "))
    expected = (f"quantization method 'gptq-marlin' is not supported; installed: "
                f"{_installed_formats()} (or a kernel family: awq_marlin, gptq_marlin, "
                "marlin)")
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        cpu_llm(refs.fixture_dir("gptq-desc-act-g64"), quantization="gptq-marlin")
    result = _cli("--model", str(refs.fixture_dir("gptq-desc-act-g64")), "-q", "gptq-marlin")
    _assert_clean_cli_error(result, expected)


def test_unknown_checkpoint_format_lists_the_registered_ones(tmp_path):
    def rename(doc):
        doc["quantization_config"]["quant_method"] = "hqq"

    path = _copy_fixture(tmp_path, "gptq-desc-act-g64", config=rename)
    with pytest.raises(ValueError, match=r"quantization method 'hqq' is not supported; "
                                         rf"installed: {re.escape(_installed_formats())}$"):
        refs.engine_model(path)


# ----------------------------------------------------------------------------- scale tensors


def _drop(key):
    return lambda t: {k: v for k, v in t.items() if k != key}


def _set(key, fn):
    def change(t):
        t = dict(t)
        t[key] = fn(t[key].clone())
        return t
    return change


def _put(index, value):
    def put(x):
        x[index] = value
        return x
    return put


L0 = "model.layers.0"
L1 = "model.layers.1"
BAD_SCALES = [
    # missing
    ("ct-fp8-static", _drop(f"{L0}.self_attn.k_proj.weight_scale"),
     r"checkpoint lacks 1 tensor\(s\): model\.layers\.0\.self_attn\.qkv_proj\.weight_scale "
     r"\(shards \['k'\]\)"),
    ("ct-fp8-static", _drop(f"{L1}.self_attn.v_proj.input_scale"),
     r"lacks 1 tensor\(s\): model\.layers\.1\.self_attn\.qkv_proj\.input_scale \(shards \['v'\]\)"),
    ("gptq-desc-act-g64", _drop(f"{L1}.mlp.down_proj.scales"),
     r"lacks 1 tensor\(s\): model\.layers\.1\.mlp\.down_proj\.scales$"),
    ("ct-nvfp4", _drop(f"{L0}.mlp.up_proj.weight_global_scale"),
     r"lacks 1 tensor\(s\): model\.layers\.0\.mlp\.gate_up_proj\.weight_global_scale "
     r"\(shards \[1\]\)"),
    # wrong shape
    ("ct-w4a16-g64", _set(f"{L0}.self_attn.q_proj.weight_scale", lambda s: s[:, :2].clone()),
     r"cannot load checkpoint tensor 'model\.layers\.0\.self_attn\.q_proj\.weight_scale': .*"
     r"shape \(256, 2\), the model expects \(256, 4\)"),
    ("ct-fp8-block", _set(f"{L0}.mlp.down_proj.weight_scale", lambda s: s[:, :1].clone()),
     r"'model\.layers\.0\.mlp\.down_proj\.weight_scale': .*shape \(2, 1\), "
     r"the model expects \(2, 4\)"),
    ("awq-gemm-g64", _set(f"{L0}.self_attn.o_proj.scales", lambda s: s.t().clone()),
     r"'model\.layers\.0\.self_attn\.o_proj\.scales': .*shape \(256, 4\)"),
    # NaN / inf / zero / negative values
    ("ct-w4a16-g64", _set(f"{L0}.mlp.down_proj.weight_scale", _put((3, 1), math.nan)),
     r"model\.layers\.0\.mlp\.down_proj: checkpoint tensor weight_scale holds 1 invalid "
     r"value\(s\), e\.g\. nan at \[3, 1\]"),
    ("ct-fp8-static", _set(f"{L0}.self_attn.k_proj.input_scale", _put(0, math.inf)),
     r"model\.layers\.0\.self_attn\.qkv_proj: checkpoint tensor input_scale \(shard 'k'\) "
     r"holds 1 invalid value\(s\), e\.g\. inf"),
    ("ct-fp8-dynamic", _set(f"{L1}.self_attn.v_proj.weight_scale", torch.zeros_like),
     r"model\.layers\.1\.self_attn\.qkv_proj: checkpoint tensor weight_scale \(shard 'v'\) "
     r"holds 128 invalid"),
    ("gptq-desc-act-g64", _set(f"{L0}.mlp.up_proj.scales", _put((2, 7), 0.0)),
     r"model\.layers\.0\.mlp\.gate_up_proj: checkpoint tensor scales \(shard 1\) holds 1 "
     r"invalid value\(s\), e\.g\. 0\.0"),
    ("awq-gemm-g64", _set(f"{L1}.mlp.gate_proj.scales", lambda s: -s),
     r"model\.layers\.1\.mlp\.gate_up_proj: checkpoint tensor scales \(shard 0\) holds 2048 "
     r"invalid"),
    ("ct-nvfp4a16", _set(f"{L0}.self_attn.q_proj.weight_scale", _put((0, 0), math.nan)),
     r"qkv_proj: checkpoint tensor weight_scale \(shard 'q'\) holds 1 invalid value\(s\), "
     r"e\.g\. nan at \[0, 0\]"),
    ("ct-nvfp4", _set(f"{L0}.self_attn.k_proj.weight_global_scale", torch.zeros_like),
     r"qkv_proj: checkpoint tensor weight_global_scale \(shard 'k'\) holds 1 invalid"),
    ("ct-nvfp4", _set(f"{L0}.self_attn.o_proj.input_global_scale", _put(0, math.nan)),
     r"o_proj: checkpoint tensor input_global_scale holds 1 invalid"),
]


@pytest.mark.parametrize(("name", "change", "expected"), BAD_SCALES,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_SCALES)])
def test_missing_misshapen_or_corrupt_scales(tmp_path, name, change, expected):
    path = _copy_fixture(tmp_path, name, tensors=change)
    with pytest.raises(ValueError, match=expected):
        refs.engine_model(path)


def test_corrupt_scale_through_llm_and_cli(tmp_path):
    path = _copy_fixture(tmp_path, "ct-w4a16-g64", tensors=_set(
        f"{L1}.self_attn.o_proj.weight_scale", _put((5, 0), math.inf)))
    expected = ("model.layers.1.self_attn.o_proj: checkpoint tensor weight_scale holds 1 "
                "invalid value(s), e.g. inf at [5, 0]")
    with pytest.raises(ValueError) as info:
        cpu_llm(path)
    assert expected in str(info.value)
    _assert_clean_cli_error(_cli("--model", str(path)), expected)


def test_the_unchanged_copy_loads(tmp_path):
    """(The copies above fail only for what was changed.)"""
    path = _copy_fixture(tmp_path, "ct-fp8-static", tensors=lambda t: t)
    assert refs.count_quantized_layers(refs.engine_model(path)) == refs.NUM_QUANTIZED_LAYERS


def test_tensors_of_another_format(tmp_path):
    """GPTQ tensors under a compressed-tensors config: the loader names what the file has
    that the format does not expect, and what it lacks."""
    ct_config = json.loads((refs.fixture_dir("ct-w4a16-g64") / "config.json").read_text())

    def swap(doc):
        doc["quantization_config"] = ct_config["quantization_config"]

    path = _copy_fixture(tmp_path, "gptq-desc-act-g64", config=swap)
    with pytest.raises(ValueError, match=r"checkpoint has \d+ tensor\(s\) the model does not "
                                         r"expect: .*qweight.*; checkpoint lacks \d+ tensor\(s\): "
                                         r".*weight_packed"):
        refs.engine_model(path)


# ----------------------------------------------------------------------------- schemes


def _ct_group(doc):
    return doc["quantization_config"]["config_groups"]["group_0"]


UNSUPPORTED = [
    ("ct-w8a8-int8", lambda d: _ct_group(d)["input_activations"].update(symmetric=False),
     "asymmetric input activations are not supported"),
    ("ct-w4a16-g64", lambda d: _ct_group(d).update(format="marlin-24"),
     "compressed-tensors format 'marlin-24' (group 'group_0') is not supported"),
    ("ct-w4a16-g64", lambda d: d["quantization_config"].update(quantization_status="frozen"),
     "compressed-tensors checkpoint in state 'frozen': only 'compressed' checkpoints"),
    ("ct-w4a16-g64",
     lambda d: d["quantization_config"].update(sparsity_config={"format": "sparse-24"}),
     "compressed-tensors sparsity is not supported"),
    ("gptq-desc-act-g64", lambda d: d["quantization_config"].update(bits=3),
     "gptq: 3-bit checkpoints are not supported"),
    ("awq-gemm-g64", lambda d: d["quantization_config"].update(version="gemv", format="gemv"),
     "awq: the 'gemv' layout is not supported"),
    ("ct-w4a16-g64", lambda d: _ct_group(d)["weights"].update(group_size=96),
     "256 input features are not a multiple of the group size 96"),
]


@pytest.mark.parametrize(("name", "change", "expected"), UNSUPPORTED,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(UNSUPPORTED)])
def test_unsupported_schemes(tmp_path, name, change, expected):
    path = _copy_fixture(tmp_path, name, config=change)
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        refs.engine_model(path)


def _padded_blocks(prefix: str, w: torch.Tensor):
    """128 x 128 block fp8 of a weight whose N / K are no multiples of 128, the way
    compressed-tensors writes it: scales of the zero-padded blocks (ceil), values unpadded."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, (-k) % 128, 0, (-n) % 128))
    tensors, _ = packers.quantize_ct_fp8(padded, "block")
    return {"weight": tensors["weight"][:n, :k].contiguous(),
            "weight_scale": tensors["weight_scale"]}, w


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fp8"])
def test_partial_weight_blocks_are_refused_clearly(synthetic, fmt):
    """Block-fp8 weights of a model whose features are no multiples of 128 (the Llama with
    hidden 160): refused at load with a message about whole blocks."""
    if fmt == "fp8":
        qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}

        def quantize(prefix, w):
            tensors, deq = _padded_blocks(prefix, w)
            return {"weight": tensors["weight"], "weight_scale_inv": tensors["weight_scale"]}, deq
    else:
        qconfig = refs.ct_config("float-quantized", dict(
            num_bits=8, type="float", strategy="block", block_structure=[128, 128]))
        quantize = _padded_blocks
    path, _ = synthetic("llama-160", f"partial-blocks-{fmt}", quantize, qconfig)
    with pytest.raises(ValueError, match=r"128x128 weight blocks need output shards and input "
                                         r"features that are whole blocks; this layer has "
                                         r"output shards \[160, 32, 32\] and 160 input features"):
        refs.engine_model(path)
