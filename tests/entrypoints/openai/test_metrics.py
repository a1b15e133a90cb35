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


def test_moe_load_families_per_expert_and_per_rank():
    metrics = ServerMetrics("tiny")
    metrics._core.stats = EngineCoreStats(moe_expert_tokens_total=[5, 0, 3, 2],
                                          moe_expert_parallel_size=2)
    samples = _samples(metrics)
    for expert, count in enumerate([5, 0, 3, 2]):
        assert _one(samples, "engine:moe_expert_tokens_total", expert=str(expert)) == count
    assert _one(samples, "engine:moe_rank_tokens_total", rank="0") == 5
    assert _one(samples, "engine:moe_rank_tokens_total", rank="1") == 5
    dense = ServerMetrics("tiny")
    dense._core.stats = EngineCoreStats()
    assert "moe_" not in dense.render().decode()


def test_served_moe_model_reports_expert_load(model_dir_factory, tmp_path):
    """engine serve -tp 2 --enable-expert-parallel: /metrics counts every routed choice,
    per expert and per rank."""
    import httpx

    from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess

    path = model_dir_factory("qwen3-moe")  # one MoE layer, top-2 of 8 experts
    server = ServerProcess(path, tmp_path / "server.log",
                           ["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    try:
        server.wait_ready()
        body = {"model": SERVED_NAME, "prompt": [list(range(5, 15))], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        text = httpx.get(server.url + "/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        experts = sum(s.value for s in families["engine:moe_expert_tokens"].samples)
        ranks = [s.value for s in families["engine:moe_rank_tokens"].samples]
        assert experts == (10 + 3) * 2  # forwarded tokens x top-2 x one MoE layer
        assert len(ranks) == 2 and sum(ranks) == experts
    finally:
        server.stop()
        server.assert_no_orphans()
