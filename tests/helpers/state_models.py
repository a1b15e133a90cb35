"""Shared steps of the state-space / hybrid model tests: transformers' greedy reference,
the engine's run with chunked prefill (16-token chunks, at most 3 requests, so decodes
and prefill chunks share steps), and the comparison with near-ties tolerated."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from engine import SamplingParams
from engine.model_executor.layers import mamba1
from tests.helpers.hf_reference import (
    assert_matches_reference,
    cpu_llm,
    hf_logprobs,
    load_hf_model,
    sampled_logprobs,
)

MAX_TOKENS = 10
Reference = tuple[list[list[int]], list[tuple[list[int], torch.Tensor]]]


def hf_greedy(hf: Any, prompt: list[int], max_tokens: int = MAX_TOKENS
              ) -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy tokens and each step's float64 logprobs, EOS allowed (its
    ``generate(min_new_tokens=...)`` would mask EOS, which the engine may pick)."""
    tokens, rows = list(prompt), []
    for _ in range(max_tokens):
        row = hf_logprobs(hf, tokens)[-1]
        rows.append(row)
        tokens.append(int(row.argmax()))
    return tokens[len(prompt):], torch.stack(rows)


def reference_for(model_dir: Path, seed: int, lengths: tuple[int, ...] = (41, 5, 26, 18)
                  ) -> Reference:
    """Random prompts of ``lengths`` (some longer than a chunk) and transformers' greedy
    outputs for them."""
    hf = load_hf_model(model_dir)
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, hf.config.vocab_size) for _ in range(n)] for n in lengths]
    return prompts, [hf_greedy(hf, p) for p in prompts]


def generate_greedy(llm: Any, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check_against(outs: list[Any], reference: Reference) -> None:
    for out, (want, ref) in zip(outs, reference[1]):
        completion = out.outputs[0]
        assert_matches_reference(list(completion.token_ids), sampled_logprobs(completion),
                                 want, ref)


def slots_all_free(core: Any) -> bool:
    slots = core.scheduler.kv_cache_manager.state_slots
    return slots.num_free == slots.num_slots


def allocated_state_bytes(runner: Any) -> int:
    """Bytes of one slot across every state tensor the runner allocated."""
    return sum(t[0].numel() * t.element_size() for layer in runner.state_caches for t in layer)


def run_chunked(model_dir: Path, reference: Reference, monkeypatch: Any = None
                ) -> tuple[Any, dict[str, Any]]:
    """The engine on ``reference``'s prompts with chunked prefill, checked against it:
    every state slot free afterwards, the reported state bytes equal to the allocated
    ones and (``monkeypatch`` given, for mixers on ``mamba1.by_parts``) some step mixing
    decodes with prefill chunks. Returns the runner and ``kv_cache_info()``."""
    mixed = [0]
    if monkeypatch is not None:
        real = mamba1.by_parts

        def spy(md: Any, *args: Any) -> Any:
            mixed[0] += bool(md.parts)
            return real(md, *args)

        monkeypatch.setattr(mamba1, "by_parts", spy)
    with cpu_llm(model_dir, max_num_batched_tokens=16, max_num_seqs=3) as llm:
        core = llm.llm_engine.client.core
        outs = generate_greedy(llm, reference[0])
        assert slots_all_free(core)
        runner = core.executor.runner
        info = core.executor.worker.kv_cache_info()
        assert info["state_bytes_per_request"] == allocated_state_bytes(runner)
    assert monkeypatch is None or mixed[0] > 0
    check_against(outs, reference)
    return runner, info
