"""MLA (DeepSeek latent attention) decode on the CPU: the C kernel vs the torch SDPA path.

Per DeepSeek-V3-like layer shape (D = 512 + 64 latent entries, L = 512), context length
and batch, one decode call of each path over a paged cache in shuffled blocks, against
two floors: the bytes read (latent cache + queries) over the measured read bandwidth
(engine.benchmarks.report.memory_read_gb_s) and the multiply-adds (2 H S (D + L) per
request) over the kernels' measured FMA peak. Then one MLA layer's decode step as the
runner runs it: eager (torch ops) vs a replayed forward graph (the C store + decode).
Times are medians of ``--repeats`` runs; one JSON line per row.

    python ci/bench_mla_decode.py --heads 16 128 --contexts 1024 4096 --batch 1 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine.benchmarks.report import memory_read_gb_s
from engine.core.interfaces import AttentionBatch, AttentionLayerSpec
from engine.plugins.cpu import mla_attention, native
from engine.plugins.cpu.attention import CPUAttentionBackend
from engine.plugins.cpu.graphs import CPUGraphCapturer

LORA, ROPE, BLOCK = 512, 64, 16


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm: first-touch pages, library load
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paged_case(batch: int, heads: int, context: int, dtype: torch.dtype, seed: int = 0):
    """Queries [R, H, D], a cache of shuffled blocks, int64 tables and lengths."""
    gen = torch.Generator().manual_seed(seed)
    entry, per_req = LORA + ROPE, -(-context // BLOCK)
    num_blocks = batch * per_req
    cache = (torch.randn(num_blocks, BLOCK, entry, generator=gen) * 0.5).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_req).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    query = torch.randn(batch, heads, entry, generator=gen).to(dtype)
    return query, cache, tables, lens


def torch_decode(impl, query, cache, tables, lens):
    """The torch path's decode (gather into a padded tensor + one SDPA), plan included."""
    seq = lens
    pos = torch.arange(int(seq.max()))
    mask = pos[None, :] < seq[:, None]
    blocks = tables.gather(1, (pos * mask) // BLOCK)
    keys = mla_attention._Keys(blocks * BLOCK + (pos * mask) % BLOCK, mask[:, None, None, :])
    flat = cache.view(-1, LORA + ROPE)
    return impl._decode(query, flat, keys, torch.float32).to(query.dtype)


def kernel_rows(kernels, heads_list, contexts, batches, dtype, repeats, bandwidth, peak):
    entry = LORA + ROPE
    size = torch.empty((), dtype=dtype).element_size()
    for heads in heads_list:
        spec = AttentionLayerSpec(heads, entry, 1, entry ** -0.5, kv_lora_rank=LORA)
        impl = mla_attention.CPUMLAAttentionImpl(spec, kernels=None)
        for context in contexts:
            for batch in batches:
                query, cache, tables, lens = paged_case(batch, heads, context, dtype)
                args = (query, cache, tables, lens)
                c_s = median_seconds(
                    lambda a=args, s=spec.scale: kernels.mla_decode_attention(*a, LORA, s),
                    repeats)
                t_s = median_seconds(lambda a=args, i=impl: torch_decode(i, *a), repeats)
                nbytes = batch * (context * entry + heads * entry) * size
                flops = 2 * batch * heads * context * (entry + LORA)
                floor = max(nbytes / (bandwidth * 1e9), flops / (peak * 1e9))
                print(json.dumps({
                    "heads": heads, "context": context, "batch": batch, "dtype": str(dtype),
                    "c_kernel_ms": round(c_s * 1e3, 3), "torch_sdpa_ms": round(t_s * 1e3, 3),
                    "speedup": round(t_s / c_s, 2),
                    "bytes_floor_ms": round(nbytes / (bandwidth * 1e9) * 1e3, 3),
                    "flops_floor_ms": round(flops / (peak * 1e9) * 1e3, 3),
                    "c_of_roofline": round(floor / c_s, 2),
                    "c_gflop_s": round(flops / c_s / 1e9, 1),
                }), flush=True)


def layer_step_row(kernels, heads: int, context: int, batch: int, dtype, repeats: int):
    """One MLA layer's decode step (store + attention): eager torch ops vs graph replay."""
    entry = LORA + ROPE
    query, cache, tables, lens = paged_case(batch, heads, context, dtype)
    backend = CPUAttentionBackend(block_size=BLOCK, device=torch.device("cpu"))
    lens_now = lens.clone()
    lens_now[:] = context  # the new token is the context's last position
    slots = tables[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK
    step = AttentionBatch(
        num_reqs=batch, num_tokens=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int64), seq_lens=lens_now,
        block_tables=tables, slot_mapping=slots.contiguous(), max_query_len=1,
        max_seq_len=context)
    key = torch.randn(batch, 1, entry).to(dtype)
    spec = AttentionLayerSpec(heads, entry, 1, entry ** -0.5, kv_lora_rank=LORA)
    eager = mla_attention.CPUMLAAttentionImpl(spec, kernels=None)
    graphed = mla_attention.CPUMLAAttentionImpl(spec, kernels=kernels)

    def eager_step():
        md = backend.build_metadata(step)  # the plan is per step: built inside
        return eager.forward(query, key, None, cache, md)

    md = backend.build_graph_metadata(step)
    with torch.inference_mode():
        graph = CPUGraphCapturer(kernels).capture(
            lambda: graphed.forward(query, key, None, cache, md))
        e_s = median_seconds(eager_step, repeats)
        g_s = median_seconds(graph.replay, repeats)
    print(json.dumps({"mla_layer_step": True, "heads": heads, "context": context,
                      "batch": batch, "dtype": str(dtype), "eager_ms": round(e_s * 1e3, 3),
                      "graph_ms": round(g_s * 1e3, 3), "speedup": round(e_s / g_s, 2)}),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                        default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = native.load_kernels()
    if kernels is None:
        sys.exit("the CPU C kernels are unavailable (compiler, ENGINE_CPU_NATIVE_KERNELS)")
    dtype = getattr(torch, args.dtype)
    bandwidth, peak = memory_read_gb_s(), kernels.fma_peak_gflops()
    print(json.dumps({"level": kernels.level, "threads": torch.get_num_threads(),
                      "read_gb_s": bandwidth, "fma_peak_gflop_s": round(peak, 1)}), flush=True)
    with torch.inference_mode():
        kernel_rows(kernels, args.heads, args.contexts, args.batch, dtype, args.repeats,
                    bandwidth, peak)
    layer_step_row(kernels, 16, 64, 1, dtype, max(args.repeats, 20))
    layer_step_row(kernels, 16, 1024, 4, dtype, args.repeats)


if __name__ == "__main__":
    main()
