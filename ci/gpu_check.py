#!/usr/bin/env python3
"""One prepared check of the Triton attention kernels on a real GPU (built for an H200).

Sections, each reported on its own so one failure never hides the others:
  1. correctness: unified attention (single pass and split-KV), reshape_and_cache and the
     backend's forward against a float32 torch reference, on the GPU;
  2. speed: decode (context 1k / 8k / 32k, batch 1 and 64) and a 2k prefill, against
     torch SDPA on contiguous K/V and against the HBM roofline / peak bf16 matmul rate;
  3. end to end: ``python -m engine.cli generate "Once upon a time" --device cuda
     --max-tokens 16 --ignore-eos --json`` on the demo model (engine/assets/demo) or, when
     this tree has none, on a tiny random bf16 Llama built here with transformers into a
     temp dir; reports tokens/s (engine startup and Triton JIT included), then the same
     with split-KV forced (ENGINE_TRITON_NUM_KV_SPLITS=4).

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

Finishes in about 4 minutes or less (a global deadline skips what is left; section 3
keeps the last ~100 s). Results go to stdout as one table, and to
``$OUT/gpu_check.json`` when ``OUT`` is set.

    ci/gpu_check.sh [--skip-e2e] [--peak-bw-tbs 4.8] [--peak-tflops 989]
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
BUDGET_S = 225.0
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


# --------------------------------------------------------------------------- 3. end to end

E2E_PROMPT = "Once upon a time"
E2E_MAX_TOKENS = 16
DEMO_MODEL_DIR = REPO / "engine" / "assets" / "demo"
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
    if not args.skip_e2e:
        reserved_s = 0.0
        torch.cuda.empty_cache()  # the engine process sizes its KV cache from free memory
        sections.append(run_engine_generate(args.e2e_device))
    return finish(sections, stats.launches.snapshot())


if __name__ == "__main__":
    sys.exit(main())
