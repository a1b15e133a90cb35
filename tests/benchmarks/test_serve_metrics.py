"""Serving-benchmark arithmetic against hand-computed values: arrivals, ITL, TPOT, stats."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.benchmarks.serve_metrics import (
    RequestRecord,
    arrival_offsets,
    peak_concurrency,
    point_metrics,
    summarize_ms,
)


def _ms(value):
    """Figures are rounded to the microsecond."""
    return pytest.approx(value, abs=1e-3)


def _record(start, chunks, end, output_tokens, prompt_tokens=10):
    return RequestRecord(start_s=start, end_s=end, success=True, chunk_times_s=list(chunks),
                         prompt_tokens=prompt_tokens, output_tokens=output_tokens)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, seed=3).tolist() == [0.0] * 5
    assert arrival_offsets(0, 2.0, seed=3).size == 0


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    offsets = arrival_offsets(20001, 4.0, seed=7)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.25) < 0.01  # 20000 exponential draws: sd of the mean 0.0018
    assert abs(gaps.std() - 0.25) < 0.01  # exponential: std == mean
    assert np.array_equal(arrival_offsets(50, 4.0, seed=7), offsets[:50])
    assert not np.array_equal(arrival_offsets(50, 4.0, seed=8), offsets[:50])
    # the same pattern, scaled: a sweep's points differ only by their rate
    np.testing.assert_allclose(arrival_offsets(50, 1.0, seed=7), offsets[:50] * 4.0)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_arrivals_reject_bad_rates(rate):
    with pytest.raises(ValueError, match="request rate"):
        arrival_offsets(3, rate, seed=0)


def test_record_ttft_itl_tpot_by_hand():
    # sent at 1.0; chunks at 1.5, 1.7, 2.2 (the last one carrying 2 tokens); ends at 2.3
    record = _record(1.0, [1.5, 1.7, 2.2], 2.3, output_tokens=4)
    assert record.ttft_s == pytest.approx(0.5)
    np.testing.assert_allclose(record.itl_s(), [0.2, 0.5])
    assert record.e2e_s == pytest.approx(1.3)
    assert record.tpot_s == pytest.approx((1.3 - 0.5) / 3)
    assert _record(0.0, [0.1], 0.2, output_tokens=1).tpot_s is None
    assert RequestRecord(start_s=0.0).ttft_s is None


def test_summary_matches_hand_percentiles():
    stats = summarize_ms([1.0, 4.0, 2.0, 3.0])
    # linear interpolation between order statistics: p90 at rank 2.7, p99 at rank 2.97
    assert stats == {"mean": 2500.0, "median": 2500.0, "std": _ms(1118.034),
                     "p90": _ms(3700.0), "p99": _ms(3970.0)}
    assert summarize_ms([]) == dict.fromkeys(["mean", "median", "std", "p90", "p99"])


def test_peak_concurrency_by_hand():
    records = [RequestRecord(0.0, 2.0), RequestRecord(1.0, 3.0), RequestRecord(2.0, 4.0),
               RequestRecord(2.5, 2.6)]
    # at 2.0 the first ends as the third starts: 2 in flight, then 3 during [2.5, 2.6)
    assert peak_concurrency(records) == 3
    assert peak_concurrency([RequestRecord(0.0, 1.0), RequestRecord(1.0, 2.0)]) == 1
    assert peak_concurrency([]) == 0


def test_point_metrics_pool_itl_and_count_usage_tokens():
    first = _record(0.0, [0.1, 0.2, 0.4], 0.5, output_tokens=3, prompt_tokens=16)
    second = _record(0.5, [0.8, 0.9], 1.0, output_tokens=5, prompt_tokens=16)
    failed = RequestRecord(start_s=0.2, end_s=0.3, error="HTTP 400: too long")
    m = point_metrics([first, second, failed], duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (32, 8)
    assert m["request_throughput"] == 1.0
    assert m["output_throughput"] == 4.0 and m["total_token_throughput"] == 20.0
    itl = np.array([0.1, 0.2, 0.1]) * 1000  # every gap of every request, not per-request means
    assert m["itl_ms"]["mean"] == _ms(itl.mean())
    assert m["itl_ms"]["p99"] == _ms(np.percentile(itl, 99))
    assert m["ttft_ms"]["mean"] == _ms(200.0)  # (100 + 300) / 2
    assert m["tpot_ms"]["median"] == _ms(1000 * ((0.4 / 2) + (0.2 / 4)) / 2)
    assert m["e2e_ms"]["median"] == _ms(500.0)
    assert m["peak_concurrent_requests"] == 2
    assert m["errors"] == ["HTTP 400: too long"]


def test_point_metrics_of_an_all_failed_point():
    m = point_metrics([RequestRecord(0.0, 0.1, error="boom")], duration_s=0.1)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0
    assert m["ttft_ms"]["p99"] is None and m["itl_ms"]["mean"] is None
    with pytest.raises(ValueError, match="duration_s"):
        point_metrics([], duration_s=0.0)
