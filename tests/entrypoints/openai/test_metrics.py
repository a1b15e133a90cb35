"""The /metrics collector on hand-made engine-core snapshots (no server, no model)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.core_protocol import EngineCoreStats
from engine.entrypoints.openai.metrics import ServerMetrics

SPEC = EngineCoreStats(
    num_running=2, prefix_cache_queries_total=40, prefix_cache_hits_total=10,
    spec_decoding_enabled=True, spec_num_drafts_total=10, spec_num_draft_tokens_total=30,
    spec_num_accepted_tokens_total=18, spec_num_accepted_tokens_per_pos_total=[9, 6, 3],
)


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample the registry renders."""
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def _one(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]


class _Engine:
    """What ``ServerMetrics.refresh`` reads of an AsyncLLM."""

    errored = False

    def __init__(self, stats: EngineCoreStats) -> None:
        self.stats = stats

    async def get_stats(self) -> EngineCoreStats:
        return self.stats


def test_spec_decode_counters_follow_the_core_totals():
    metrics = ServerMetrics("tiny")
    asyncio.run(metrics.refresh(_Engine(SPEC)))
    samples = _samples(metrics)
    assert _one(samples, "engine:spec_decode_num_drafts_total") == 10
    assert _one(samples, "engine:spec_decode_num_draft_tokens_total") == 30
    assert _one(samples, "engine:spec_decode_num_accepted_tokens_total") == 18
    for position, accepted in enumerate([9, 6, 3]):
        assert _one(samples, "engine:spec_decode_num_accepted_tokens_per_pos_total",
                    position=str(position)) == accepted
    assert ("engine:spec_decode_num_accepted_tokens_per_pos_total",
            (("model_name", "tiny"), ("position", "3"))) not in samples
    assert _one(samples, "engine:spec_decode_acceptance_rate") == pytest.approx(0.6)
    # The other families are unaffected.
    assert _one(samples, "engine:num_requests_running") == 2
    assert _one(samples, "engine:prefix_cache_hit_rate") == pytest.approx(0.25)


def test_spec_decode_families_are_typed_counters():
    metrics = ServerMetrics("tiny")
    metrics._core.stats = SPEC
    types = {f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "num_accepted_tokens_per_pos"):
        assert types[f"engine:spec_decode_{name}"] == "counter"
    assert types["engine:spec_decode_acceptance_rate"] == "gauge"


def test_spec_decode_on_before_any_draft_exports_zeros():
    metrics = ServerMetrics("tiny")
    metrics._core.stats = EngineCoreStats(spec_decoding_enabled=True)
    samples = _samples(metrics)
    assert _one(samples, "engine:spec_decode_num_drafts_total") == 0
    assert _one(samples, "engine:spec_decode_acceptance_rate") == 0


def test_no_spec_decode_metrics_while_it_is_off():
    metrics = ServerMetrics("tiny")
    asyncio.run(metrics.refresh(_Engine(EngineCoreStats(num_running=1))))
    text = metrics.render().decode()
    assert "spec_decode" not in text
    assert 'engine:num_requests_running{model_name="tiny"} 1.0' in text
