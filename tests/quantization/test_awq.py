"""AWQ checkpoints in the GEMM layout (``quant_method: awq``, ``version: gemm``) of other
shapes and group sizes than the fixture's: ``qweight [K, N / 8]`` with the columns of each
int32 in AWQ's nibble order [0, 2, 4, 6, 1, 3, 5, 7], ``qzeros`` packed the same way (the
zero itself), fp16 scales.

Written by :func:`packers.quantize_awq` (AutoAWQ's packing); reference: transformers with
the dequantized weights, float32, within 1e-3 x max|logit| (measured ~2e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.quantization import packers, refs

CASES = [("qwen3-384", 128), ("qwen3-384", 64), ("llama-160", 32)]


def _config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


@pytest.mark.parametrize(("shape", "group"), CASES, ids=[f"{s}-g{g}" for s, g in CASES])
def test_awq_gemm_matches_dequantized_transformers(synthetic, shape, group):
    path, reference = synthetic(shape, f"awq-g{group}",
                                lambda prefix, w: packers.quantize_awq(w, group), _config(group))
    refs.check_synthetic(path, shape, reference)


def test_awq_nibble_order_is_not_the_plain_one():
    """The packer's order is AWQ's, not the plain one the other formats use: the same
    codes packed in order [0..7] give different words (so the test above would fail for
    a loader that read AWQ words in plain order)."""
    codes = torch.arange(16).reshape(2, 8) % 16
    awq = packers.pack_rows(codes, 4, packers.AWQ_ORDER)
    plain = packers.pack_rows(codes, 4)
    assert not torch.equal(awq, plain)
    # word 0 holds columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7
    nibbles = [(int(awq[0, 0]) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]


def test_modules_to_not_convert_stay_dense(synthetic):
    """``modules_to_not_convert`` names modules AWQ left in float: they load as dense."""
    shape = "llama-160"

    def quantize(prefix: str, w: torch.Tensor):
        if prefix.endswith("mlp.down_proj"):
            return {"weight": w.clone()}, w.clone()
        return packers.quantize_awq(w, 32)

    config = {**_config(32), "modules_to_not_convert": ["down_proj"]}
    path, reference = synthetic(shape, "awq-not-converted", quantize, config)
    model = refs.engine_model(path)
    assert refs.count_quantized_layers(model) == 6
    tokens = refs.synthetic_prompt(shape)
    want = refs.hf_logits(reference, tokens)
    assert refs.rel_diff(refs.engine_logits(model, tokens), want) <= 1e-3
