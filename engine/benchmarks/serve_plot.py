"""One PNG of a serving sweep: throughput and latency percentiles per sweep point.

matplotlib is an optional extra (``engine[bench]``), so it is checked before a run
starts rather than after minutes of load. The figure is drawn on a bare ``Figure`` (the
Agg canvas), never through pyplot, so no GUI backend or global state is involved.
The x axis is categorical because a rate may be ``inf``.
"""

from __future__ import annotations

from pathlib import Path

from engine.benchmarks.serve import PointResult, SweepPoint, rate_text

INSTALL_HINT = "pip install 'engine[bench]'"

# (panel title, unit, [(metric key, statistic, legend label)])
_PANELS = (
    ("Output throughput", "tok/s", [("output_throughput", None, "output tok/s")]),
    ("Time to first token", "ms", [("ttft_ms", "median", "p50"), ("ttft_ms", "p99", "p99")]),
    ("Inter-token latency", "ms", [("itl_ms", "median", "ITL p50"), ("itl_ms", "p99", "ITL p99"),
                                   ("tpot_ms", "median", "TPOT p50")]),
    ("End-to-end latency", "ms", [("e2e_ms", "median", "p50"), ("e2e_ms", "p99", "p99")]),
)


def require_matplotlib() -> None:
    """ImportError naming the extra to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib: {INSTALL_HINT}") from exc


def sweep_axes(points: list[SweepPoint]) -> tuple[str, list[str], list[tuple[str, list[int]]]]:
    """The x-axis title, its tick labels, and the lines to draw: ``(legend suffix, index
    of the point at each tick)``. Only the varied setting goes on the x axis; when both
    vary, rates go on the axis and each concurrency cap gets its own line."""
    rates = list(dict.fromkeys(p.request_rate for p in points))
    caps = list(dict.fromkeys(p.max_concurrency for p in points))
    where = {(p.request_rate, p.max_concurrency): i for i, p in enumerate(points)}
    if len(caps) > 1 and len(rates) == 1:
        return ("max concurrency", [_cap_text(c) for c in caps],
                [("", [where[rates[0], c] for c in caps])])
    lines = [(f", c={_cap_text(c)}" if len(caps) > 1 else "", [where[r, c] for r in rates])
             for c in caps]
    return "request rate (req/s)", [rate_text(r) for r in rates], lines


def _cap_text(cap: int | None) -> str:
    return "none" if cap is None else str(cap)


def plot_sweep(results: list[PointResult], path: str | Path, title: str) -> None:
    """Write the 2x2 panel PNG: lines over the sweep, bars for a single point."""
    require_matplotlib()
    from matplotlib.figure import Figure

    xlabel, ticks, lines = sweep_axes([r.point for r in results])
    figure = Figure(figsize=(11, 8), layout="constrained")
    figure.suptitle(title)
    for axes, (name, unit, series) in zip(figure.subplots(2, 2).ravel(), _PANELS):
        if len(results) == 1:
            values = [_value(results[0].metrics[key], stat) for key, stat, _ in series]
            axes.bar(range(len(series)), values, width=0.6, color=[f"C{i}" for i in
                                                                   range(len(series))])
            axes.set_xticks(range(len(series)), [label for _, _, label in series])
            axes.set_xlim(-0.8, len(series) - 0.2)
            axes.set_xlabel(results[0].point.label())
        else:
            for key, stat, label in series:
                for suffix, indices in lines:
                    axes.plot(range(len(ticks)),
                              [_value(results[i].metrics[key], stat) for i in indices],
                              marker="o", label=label + suffix)
            axes.set_xticks(range(len(ticks)), ticks)
            axes.set_xlabel(xlabel)
            axes.legend()
        axes.set_title(name)
        axes.set_ylabel(unit)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    figure.savefig(path, format="png", dpi=100)


def _value(metric, stat: str | None) -> float:
    value = metric if stat is None else metric[stat]
    return float("nan") if value is None else float(value)
