"""Per-layer fp8 KV cache scales from the checkpoint (vLLM's k_scale / v_scale).

A tiny transformers model gets scale tensors added to its safetensors under each of the
spellings vLLM maps (``self_attn.k_scale``, llm-compressor's ``k_proj.output_scale``,
ModelOpt's ``k_proj.k_scale``, the deprecated single ``kv_scale``). The engine must hand
them to every layer's kernel, and its fp8 run must equal transformers with the same K/V
fake-quantized (``quantize_kv`` / ``dequantize_kv`` of the post-RoPE keys and the values,
per layer, with those scales): the independent reference that says the scales mean what
the contract says, not only that they changed the output.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.interfaces.attention import dequantize_kv, quantize_kv
from engine.model_executor.layers.attention import Attention
from engine.model_executor.weight_utils import kv_scale_targets

# layer -> (k_scale, v_scale); neither a power of two, both far from 1
SCALES = {0: (0.05, 0.02), 1: (0.2, 0.004)}
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def with_tensors(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of the model directory ``src`` whose safetensors also hold ``tensors``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights.update(tensors)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def scaled_dirs(model_dir_factory, tmp_path_factory):
    """(plain model, the same with SCALES: layer 0 under vLLM's own names, layer 1 under
    llm-compressor's)."""
    plain = model_dir_factory("llama-gqa")
    (k0, v0), (k1, v1) = SCALES[0], SCALES[1]
    scaled = with_tensors(plain, tmp_path_factory.mktemp("scaled") / "model", {
        "model.layers.0.self_attn.k_scale": torch.tensor(k0),
        "model.layers.0.self_attn.v_scale": torch.tensor(v0),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([k1]),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([v1]),
    })
    return plain, scaled


def attention_layers(llm: LLM) -> list[Attention]:
    model = llm.llm_engine.client.core.executor.worker.model
    return [m for m in model.modules() if isinstance(m, Attention)]


SEQS = [[random.Random(n).randrange(5, 380) for _ in range(n)] for n in (9, 24, 47)]


def engine_logprobs(path: Path, kv_cache_dtype: str) -> tuple[list[torch.Tensor], list]:
    """Teacher-forced logprobs of SEQS' tokens (prompt logprobs: one prefill, the fp8
    cache written and read in the same step) and the layers' (k_scale, v_scale)."""
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=128,
             kv_cache_dtype=kv_cache_dtype) as llm:
        scales = [(layer.impl.k_scale, layer.impl.v_scale) for layer in attention_layers(llm)]
        outs = llm.generate([{"prompt_token_ids": s} for s in SEQS],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lps = [torch.tensor([o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))],
                        dtype=torch.float64) for s, o in zip(SEQS, outs)]
    return lps, scales


@torch.inference_mode()
def transformers_fp8_logprobs(path: Path, dtype: torch.dtype, scales: dict) -> list:
    """transformers' float32 logprobs with every layer's K (after RoPE) and V replaced by
    their fp8 cache values under ``scales``."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        key = dequantize_kv(quantize_kv(key, k_scale, dtype), k_scale)
        value = dequantize_kv(quantize_kv(value, v_scale, dtype), v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("engine_test_fp8_kv", fp8_kv_sdpa)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="engine_test_fp8_kv").eval()
    out = []
    for s in SEQS:
        lp = model(torch.tensor([s])).logits[0].double().log_softmax(-1)
        out.append(torch.stack([lp[i - 1, s[i]] for i in range(1, len(s))]))
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_checkpoint_scales_reach_every_layer_and_mean_what_they_say(scaled_dirs,
                                                                     kv_cache_dtype):
    plain, scaled = scaled_dirs
    dtype = DTYPES[kv_cache_dtype]
    got, layer_scales = engine_logprobs(scaled, kv_cache_dtype)
    f32 = [(float(torch.tensor(k)), float(torch.tensor(v))) for k, v in SCALES.values()]
    assert layer_scales == f32
    unit, unit_scales = engine_logprobs(plain, kv_cache_dtype)
    assert unit_scales == [(1.0, 1.0)] * 2
    # the scales change the output, exactly as transformers over the same fp8 values
    # (measured: within 7e-6 of it, with and without scales; 0.8 to 3.8 from each other)
    assert max_diff(got, unit) > 0.1
    assert max_diff(got, transformers_fp8_logprobs(scaled, dtype, SCALES)) < 1e-4
    assert max_diff(unit, transformers_fp8_logprobs(plain, dtype, {})) < 1e-4


def test_a_float_cache_ignores_the_scales(scaled_dirs):
    plain, scaled = scaled_dirs
    got, layer_scales = engine_logprobs(scaled, "auto")
    assert layer_scales == [(float(torch.tensor(k)), float(torch.tensor(v)))
                            for k, v in SCALES.values()]  # loaded all the same
    want, _ = engine_logprobs(plain, "auto")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_deprecated_kv_scale_and_modelopt_names(model_dir_factory, tmp_path):
    path = with_tensors(model_dir_factory("llama-gqa"), tmp_path / "model", {
        "model.layers.0.self_attn.kv_scale": torch.tensor(0.25),  # both K and V
        "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(2.0),
        "model.layers.1.self_attn.q_scale": torch.tensor(3.0),  # fp8 queries: unused here
    })
    with LLM(str(path), device="cpu", max_model_len=64, kv_cache_dtype="fp8") as llm:
        layers = attention_layers(llm)
        assert [(a.impl.k_scale, a.impl.v_scale) for a in layers] == [(0.25, 0.25), (0.5, 2.0)]
        assert "kv_cache=fp8_e4m3 (k_scale=0.25, v_scale=0.25)" in repr(layers[0])


@pytest.mark.parametrize("tensor,match", [
    (torch.tensor([0.5, 0.5]), "per layer"),  # per-head scales
    (torch.tensor(0.0), "positive finite"),
    (torch.tensor(float("nan")), "positive finite"),
])
def test_unusable_scales_are_clear_errors(model_dir_factory, tmp_path, tensor, match):
    path = with_tensors(model_dir_factory("llama-gqa"), tmp_path / "model",
                        {"model.layers.1.self_attn.v_scale": tensor})
    with pytest.raises(ValueError, match=match):
        LLM(str(path), device="cpu", max_model_len=64, kv_cache_dtype="fp8")


def test_scale_names_map_like_vllm():
    params = {f"model.layers.3.self_attn.attn.{n}": None for n in ("k_scale", "v_scale")}
    attn = "model.layers.3.self_attn"
    expected = {
        f"{attn}.k_scale": [f"{attn}.attn.k_scale"],
        f"{attn}.v_scale": [f"{attn}.attn.v_scale"],
        f"{attn}.kv_scale": [f"{attn}.attn.k_scale", f"{attn}.attn.v_scale"],
        f"{attn}.k_proj.output_scale": [f"{attn}.attn.k_scale"],
        f"{attn}.v_proj.output_scale": [f"{attn}.attn.v_scale"],
        f"{attn}.k_proj.k_scale": [f"{attn}.attn.k_scale"],
        f"{attn}.v_proj.v_scale": [f"{attn}.attn.v_scale"],
        f"{attn}.q_scale": [],  # known but unused: dropped
        f"{attn}.prob_output_scale": [],
        f"{attn}.q_proj.output_scale": [],
        "model.layers.4.self_attn.k_scale": None,  # no such layer: unexpected, as before
        f"{attn}.k_proj.weight_scale": None,  # a linear's own scale: not ours
        "model.layers.3.mlp.k_scale": None,
    }
    for name, want in expected.items():
        assert kv_scale_targets(name, params) == want, name
