"""The Triton weight-only int kernels (engine/kernels/quant_gemm_int.py) end to end: the
real int4 fixtures of tests/data/quant-fixtures (GPTQ act-order with zero points, AWQ,
compressed-tensors symmetric W4A16) through ``LLM`` on the CPU platform with
``ENGINE_CPU_QUANT_GEMM=triton`` and ``TRITON_INTERPRET=1``, so every quantized linear
runs the GPU plugins' kernels in Triton's interpreter.

Each must give the same greedy tokens as the CPU plugin's own C kernel (and the tool's
reference tokens), and logits within the fixtures' 1e-3 of the reference. The runtime
report names the Triton kernel for every quantized layer and the module's launch counters
prove it ran. The "marlin" kernel family (``--quantization gptq_marlin`` / ``awq_marlin``
/ ``marlin``) selects the Marlin-style kernel; ``ENGINE_TRITON_INT_GEMM=plain`` the plain
one. The interpreter is slow: two short prompts, a few tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from engine.kernels import quant_gemm_int
from engine.plugins.cpu import quant_gemm
from tests.helpers.hf_reference import cpu_llm
from tests.quantization import refs

PROMPTS = (0, 1)  # the fixtures' 1- and 7-token prompts
STEPS = 4
QUANTIZED_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# fixture, --quantization (a "marlin" family name), the kernel it must get
CASES = [
    ("gptq-desc-act-g64", "gptq_marlin", "triton_marlin"),
    ("awq-gemm-g64", "awq_marlin", "triton_marlin"),
    ("ct-w4a16-g64", None, "triton_w4a16"),  # with ENGINE_TRITON_INT_GEMM=plain
]


def _generate(name: str, quantization: str | None = None) -> tuple[list[list[int]], dict, object]:
    llm = cpu_llm(refs.fixture_dir(name), quantization=quantization)
    try:
        info = llm.llm_engine.client.core.executor.runtime_info()
        prompts = [refs.prompts(name)[i] for i in PROMPTS]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            refs.greedy_params(STEPS), use_tqdm=False)
        tokens = [list(out.outputs[0].token_ids) for out in outs]
        ref = refs.reference(name)
        logits = refs.engine_logits(refs.llm_model(llm), ref["prompt1.input_ids"].tolist())
        diff = refs.rel_diff(logits, ref["prompt1.logits"])
        return tokens, info["layer_kernels"], diff
    finally:
        del llm


@pytest.mark.parametrize(("name", "quantization", "kernel"), CASES)
def test_triton_kernels_match_the_cpu_kernels(monkeypatch, name, quantization, kernel):
    monkeypatch.setenv(quant_gemm.QUANT_GEMM_ENV, "auto")
    want, cpu_kinds, _ = _generate(name)
    assert all(cpu_kinds[kind].startswith("cpu_qgemm") for kind in QUANTIZED_KINDS)

    monkeypatch.setenv(quant_gemm.QUANT_GEMM_ENV, "triton")
    if kernel == "triton_w4a16":
        monkeypatch.setenv(quant_gemm_int.ORDER_ENV, "plain")
    quant_gemm_int.launches.reset()
    got, kinds, diff = _generate(name, quantization)
    counts = quant_gemm_int.launches.snapshot()

    for kind in QUANTIZED_KINDS:
        assert kinds[kind].startswith(f"{kernel} (int4)"), kinds
    # 8 quantized layers per forward; at least prefill + STEPS - 1 decodes + the logits
    launched = counts["marlin_gemm" if kernel == "triton_marlin" else "int_gemm"]
    assert launched >= refs.NUM_QUANTIZED_LAYERS * (STEPS + 1), counts
    assert got == want, f"{name}: Triton {got} vs CPU kernel {want}"
    ref = refs.reference(name)
    assert got == [ref[f"prompt{i}.greedy_tokens"].tolist()[:STEPS] for i in PROMPTS]
    assert diff <= 1e-3, f"{name}: logits differ from the reference by {diff:.3g}"


def test_cpu_selection_needs_the_interpreter(monkeypatch):
    """The CPU platform offers the Triton kernels first, each refusing a forward-graph
    capture (which replays only C kernels), and only under the interpreter."""
    import torch
    from torch import nn

    from engine.core.interfaces import GraphCaptureError, QuantizedLayerSpec, QuantizedWeights
    from engine.plugins.cpu import native

    monkeypatch.setenv(quant_gemm.QUANT_GEMM_ENV, "triton")
    kernels = quant_gemm.quant_gemm_preference()
    assert [k.name for k in kernels[:2]] == ["triton_marlin", "triton_w4a16"]
    assert quant_gemm.quant_gemm_preference() == kernels  # the same classes every time
    spec = QuantizedLayerSpec("test", "int", 4, 64, 64, 64, torch.float32)
    layer, kernel = nn.Module(), kernels[0]()
    kernel.prepare(layer, QuantizedWeights(spec, torch.full((64, 64), 9, dtype=torch.uint8),
                                           torch.ones(64, 1)))
    assert torch.equal(kernel.apply(layer, torch.ones(1, 64)), torch.full((1, 64), 64.0))
    with native.recording_calls(), pytest.raises(GraphCaptureError, match="interpreted"):
        kernel.apply(layer, torch.ones(1, 64))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 as well"):
        quant_gemm.quant_gemm_preference()
