#!/usr/bin/env python3
"""One prepared check of the Triton attention kernels on a real GPU (built for an H200).

Sections, each reported on its own so one failure never hides the others:
  1. correctness: unified attention (single pass and split-KV), reshape_and_cache and the
     backend's forward against a float32 torch reference, on the GPU;
  2. speed: decode (context 1k / 8k / 32k, batch 1 and 64) and a 2k prefill, against
     torch SDPA on contiguous K/V and against the HBM roofline / peak bf16 matmul rate;
  2b. quantized GEMMs: the Triton weight-only int kernels (engine/kernels/quant_gemm_int.py,
     plain W4A16 layout and Marlin-style) against a float32 torch reference, then timed at
     decode (M = 1, 4, 16) and prefill (M = 2048), K = N = 4096 and 8192, int4 group 128,
     against torch's bf16 matmul of the same (dequantized) weights and against the HBM
     roofline (packed weight bytes / measured time vs the device's bandwidth);
  2c. fp8 / int8 / nvfp4 GEMMs (engine/kernels/quant_gemm_fp.py): the activation quantizer
     bit for bit against engine.quantization.numerics, the GEMMs (the device's MMA path and
     the no-MMA path) against the torch reference kernel, then timed at decode (M = 1, 4,
     16) and prefill (M = 2048), K = N = 4096 and 8192, per-channel fp8, 128 x 128 block
     fp8, int8 W8A8 and NVFP4, against torch's bf16 matmul and the HBM roofline;
  2d. batch-invariant mode (engine/kernels/batch_invariant.py, unified attention with
     ``batch_invariant=True``): a row's result bit for bit the same alone and among
     others (GEMM rows at M = 1..2048, RMSNorm, log-softmax, one query token as a lone
     decode, among 63 decodes, in a 4-token verification and at the end of a prefill
     chunk), then the price: the invariant GEMM vs cuBLAS (M = 1..2048, Llama-8B shapes),
     RMSNorm / log-softmax vs torch, attention without split-KV vs the default;
     ``--skip-batch-invariant`` drops it (~30 s);
  3. end to end: ``python -m engine.cli generate "Once upon a time" --device cuda
     --max-tokens 16 --ignore-eos --json`` on the demo model (engine/assets/demo) or, when
     this tree has none, on a tiny random bf16 Llama built here with transformers into a
     temp dir; reports tokens/s (engine startup and Triton JIT included), then the same
     with split-KV forced (ENGINE_TRITON_NUM_KV_SPLITS=4), then (time permitting) on the
     GPTQ int4 act-order fixture (tests/data/quant-fixtures/gptq-desc-act-g64) with
     ``--quantization gptq_marlin`` on a GPU: the platform's Triton Marlin-style kernel.

Sections 1-2 need only torch + triton (and numpy): ``import engine`` pulls in nothing
else. Section 3 runs the whole engine, whose imports a bare CUDA image (the H200 one:
Python 3.12, torch, triton, transformers, safetensors, tokenizers, jinja2, click, pluggy,
numpy, tqdm) lacks in part; carry these as cp312 wheels in ``.whl/``:
    pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions (pydantic
    needs >= 4.14), msgspec
(pyzmq, fastapi and uvicorn are not imported by ``engine generate``). The platforms are
entry points of the installed ``engine`` distribution, so the engine must be installed
too. ``ci/gpu_check.sh`` does both; ``ci/gpu_check.sh fetch-wheels`` fills ``.whl/``.
Missing modules skip section 3 with a note, never fail the run.

Finishes in about 6 minutes or less (a global deadline skips what is left; section 3
keeps the last ~100 s; sections 2b and 2c take ~60 s each, ``--skip-quant`` drops them).
Results go to stdout as one table, and to ``$OUT/gpu_check.json`` when ``OUT`` is set.

    ci/gpu_check.sh [--skip-e2e] [--skip-quant] [--skip-batch-invariant] [--peak-bw-tbs 4.8]
                    [--peak-tflops 989]
    python ci/gpu_check.py --e2e-only --e2e-device cpu   # check section 3's wiring anywhere
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 365.0
E2E_RESERVE_S = 100.0  # kernel sections stop this long before the deadline when e2e runs
START = time.monotonic()
reserved_s = 0.0


def time_left() -> float:
    return BUDGET_S - (time.monotonic() - START)


def import_kernels():
    """The kernel modules; bypasses ``engine/__init__`` if its dependencies are missing."""
    sys.path.insert(0, str(REPO))
    try:
        import engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - fall back to a bare package
        print(f"note: `import engine` failed ({type(exc).__name__}: {exc}); loading kernels only")
        for name in [n for n in sys.modules if n == "engine" or n.startswith("engine.")]:
            del sys.modules[name]
        package = types.ModuleType("engine")
        package.__path__ = [str(REPO / "engine")]
        sys.modules["engine"] = package
    from engine.kernels import reshape_and_cache, stats, triton_backend, unified_attention

    return unified_attention, reshape_and_cache, triton_backend, stats


def import_quant_kernels():
    """The weight-only int GEMM kernels (after :func:`import_kernels` set up ``engine``)."""
    from engine.kernels import quant_gemm_int

    return quant_gemm_int


@dataclass
class Section:
    name: str
    rows: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def guarded(section: Section, label: str, fn, *args, **kwargs):
    """Run one case; record an exception (with the innermost frames) instead of raising."""
    if time_left() <= reserved_s:
        section.skipped.append(f"{label}: out of time budget")
        return None
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a per-case report is the point
        tail = "".join(traceback.format_exception(exc)[-3:]).strip().replace("\n", " | ")
        section.errors.append(f"{label}: {type(exc).__name__}: {exc} [{tail[-400:]}]")
        return None


# --------------------------------------------------------------------------- inputs


def make_paged(torch, requests, heads, kv_heads, head_size, block_size, dtype, device, gen):
    """Random q and per-request K/V, stored (by plain indexing) at random cache blocks."""
    blocks = [math.ceil(seq / block_size) for _, seq in requests]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen, device="cpu").to(device)
    tables = torch.zeros(len(requests), max(blocks), dtype=torch.int32, device=device)
    cache = torch.full(
        (2, num_blocks, block_size, kv_heads, head_size), float("nan"), dtype=dtype, device=device
    )
    flat = cache.view(2, -1, kv_heads, head_size)
    keys, values, qs, slots = [], [], [], []
    used = 0
    for r, ((q_len, seq), n) in enumerate(zip(requests, blocks)):
        table = perm[used : used + n]
        used += n
        tables[r, :n] = table.to(torch.int32)
        k = torch.randn(seq, kv_heads, head_size, device=device, dtype=dtype)
        v = torch.randn(seq, kv_heads, head_size, device=device, dtype=dtype)
        pos = torch.arange(seq, device=device)
        slot = table[pos // block_size] * block_size + pos % block_size
        flat[0, slot] = k
        flat[1, slot] = v
        keys.append(k)
        values.append(v)
        slots.append(slot[seq - q_len :])
        qs.append(torch.randn(q_len, heads, head_size, device=device, dtype=dtype))
    q_lens = torch.tensor([q for q, _ in requests], device=device)
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32, device=device)
    return {
        "q": torch.cat(qs),
        "cache": cache,
        "qsl": qsl,
        "seq_lens": seq_lens,
        "tables": tables,
        "slots": torch.cat(slots).long(),
        "keys": keys,
        "values": values,
        "max_q": max(q for q, _ in requests),
        "max_s": max(s for _, s in requests),
    }


def reference(torch, batch, scale, window=None, soft_cap=None):
    """float32 causal attention from the per-request K/V (never reads the cache)."""
    outs = []
    heads = batch["q"].shape[1]
    qsl = batch["qsl"].tolist()
    for r, (k, v) in enumerate(zip(batch["keys"], batch["values"])):
        q = batch["q"][qsl[r] : qsl[r + 1]].float()
        seq, group = k.shape[0], heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q, k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq - q.shape[0], seq, device=q.device)[:, None]
        k_pos = torch.arange(seq, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= q_pos - k_pos < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", torch.softmax(scores, -1), v))
    return torch.cat(outs)


# --------------------------------------------------------------------------- 1. correctness

TOL = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 2e-4}
MIXED = [(37, 300), (1, 1000), (128, 128), (1, 17), (5, 4000), (64, 700)]
CORRECTNESS_CASES = [
    # label, requests, heads, kv heads, head size, block size, dtype, window, soft cap
    ("bf16 gqa4 d128 bs16", MIXED, 32, 8, 128, 16, "bfloat16", None, None),
    ("fp16 mha d64 bs32 window softcap", MIXED, 8, 8, 64, 32, "float16", 256, 30.0),
    ("bf16 gqa8 d80 bs64", MIXED, 16, 2, 80, 64, "bfloat16", None, None),
    ("fp32 gqa4 d256 bs16", MIXED[:4], 4, 1, 256, 16, "float32", None, None),
    (
        "bf16 decodes gqa8 d128 bs16",
        [(1, 5000)] * 3 + [(1, 33)],
        64,
        8,
        128,
        16,
        "bfloat16",
        None,
        None,
    ),
]


def check_correctness(torch, ua, rc, tb, stats, device) -> Section:
    section = Section("correctness")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    def attention_case(label, requests, heads, kv_heads, head_size, bs, dtype, window, cap):
        batch = make_paged(
            torch, requests, heads, kv_heads, head_size, bs, getattr(torch, dtype), device, gen
        )
        scale = head_size**-0.5
        expected = reference(torch, batch, scale, window, cap)
        for splits in (1, 7, None):
            out = torch.full_like(batch["q"], float("nan"))
            ua.unified_attention(
                batch["q"],
                batch["cache"],
                out,
                batch["qsl"],
                batch["seq_lens"],
                batch["tables"],
                batch["max_q"],
                batch["max_s"],
                scale,
                sliding_window=window,
                logits_soft_cap=cap,
                num_kv_splits=splits,
            )
            err = (out.float() - expected).abs().max().item()
            ok = not out.isnan().any().item() and err <= TOL[dtype] * (
                1 + expected.abs().max().item()
            )
            section.rows.append(
                {"case": f"{label} splits={splits or 'auto'}", "max_abs_err": err, "ok": bool(ok)}
            )

    for case in CORRECTNESS_CASES:
        guarded(section, case[0], attention_case, *case)

    def reshape_case():
        cache = torch.zeros(2, 40, 16, 8, 128, dtype=torch.bfloat16, device=device)
        key = torch.randn(100, 8, 128, dtype=torch.bfloat16, device=device)
        value = torch.randn_like(key)
        slots = torch.randperm(640, device=device)[:100]
        slots[::7] = -1
        expected = cache.clone()
        keep = slots >= 0
        expected.view(2, -1, 8, 128)[0, slots[keep]] = key[keep]
        expected.view(2, -1, 8, 128)[1, slots[keep]] = value[keep]
        rc.reshape_and_cache(key, value, cache, slots)
        section.rows.append(
            {
                "case": "reshape_and_cache bf16",
                "max_abs_err": 0.0,
                "ok": bool(torch.equal(cache, expected)),
            }
        )

    guarded(section, "reshape_and_cache", reshape_case)

    def backend_case():
        from engine.core.interfaces.attention import AttentionBatch, AttentionLayerSpec

        requests = [(20, 90), (1, 300), (7, 7)]
        batch = make_paged(torch, requests, 32, 8, 128, 16, torch.bfloat16, device, gen)

        def new(full):
            return torch.cat([t[t.shape[0] - q :] for t, (q, _) in zip(full, requests)])

        backend = tb.TritonAttentionBackend(16, device)
        impl = backend.make_impl(AttentionLayerSpec(32, 128, 8, scale=0.088))
        meta = backend.build_metadata(
            AttentionBatch(
                num_reqs=3,
                num_tokens=batch["q"].shape[0],
                query_start_loc=batch["qsl"],
                seq_lens=batch["seq_lens"],
                block_tables=batch["tables"],
                slot_mapping=batch["slots"],
                max_query_len=batch["max_q"],
                max_seq_len=batch["max_s"],
            )
        )
        batch["cache"].view(2, -1, 8, 128)[:, batch["slots"]] = float("nan")  # forward writes them
        before = stats.launches.snapshot()
        out = impl.forward(
            batch["q"], new(batch["keys"]), new(batch["values"]), batch["cache"], meta
        )
        after = stats.launches.snapshot()
        err = (out.float() - reference(torch, batch, 0.088)).abs().max().item()
        launched = after["reshape_and_cache"] > before["reshape_and_cache"]
        section.rows.append(
            {
                "case": "backend forward bf16",
                "max_abs_err": err,
                "ok": bool(err < 5e-2 and launched),
            }
        )

    guarded(section, "backend forward", backend_case)
    return section


# --------------------------------------------------------------------------- 2. speed

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16  # Llama-3-8B attention, bf16
DECODE_CASES = [(1, 1024), (1, 8192), (1, 32768), (64, 1024), (64, 8192), (64, 32768)]
PREFILL_LEN = 2048


def sdpa(torch, q, k, v, causal):
    """Torch SDPA with native GQA; falls back to expanded K/V if this build lacks it."""
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal
        )


def paged_from_contiguous(torch, k, v, gen):
    """A paged cache holding contiguous [B, KV, S, D] K/V at randomly permuted blocks."""
    batch, kv_heads, seq, dim = k.shape
    per_req = seq // BLOCK
    num_blocks = batch * per_req
    perm = torch.randperm(num_blocks, generator=gen).to(k.device)
    cache = torch.empty(2, num_blocks, BLOCK, kv_heads, dim, dtype=k.dtype, device=k.device)
    for i, src in enumerate((k, v)):
        blocks = src.permute(0, 2, 1, 3).reshape(num_blocks, BLOCK, kv_heads, dim)
        cache[i].index_copy_(0, perm, blocks)
    tables = perm.view(batch, per_req).to(torch.int32)
    return cache, tables


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=60))


def check_speed(torch, ua, device, peak_tbs, peak_tflops) -> Section:
    section = Section("speed")
    gen = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16
    scale = HEAD_SIZE**-0.5
    elt = 2

    def decode_case(batch, ctx):
        k = torch.randn(batch, KV_HEADS, ctx, HEAD_SIZE, dtype=dtype, device=device)
        v = torch.randn_like(k)
        q = torch.randn(batch, HEADS, 1, HEAD_SIZE, dtype=dtype, device=device)
        cache, tables = paged_from_contiguous(torch, k, v, gen)
        q_flat = q.reshape(batch, HEADS, HEAD_SIZE)
        out = torch.empty_like(q_flat)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        splits = ua.choose_num_kv_splits(
            batch, KV_HEADS, 1, ctx, torch.cuda.get_device_properties(device).multi_processor_count
        )

        def ours(n=None):
            return ua.unified_attention(
                q_flat, cache, out, qsl, seq_lens, tables, 1, ctx, scale, num_kv_splits=n
            )

        ours()
        expected = sdpa(torch, q, k, v, False).reshape(batch, HEADS, HEAD_SIZE)
        err = (out.float() - expected.float()).abs().max().item()
        t_ours = bench_ms(ours)
        t_single = bench_ms(lambda: ours(1)) if splits > 1 else t_ours
        t_sdpa = bench_ms(lambda: sdpa(torch, q, k, v, False))
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_SIZE * elt
        io_bytes = kv_bytes + 2 * q.numel() * elt
        section.rows.append(
            {
                "case": f"decode b={batch} ctx={ctx}",
                "splits": splits,
                "ours_ms": t_ours,
                "single_pass_ms": t_single,
                "sdpa_ms": t_sdpa,
                "speedup_vs_sdpa": t_sdpa / t_ours,
                "ours_tb_s": io_bytes / t_ours / 1e9,
                "pct_peak_bw": 100 * io_bytes / t_ours / 1e9 / peak_tbs,
                "sdpa_pct_peak_bw": 100 * io_bytes / t_sdpa / 1e9 / peak_tbs,
                "max_abs_err_vs_sdpa": err,
                "ok": err < 5e-2,
            }
        )

    for batch, ctx in DECODE_CASES:
        guarded(section, f"decode b={batch} ctx={ctx}", decode_case, batch, ctx)
        torch.cuda.empty_cache()

    def prefill_case(seq):
        k = torch.randn(1, KV_HEADS, seq, HEAD_SIZE, dtype=dtype, device=device)
        v = torch.randn_like(k)
        q = torch.randn(1, HEADS, seq, HEAD_SIZE, dtype=dtype, device=device)
        cache, tables = paged_from_contiguous(torch, k, v, gen)
        q_flat = q[0].transpose(0, 1).contiguous()  # [T, H, D]
        out = torch.empty_like(q_flat)
        qsl = torch.tensor([0, seq], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([seq], dtype=torch.int32, device=device)

        def ours():
            return ua.unified_attention(q_flat, cache, out, qsl, seq_lens, tables, seq, seq, scale)

        ours()
        expected = sdpa(torch, q, k, v, True)[0].transpose(0, 1)
        err = (out.float() - expected.float()).abs().max().item()
        t_ours = bench_ms(ours)
        t_sdpa = bench_ms(lambda: sdpa(torch, q, k, v, True))
        flops = 4 * HEADS * HEAD_SIZE * seq * (seq + 1) / 2  # causal QK^T and PV
        section.rows.append(
            {
                "case": f"prefill {seq}",
                "splits": 1,
                "ours_ms": t_ours,
                "single_pass_ms": t_ours,
                "sdpa_ms": t_sdpa,
                "speedup_vs_sdpa": t_sdpa / t_ours,
                "ours_tflops": flops / t_ours / 1e9,
                "pct_peak_tflops": 100 * flops / t_ours / 1e9 / peak_tflops,
                "sdpa_tflops": flops / t_sdpa / 1e9,
                "max_abs_err_vs_sdpa": err,
                "ok": err < 5e-2,
            }
        )

    guarded(section, f"prefill {PREFILL_LEN}", prefill_case, PREFILL_LEN)
    return section


# ---------------------------------------------------------------- 2d. batch-invariant mode

BI_GEMM_SHAPES = ((4096, 4096), (14336, 4096))  # (N, K): Llama-3-8B o_proj, up_proj
BI_GEMM_M = (1, 16, 64, 256, 2048)
BI_BATCHES = ((1, 0), (3, 1), (17, 16), (64, 37), (256, 200), (2048, 1500))  # (rows, place)


def check_batch_invariant(torch, device, peak_tbs, peak_tflops, small=False) -> Section:
    """Batch-invariant kernels on the GPU: bitwise invariance, then cost against the
    default kernels. ``small``: tiny shapes and no timing (a wiring check anywhere, e.g.
    on the CPU under TRITON_INTERPRET=1)."""
    import torch.nn.functional as F

    from engine.kernels import batch_invariant as bi
    from engine.kernels import unified_attention as ua

    section = Section("batch-invariant mode")
    gen = torch.Generator().manual_seed(7)  # host draws: permutations, lengths
    dgen = torch.Generator(device=device).manual_seed(7)  # tensors, drawn on the device
    bf16 = torch.bfloat16
    hidden, vocab = (96, 1000) if small else (4096, 128256)
    batches = BI_BATCHES[:4] if small else BI_BATCHES

    def rand(*shape, dtype=bf16):
        return torch.randn(*shape, generator=dgen, device=device, dtype=torch.float32).to(dtype)

    def invariant(fn, target, pool) -> bool:
        """fn(rows)[place] == fn(target) for the target placed among pool rows (the
        batch sizes the pool covers)."""
        alone = fn(target)[0]
        for rows, place in batches:
            if rows - 1 > len(pool):
                break
            batch = torch.cat([pool[:place], target, pool[place : rows - 1]])
            if not torch.equal(fn(batch)[place], alone):
                return False
        return True

    def gemm_case():
        w = rand(hidden, hidden)
        target, pool = rand(1, hidden), rand(batches[-1][0], hidden)
        ok = invariant(lambda x: bi.matmul(x, w), target, pool)
        ref = F.linear(target.float(), w.float())
        err = ((bi.matmul(target, w).float() - ref).abs().max() / ref.abs().max()).item()
        section.rows.append({"case": f"invariance gemm bf16 {hidden}x{hidden}",
                             "rel_err": err, "ok": ok and err < 2e-2})

    def norm_case():
        w = rand(hidden)
        target, pool = rand(1, hidden), rand(batches[-1][0], hidden)
        res_t, res_p = rand(1, hidden), rand(batches[-1][0], hidden)
        plain = invariant(lambda x: bi.rms_norm(x, w, 1e-6), target, pool)
        both = torch.cat([target, res_t], 1), torch.cat([pool, res_p], 1)
        fused = invariant(lambda xr: bi.rms_norm(xr[:, :hidden], w, 1e-6,
                                                 xr[:, hidden:].clone()), *both)
        section.rows.append({"case": f"invariance rms_norm bf16 {hidden}",
                             "ok": plain and fused})

    def softmax_case():
        target, pool = rand(1, vocab, dtype=torch.float32), rand(64, vocab, dtype=torch.float32)
        ok = invariant(bi.log_softmax, target, pool)
        err = (bi.log_softmax(target) - torch.log_softmax(target, -1)).abs().max().item()
        section.rows.append({"case": f"invariance log_softmax fp32 {vocab}",
                             "max_abs_err": err, "ok": ok and err < 1e-4})

    heads, kv_heads, head, block = (4, 1, 32, 16) if small else (HEADS, KV_HEADS, HEAD_SIZE, BLOCK)
    ctx = 600 if small else 4096

    def request(seq, q_rows=64):
        """(q of the last q_rows positions, K, V of all seq positions)."""
        return rand(q_rows, heads, head), rand(seq, kv_heads, head), rand(seq, kv_heads, head)

    def paged(reqs):
        """unified_attention's arguments for ``(request, q_len)`` pairs (its last q_len
        rows), over a cache whose blocks are randomly placed."""
        seqs = [k.shape[0] for (_, k, _), _ in reqs]
        per = [-(-s // block) for s in seqs]
        perm = torch.randperm(sum(per), generator=gen).to(device)
        cache = torch.empty(2, sum(per), block, kv_heads, head, dtype=bf16, device=device)
        tables = torch.zeros(len(reqs), max(per), dtype=torch.int32, device=device)
        used = 0
        for i, (((_, k, v), _), n) in enumerate(zip(reqs, per)):
            tables[i, :n] = perm[used : used + n].to(torch.int32)
            used += n
            pos = torch.arange(seqs[i], device=device)
            slot = tables[i].long()[pos // block] * block + pos % block
            flat = cache.view(2, -1, kv_heads, head)
            flat[0, slot], flat[1, slot] = k, v
        q_lens = [ql for _, ql in reqs]
        q = torch.cat([r[0][r[0].shape[0] - ql:] for r, ql in reqs])
        qsl = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor(seqs, dtype=torch.int32, device=device)
        return (q, cache, torch.empty_like(q), qsl, seq_lens, tables, max(q_lens), max(seqs),
                head**-0.5), q_lens

    def attend(reqs, **kwargs):
        args, q_lens = paged(reqs)
        return list(ua.unified_attention(*args, **kwargs).split(q_lens))

    def attention_case():
        target = request(ctx)
        lengths = torch.randint(1, ctx, (63,), generator=gen).tolist()
        others = [(request(s, 1), 1) for s in lengths]
        rows = {}
        for label, kwargs in (("invariant", {"batch_invariant": True}), ("default", {})):
            alone = attend([(target, 1)], **kwargs)[0][-1]
            among = attend(others[:31] + [(target, 1)] + others[31:], **kwargs)[31][-1]
            verify = attend([(target, 4)], **kwargs)[0][-1]
            chunk = attend([others[0], (target, 64)], **kwargs)[1][-1]
            rows[label] = [torch.equal(r, alone) for r in (among, verify, chunk)]
        section.rows.append({"case": f"invariance attention bf16 ctx={ctx} (batch, verify, "
                                     "chunk)", "invariant": rows["invariant"],
                             "default_mode": rows["default"], "ok": all(rows["invariant"])})

    for label, fn in (("gemm", gemm_case), ("rms_norm", norm_case),
                      ("log_softmax", softmax_case), ("attention", attention_case)):
        guarded(section, f"batch-invariant {label}", fn)
    if small:
        return section

    def gemm_speed(n, k, m):
        w, x = rand(n, k), rand(m, k)
        t_ours = bench_ms(lambda: bi.matmul(x, w))
        t_blas = bench_ms(lambda: F.linear(x, w))
        flops, weight_bytes = 2 * m * n * k, 2 * n * k
        section.rows.append({"case": f"gemm m={m} n={n} k={k}", "ours_ms": t_ours,
                             "cublas_ms": t_blas, "slowdown_vs_cublas": t_ours / t_blas,
                             "ours_tflops": flops / t_ours / 1e9,
                             "pct_peak_tflops": 100 * flops / t_ours / 1e9 / peak_tflops,
                             "pct_peak_bw": 100 * weight_bytes / t_ours / 1e9 / peak_tbs})

    for n, k in BI_GEMM_SHAPES:
        for m in BI_GEMM_M:
            guarded(section, f"gemm speed m={m} n={n}", gemm_speed, n, k, m)

    def row_op_speed(label, ours, theirs):
        t_ours, t_torch = bench_ms(ours), bench_ms(theirs)
        section.rows.append({"case": label, "ours_ms": t_ours, "torch_ms": t_torch,
                             "slowdown_vs_torch": t_ours / t_torch})

    for m in (1, 64, 2048):
        x, w = rand(m, hidden), rand(hidden)
        guarded(section, f"rms_norm speed m={m}", row_op_speed, f"rms_norm m={m}",
                lambda x=x, w=w: bi.rms_norm(x, w, 1e-6),
                lambda x=x, w=w: F.rms_norm(x, (hidden,), w, 1e-6))
    logits = rand(64, vocab, dtype=torch.float32)
    guarded(section, "log_softmax speed", row_op_speed, f"log_softmax 64x{vocab}",
            lambda: bi.log_softmax(logits), lambda: torch.log_softmax(logits, -1))

    def attention_speed(batch, seq, q_len):
        args, _ = paged([(request(seq, q_len), q_len) for _ in range(batch)])
        t_inv = bench_ms(lambda: ua.unified_attention(*args, batch_invariant=True))
        t_def = bench_ms(lambda: ua.unified_attention(*args))
        section.rows.append({"case": f"attention b={batch} ctx={seq} q={q_len}",
                             "ours_ms": t_inv, "default_ms": t_def,
                             "slowdown_vs_default": t_inv / t_def})

    for batch, seq, q_len in ((1, 32768, 1), (64, 8192, 1), (1, 2048, 2048)):
        guarded(section, f"attention speed b={batch} ctx={seq}", attention_speed, batch, seq,
                q_len)
        torch.cuda.empty_cache()
    return section


# --------------------------------------------------------------------------- 2b. quantized GEMMs

QUANT_SIZES = (4096, 8192)  # K = N
QUANT_DECODE_M = (1, 4, 16)
QUANT_PREFILL_M = 2048
QUANT_GROUP = 128
QUANT_TOL = 2e-2  # max |ours - ref| / max |ref|: bf16 operands and output
QUANT_CORRECTNESS = [
    # label, m, n, k, group, bits, zero points, act-order, bias
    ("int4 g128 sym", 1, 4096, 4096, 128, 4, False, False, False),
    ("int4 g128 zp act-order bias", 7, 4096, 4096, 128, 4, True, True, True),
    ("int4 g32 zp", 16, 2048, 4096, 32, 4, True, False, False),
    ("int8 per-channel bias", 3, 4096, 4096, 4096, 8, False, False, True),
    ("int8 g128 zp", 16, 1024, 2048, 128, 8, True, False, False),
    ("int4 g128 zp prefill", 300, 4096, 4096, 128, 4, True, False, True),
    ("int4 g64 act-order prefill", 1000, 1536, 2048, 64, 4, True, True, False),
]


def make_int_weights(torch, n, k, group, bits, zero_points, act_order, device, gen):
    """Random canonical int weights (engine/core/interfaces/quant.py) on ``device``."""
    from engine.core.interfaces import QuantizedLayerSpec, QuantizedWeights

    groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.002
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).float() if zero_points else None
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)] if act_order else None
    spec = QuantizedLayerSpec("gpu-check", "int", bits, group, k, n, torch.bfloat16,
                              has_zero_points=zero_points, act_order=act_order)
    move = (lambda t: None if t is None else t.to(device))
    return QuantizedWeights(spec, move(codes), move(scales), move(zeros), move(g_idx),
                            shard_sizes=(n,))


def dequantize_int(torch, weights):
    """float32 [N, K] of canonical int weights (g_idx applied)."""
    spec = weights.spec
    k = spec.in_features
    groups = (weights.g_idx if weights.g_idx is not None
              else torch.arange(k, device=weights.codes.device) // spec.group_size)
    zero = (weights.zeros[:, groups] if weights.zeros is not None
            else float(1 << (spec.weight_bits - 1)))
    return (weights.codes.float() - zero) * weights.scales[:, groups]


def packed_bytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in (packed.words, packed.scales, packed.zeros)
               if t is not None)


def check_quant(torch, qi, device, peak_tbs, peak_tflops) -> Section:
    section = Section("quantized gemm")
    gen = torch.Generator().manual_seed(2)
    layouts = (("plain", False), ("marlin", True))

    def correctness_case(label, m, n, k, group, bits, zp, act_order, with_bias):
        weights = make_int_weights(torch, n, k, group, bits, zp, act_order, device, gen)
        x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
        bias = (torch.randn(n, generator=gen) * 0.5).to(device, torch.bfloat16) if with_bias else None
        expected = x.float() @ dequantize_int(torch, weights).t()
        if bias is not None:
            expected += bias.float()
        for layout, tiled in layouts:
            packed = qi.pack_int_weight(weights, tiled=tiled)
            config = qi.choose_config(m, packed, x.dtype, qi.compute_units(x.device))
            configs = [("auto", config)]
            if config.split_k > 1:
                configs.append(("no split", qi.IntGemmConfig(**{**asdict(config), "split_k": 1})))
            elif m <= qi.SPLIT_K_MAX_M:
                configs.append(("split 4", qi.IntGemmConfig(**{**asdict(config), "split_k": 4})))
            for tag, cfg in configs:
                out = torch.full((m, n), float("nan"), dtype=x.dtype, device=device)
                qi.int_gemm(x, packed, bias, config=cfg, out=out)
                err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
                ok = not out.isnan().any().item() and err <= QUANT_TOL
                section.rows.append({"case": f"{label} {layout} {tag}", "split_k": cfg.split_k,
                                     "block_k": cfg.block_k, "max_rel_err": err, "ok": bool(ok)})

    for case in QUANT_CORRECTNESS:
        guarded(section, f"quant {case[0]}", correctness_case, *case)
        torch.cuda.empty_cache()

    def speed_case(size, weights, dense, m):
        x = torch.randn(m, size, generator=gen).to(device, torch.bfloat16)
        expected = x @ dense.t()
        t_torch = bench_ms(lambda: x @ dense.t())
        dense_bytes = dense.numel() * dense.element_size()
        io = 2 * (x.numel() + m * size)  # activations in, output out (bf16)
        for layout, tiled in layouts:
            packed = qi.pack_int_weight(weights, tiled=tiled)
            config = qi.choose_config(m, packed, x.dtype, qi.compute_units(x.device))
            out = qi.int_gemm(x, packed)
            err = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
            t_ours = bench_ms(lambda p=packed: qi.int_gemm(x, p))
            moved = packed_bytes(packed) + io
            row = {
                "case": f"{'decode' if m <= qi.SPLIT_K_MAX_M else 'prefill'} m={m} k=n={size}",
                "kernel": layout,
                "split_k": config.split_k,
                "ours_ms": t_ours,
                "torch_bf16_ms": t_torch,
                "speedup_vs_bf16": t_torch / t_ours,
                "ours_tb_s": moved / t_ours / 1e9,
                "pct_peak_bw": 100 * moved / t_ours / 1e9 / peak_tbs,
                "bf16_pct_peak_bw": 100 * (dense_bytes + io) / t_torch / 1e9 / peak_tbs,
                "max_rel_err_vs_bf16": err,
                "ok": err <= QUANT_TOL,
            }
            if m > qi.SPLIT_K_MAX_M:
                flops = 2 * m * size * size
                row.update(ours_tflops=flops / t_ours / 1e9,
                           pct_peak_tflops=100 * flops / t_ours / 1e9 / peak_tflops,
                           bf16_tflops=flops / t_torch / 1e9)
            section.rows.append(row)

    for size in QUANT_SIZES:
        weights = guarded(section, f"quant weights k=n={size}", make_int_weights, torch, size,
                          size, QUANT_GROUP, 4, True, False, device, gen)
        if weights is None:
            continue
        dense = dequantize_int(torch, weights).to(torch.bfloat16)
        for m in (*QUANT_DECODE_M, QUANT_PREFILL_M):
            guarded(section, f"quant m={m} k=n={size}", speed_case, size, weights, dense, m)
        del weights, dense
        torch.cuda.empty_cache()
    return section


# ------------------------------------------------------------- 2c. fp8 / int8 / nvfp4 GEMMs

FP_QUANT_SIZES = (4096, 8192)  # K = N
FP_QUANT_M = (1, 4, 16, 2048)  # decode, prefill
FP_QUANT_TOL = 2e-2  # max |ours - torch reference| / max |ref| (bf16 outputs, same QDQ)
FP_QUANT_CASES = [
    # weights (make_fp_weights), m, n, k, fused shards, bias
    ("fp8 static", 7, 3072, 2048, (2048, 512, 512), True),
    ("fp8 token", 33, 1536, 4096, None, False),
    ("fp8 block", 300, 2048, 2048, None, True),
    ("fp8 a16", 5, 1000, 1024, None, True),
    ("int8 token", 16, 2048, 4096, None, True),
    ("int8 static", 300, 1536, 2048, (1024, 512), False),
    ("nvfp4", 300, 2048, 2048, (1024, 1024), True),
    ("nvfp4 a16", 3, 2048, 4096, None, False),
]


def fp_capability(torch):
    """The device's DeviceCapability as the GPU platforms report it."""
    from engine.core.interfaces import DeviceCapability

    try:
        from engine.plugins.torch_cuda_api import TorchCudaApiPlatform

        return TorchCudaApiPlatform.device_capability(None)  # reads torch.cuda only
    except Exception:  # noqa: BLE001 - the same rule, inline
        major, minor = torch.cuda.get_device_capability()
        fp8 = (major, minor) >= (8, 9)
        return DeviceCapability("nvidia", f"sm_{major}{minor}", major, minor,
                                fp8_dtype="e4m3fn" if fp8 else None, fp8_mma=fp8,
                                fp4_mma=major >= 10, int8_mma=True)


