"""Output processor: EngineCoreOutputs for a token stream -> RequestOutputs, checked
against full decodes and hand-computed expectations."""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest

from engine.core.engine_io import EngineCoreOutput
from engine.frontend.output_collector import RequestOutputCollector
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import Processor
from engine.core.request import FinishReason
from engine.core.sampling_params import RequestOutputKind, SamplingParams
from engine.core.scheduler.output import LogprobsLists
from tests.helpers.tiny_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture()
def proc(tok):
    return Processor(tok, max_model_len=256, eos_token_id=tok.eos_token_id, vocab_size=len(tok))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _run(out_proc, child_id: str, ids: list[int], finish=FinishReason.LENGTH, stop_reason=None):
    """Feed ``ids`` one token per step; the last step carries ``finish``. Returns every
    RequestOutput and every abort the processor asked for."""
    outputs, aborts = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        result = out_proc.process_outputs(
            [
                EngineCoreOutput(
                    child_id,
                    [token],
                    finish_reason=int(finish) if last else None,
                    stop_reason=stop_reason if last else None,
                )
            ]
        )
        outputs += result.request_outputs
        aborts += result.reqs_to_abort
        if result.reqs_to_abort:
            break
    return outputs, aborts


def _start(proc, out_proc, request_id="r", prompt="Question:", **params):
    processed = proc.process(request_id, prompt, SamplingParams(**params))
    out_proc.add_request(processed)
    return processed


# -- text, finish reasons ---------------------------------------------------------------------
def test_multibyte_stream_and_length_finish(tok, proc):
    text = " Café 日本語 😀 👨\u200d👩\u200d👧!"
    op = OutputProcessor(tok)
    _start(proc, op, output_kind=RequestOutputKind.DELTA)
    outputs, aborts = _run(op, "r", _ids(tok, text))
    assert not aborts
    deltas = [o.outputs[0].text for o in outputs]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert not op.has_unfinished_requests()


def test_eos_is_not_part_of_the_text(tok, proc):
    op = OutputProcessor(tok)
    _start(proc, op, skip_special_tokens=False)
    ids = _ids(tok, " Hi there") + [tok.eos_token_id]
    outputs, _ = _run(op, "r", ids, finish=FinishReason.STOP)
    completion = outputs[-1].outputs[0]
    assert completion.text == " Hi there"
    assert completion.token_ids == ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)


