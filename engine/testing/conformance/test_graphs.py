"""Forward graphs (``engine.core.interfaces.graphs``).

Clauses: ``[graphs.capture]`` a forward over the platform's own fused ops (torch ops
when it has none) can be captured; ``[graphs.replay]`` a replay reads its input buffers
at replay time and returns what the eager forward computes on those values.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.interfaces import GraphCaptureError


@pytest.mark.conformance("graphs.capture", "graphs.replay")
def test_capture_replays_fused_ops(engine_platform):
    """[graphs.capture] [graphs.replay] norm -> silu_and_mul captured once, replayed on
    fresh values written into the same buffers, equals the eager result."""
    capturer = engine_platform.forward_graph_capturer()
    if capturer is None:
        pytest.skip("platform has no forward graph capturer (every forward runs eagerly)")
    device = engine_platform.device()
    ops = engine_platform.fused_ops()
    dtype = torch.float32
    if ops is not None and not ops.supports(dtype):
        dtype = next((d for d in engine_platform.supported_dtypes() if ops.supports(d)), None)
        if dtype is None:
            pytest.skip("the fused ops support none of the platform's dtypes")

    def forward_of(x, w):
        if ops is not None:
            return ops.silu_and_mul(ops.rms_norm(x, w, 1e-5))
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(4, 64, dtype=dtype, device=device)
    w = (torch.rand(64, generator=gen) + 0.5).to(dtype).to(device)
    try:
        graph = capturer.capture(lambda: forward_of(x, w))
    except GraphCaptureError as exc:
        pytest.fail(f"[graphs.capture] a forward of the platform's own fused ops could not "
                    f"be captured: {exc}")
    for _ in range(3):
        x.copy_(torch.randn(4, 64, generator=gen).to(dtype))
        expected = forward_of(x.clone(), w)
        got = graph.replay()
        engine_platform.synchronize()
        assert torch.allclose(got.float(), expected.float(), rtol=1e-5, atol=1e-6), (
            "[graphs.replay] replay on new input values differs from the eager forward "
            f"by {(got.float() - expected.float()).abs().max().item():.3g}")
