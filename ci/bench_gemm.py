"""The CPU platform's dense GEMM kernels side by side, over batch sizes.

For each ``[out, in]`` weight shape and row count M it times every kernel that accepts
the shape (the plugin's AVX512-BF16 GEMM, oneDNN on a prepacked weight, the plain-layout
GEMV for tied LM heads) and plain ``F.linear``, on weights that stay in cache (``--cold`` cycles through enough copies to
stream them from memory, as a batch-1 decode step does), and prints microseconds,
GFLOP/s and each kernel's speedup over ``F.linear``. The process keeps large freed
blocks in its heap as engine workers do (cpu.host_memory): otherwise every call's
output at prefill sizes (50 MB at M = 8192) pays fresh page faults, which made both
kernels look 20% slower there.

    python ci/bench_gemm.py                       # llama-tiny's shapes, bf16
    python ci/bench_gemm.py --shapes 5632x1024,1024x2816 --rows 1,8,64 --cold
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.core.interfaces import DenseLayerSpec
from engine.plugins.cpu.gemm import CPUPackedGemm, CPUPlainGemm, OneDNNPackedGemm
from engine.plugins.cpu.host_memory import keep_freed_blocks_in_heap

TINY_SHAPES = "768x512,512x512,3072x512,512x1536,16000x512"
COLD_BYTES = 256 << 20  # enough copies of a weight to overflow any L3


def _time_us(fn, min_seconds: float = 0.2) -> float:
    for _ in range(3):
        fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def _runner(kernel, spec, weights: list[torch.Tensor], x: torch.Tensor):
    prepared = [kernel.prepare(w, spec) if kernel else w for w in weights]
    turn = iter(range(1 << 62))

    def run() -> None:
        w = prepared[next(turn) % len(prepared)]
        kernel.apply(w, x) if kernel else F.linear(x, w)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=TINY_SHAPES, help="OUTxIN,... weight shapes")
    parser.add_argument("--rows", default="1,2,4,8,16,64,256", help="batch sizes M")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cold", action="store_true", help="stream weights from memory")
    args = parser.parse_args()
    keep_freed_blocks_in_heap()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{'shape':>12} {'M':>5} {'kernel':>16} {'us':>10} {'GFLOP/s':>8}")
    for shape in args.shapes.split(","):
        out_f, in_f = map(int, shape.lower().split("x"))
        spec = DenseLayerSpec(in_f, out_f, dtype, torch.device("cpu"))
        candidates = (CPUPackedGemm, OneDNNPackedGemm, CPUPlainGemm)
        kernels = [k() for k in candidates if k.can_implement(spec) is None]
        copies = max(1, COLD_BYTES // (out_f * in_f * dtype.itemsize)) if args.cold else 1
        weights = [torch.randn(out_f, in_f).to(dtype) for _ in range(copies)]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, in_f).to(dtype)
            base = _time_us(_runner(None, spec, weights, x))
            for kernel in (*kernels, None):
                us = base if kernel is None else _time_us(_runner(kernel, spec, weights, x))
                name = kernel.name if kernel else "F.linear"
                gflops = 2 * m * out_f * in_f / us / 1e3
                print(f"{shape:>12} {m:>5} {name:>16} {us:>10.1f} {gflops:>8.1f}"
                      f"  ({base / us:.2f}x F.linear)")


if __name__ == "__main__":
    main()
