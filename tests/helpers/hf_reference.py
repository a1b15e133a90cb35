"""Transformers as the reference: load a model directory, score token sequences.

Shared by the engine-vs-transformers tests under tests/entrypoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_logprobs(model: Any, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float64 log_softmax of the model's logits; row ``p``
    is the distribution of the token at position ``p + 1``."""
    logits = model(torch.tensor([token_ids])).logits[0]
    return logits.double().log_softmax(-1)


@torch.inference_mode()
def hf_generate_with_logprobs(model: Any, prompt: list[int], max_tokens: int
                              ) -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy tokens (exactly ``max_tokens``) and the float64 logprobs of
    each step's raw logits ``[max_tokens, vocab]``."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    logprobs = torch.stack([s[0] for s in out.logits]).double().log_softmax(-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


def sampled_logprobs(completion: Any) -> list[float]:
    """The logprob the engine reported for each token it sampled (``logprobs >= 0``)."""
    return [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]


def assert_matches_reference(got: list[int], got_logprobs: list[float], want: list[int],
                             ref: torch.Tensor, tie: float = 1e-3, atol: float = 2e-4) -> None:
    """The engine's tokens equal the reference's up to a verified near-tie (top-2 within
    ``tie`` in the reference's step distribution ``ref``); the sampled tokens' logprobs
    equal the reference's until then."""
    agree = len(want)
    for j, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top = ref[j].topk(2)
            gap = float(top.values[0] - top.values[1])
            assert gap < tie and g in top.indices.tolist(), (
                f"diverged at output {j}: engine {g}, transformers {w}, top-2 gap {gap:.2e}")
            agree = j
            break
    assert len(got) == len(want), (got, want)
    expected = ref[:agree].gather(1, torch.tensor(want[:agree])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(got_logprobs[:agree], dtype=torch.float64),
                               expected, atol=atol, rtol=0)


def cpu_llm(path: str | Path, **kwargs: Any):
    """An engine ``LLM`` on the CPU platform, float32 and a short context by default."""
    from engine import LLM

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 128)
    return LLM(str(path), device="cpu", **kwargs)