def test_stop_token_id_kept_with_include_stop_str(tok, proc):
    op = OutputProcessor(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    _start(
        proc,
        op,
        stop_token_ids=[im_end],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    outputs, _ = _run(
        op, "r", _ids(tok, " ok") + [im_end], finish=FinishReason.STOP, stop_reason=im_end
    )
    completion = outputs[-1].outputs[0]
    assert completion.text == " ok<|im_end|>" and completion.stop_reason == im_end


def test_core_abort_finish_reason(tok, proc):
    op = OutputProcessor(tok)
    _start(proc, op)
    outputs, _ = _run(op, "r", _ids(tok, " a b"), finish=FinishReason.ABORT)
    assert outputs[-1].outputs[0].finish_reason == "abort"


def test_skip_special_tokens_in_the_middle(tok, proc):
    ids = _ids(tok, " one") + [tok.convert_tokens_to_ids("<|im_start|>")] + _ids(tok, " two")
    for skip in (True, False):
        op = OutputProcessor(tok)
        _start(proc, op, skip_special_tokens=skip)
        outputs, _ = _run(op, "r", ids)
        assert outputs[-1].outputs[0].text == tok.decode(ids, skip_special_tokens=skip)


# -- stop strings -----------------------------------------------------------------------------
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_finishes_and_aborts(tok, proc, include):
    text = " Hello world. STOP and more text"
    ids = _ids(tok, text)
    op = OutputProcessor(tok)
    _start(
        proc,
        op,
        stop=["STOP"],
        include_stop_str_in_output=include,
        output_kind=RequestOutputKind.DELTA,
    )
    outputs, aborts = _run(op, "r", ids)
    assert aborts == ["r"]  # the core must free it
    expected = " Hello world. STOP" if include else " Hello world. "
    assert "".join(o.outputs[0].text for o in outputs) == expected
    last = outputs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", "STOP")
    assert outputs[-1].finished and not op.has_unfinished_requests()
    # Late outputs for the finished child (in flight before the abort) are ignored.
    assert op.process_outputs([EngineCoreOutput("r", [ids[-1]])]).request_outputs == []


def test_streaming_withholds_possible_stop_prefix(tok, proc):
    ids = _ids(tok, " abc </answ and </answer> tail")
    op = OutputProcessor(tok)
    _start(proc, op, stop=["</answer>"], output_kind=RequestOutputKind.DELTA)
    outputs, _ = _run(op, "r", ids)
    shown = ""
    for position, output in enumerate(outputs):
        shown += output.outputs[0].text
        if not output.finished:
            full = tok.decode(ids[: position + 1])
            assert len(shown) <= max(len(full) - (len("</answer>") - 1), 0)
            assert " abc </answ and ".startswith(shown)  # nothing shown is later cut
    assert shown == " abc </answ and "


def test_earliest_stop_string_wins(tok, proc):
    op = OutputProcessor(tok)
    _start(proc, op, stop=["world", "lo w"])
    outputs, _ = _run(op, "r", _ids(tok, " Hello world"))
    completion = outputs[-1].outputs[0]
    assert (completion.text, completion.stop_reason) == (" Hel", "lo w")


def test_stop_string_inside_min_tokens_is_ignored(tok, proc):
    ids = _ids(tok, " STOP then STOP")
    op = OutputProcessor(tok)
    _start(proc, op, stop=["STOP"], min_tokens=len(_ids(tok, " STOP")))
    outputs, _ = _run(op, "r", ids)
    assert outputs[-1].outputs[0].text == " STOP then "


def test_stop_string_completed_by_the_final_step(tok, proc):
    """The core finishes (length) in the very step that completes a stop string."""
    op = OutputProcessor(tok)
    _start(proc, op, stop=["END"])
    outputs, aborts = _run(op, "r", _ids(tok, " x END"), finish=FinishReason.LENGTH)
    assert aborts == []  # the core already finished it
    assert (outputs[-1].outputs[0].text, outputs[-1].outputs[0].finish_reason) == (" x ", "stop")


# -- output kinds and n > 1 -------------------------------------------------------------------
def _collect(tok, proc, kind, n=1):
    op = OutputProcessor(tok)
    processed = proc.process("p", "Hi", SamplingParams(n=n, output_kind=kind, logprobs=1))
    op.add_request(processed)
    texts = [" first sample 日本", " second 😀 one", " third"]
    streams = [_ids(tok, t) for t in texts[:n]]
    results = []
    for step in range(max(map(len, streams))):
        batch = []
        for i, ids in enumerate(streams):
            if step < len(ids):
                last = step == len(ids) - 1
                lp = LogprobsLists([[ids[step], 7]], [[-0.5, -0.25]], [2])
                batch.append(
                    EngineCoreOutput(
                        processed.child_request_ids[i],
                        [ids[step]],
                        new_logprobs=lp,
                        finish_reason=int(FinishReason.LENGTH) if last else None,
                    )
                )
        results += op.process_outputs(batch).request_outputs
    return results, texts[:n], streams


def test_inter_token_latencies_are_one_per_step(tok, proc, monkeypatch):
    """n=3 children share each step: one latency per step after the first, measured
    between the steps' clocks (not one mean per request)."""
    ticks = itertools.count()
    monkeypatch.setattr("engine.frontend.output_processor.time.monotonic",
                        lambda: 0.25 * next(ticks) ** 2)  # uneven gaps
    results, _, streams = _collect(tok, proc, RequestOutputKind.FINAL_ONLY, n=3)
    metrics = results[-1].metrics
    gaps = metrics.inter_token_latencies
    assert len(gaps) == max(map(len, streams)) - 1 and all(g > 0 for g in gaps)
    assert len(set(gaps)) > 1  # each step's own gap, not a mean
    assert sum(gaps) == pytest.approx(metrics.last_token_time - metrics.first_token_time)
    assert metrics.num_generation_tokens == sum(map(len, streams))


def test_delta_cumulative_final_only_agree(tok, proc):
    delta, texts, streams = _collect(tok, proc, RequestOutputKind.DELTA)
    cumulative, _, _ = _collect(tok, proc, RequestOutputKind.CUMULATIVE)
    final_only, _, _ = _collect(tok, proc, RequestOutputKind.FINAL_ONLY)
    assert len(final_only) == 1 and final_only[0].finished
    assert len(delta) == len(cumulative) == len(streams[0])
    joined = "".join(o.outputs[0].text for o in delta)
    joined_ids = [t for o in delta for t in o.outputs[0].token_ids]
    joined_lps = [p for o in delta for p in o.outputs[0].logprobs]
    for outs in (cumulative[-1], final_only[0]):
        completion = outs.outputs[0]
        assert completion.text == joined == texts[0]
        assert completion.token_ids == joined_ids == streams[0]
        assert completion.logprobs == joined_lps
    # Cumulative outputs grow: each is a prefix of the next.
    for earlier, later in itertools.pairwise(cumulative):
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)
        assert (
            later.outputs[0].token_ids[: len(earlier.outputs[0].token_ids)]
            == earlier.outputs[0].token_ids
        )


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_n_children_aggregate_into_one_request_output(tok, proc, kind):
    results, texts, streams = _collect(tok, proc, kind, n=3)
    assert all(r.request_id == "p" for r in results)
    assert [r.finished for r in results].count(True) == 1 and results[-1].finished
    if kind == RequestOutputKind.DELTA:
        merged = {i: "" for i in range(3)}
        for r in results:
            for c in r.outputs:
                merged[c.index] += c.text
        assert [merged[i] for i in range(3)] == texts
    else:
        final = results[-1]
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert [c.text for c in final.outputs] == texts
        assert [c.token_ids for c in final.outputs] == streams
        assert all(c.finish_reason == "length" for c in final.outputs)
    if kind == RequestOutputKind.CUMULATIVE:
        assert all(len(r.outputs) == 3 for r in results)
        # The shortest child finished early; the parent did not.
        assert (
            results[len(streams[2]) - 1].outputs[2].finished()
            and not results[len(streams[2]) - 1].finished
        )


# -- logprobs ---------------------------------------------------------------------------------
def test_logprob_conversion(tok, proc):
    op = OutputProcessor(tok)
    processed = proc.process("r", "Hi", SamplingParams(logprobs=2))
    op.add_request(processed)
    a, b, c = _ids(tok, " the fox")[:3]
    # Row 1: sampled token also in the top-k. Row 2: sampled token outside the top-k.
    rows = LogprobsLists(
        token_ids=[[a, a, b], [b, c, a]],
        logprobs=[[-0.1, -0.1, -2.5], [-3.0, -0.2, -1.0]],
        ranks=[1, 5],
    )
    out = (
        op.process_outputs([EngineCoreOutput("r", [a, b], new_logprobs=rows)])
        .request_outputs[0]
        .outputs[0]
    )
    first, second = out.logprobs
    assert list(first) == [a, b]
    assert (first[a].logprob, first[a].rank, first[a].decoded_token) == (-0.1, 1, tok.decode([a]))
    assert (first[b].logprob, first[b].rank) == (-2.5, 2)
    assert list(second) == [b, c, a]
    assert [second[t].rank for t in (b, c, a)] == [5, 1, 2]
    assert [second[t].decoded_token for t in (b, c, a)] == [tok.decode([t]) for t in (b, c, a)]
    assert out.cumulative_logprob == pytest.approx(math.fsum([-0.1, -3.0]))


def test_no_logprobs_requested_gives_none(tok, proc):
    op = OutputProcessor(tok)
    _start(proc, op)
    outputs, _ = _run(op, "r", _ids(tok, " hi"))
    assert (
        outputs[-1].outputs[0].logprobs is None
        and outputs[-1].outputs[0].cumulative_logprob is None
    )


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_prompt_logprobs_accumulate_chunk_by_chunk(tok, proc, kind):
    op = OutputProcessor(tok)
    processed = proc.process(
        "r", "Hello world fox", SamplingParams(prompt_logprobs=1, output_kind=kind)
    )
    op.add_request(processed)
    prompt = processed.prompt_token_ids
    rows = [[prompt[i], 9] for i in range(1, len(prompt))]
    lps = [[-float(i), -0.01] for i in range(1, len(prompt))]
    split = 3
    chunk1 = LogprobsLists(rows[:split], lps[:split], [2] * split)
    chunk2 = LogprobsLists(rows[split:], lps[split:], [2] * (len(rows) - split))
    # A prefill chunk that samples nothing produces no RequestOutput yet.
    assert (
        op.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=chunk1)]).request_outputs
        == []
    )
    first = op.process_outputs(
        [EngineCoreOutput("r", [5], new_prompt_logprobs=chunk2)]
    ).request_outputs[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = first.prompt_logprobs[position][prompt[position]]
        assert (entry.logprob, entry.rank) == (-float(position), 2)
    second = op.process_outputs(
        [EngineCoreOutput("r", [6], finish_reason=int(FinishReason.LENGTH))]
    ).request_outputs[0]
    if kind == RequestOutputKind.DELTA:
        assert second.prompt_logprobs is None
    else:
        assert second.prompt_logprobs == first.prompt_logprobs


# -- aborts, sinks, bookkeeping ---------------------------------------------------------------
def test_abort_returns_children_and_ends_streams(tok, proc):
    op = OutputProcessor(tok)
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    processed = proc.process("p", "Hi", SamplingParams(n=2, output_kind=RequestOutputKind.DELTA))
    op.add_request(processed, queue=collector)
    result = op.process_outputs(
        [
            EngineCoreOutput("0_p", _ids(tok, " yes")),
            EngineCoreOutput("1_p", [5], finish_reason=int(FinishReason.LENGTH)),
        ]
    )
    assert result.request_outputs == []  # they went to the collector
    assert op.abort_requests(["p", "unknown"]) == ["0_p"]
    assert not op.has_unfinished_requests()
    merged = collector.get_nowait()
    assert merged.finished
    by_index = {c.index: c for c in merged.outputs}
    assert by_index[0].text == " yes" and by_index[0].finish_reason == "abort"
    assert by_index[1].finish_reason == "length"
    assert collector.get_nowait() is None


def test_collector_merges_deltas_for_a_slow_consumer(tok, proc):
    async def scenario():
        op = OutputProcessor(tok)
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        op.add_request(
            proc.process(
                "r", "Hi", SamplingParams(output_kind=RequestOutputKind.DELTA, logprobs=0)
            ),
            queue=collector,
        )
        ids = _ids(tok, " slow consumer 😀 here")
        consumer = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)
        for i, token in enumerate(ids):  # the producer runs ahead of the consumer
            lp = LogprobsLists([[token]], [[-1.0]], [1])
            op.process_outputs(
                [
                    EngineCoreOutput(
                        "r",
                        [token],
                        new_logprobs=lp,
                        finish_reason=int(FinishReason.LENGTH) if i == len(ids) - 1 else None,
                    )
                ]
            )
        first = await consumer
        rest = await collector.get() if not first.finished else None
        chunks = [first] + ([rest] if rest else [])
        return ids, chunks

    ids, chunks = asyncio.run(scenario())
    text = "".join(c.outputs[0].text for c in chunks)
    assert text == " slow consumer 😀 here"
    assert [t for c in chunks for t in c.outputs[0].token_ids] == ids
    assert sum(len(c.outputs[0].logprobs) for c in chunks) == len(ids)
    assert chunks[-1].finished and chunks[-1].outputs[0].cumulative_logprob == -len(ids)


