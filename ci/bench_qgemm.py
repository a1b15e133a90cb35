"""The CPU platform's quantized GEMM (csrc/gemm_quant.h) against its dense GEMM, per
encoding, batch size and ISA level.

For each ``[out, in]`` shape and row count M it times the plugin's quantized kernel on
int4 (group 128, zero points), int8 (per channel), fp8 (per channel), nvfp4 (groups of
16), W8A8 (int8 weights, dynamic per-token int8 activations) and FP8 W8A8 weights, next
to the dense C GEMM on the same shape in bf16 (the checkpoint a quantized model
replaces) and the torch reference kernel; weights cycle through enough copies to
stream from memory (``--warm``: stay in cache), as a decode step reads them. It prints
microseconds, the weight bytes each call streams, the GB/s that is, and the speedup
over bf16. The header names the CPU, the ISA level and the memory read bandwidth::

    python ci/bench_qgemm.py                                  # llama-small's shapes
    python ci/bench_qgemm.py --rows 1,8,64,512 --isa avx2
    python ci/bench_qgemm.py --shapes 5632x1024 --schemes int4,nvfp4 --warm
"""

from __future__ import annotations

import argparse

import torch

from engine.benchmarks.report import memory_read_gb_s
from engine.core.interfaces import ActivationQuant, DenseLayerSpec, QuantizedLayerSpec
from engine.core.interfaces import QuantizedWeights
from engine.plugins.cpu import kernel_build, native
from engine.plugins.cpu.gemm import CPUPackedGemm
from engine.plugins.cpu.host_memory import keep_freed_blocks_in_heap
from engine.plugins.cpu.quant_gemm import CPUQuantizedGemm
from engine.quantization.reference import TorchQuantizedGemm

from bench_gemm import COLD_BYTES, time_us  # ci/ is this script's directory

SMALL_SHAPES = "1536x1024,1024x1024,5632x1024,1024x2816"  # llama-small's linears
SCHEMES = {  # encoding, bits, group (0: per channel), activation
    "int4": ("int", 4, 128, None),
    "int8": ("int", 8, 0, None),
    "fp8": ("fp8", 8, 0, None),
    "nvfp4": ("nvfp4", 4, 16, None),
    "w8a8": ("int", 8, 0, ActivationQuant("int8", "token", True)),
    "fp8-dyn": ("fp8", 8, 0, ActivationQuant("fp8", "token", True)),
}


def _weights(scheme: str, n: int, k: int, act_dtype: torch.dtype) -> QuantizedWeights:
    encoding, bits, group, act = SCHEMES[scheme]
    group = group or k
    groups = k // group
    if encoding == "int":
        codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
        zeros = torch.randint(0, 1 << bits, (n, groups)).float() if bits == 4 else None
    elif encoding == "fp8":
        codes = torch.randn(n, k).to(torch.float8_e4m3fn)
        zeros = None
    else:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        zeros = None
    spec = QuantizedLayerSpec(scheme, encoding, bits, group, k, n, act_dtype,
                              zeros is not None, activation=act, shard_sizes=(n,))
    return QuantizedWeights(spec, codes, torch.rand(n, groups) * 0.01, zeros, None, None, (n,))


def _cycle(layers: list, call) -> callable:
    turn = iter(range(1 << 62))
    return lambda: call(layers[next(turn) % len(layers)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SMALL_SHAPES, help="OUTxIN,... weight shapes")
    parser.add_argument("--rows", default="1,4,16,64,256", help="batch sizes M")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="of " + ",".join(SCHEMES))
    parser.add_argument("--act-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--isa", default=None, help="ISA level (default: this CPU's best)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--warm", action="store_true", help="weights stay in cache")
    parser.add_argument("--reference", action="store_true", help="also time the torch kernel")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_blocks_in_heap()
    kernels = native.load_kernels(args.isa)
    if kernels is None:
        raise SystemExit("the CPU plugin's C kernels are not available here")
    act_dtype = getattr(torch, args.act_dtype)
    cpu = kernel_build.cpu_model_name()
    print(f"# {cpu} | level {kernels.level} | {torch.get_num_threads()} threads | memory "
          f"read {memory_read_gb_s():.1f} GB/s | activations {args.act_dtype} | "
          f"{'warm' if args.warm else 'cold'} weights")
    print("| shape | M | scheme | us | MB streamed | GB/s | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        dense_bytes = n * k * 2
        copies = 1 if args.warm else max(1, COLD_BYTES // dense_bytes)
        dense = CPUPackedGemm(kernels)
        spec = DenseLayerSpec(n, k, torch.bfloat16, torch.device("cpu"), act_dtype)
        packed = [dense.prepare(torch.randn(n, k).bfloat16(), spec) for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).to(act_dtype)
            base = time_us(_cycle(packed, lambda w: dense.apply(w, x)))
            print(f"| {n}x{k} | {m} | bf16 dense | {base:.1f} | {dense_bytes / 1e6:.2f} | "
                  f"{dense_bytes / base / 1e3:.1f} | 1.00 |")
            for scheme in args.schemes.split(","):
                kernel_classes = [CPUQuantizedGemm] + ([TorchQuantizedGemm] if args.reference else [])
                for kernel_cls in kernel_classes:
                    layers = []
                    weights = _weights(scheme, n, k, act_dtype)
                    for _ in range(1 if kernel_cls is TorchQuantizedGemm else copies):
                        layer = torch.nn.Module()
                        kernel = kernel_cls(kernels) if kernel_cls is CPUQuantizedGemm else kernel_cls()
                        kernel.prepare(layer, weights)
                        layers.append(layer)
                    nbytes = layers[0].q_packed.numel() if hasattr(layers[0], "q_packed") else 0
                    us = time_us(_cycle(layers, lambda layer: kernel.apply(layer, x)))
                    label = scheme if kernel_cls is CPUQuantizedGemm else f"{scheme} (torch)"
                    rate = f"{nbytes / us / 1e3:.1f}" if nbytes else "-"
                    print(f"| {n}x{k} | {m} | {label} | {us:.1f} | {nbytes / 1e6:.2f} | {rate} | "
                          f"{base / us:.2f} |")


if __name__ == "__main__":
    main()
