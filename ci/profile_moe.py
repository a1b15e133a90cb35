"""Where a MoE decode step's time goes: a Mixtral-shaped random model at 64 requests.

Builds a Mixtral-shaped checkpoint (8 experts, top-2; the sizes below), runs decode
steps of ``--requests`` concurrent requests under torch.profiler, and reports per step
(and the expert GEMMs' bytes per second against the read bandwidth measured here):
the whole step, and the MoE layers' labelled phases (``moe.select_experts``: router
scores and top-k; ``moe.permute``: sort and gather of the (token, choice) pairs;
``moe.expert_gemms``; ``moe.combine``: weighted scatter-add), plus attention. The
expert-parallel all-to-all runs in worker processes, so it is timed apart on two gloo
ranks with one step's dispatch shapes. Usage::

    python ci/profile_moe.py [--hidden 1024 --intermediate 2816 --layers 4 --requests 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' model helpers


def build_model(out: Path, args: argparse.Namespace) -> Path:
    import torch
    import transformers

    from tests.helpers.hf_models import build_tokenizer

    tokenizer = build_tokenizer(out)
    config = transformers.MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 512),
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
        sliding_window=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def _profiled(llm, prompts, max_tokens: int) -> tuple[float, dict[str, float]]:
    """Wall seconds of one generate and the total ms of each labelled MoE phase."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
        wall = time.perf_counter() - start
    phases = {e.key: e.cpu_time_total / 1000 for e in prof.key_averages()
              if e.key.startswith("moe.")}
    return wall, phases


def profile_steps(path: Path, args: argparse.Namespace) -> dict:
    """Decode-step figures: a generate of ``steps + 1`` tokens minus one of 1 token (the
    prefill), divided by ``steps``."""
    import torch

    from engine import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(32)]}
               for i in range(args.requests)]
    with LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_seqs=args.requests,
             enable_prefix_caching=False) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        short_s, short = _profiled(llm, prompts, 1)
        long_s, long = _profiled(llm, prompts, args.steps + 1)
        runtime = llm.llm_engine.client.core.executor.runtime_info()
    per_step = {k: round((long.get(k, 0) - short.get(k, 0)) / args.steps, 3) for k in long}
    step_ms = (long_s - short_s) / args.steps * 1000
    moe_ms = per_step.get("moe.select_experts", 0) + per_step.get("moe.experts", 0)
    return {"decode_step_ms": round(step_ms, 2), "moe_share_of_step": round(moe_ms / step_ms, 3),
            "per_step_ms": dict(sorted(per_step.items())), "threads": torch.get_num_threads(),
            "cpu": runtime.get("cpu_model"), "isa_level": runtime.get("isa_level")}


def _time_all_to_all(comm, rows: int, hidden: int) -> float:
    """Median milliseconds of one all-to-all sending half the rows to each rank."""
    import torch

    x = torch.randn(rows, hidden).to(torch.bfloat16)
    half = rows // 2
    times = []
    for i in range(60):
        start = time.perf_counter()
        comm.all_to_all(x, [half, rows - half], [half, rows - half])
        if i >= 10:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def all_to_all_ms(rows: int, hidden: int) -> float:
    from gloo_ranks import on_two_ranks

    return on_two_ranks(_time_all_to_all, rows, hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args)
        report = profile_steps(path, args)
    # One EP dispatch of a layer: each rank sends its half of the tokens' two choices.
    rows = args.requests * 2 // 2
    a2a = all_to_all_ms(rows, args.hidden)
    report["ep2_all_to_all_ms_per_call"] = round(a2a, 3)
    report["ep2_all_to_all_ms_per_step"] = round(a2a * 2 * args.layers, 2)  # dispatch + combine
    report["shape"] = vars(args)
    report.update(roofline(report, args))
    print(json.dumps(report, indent=2))


def roofline(report: dict, args: argparse.Namespace) -> dict:
    """The expert GEMMs against the memory roofline: a decode step streams every expert's
    bf16 weights once (8 experts top-2: at 16+ requests every expert gets rows), so their
    floor is those bytes over the read bandwidth measured here."""
    from engine.benchmarks.report import memory_read_gb_s

    expert_bytes = args.layers * 8 * 3 * args.hidden * args.intermediate * 2
    gemm_ms = report["per_step_ms"].get("moe.expert_gemms")
    bandwidth = memory_read_gb_s()
    if not gemm_ms:
        return {"memory_read_gb_s": bandwidth}
    achieved = expert_bytes / (gemm_ms / 1e3) / 1e9
    return {"memory_read_gb_s": bandwidth, "expert_gemms_gb_s": round(achieved, 1),
            "expert_gemms_x_roofline": round(bandwidth / achieved, 2)}


if __name__ == "__main__":
    main()
