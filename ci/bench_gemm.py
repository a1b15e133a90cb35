"""The CPU platform's dense GEMM kernels side by side, over batch sizes and ISA levels,
against the machine's limits.

For each ``[out, in]`` weight shape and row count M it times every kernel that accepts
the layer (the plugin's packed C GEMM of the chosen ISA level(s), oneDNN on a prepacked
weight, the plain-layout GEMM for tied LM heads) and plain ``F.linear``, on weights that
stay in cache (``--cold`` cycles through enough copies to stream them from memory, as a
batch-1 decode step does), and prints microseconds, GFLOP/s, the share of the level's
measured float32 FMA peak and each kernel's speedup over ``F.linear``. The header gives
the machine's limits: the FMA peak of every level timed (``fma_peak_gflops``: independent
vector multiply-adds on every thread) and the memory read bandwidth. The process keeps
large freed blocks in its heap as engine workers do (cpu.host_memory): otherwise every
call's output at prefill sizes (50 MB at M = 8192) pays fresh page faults.

Weights default to bf16 with the activation dtype ``--dtype auto`` would pick on this CPU
(bf16 with bf16 dot products, else float32)::

    python ci/bench_gemm.py                                    # llama-tiny's shapes
    python ci/bench_gemm.py --isa all --rows 1,64,1024         # every level this CPU runs
    python ci/bench_gemm.py --shapes 5632x1024,1024x2816 --rows 1,8,64 --cold
    python ci/bench_gemm.py --dtype float32 --act-dtype float32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.benchmarks.report import memory_read_gb_s
from engine.core.interfaces import DenseLayerSpec
from engine.plugins.cpu import kernel_build, native
from engine.plugins.cpu.gemm import CPUPackedGemm, CPUPlainGemm, OneDNNPackedGemm
from engine.plugins.cpu.host_memory import keep_freed_blocks_in_heap

TINY_SHAPES = "768x512,512x512,3072x512,512x1536,16000x512"
COLD_BYTES = 256 << 20  # enough copies of a weight to overflow any L3


def time_us(fn, min_seconds: float = 0.2) -> float:
    for _ in range(3):
        fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def _runner(kernel, spec, weights: list[torch.Tensor], x: torch.Tensor):
    prepared = [kernel.prepare(w, spec) if kernel else w.to(x.dtype) for w in weights]
    turn = iter(range(1 << 62))

    def run() -> None:
        w = prepared[next(turn) % len(prepared)]
        kernel.apply(w, x) if kernel else F.linear(x, w)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=TINY_SHAPES, help="OUTxIN,... weight shapes")
    parser.add_argument("--rows", default="1,2,4,8,16,64,256", help="batch sizes M")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="the weights' dtype")
    parser.add_argument("--act-dtype", default="auto",
                        choices=["auto", "bfloat16", "float16", "float32"],
                        help="the activations' (auto: what --dtype auto picks on this CPU)")
    parser.add_argument("--isa", default=None,
                        help="ISA level(s) of the C GEMMs, comma-separated, or 'all' "
                             "(default: the engine's)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cold", action="store_true", help="stream weights from memory")
    args = parser.parse_args()
    keep_freed_blocks_in_heap()
    if args.threads:
        torch.set_num_threads(args.threads)
    runnable = [lv.name for lv in kernel_build.runnable_levels()]
    levels = (runnable if args.isa == "all" else args.isa.split(",") if args.isa
              else [kernel_build.select_level().name])
    libraries = {name: native.load_kernels(name) for name in levels}
    if any(lib is None for lib in libraries.values()):
        raise SystemExit("the plugin's C kernels could not be built (see the log)")
    dtype = getattr(torch, args.dtype)
    if args.act_dtype == "auto":
        from engine.plugins.cpu.platform import CPUPlatform

        act = CPUPlatform().activation_dtype(dtype)
    else:
        act = getattr(torch, args.act_dtype)
    peaks = {name: lib.fma_peak_gflops() for name, lib in libraries.items()}
    print(f"threads {torch.get_num_threads()}, memory read {memory_read_gb_s()} GB/s, "
          f"float32 FMA peak " + ", ".join(f"{n} {p:.0f} GFLOP/s" for n, p in peaks.items()))
    print(f"{args.dtype} weights, {str(act)[6:]} activations")
    print(f"{'shape':>12} {'M':>5} {'kernel':>26} {'us':>10} {'GFLOP/s':>8} {'peak':>5}")
    for shape in args.shapes.split(","):
        out_f, in_f = map(int, shape.lower().split("x"))
        spec = DenseLayerSpec(in_f, out_f, dtype, torch.device("cpu"), activation_dtype=act)
        kernels: list[tuple[str, object, float | None]] = []
        for name, lib in libraries.items():
            for cls in (CPUPackedGemm, CPUPlainGemm):
                if cls.can_implement(spec) is None:
                    kernels.append((f"{cls.name} ({name})", cls(lib), peaks[name]))
        if OneDNNPackedGemm.can_implement(spec) is None:
            kernels.append((OneDNNPackedGemm.name, OneDNNPackedGemm(), None))
        copies = max(1, COLD_BYTES // (out_f * in_f * dtype.itemsize)) if args.cold else 1
        weights = [torch.randn(out_f, in_f).to(dtype) for _ in range(copies)]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, in_f).to(act)
            base = time_us(_runner(None, spec, weights, x))
            for name, kernel, peak in (*kernels, ("F.linear", None, None)):
                us = base if kernel is None else time_us(_runner(kernel, spec, weights, x))
                gflops = 2 * m * out_f * in_f / us / 1e3
                share = f"{100 * gflops / peak:4.0f}%" if peak else "    -"
                print(f"{shape:>12} {m:>5} {name:>26} {us:>10.1f} {gflops:>8.1f} {share:>5}"
                      f"  ({base / us:.2f}x F.linear)")


if __name__ == "__main__":
    main()
