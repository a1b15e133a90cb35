"""GPT-OSS (MXFP4 experts, attention sinks) on two tensor-parallel ranks against one
process: each rank its query heads and their sinks and either its part of every expert
(the MXFP4 blocks read for its intermediate features only, the down bias added once) or,
with expert parallelism, its experts whole."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.entrypoints.test_llm_equivalence import _prompts
from tests.helpers.equivalence import assert_outputs_equivalent
from tests.model_executor.models.test_gpt_oss import (  # noqa: F401 (fixture)
    ENGINE,
    _write_mxfp4_checkpoint,
    gpt_oss_dir,
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=2)


@pytest.fixture(scope="module")
def mxfp4_reference(gpt_oss_dir, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "mxfp4"
    _write_mxfp4_checkpoint(gpt_oss_dir, path)
    prompts = [{"prompt_token_ids": p} for p in _prompts(200, [4, 21], seed=1)]
    with LLM(str(path), **ENGINE) as ref:
        want = ref.generate(prompts, PARAMS, use_tqdm=False)
    return path, prompts, want


@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2},
    pytest.param({"tensor_parallel_size": 2, "enable_expert_parallel": True},
                 marks=pytest.mark.slow),
], ids=["tp2", "tp2-ep"])
def test_gpt_oss_mxfp4_parallel_matches_one_process(mxfp4_reference, parallel):
    path, prompts, want = mxfp4_reference
    with LLM(str(path), **ENGINE, **parallel) as llm:
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert_outputs_equivalent(want, got)
