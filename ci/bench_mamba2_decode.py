"""Mamba-2 decode throughput: this engine vs transformers' ``generate`` on one model.

A random-weight Mamba-2 of mamba2-130m's shape (24 layers, d_model 768, 24 heads of 64,
d_state 128; vocab cut to 8,192) is built locally; both run float32 greedy decoding of
``--new-tokens`` tokens after a ``--prompt-len`` prompt, at each batch size, on the
CPU. Prints one JSON line per (runner, batch) with output tokens per second (prefill
included, small at these lengths).

    python ci/bench_mamba2_decode.py --batch 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

MAMBA2_130M = {"hidden_size": 768, "num_hidden_layers": 24, "num_heads": 24, "head_dim": 64,
               "expand": 2, "n_groups": 1, "state_size": 128, "conv_kernel": 4,
               "chunk_size": 256, "layer_norm_epsilon": 1e-5, "vocab_size": 8192}


def build(out: Path) -> Path:
    from tests.helpers import hf_models

    hf_models.ARCH_CONFIGS.setdefault("mamba2-130m", {"arch": "Mamba2ForCausalLM",
                                                      **MAMBA2_130M})
    return hf_models.build_model_dir(out, "mamba2-130m", init_range=0.02)


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(5, 8000, (batch, length), generator=g).tolist()


def bench_engine(path: Path, batch: int, prompt_len: int, new_tokens: int) -> float:
    from engine import LLM, SamplingParams

    os.environ.setdefault("ENGINE_CPU_THREADS_ADAPT", "0")  # a fixed count, like HF's
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
             max_num_seqs=max(batch, 1)) as llm:
        reqs = [{"prompt_token_ids": p} for p in prompts(batch, prompt_len)]
        llm.generate(reqs[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


@torch.inference_mode()
def bench_hf(path: Path, batch: int, prompt_len: int, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)  # the engine may have lowered it
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(batch, prompt_len))
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    model.generate(ids[:1], max_new_tokens=4, **{**kwargs, "attention_mask": None})
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - prompt_len) * batch / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=None, help="reuse a built model dir")
    args = parser.parse_args()
    path = args.model or build(Path(tempfile.mkdtemp()) / "mamba2-130m")
    for batch in args.batch:
        for name, fn in (("engine", bench_engine), ("transformers", bench_hf)):
            tps = fn(path, batch, args.prompt_len, args.new_tokens)
            print(json.dumps({"runner": name, "batch": batch, "output_tokens_per_s":
                              round(tps, 1), "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
