"""Compile the engine's Triton kernels for a GPU target on a machine without a GPU.

The interpreter tests (tests/kernels) prove the kernels compute the right thing; this
script proves the same kernels *compile* for real hardware (Triton -> TTGIR -> PTX ->
cubin, or -> AMDGCN), catching constructs the interpreter accepts but the compiler
rejects, and reports register spills on NVIDIA. A stand-in driver answers the target
question and the launches are warm-ups, so nothing ever runs.

    python ci/triton_compile_check.py              # cuda:90 (H100/H200)
    python ci/triton_compile_check.py hip:gfx942   # MI300
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("unset TRITON_INTERPRET: this script compiles for a GPU target")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

import engine.kernels.reshape_and_cache as rc
import engine.kernels.unified_attention as ua


class _TargetOnlyDriver:
    """Enough of a Triton driver to compile for ``target``; cannot launch anything."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def _parse_target(text: str) -> GPUTarget:
    backend, arch = text.split(":")
    if backend == "cuda":
        return GPUTarget("cuda", int(arch), 32)
    return GPUTarget("hip", arch, 64)


def _spills(kernel, target: GPUTarget) -> str:
    """Registers / spill bytes from ptxas -v (NVIDIA only, best effort)."""
    if target.backend != "cuda":
        return ""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptx = kernel.asm["ptx"]
        arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
        path = f"/tmp/_engine_check_{os.getpid()}.ptx"
        with open(path, "w") as handle:
            handle.write(ptx)
        report = subprocess.run(
            [get_ptxas(target.arch).path, f"-arch={arch}", "-v", path, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        ).stderr
        os.unlink(path)
        regs = re.findall(r"Used (\d+) registers", report)
        spills = re.findall(r"(\d+) bytes spill stores", report)
        return f"regs={regs[-1] if regs else '?'} spill_bytes={spills[-1] if spills else '?'}"
    except Exception as exc:  # noqa: BLE001 - reporting only
        return f"(no ptxas report: {exc})"


def _inputs(reqs, heads, kv_heads, head_size, block_size, dtype):
    """Random q, cache and batch tensors (CPU; only their dtypes and shapes matter)."""
    q_lens = torch.tensor([q for q, _ in reqs])
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    width = int((seq_lens.max() + block_size - 1) // block_size)
    num_blocks = width * len(reqs)
    q = torch.randn(int(q_lens.sum()), heads, head_size).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size).to(dtype)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(len(reqs), width)
    return q, cache, qsl, seq_lens, tables, int(q_lens.max()), int(seq_lens.max())


CASES = [
    # name, requests, heads, kv heads, head size, block size, dtype, extra
    ("bf16 prefill+decode gqa4 d128", [(5, 21), (1, 40)], 32, 8, 128, 16, torch.bfloat16, {}),
    ("bf16 decode gqa8 d128", [(1, 40), (1, 9)], 64, 8, 128, 16, torch.bfloat16, {}),
    (
        "fp16 decode window softcap d64",
        [(1, 40)],
        8,
        8,
        64,
        32,
        torch.float16,
        {"sliding_window": 8, "logits_soft_cap": 30.0},
    ),
    ("fp32 mixed d80", [(5, 21), (1, 40)], 4, 2, 80, 16, torch.float32, {}),
    ("bf16 prefill d256", [(5, 21)], 8, 1, 256, 16, torch.bfloat16, {}),
    ("bf16 decode d80 bs64", [(1, 200)], 16, 2, 80, 64, torch.bfloat16, {}),
]


def main() -> int:
    target = _parse_target(sys.argv[1] if len(sys.argv) > 1 else "cuda:90")
    driver.set_active(_TargetOnlyDriver(target))
    compiled = []

    def warmup_only(self, grid):
        def launch(*args, **kwargs):
            compiled.append((self.fn.__name__, self.run(*args, grid=grid, warmup=True, **kwargs)))

        return launch

    JITFunction.__getitem__ = warmup_only
    ua.check_device = rc.check_device = lambda *args: None  # CPU tensors stand in for GPU ones
    failures = 0
    cases = [(*case, None) for case in CASES] + [  # fp8 caches (engine.kernels.fp8_kv)
        (f"{name} {str(fp8).removeprefix('torch.')}", *rest, fp8)
        for name, *rest in CASES[:2] for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2)
    ]
    for name, reqs, heads, kv_heads, head_size, block_size, dtype, extra, fp8 in cases:
        q, cache, qsl, seq_lens, tables, max_q, max_s = _inputs(
            reqs, heads, kv_heads, head_size, block_size, dtype
        )
        scales = {}
        if fp8 is not None:
            cache, scales = cache.float().to(fp8), {"k_scale": 0.5, "v_scale": 0.25}
        for splits in (1, 4):
            start = time.time()
            compiled.clear()
            try:
                ua.unified_attention(
                    q,
                    cache,
                    torch.empty_like(q),
                    qsl,
                    seq_lens,
                    tables,
                    max_q,
                    max_s,
                    0.1,
                    num_kv_splits=splits,
                    **extra,
                    **scales,
                )
                notes = "; ".join(f"{fn} {_spills(k, target)}".strip() for fn, k in compiled)
                print(f"ok   {name} splits={splits} ({time.time() - start:.1f}s) {notes}")
            except Exception as exc:  # noqa: BLE001 - report every case
                failures += 1
                print(f"FAIL {name} splits={splits}: {type(exc).__name__}: {exc}")
        try:
            key = torch.randn(3, kv_heads, head_size).to(dtype)
            rc.reshape_and_cache(key, key, cache, torch.tensor([0, -1, 5]), **scales)
        except Exception as exc:  # noqa: BLE001
            failures += 1
            print(f"FAIL reshape_and_cache {name}: {type(exc).__name__}: {exc}")
    print("all kernels compiled" if failures == 0 else f"{failures} compile failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