def make_fp_weights(torch, kind, n, k, device, gen, shards=None):
    """Random canonical fp8 / int8 / nvfp4 weights on ``device`` and their layer spec:
    ``kind`` is "fp8 static" (per-tensor, static activations per shard), "fp8 token"
    (per-channel, dynamic per-token), "fp8 block" (128 x 128, per-group-128), "fp8 a16",
    "int8 token", "int8 static", "nvfp4" (nvfp4 activations) or "nvfp4 a16"."""
    from engine.core.interfaces import ActivationQuant, QuantizedLayerSpec, QuantizedWeights

    shards = tuple(shards or (n,))
    enc = kind.split()[0]
    act = {"fp8 static": ActivationQuant("fp8", "tensor", False),
           "fp8 token": ActivationQuant("fp8", "token", True),
           "fp8 block": ActivationQuant("fp8", "group", True, 128),
           "int8 token": ActivationQuant("int8", "token", True),
           "int8 static": ActivationQuant("int8", "tensor", False),
           "nvfp4": ActivationQuant("nvfp4", "group", True, 16)}.get(kind)
    input_scales = None
    if enc == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
        codes = codes.to(device).view(torch.float8_e4m3fn)
        group = 128 if kind == "fp8 block" else k
        scales = torch.rand(n, k // group, generator=gen) * 1e-4 + 1e-5
        if kind == "fp8 block":
            scales = scales[::128].repeat_interleave(128, dim=0)[:n]
        if kind == "fp8 static":
            input_scales = torch.rand(len(shards), generator=gen) * 0.02 + 0.01
        bits = 8
    elif enc == "int8":
        enc, bits, group = "int", 8, k
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8).to(device)
        scales = torch.rand(n, 1, generator=gen) * 1e-3 + 1e-4
        if kind == "int8 static":
            input_scales = torch.rand(len(shards), generator=gen) * 0.02 + 0.01
    else:
        bits, group = 4, 16
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(device)
        fp8 = (torch.rand(n, k // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
        scales = fp8.float() / 2688.0
        if act is not None:
            input_scales = torch.rand(len(shards), generator=gen) * 200 + 100
    spec = QuantizedLayerSpec("gpu-check", enc, bits, group, k, n, torch.bfloat16,
                              activation=act, shard_sizes=shards)
    return QuantizedWeights(spec, codes, scales.to(device), None, None,
                            None if input_scales is None else input_scales.to(device), shards)


def check_quant_fp(torch, device, peak_tbs, peak_tflops) -> Section:
    """The Triton fp8 / int8 / nvfp4 GEMMs (engine/kernels/quant_gemm_fp.py): the
    activation quantizer bit for bit against engine.quantization.numerics on the GPU,
    GEMMs (device path and no-MMA path) against the torch reference kernel, then timed
    at decode and prefill against torch's bf16 matmul and the HBM roofline."""
    from torch import nn

    from engine.core.interfaces import ActivationQuant, DeviceCapability
    from engine.kernels import quant_gemm_fp as qf
    from engine.quantization.numerics import quantize_dequantize
    from engine.quantization.reference import TorchQuantizedGemm

    section = Section("fp8 / int8 / nvfp4 gemm")
    cap = fp_capability(torch)
    plain = DeviceCapability(cap.vendor, cap.arch, cap.major, cap.minor)  # no fp8 / int8 mma
    gen = torch.Generator().manual_seed(3)
    print(f"quant_gemm_fp capability: {cap}")

    def quantizer_case(act, scale):
        x = (torch.randn(67, 4096, generator=gen) * 3).to(device, torch.bfloat16)
        x[1] = 0
        static = None if scale is None else torch.tensor([scale], device=device)
        if act.encoding == "nvfp4":
            got, _ = qf.quantize_activation(x, act, static, qdq_dtype=torch.float32)
            want = quantize_dequantize(x, act, global_scale=static)
        else:
            codes, scales = qf.quantize_activation(x, act, static)
            vals = (codes.float() if act.encoding == "int8"
                    else codes.view(torch.float8_e4m3fn).float())
            got = (vals.unflatten(-1, (scales.shape[1], -1)) * scales[:, :, None]).flatten(-2)
            want = quantize_dequantize(x, act, static_scale=static)
        mismatches = int((got != want).sum().item())
        section.rows.append({"case": f"quantizer {act.encoding} {act.strategy}"
                             f"{'' if act.dynamic else ' static'}", "mismatches": mismatches,
                             "ok": mismatches == 0})

    for act, scale in ((ActivationQuant("fp8", "token", True), None),
                       (ActivationQuant("fp8", "tensor", True), None),
                       (ActivationQuant("fp8", "tensor", False), 0.0123),
                       (ActivationQuant("fp8", "group", True, 128), None),
                       (ActivationQuant("int8", "token", True), None),
                       (ActivationQuant("int8", "tensor", False), 0.0211),
                       (ActivationQuant("nvfp4", "group", True, 16), 150.0)):
        guarded(section, f"quantizer {act}", quantizer_case, act, scale)

    def kernel_cls(weights, capability):
        kind = {"fp8": qf.TritonFp8Gemm, "int": qf.TritonInt8Gemm,
                "nvfp4": qf.TritonNvfp4Gemm}[weights.spec.encoding]
        bound = kind.for_capability(capability)
        why = bound.can_implement(weights.spec)
        if why is not None:
            raise RuntimeError(f"{bound.name} refused: {why}")
        return bound

    def prepared(weights, capability):
        kernel, layer = kernel_cls(weights, capability)(), nn.Module()
        kernel.prepare(layer, weights)
        ref, ref_layer = TorchQuantizedGemm(), nn.Module()
        ref.prepare(ref_layer, weights)
        return kernel, layer, ref, ref_layer

    def correctness_case(kind, m, n, k, shards, with_bias):
        weights = make_fp_weights(torch, kind, n, k, device, gen, shards)
        x = (torch.randn(m, k, generator=gen) * 2).to(device, torch.bfloat16)
        bias = ((torch.randn(n, generator=gen) * 0.1).to(device, torch.bfloat16)
                if with_bias else None)
        for tag, capability in (("device", cap), ("no-mma", plain)):
            kernel, layer, ref, ref_layer = prepared(weights, capability)
            want = ref.apply(ref_layer, x, bias).float()
            out = torch.full((m * n,), float("nan"), dtype=x.dtype, device=device)
            got = kernel.apply(layer, x, bias, out=out).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            ok = not got.isnan().any().item() and err <= FP_QUANT_TOL
            section.rows.append({"case": f"{kind} m={m} n={n} k={k} {tag}",
                                 "kernel": kernel.description, "max_rel_err": err, "ok": bool(ok)})

    for case in FP_QUANT_CASES:
        guarded(section, f"quant fp {case[0]}", correctness_case, *case)
        torch.cuda.empty_cache()

    def speed_case(kind, size, dense):
        weights = make_fp_weights(torch, kind, size, size, device, gen)
        kernel, layer, ref, ref_layer = prepared(weights, cap)
        weight_bytes = sum(t.numel() * t.element_size() for t in (layer.qf_codes, layer.qf_scales))
        dense_bytes = dense.numel() * dense.element_size()
        for m in FP_QUANT_M:
            if time_left() <= reserved_s:
                section.skipped.append(f"quant fp {kind} m={m} k=n={size}: out of time budget")
                continue
            x = torch.randn(m, size, generator=gen).to(device, torch.bfloat16)
            want = ref.apply(ref_layer, x).float()
            got = kernel.apply(layer, x).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            t_ours = bench_ms(lambda x=x: kernel.apply(layer, x))
            t_torch = bench_ms(lambda x=x: x @ dense.t())
            io = 2 * (x.numel() + m * size)  # activations in, output out (bf16)
            row = {
                "case": f"{kind} {'decode' if m <= 16 else 'prefill'} m={m} k=n={size}",
                "kernel": kernel.description,
                "ours_ms": t_ours,
                "torch_bf16_ms": t_torch,
                "speedup_vs_bf16": t_torch / t_ours,
                "ours_tb_s": (weight_bytes + io) / t_ours / 1e9,
                "pct_peak_bw": 100 * (weight_bytes + io) / t_ours / 1e9 / peak_tbs,
                "bf16_pct_peak_bw": 100 * (dense_bytes + io) / t_torch / 1e9 / peak_tbs,
                "max_rel_err": err,
                "ok": err <= FP_QUANT_TOL,
            }
            if m > 16:
                flops = 2 * m * size * size
                row.update(ours_tflops=flops / t_ours / 1e9,
                           pct_peak_bf16_tflops=100 * flops / t_ours / 1e9 / peak_tflops,
                           bf16_tflops=flops / t_torch / 1e9)
            section.rows.append(row)

    for size in FP_QUANT_SIZES:
        dense = torch.randn(size, size, device=device, dtype=torch.bfloat16)  # timing baseline
        for kind in ("fp8 token", "fp8 block", "int8 token", "nvfp4"):
            guarded(section, f"quant fp {kind} k=n={size}", speed_case, kind, size, dense)
            torch.cuda.empty_cache()
        del dense
    return section


# --------------------------------------------------------------------------- 3. end to end

E2E_PROMPT = "Once upon a time"
E2E_MAX_TOKENS = 16
DEMO_MODEL_DIR = REPO / "engine" / "assets" / "demo"
QUANT_FIXTURE = REPO / "tests" / "data" / "quant-fixtures" / "gptq-desc-act-g64"
TINY_LLAMA_TEXT = (
    "Once upon a time a small engine served a language model on a large GPU. "
    "Paged attention keeps keys and values in fixed-size blocks; the scheduler hands out "
    "a token budget every step, and prefill chunks share steps with decodes. "
) * 8


def build_tiny_llama(out_dir: Path) -> Path:
    """A random-weight bf16 Llama (GQA 8:2, head_dim 64) plus a byte-level BPE tokenizer.

    Built here with transformers and tokenizers, so the check needs no download and no
    file from outside this script.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TINY_LLAMA_TEXT], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def e2e_command(device: str, model: Path | None) -> list[str]:
    """``engine generate`` as a user runs it; ``--ignore-eos`` so every token is timed."""
    command = [sys.executable, "-m", "engine.cli", "generate", E2E_PROMPT, "--device", device,
               "--max-tokens", str(E2E_MAX_TOKENS), "--ignore-eos", "--json"]
    return command if model is None else [*command, "--model", str(model)]


def _missing_module(output: str) -> str | None:
    for line in reversed(output.splitlines()):
        if "No module named" in line:
            return line.strip()
    return None


def run_generate(section: Section, label: str, command: list[str], env: dict, timeout_s: float):
    """One ``engine generate`` process -> a row with tokens/s; its token ids (or None)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command, check=False, cwd=REPO, env=env, capture_output=True, text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        section.errors.append(f"{label}: timed out after {timeout_s:.0f}s")
        return None
    wall = time.monotonic() - start
    missing = _missing_module(proc.stderr) if proc.returncode else None
    if missing:
        section.skipped.append(
            f"{label}: dependencies missing here ({missing[:200]}); carry the wheels named "
            "in this script's header (ci/gpu_check.sh fetch-wheels, then run ci/gpu_check.sh)"
        )
        return None
    row = {"case": label, "rc": proc.returncode, "process_s": wall}
    token_ids = None
    if proc.returncode == 0:
        report = json.loads(proc.stdout[proc.stdout.index("{"):])
        token_ids = [t for r in report["results"] for o in r["outputs"] for t in o["token_ids"]]
        elapsed = float(report["elapsed_s"])
        row.update(
            model=report["model"],
            tokens=len(token_ids),
            engine_s=elapsed,  # LLM construction (load, KV cache, Triton JIT) + generation
            tok_s_incl_startup=len(token_ids) / elapsed if elapsed > 0 else float("nan"),
            text=repr(report["results"][0]["outputs"][0]["text"][:40]),
            ok=len(token_ids) == E2E_MAX_TOKENS,
        )
    else:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
        row.update(output_tail=tail[-600:], ok=False)
    section.rows.append(row)
    return token_ids


def run_engine_generate(device: str = "cuda", timeout_s: float = 120.0) -> Section:
    """``engine generate`` on the demo model (or a tiny Llama built on the fly), then again
    with split-KV forced on every step (ENGINE_TRITON_NUM_KV_SPLITS)."""
    section = Section("end-to-end")
    if time_left() < 30:
        section.skipped.append("engine generate: out of time budget")
        return section
    with tempfile.TemporaryDirectory(prefix="engine-gpu-check-") as tmp:
        model = None
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            model = guarded(section, "build tiny Llama", build_tiny_llama, Path(tmp))
            if model is None:
                return section
        env = {k: v for k, v in os.environ.items() if k != "ENGINE_PLUGINS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.pop("ENGINE_TRITON_NUM_KV_SPLITS", None)
        command = e2e_command(device, model)
        base = run_generate(
            section, f"engine generate --device {device}", command, env,
            min(timeout_s, time_left()),
        )
        if base is None or time_left() < 30:
            return section
        split_env = dict(env, ENGINE_TRITON_NUM_KV_SPLITS="4")
        split = run_generate(
            section, f"engine generate --device {device}, split-KV x4", command, split_env,
            min(timeout_s, time_left()),
        )
        if split is not None:  # bf16 near-ties may differ: reported, not failed
            section.rows[-1]["same_tokens_as_auto"] = split == base
        if QUANT_FIXTURE.is_dir() and time_left() >= 30:
            # the marlin family exists only on GPU platforms (the CPU has its C kernel)
            family = [] if device == "cpu" else ["--quantization", "gptq_marlin"]
            run_generate(
                section, f"engine generate --device {device}, GPTQ int4 {' '.join(family)}".strip(),
                [*e2e_command(device, QUANT_FIXTURE), *family], env,
                min(timeout_s, time_left()),
            )
    return section


# --------------------------------------------------------------------------- report


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def print_table(sections: list[Section]) -> None:
    for section in sections:
        print(f"\n== {section.name} ==")
        if section.rows:
            cols = list(dict.fromkeys(key for row in section.rows for key in row))
            cells = [[fmt(row.get(c, "")) for c in cols] for row in section.rows]
            widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
            print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
            for row in cells:
                print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
        for line in section.skipped:
            print(f"SKIPPED {line}")
        for line in section.errors:
            print(f"ERROR {line}")


def finish(sections: list[Section], launches: dict | None) -> int:
    print_table(sections)
    print(f"\nkernel launches: {launches}; total {time.monotonic() - START:.0f}s")
    failed = any(s.errors for s in sections) or any(
        row.get("ok") is False for s in sections for row in s.rows
    )
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gpu_check.json").write_text(
            json.dumps([asdict(s) for s in sections], indent=1, default=str)
        )
    print("RESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


def main() -> int:
    global reserved_s
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-quant", action="store_true", help="skip sections 2b, 2c")
    parser.add_argument("--skip-batch-invariant", action="store_true", help="skip section 2d")
    parser.add_argument("--e2e-only", action="store_true", help="only section 3 (no GPU needed)")
    parser.add_argument("--e2e-device", default="cuda", help="--device for engine generate")
    parser.add_argument("--peak-bw-tbs", type=float, default=4.8, help="HBM TB/s (H200: 4.8)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s")
    args = parser.parse_args()
    if args.e2e_only:
        return finish([run_engine_generate(args.e2e_device)], None)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("no CUDA/HIP device visible to torch; nothing to check")
        return 2
    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    props = torch.cuda.get_device_properties(device)
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, triton "
        f"{triton.__version__}, python {sys.version.split()[0]}"
    )
    ua, rc, tb, stats = import_kernels()
    reserved_s = 0.0 if args.skip_e2e else E2E_RESERVE_S

    sections = [check_correctness(torch, ua, rc, tb, stats, device)]
    sections.append(check_speed(torch, ua, device, args.peak_bw_tbs, args.peak_tflops))
    quant_launches = None
    if not args.skip_quant:
        qi = guarded(sections[-1], "import quant_gemm_int", import_quant_kernels)
        if qi is not None:
            sections.append(check_quant(torch, qi, device, args.peak_bw_tbs, args.peak_tflops))
            quant_launches = qi.launches
    if not args.skip_quant:
        fp_section = guarded(sections[-1], "quant fp section", check_quant_fp, torch, device,
                             args.peak_bw_tbs, args.peak_tflops)
        if fp_section is not None:
            sections.append(fp_section)
    if not args.skip_batch_invariant:
        bi_section = guarded(sections[-1], "batch-invariant section", check_batch_invariant,
                             torch, device, args.peak_bw_tbs, args.peak_tflops)
        if bi_section is not None:
            sections.append(bi_section)
    if not args.skip_e2e:
        reserved_s = 0.0
        torch.cuda.empty_cache()  # the engine process sizes its KV cache from free memory
        sections.append(run_engine_generate(args.e2e_device))
    launches = stats.launches.snapshot()
    if quant_launches is not None:
        launches.update(quant_launches.snapshot())
    return finish(sections, launches)


if __name__ == "__main__":
    sys.exit(main())
