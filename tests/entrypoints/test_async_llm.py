"""AsyncLLM: streaming, cancellation, stop strings, metrics and a dying core.

One engine (one core process) and one event loop serve the module; the last test kills
the core and then shuts the engine down.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import pytest
import torch

from engine import EngineArgs, SamplingParams
from engine.core.errors import EngineDeadError
from engine.core.sampling_params import RequestOutputKind
from engine.entrypoints.async_llm import AsyncLLM

DELTA, CUMULATIVE, FINAL_ONLY = (
    RequestOutputKind.DELTA,
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.FINAL_ONLY,
)
PROMPTS = [
    "hello",
    "the quick brown fox",
    "jumps over",
    "a lazy dog",
    "one two three four five",
    "to be or not to be",
    "x",
    "lorem ipsum dolor sit amet",
    "abc def",
    "streaming test",
    "sixteen requests at once",
    "z y x w",
    "cats and dogs",
    "tiny random llama",
    "prefix",
    "end",
]


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def llm(llama_dir, runner):
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(llama_dir), device="cpu", dtype="float32", max_model_len=128)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def _assert_greedy_matches_hf(hf, prompt: list[int], got: list[int]) -> None:
    """``got`` equals transformers' greedy continuation, up to a verified near-tie."""
    ids = torch.tensor([prompt])
    want = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=len(got),
        min_new_tokens=len(got),
        do_sample=False,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    for j, (g, w) in enumerate(zip(got, want)):
        if g != w:
            logprobs = hf(torch.tensor([prompt + want[:j]])).logits[0, -1].double().log_softmax(-1)
            top = logprobs.topk(2)
            assert float(top.values[0] - top.values[1]) < 1e-3 and g in top.indices.tolist(), (
                f"diverged at token {j}: engine {g}, transformers {w}"
            )
            return
    assert got == want


async def _collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [out async for out in llm.generate(prompt, params, request_id)]


async def _wait_for(predicate, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not await predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_concurrent_delta_streams(llm, runner, hf_model):
    def params(i: int) -> SamplingParams:
        n = 4 + i % 9  # min_tokens = max_tokens masks EOS, as min_new_tokens does in HF
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, output_kind=DELTA)

    async def main():
        return await asyncio.gather(
            *(_collect(llm, p, params(i), f"stream-{i}") for i, p in enumerate(PROMPTS))
        )

    streams = runner.run(main())
    for i, stream in enumerate(streams):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        token_ids = [t for o in stream for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in stream)
        assert len(token_ids) == params(i).max_tokens
        assert stream[-1].outputs[0].finish_reason == "length"
        assert text == llm.tokenizer.decode(token_ids, skip_special_tokens=True)
        _assert_greedy_matches_hf(hf_model, stream[0].prompt_token_ids, token_ids)
    assert llm.output_processor.get_num_unfinished_requests() == 0


def test_cumulative_and_final_only(llm, runner):
    base = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    cumulative = runner.run(
        _collect(llm, "cumulative", SamplingParams(**base, output_kind=CUMULATIVE), "cum")
    )
    final = runner.run(
        _collect(llm, "cumulative", SamplingParams(**base, output_kind=FINAL_ONLY), "fin")
    )
    texts = [o.outputs[0].text for o in cumulative]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids


def test_stop_string_finishes_request_and_aborts_it_in_core(llm, runner):
    params = {"temperature": 0.0, "ignore_eos": True}
    full = runner.run(_collect(llm, "stop here", SamplingParams(**params, max_tokens=30), "full"))[
        -1
    ]
    text = full.outputs[0].text
    # A stop string whose first occurrence starts inside the text (not at 0).
    start = next(p for p in range(1, len(text) - 3) if text.find(text[p : p + 3]) == p)
    stop = text[start : start + 3]

    async def main():
        outputs = await _collect(
            llm, "stop here", SamplingParams(**params, max_tokens=100, stop=[stop]), "stopped"
        )
        return outputs[-1], await llm.get_stats()

    last, stats = runner.run(main())
    assert last.outputs[0].text == text[:start]
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", stop)
    # The core had ~70 tokens to go: only the forwarded abort can have ended it already.
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_cancel_and_early_exit_abort_in_core(llm, runner):
    params = SamplingParams(max_tokens=110, ignore_eos=True, output_kind=DELTA)

    async def main():
        first = asyncio.Event()

        async def consume(request_id):
            async for _ in llm.generate("cancel me", params, request_id):
                first.set()

        task = asyncio.create_task(consume("cancelled"))  # a client disconnect cancels its task
        gen = llm.generate("leave early", params, "left")
        await gen.__anext__()
        await first.wait()
        running = (await llm.get_stats()).num_running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()  # a consumer that stops iterating
        return running, await llm.get_stats()

    running, stats = runner.run(main())
    assert running == 2
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert llm.output_processor.get_num_unfinished_requests() == 0


def test_bad_input_is_a_value_error_and_engine_survives(llm, runner):
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        runner.run(_collect(llm, list(range(5, 205)), SamplingParams(), "too-long"))
    runner.run(llm.check_health())
    assert llm.is_running and not llm.errored


def test_reset_prefix_cache_and_stats(llm, runner):
    prompt = list(range(100, 140))  # two full blocks of 16

    async def main():
        before = await llm.get_stats()
        for request_id in ("cache-a", "cache-b"):
            await _collect(llm, prompt, SamplingParams(max_tokens=2), request_id)
        after = await llm.get_stats()
        return before, after, await llm.reset_prefix_cache()

    before, after, reset = runner.run(main())
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == 32
    assert after.num_kv_blocks > 0 and reset is True
    assert (llm.model_name, llm.max_model_len) == (llm.config.model.served_model_name, 128)


def test_killed_core_fails_everything_promptly(llm, runner):
    """Runs last: it kills the module's core process."""
    pid = llm.client.proc.pid

    async def main():
        gen = llm.generate(
            "doomed", SamplingParams(max_tokens=110, ignore_eos=True, output_kind=DELTA), "doomed"
        )
        await gen.__anext__()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        in_flight_s = time.monotonic() - start

        async def unhealthy():
            try:
                await llm.check_health()
            except EngineDeadError:
                return True
            return False

        await _wait_for(unhealthy, timeout_s=2.0)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            await _collect(llm, "after death", SamplingParams(), "late")
        with pytest.raises(EngineDeadError):
            await llm.get_stats()
        return in_flight_s, time.monotonic() - start

    in_flight_s, new_request_s = runner.run(main())
    assert in_flight_s < 2.0 and new_request_s < 0.5
    assert llm.errored and not llm.is_running
    run_dir = llm.client.proc.run_dir
    llm.shutdown()
    assert llm.client.proc.process.poll() is not None and not run_dir.exists()
