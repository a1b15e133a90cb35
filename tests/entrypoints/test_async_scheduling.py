"""Async scheduling (``async_scheduling=True``): step N+1 is scheduled while step N runs,
and every output equals the serial loop's token for token (and logprob for logprob)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.engine_args import EngineArgs
from engine.structured_output.params import StructuredOutputsParams

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 32,
          "block_size": 8, "max_num_seqs": 8}


def workload(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts longer than a chunk and short ones; greedy, seeded sampling, EOS-stopping,
    one-token, logprobs, and a constrained request (which never runs ahead)."""
    lengths = (5, 70, 40, 7, 90, 3, 33)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(n)]}
               for i, n in enumerate(lengths)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=1.0, top_p=0.8, seed=3, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no", "maybe"])),
    ]
    return prompts, params


def run(path, async_scheduling: bool, **extra) -> list:
    with LLM(str(path), async_scheduling=async_scheduling, **ENGINE, **extra) as llm:
        prompts, params = workload(llm.get_tokenizer().vocab_size)
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[:3], params[:3], use_tqdm=False)  # prefix hits
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.num_cached_tokens,
             None if o.outputs[0].logprobs is None else
             [{t: round(lp.logprob, 5) for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in first + again]


@pytest.mark.parametrize("extra", [{}, {"enforce_eager": True}])
def test_async_outputs_equal_the_serial_loop(llama_dir, extra):
    assert run(llama_dir, True, **extra) == run(llama_dir, False, **extra)


def test_async_engine_overlaps_steps(llama_dir):
    """The core really keeps two steps in flight (not the serial loop under a flag)."""
    with LLM(str(llama_dir), async_scheduling=True, **ENGINE) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3,
                     SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                     use_tqdm=False)
        core = llm.llm_engine.client.core
        assert core.batch_queue_size == 2 and core.max_batches_in_flight == 2


def test_async_scheduling_refuses_what_cannot_overlap(llama_dir):
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineArgs(model=str(llama_dir), async_scheduling=True, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="pipeline parallelism"):
        EngineArgs(model=str(llama_dir), async_scheduling=True,
                   pipeline_parallel_size=2).create_engine_config()