def test_collector_raises_propagated_errors(tok, proc):
    op = OutputProcessor(tok)
    collector = RequestOutputCollector()
    op.add_request(proc.process("r", "Hi", SamplingParams()), queue=collector)
    op.propagate_error(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(collector.get())


def test_duplicate_ids_rejected_and_metrics_recorded(tok, proc):
    op = OutputProcessor(tok)
    processed = _start(proc, op)
    with pytest.raises(ValueError, match="already in use"):
        op.add_request(processed)
    outputs, _ = _run(op, "r", _ids(tok, " a b c"))
    metrics = outputs[-1].metrics
    assert (
        metrics.arrival_time
        <= metrics.first_token_time
        <= metrics.last_token_time
        <= metrics.finished_time
    )
    assert metrics.num_generation_tokens == len(_ids(tok, " a b c"))
    assert outputs[0].metrics.finished_time is None  # snapshots, not a shared live object


def test_detokenize_false_gives_token_ids_only(tok, proc):
    op = OutputProcessor(tok)
    _start(proc, op, detokenize=False, logprobs=0)
    ids = _ids(tok, " abc")
    rows = LogprobsLists([[t] for t in ids], [[-1.0]] * len(ids), [1] * len(ids))
    out = op.process_outputs(
        [EngineCoreOutput("r", ids, new_logprobs=rows, finish_reason=int(FinishReason.LENGTH))]
    ).request_outputs[0]
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == ids
    assert all(p[t].decoded_token is None for p, t in zip(out.outputs[0].logprobs, ids))
