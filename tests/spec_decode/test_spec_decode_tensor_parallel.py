"""Speculative decoding over two tensor-parallel ranks drafts and verifies exactly as one
rank does (float32 demo model: greedy text equal, the acceptance counts equal)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPTS = ["The hacker", "Repeat: the cat sat on the mat. the cat sat on the"]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_tensor_parallel_speculation_matches_one_rank(method):
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config["prompt_lookup_max"] = 3
    params = SamplingParams(temperature=0.0, max_tokens=24)
    runs = {}
    for tp in (1, 2):
        with LLM(dtype="float32", tensor_parallel_size=tp, speculative_config=config,
                 num_gpu_blocks_override=128, max_model_len=512) as llm:
            texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            runs[tp] = texts, llm.get_spec_decoding_stats()
    assert runs[2][0] == runs[1][0]
    assert runs[2][1].num_draft_tokens == runs[1][1].num_draft_tokens > 0
    assert runs[2][1].num_accepted_tokens == runs[1][1].num_accepted_tokens
