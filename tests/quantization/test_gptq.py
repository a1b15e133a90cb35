"""Legacy GPTQ checkpoints (AutoGPTQ / GPTQModel, ``quant_method: gptq``) of other shapes
and bit widths than the fixture's: 4- and 8-bit, symmetric and asymmetric zero points,
act-order (``desc_act``: a random permutation of the input features per input, shared by
the linears reading it, as GPTQ derives it from that input's Hessian), group 32 / 128 /
per channel, v1 (zeros stored minus one) and v2.

Written by :func:`packers.quantize_gptq` (the AutoGPTQ packing); reference: transformers
with the dequantized weights, float32, within 1e-3 x max|logit| (measured ~2e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.quantization import packers, refs

CASES = [
    # shape, bits, group (-1: per channel), sym, desc_act, checkpoint_format
    ("qwen3-384", 4, 128, True, True, "gptq"),
    ("qwen3-384", 4, 128, False, True, "gptq"),
    ("qwen3-384", 8, 128, False, True, "gptq"),
    ("llama-160", 4, 32, False, True, "gptq"),
    ("llama-160", 8, 32, True, True, "gptq"),
    ("llama-160", 4, 32, False, False, "gptq"),
    ("llama-160", 4, -1, True, False, "gptq"),
    ("llama-160", 4, 32, False, True, "gptq_v2"),
]


def _quantizer(bits: int, group: int, sym: bool, desc_act: bool, fmt: str):
    def quantize(prefix: str, w: torch.Tensor):
        k = w.shape[1]
        perm = refs.perm_for(prefix, k) if desc_act else None
        tensors, deq = packers.quantize_gptq(w, bits, k if group == -1 else group, sym, perm)
        if fmt == "gptq_v2":  # v2 stores the zero points themselves
            zeros = packers.unpack_rows(tensors["qzeros"], bits) + 1
            tensors["qzeros"] = packers.pack_rows(zeros, bits)
        return tensors, deq

    return quantize


def _config(bits, group, sym, desc_act, fmt):
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
            "desc_act": desc_act, "checkpoint_format": fmt, "lm_head": False,
            "pack_dtype": "int32", "damp_percent": 0.05, "true_sequential": True}


@pytest.mark.parametrize(("shape", "bits", "group", "sym", "desc_act", "fmt"), CASES,
                         ids=[f"{s}-{b}bit-g{g}-{'sym' if y else 'asym'}-"
                              f"{'actorder' if a else 'plain'}-{f}" for s, b, g, y, a, f in CASES])
def test_gptq_matches_dequantized_transformers(synthetic, shape, bits, group, sym, desc_act,
                                               fmt):
    label = f"gptq-{bits}-{group}-{sym}-{desc_act}-{fmt}"
    path, reference = synthetic(shape, label, _quantizer(bits, group, sym, desc_act, fmt),
                                _config(bits, group, sym, desc_act, fmt))
    tensors = refs.read_tensors(path)
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"].long()
    k = g_idx.numel()
    plain = torch.arange(k) // (k if group == -1 else group)
    assert bool((g_idx == plain).all()) == (not desc_act)
    if not sym:  # zero points other than the midpoint are really exercised
        zeros = packers.unpack_rows(tensors["model.layers.0.self_attn.q_proj.qzeros"], bits)
        assert len(torch.unique(zeros)) > 2
    refs.check_synthetic(path, shape, reference)


def test_fused_shards_with_different_act_order_are_refused(synthetic):
    """q/k/v read one input, so GPTQ gives them one act-order; a checkpoint whose k_proj
    has another g_idx cannot run as one fused GEMM: a clear error, not wrong output."""
    shape = "llama-160"

    def quantize(prefix: str, w: torch.Tensor):
        perm = refs.perm_for(prefix + ("-own" if prefix.endswith("k_proj") else ""), w.shape[1])
        return packers.quantize_gptq(w, 4, 32, True, perm)

    path, _ = synthetic(shape, "gptq-mismatched-gidx", quantize,
                        _config(4, 32, True, True, "gptq"))
    with pytest.raises(ValueError, match=r"qkv_proj.*different g_idx"):
        refs.engine_model(path)
