"""Cumulative engine-core stats: the core process folds the scheduler's interval counts
(speculative decoding included) into totals, and the front ends read them back.

Stub cores and clients stand in for the model: only the arithmetic and the wire shape
are under test here.
"""

from __future__ import annotations

import msgspec
import pytest

from engine.core import core_protocol as wire
from engine.core.core_proc import EngineCoreProc
from engine.core.scheduler.stats import SchedulerStats, SpecDecodingStats


def _interval(spec: SpecDecodingStats | None, **counts: int) -> SchedulerStats:
    base = dict(num_running=1, num_waiting=0, kv_cache_usage=0.5, prefix_cache_queries=0,
                prefix_cache_hits=0, num_preemptions=0)
    return SchedulerStats(**{**base, **counts}, spec=spec)


class _StubCore:
    """Hands out prepared SchedulerStats, one per ``get_stats`` (as make_stats would)."""

    num_kv_blocks = 64
    kv_connector = None
    dp_lockstep = None  # steps on its own (no experts shared across data-parallel ranks)

    def __init__(self, intervals: list[SchedulerStats]) -> None:
        from types import SimpleNamespace

        from engine.structured_output.stats import CompileStats

        self.intervals = list(intervals)
        self.structured_output_manager = SimpleNamespace(stats=CompileStats())
        # One engine core (no data-parallel ranks): no KV usage rides on its outputs.
        self.config = SimpleNamespace(parallel=SimpleNamespace(data_parallel_size=1))

    def get_stats(self) -> SchedulerStats:
        return self.intervals.pop(0)

    def reset_prefix_cache(self) -> bool:
        return True


def _proc(intervals: list[SchedulerStats]) -> EngineCoreProc:
    return EngineCoreProc(_StubCore(intervals), input_socket=None, output_socket=None,
                          parent_pid=0)


def _through_the_wire(stats: wire.EngineCoreStats) -> wire.EngineCoreStats:
    """What the front end sees: a UtilityResult's payload converted back (mp_client)."""
    reply = wire.utility_result_decoder.decode(
        wire.encoder.encode(wire.UtilityResult(1, result=stats)))
    return msgspec.convert(reply.result, wire.EngineCoreStats)


def test_get_stats_folds_spec_intervals_into_totals():
    first = SpecDecodingStats(num_drafts=4, num_draft_tokens=8, num_accepted_tokens=5,
                              num_accepted_tokens_per_pos=[3, 2])
    second = SpecDecodingStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
                               num_accepted_tokens_per_pos=[2, 1, 1])  # a longer draft now
    proc = _proc([_interval(first, prefix_cache_queries=16, prefix_cache_hits=8),
                  _interval(second, num_preemptions=1)])
    proc._get_stats()
    totals = _through_the_wire(proc._get_stats())
    assert totals.spec_decoding_enabled
    assert totals.spec_num_drafts_total == 6
    assert totals.spec_num_draft_tokens_total == 14
    assert totals.spec_num_accepted_tokens_total == 9
    assert totals.spec_num_accepted_tokens_per_pos_total == [5, 3, 1]
    # The other counters fold as before.
    assert (totals.prefix_cache_queries_total, totals.prefix_cache_hits_total) == (16, 8)
    assert totals.num_preemptions_total == 1
    assert totals.num_kv_blocks == 64
    cumulative = totals.spec_decoding_stats()
    assert cumulative.acceptance_rate == pytest.approx(9 / 14)
    assert cumulative.mean_acceptance_length == pytest.approx(1 + 9 / 6)
    # The core's interval lists are not aliased into the totals.
    assert first.num_accepted_tokens_per_pos == [3, 2]


def test_spec_totals_stay_empty_while_spec_decoding_is_off():
    proc = _proc([_interval(None), _interval(None)])
    proc._get_stats()
    totals = _through_the_wire(proc._get_stats())
    assert not totals.spec_decoding_enabled and totals.spec_decoding_stats() is None
    assert (totals.spec_num_drafts_total, totals.spec_num_accepted_tokens_per_pos_total) == (0, [])


def test_an_interval_without_drafts_turns_the_counters_on_at_zero():
    proc = _proc([_interval(SpecDecodingStats())])
    totals = proc._get_stats()
    assert totals.spec_decoding_enabled and totals.spec_num_drafts_total == 0


def test_stats_from_a_peer_without_spec_fields_still_decode():
    class OldStats(msgspec.Struct):
        num_running: int = 0
        prefix_cache_queries_total: int = 0

    payload = msgspec.to_builtins(OldStats(num_running=3, prefix_cache_queries_total=7))
    stats = msgspec.convert(payload, wire.EngineCoreStats)
    assert (stats.num_running, stats.prefix_cache_queries_total) == (3, 7)
    assert not stats.spec_decoding_enabled
    assert stats.spec_num_accepted_tokens_per_pos_total == []
    one, other = wire.EngineCoreStats(), wire.EngineCoreStats()
    one.spec_num_accepted_tokens_per_pos_total.append(1)
    assert other.spec_num_accepted_tokens_per_pos_total == []  # no shared default list


# -- the front end's reading: LLMEngine.get_spec_decoding_stats ------------------------------
class _TotalsClient:
    """A process-backed client: ``get_stats`` returns cumulative EngineCoreStats."""

    def __init__(self, proc: EngineCoreProc) -> None:
        self.proc = proc

    def get_stats(self) -> wire.EngineCoreStats:
        return _through_the_wire(self.proc._get_stats())

    def shutdown(self) -> None:
        pass


class _InprocStub:
    """An in-process client: the scheduler's interval stats through ``client.core``."""

    def __init__(self, intervals: list[SchedulerStats]) -> None:
        self.core = _StubCore(intervals)

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def spec_config(llama_dir):
    from engine import EngineArgs
    from engine.core.config import SpeculativeConfig

    config = EngineArgs(model=str(llama_dir), device="cpu").create_engine_config()
    return config.model_copy(
        update={"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=3)})


def test_llm_engine_spec_stats_are_the_change_since_the_last_call(spec_config):
    from engine.frontend.llm_engine import LLMEngine

    intervals = [
        _interval(SpecDecodingStats(4, 12, 6, [4, 2])),
        _interval(SpecDecodingStats(2, 6, 5, [2, 2, 1])),
        _interval(None),
    ]
    engine = LLMEngine(spec_config, client=_TotalsClient(_proc(intervals)))
    assert engine.get_spec_decoding_stats() == SpecDecodingStats(4, 12, 6, [4, 2])
    assert engine.get_spec_decoding_stats() == SpecDecodingStats(2, 6, 5, [2, 2, 1])
    assert engine.get_spec_decoding_stats() == SpecDecodingStats(0, 0, 0, [0, 0, 0])


def test_llm_engine_spec_stats_in_process_and_when_off(spec_config):
    from engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine(spec_config, client=_InprocStub(
        [_interval(SpecDecodingStats(1, 3, 2, [1, 1, 0])), _interval(None)]))
    assert engine.get_spec_decoding_stats() == SpecDecodingStats(1, 3, 2, [1, 1, 0])
    assert engine.get_spec_decoding_stats() == SpecDecodingStats()  # on, nothing drafted
    off = LLMEngine(spec_config.model_copy(update={"speculative": None}),
                    client=_InprocStub([]))
    assert off.get_spec_decoding_stats() is None  # and the core's counters are left alone
