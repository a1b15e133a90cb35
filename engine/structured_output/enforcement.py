"""What a constraint compiles to: which backend, and what of a JSON schema it relaxes.

:func:`plan_constraint` answers, without a tokenizer, for one
:class:`StructuredOutputsParams`:

1. Regexes are written in the form the backends read (:mod:`ecma_regex`: JSON Schema
   regexes are ECMA-262), in a ``regex`` constraint and in a schema's ``pattern`` /
   ``patternProperties``.
2. The first backend of the order (``auto``: xgrammar, then llguidance) that enforces
   the whole constraint wins. For xgrammar a schema is first *lowered*
   (:func:`~engine.structured_output.json_schema.lower_compositions`: ``allOf`` merged,
   ``$ref`` beside other keywords inlined, the siblings of an ``anyOf`` / ``oneOf``
   copied into its branches), which keeps its meaning in the subset xgrammar enforces.
3. If none does, and the constraint is a JSON schema, each backend's *relaxed* schema is
   built: only the keywords that backend cannot enforce are dropped (``uniqueItems``,
   ``propertyNames``, a ``pattern`` with look-around ...) or loosened (``oneOf`` to
   ``anyOf``); everything else (root type, ``properties``, ``required``, ``enum``,
   ``items``, lengths, bounds) stays enforced. The backend with the fewest relaxed
   keywords wins (llguidance on a tie). The plan names them (:attr:`CompilePlan.relaxed`).
4. Only if no backend compiles even its relaxed schema does the backend's own best-effort
   mode remain (``lenient``; the plan then names what the audit found, or ``*``); for
   xgrammar on the lowered schema, so the keywords beside an ``anyOf`` (the root type)
   stay in its branches.

A request with ``strict`` (OpenAI's ``json_schema.strict``, or the engine default) is
refused when the plan relaxes anything: :func:`check_strict` raises a ValueError naming
the keywords, before the request reaches the engine core.

Plans are cached (per process) by the normalized constraint; :data:`CHECK_STATS` counts
the front end's lookups and the time spent planning (``/metrics``).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.structured_output import ecma_regex
from engine.structured_output.json_schema import (
    ANNOTATIONS,
    hoist_deep_refs,
    inline_recursive_refs,
    lower_compositions,
    resolve_local_ref,
    subschemas,
)
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.stats import CompileStats

logger = logging.getLogger(__name__)

# llguidance's JSON Schema support (its docs/json_schema.md, and what its strict mode
# answers "Unimplemented keys" for): keywords it cannot enforce at all.
LLGUIDANCE_UNSUPPORTED = frozenset(
    {
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
BEST_EFFORT = "*"  # the relaxed "keyword" of a backend's own best-effort mode
_PLAN_CACHE_SIZE = 1024
_MAX_BRANCH_PRODUCT = 64  # anyOf x oneOf pairs written out for xgrammar
_MAX_ROUNDS = 8  # error-driven relaxation rounds (llguidance names one problem at a time)

CHECK_STATS = CompileStats()  # this process's plan lookups (the front end's "check" stage)


class NotEnforceableError(ValueError):
    """A strict request whose JSON schema the backends cannot enforce in full."""

    def __init__(self, message: str, keywords: tuple[str, ...]) -> None:
        super().__init__(message)
        self.keywords = keywords


@dataclass(frozen=True)
class CompilePlan:
    backend: str
    params: StructuredOutputsParams  # what ``backend`` compiles (regexes rewritten ...)
    relaxed: tuple[str, ...] = ()  # JSON Schema keywords not enforced as written (sorted)
    lenient: bool = False  # the backend's own best-effort mode (last resort)
    reasons: tuple[str, ...] = ()  # why no backend enforces it in full

    @property
    def enforced(self) -> bool:
        return not self.relaxed and not self.lenient


def plan_constraint(
    params: StructuredOutputsParams,
    default: str = "auto",
    exclude: Iterable[str] = (),
    record: bool = True,
) -> CompilePlan:
    """The :class:`CompilePlan` for ``params`` (``strict`` is not applied: see
    :func:`check_strict`); ValueError naming every backend's reason when nothing compiles.
    ``record``: count this lookup in :data:`CHECK_STATS`."""
    exclude = tuple(sorted(set(exclude)))
    key = (constraint_key(params), params.backend or default, params.disable_fallback, exclude)
    start = time.perf_counter()
    plan = _PLANS.get(key)
    if plan is not None:
        if record:
            CHECK_STATS.hit()
        return plan
    plan = _make_plan(params, default, exclude)
    _PLANS.put(key, plan)
    if record:
        CHECK_STATS.miss()
        CHECK_STATS.observe(time.perf_counter() - start)
    if not plan.enforced:
        logger.debug(
            "structured output: JSON schema planned for %s with relaxed keywords %s%s",
            plan.backend,
            ", ".join(plan.relaxed),
            f": {'; '.join(plan.reasons)}" if plan.reasons else "",
        )
    return plan


def relaxed_keywords(
    params: StructuredOutputsParams | None, default: str = "auto"
) -> tuple[str, ...] | None:
    """The JSON Schema keywords ``params`` would be compiled without (empty: enforced in
    full); None when there is no constraint or it does not compile at all (the request's
    own checks report that). Counted in :data:`CHECK_STATS`."""
    if params is None:
        return None
    try:
        return plan_constraint(params, default).relaxed
    except ValueError:
        return None


def check_strict(plan: CompilePlan, params: StructuredOutputsParams) -> None:
    """NotEnforceableError (a ValueError) when ``params`` is strict and ``plan`` relaxes."""
    if not params.strict or plan.enforced:
        return
    keywords = plan.relaxed
    shown = ", ".join(k for k in keywords if k != BEST_EFFORT) or "(unknown)"
    raise NotEnforceableError(
        f"strict structured output: the JSON schema cannot be enforced in full; "
        f"unsupported keyword(s): {shown} ({'; '.join(plan.reasons)}). Remove them, or "
        "send strict: false to have them relaxed (the response header "
        "x-structured-output-relaxed then names them)",
        keywords,
    )


def constraint_key(params: StructuredOutputsParams) -> str:
    """The normalized constraint: equal for equal constraints, whatever key order."""
    kind = params.kind
    value = getattr(params, kind)
    return json.dumps(
        {"kind": kind, "value": value, "compact": bool(params.disable_any_whitespace)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )


def clear_plan_cache() -> None:
    _PLANS.clear()


# -- planning ---------------------------------------------------------------------------------
def _make_plan(
    params: StructuredOutputsParams, default: str, exclude: tuple[str, ...]
) -> CompilePlan:
    from engine.structured_output.selection import backend_class, backend_order

    names = [n for n in backend_order(params, default) if n not in exclude]
    if not names:
        raise ValueError("cannot compile the structured output constraint: no backend left")
    prepared = _with_backend_regexes(params)
    errors: list[str] = []
    for name in names:
        try:
            cls = backend_class(name)
            attempt = _lowered_for(name, prepared)
            cls.check(attempt, False)
            return CompilePlan(name, attempt)
        except ValueError as exc:
            errors.append(str(exc))
    if prepared.kind != "json":
        raise ValueError("invalid structured output constraint: " + "; ".join(errors))
    relaxed: list[tuple[int, int, str, StructuredOutputsParams, frozenset[str]]] = []
    from engine.structured_output.selection import LENIENT_ORDER

    for name in names:
        result = _relax(name, prepared)
        if result is not None:
            schema, keywords = result
            rank = LENIENT_ORDER.index(name) if name in LENIENT_ORDER else len(LENIENT_ORDER)
            attempt = prepared.derive(json=schema)
            relaxed.append((len(keywords), rank, name, attempt, keywords))
    reasons = tuple(errors)
    if relaxed:
        _, _, name, attempt, keywords = min(relaxed, key=lambda r: (r[0], r[1]))
        return CompilePlan(name, attempt, tuple(sorted(keywords)), reasons=reasons)
    for name in (n for n in LENIENT_ORDER if n in names):  # the backends' own best effort
        attempt, lost = _lenient_for(name, prepared)
        try:
            backend_class(name).check(attempt, True)
        except ValueError:
            continue
        found = (_audit(name, attempt.json) | lost) or {BEST_EFFORT}
        return CompilePlan(name, attempt, tuple(sorted(found)), lenient=True, reasons=reasons)
    raise ValueError("invalid structured output constraint: " + "; ".join(errors))


def _lowered_for(name: str, params: StructuredOutputsParams) -> StructuredOutputsParams:
    """xgrammar takes a JSON schema with its compositions lowered (when that is exact)."""
    if name != "xgrammar" or params.kind != "json":
        return params
    try:
        lowered, lost = lower_compositions(params.json)
    except Exception:
        logger.debug("could not lower the schema's compositions", exc_info=True)
        return params
    if lost:
        return params  # not exact: the strict attempt sees the schema as written
    return params.derive(json=lowered)


def _lenient_for(
    name: str, params: StructuredOutputsParams
) -> tuple[StructuredOutputsParams, set[str]]:
    """What ``name``'s best-effort mode compiles. xgrammar's takes the branches of an
    ``anyOf`` beside other keywords alone (an object-rooted schema then took ``[1.0]``):
    it gets the schema with compositions lowered (siblings copied into the branches), and
    the keywords lowering could not keep exact."""
    if name != "xgrammar" or params.kind != "json":
        return params, set()
    try:
        lowered, lost = lower_compositions(params.json)
    except Exception:
        logger.debug("could not lower the schema's compositions", exc_info=True)
        return params, set()
    return params.derive(json=lowered), set(lost)


def _with_backend_regexes(params: StructuredOutputsParams) -> StructuredOutputsParams:
    if params.kind == "regex":
        return params.derive(regex=ecma_regex.to_backend(params.regex))
    if params.kind == "json":
        try:
            return params.derive(json=_rewrite_patterns(hoist_deep_refs(params.json)))
        except Exception:
            logger.debug("could not rewrite the schema's references / patterns", exc_info=True)
    return params


def _rewrite_patterns(schema: Any) -> Any:
    """A copy with every valid ECMA-262 ``pattern`` / ``patternProperties`` regex written
    for the backends (the schema itself when it has none)."""
    if not any("pattern" in n or "patternProperties" in n for n in subschemas(schema)):
        return schema
    copied = copy.deepcopy(schema)
    for node in subschemas(copied):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and ecma_regex.is_valid(pattern):
            node["pattern"] = ecma_regex.to_backend(pattern)
        props = node.get("patternProperties")
        if isinstance(props, dict):
            node["patternProperties"] = {
                (ecma_regex.to_backend(k) if ecma_regex.is_valid(k) else k): v
                for k, v in props.items()
            }
    return copied


# -- relaxing ---------------------------------------------------------------------------------
def _audit(name: str, schema: Any) -> set[str]:
    if name == "xgrammar":
        from engine.structured_output.xgrammar_backend import unenforced_keywords

        return unenforced_keywords(schema)
    found = {k for n in subschemas(schema) for k in LLGUIDANCE_UNSUPPORTED.intersection(n)}
    if _remote_refs(schema):
        found.add("$ref")
    return found


def _relax(name: str, params: StructuredOutputsParams) -> tuple[Any, frozenset[str]] | None:
    """``name``'s relaxed schema for ``params`` and the keywords it relaxes, checked to
    compile strictly; None when even that fails."""
    from engine.structured_output.selection import backend_class

    cls = backend_class(name)
    try:
        if name == "xgrammar":
            schema, keywords = _relax_for_xgrammar(params.json)
            cls.check(params.derive(json=schema), False)
            return schema, frozenset(keywords)
        return _relax_for_llguidance(cls, params)
    except ValueError as exc:
        logger.debug("%s cannot compile even a relaxed schema: %s", name, exc)
        return None
    except Exception:
        logger.debug("%s: relaxing the schema failed", name, exc_info=True)
        return None


def _relax_for_xgrammar(schema: Any) -> tuple[Any, set[str]]:
    from engine.structured_output.xgrammar_backend import UNENFORCED_KEYWORDS, regex_problem

    schema, keywords = lower_compositions(schema)
    for node in subschemas(schema):
        _drop_unusable_patterns(node, keywords, regex_problem)
        if isinstance(node.get("pattern"), str):
            for key in ("minLength", "maxLength"):
                if key in node:
                    del node[key]  # xgrammar ignores lengths beside a pattern: say so
                    keywords.add(key)
        if isinstance(node.get("oneOf"), list):
            keywords.add("oneOf")  # xgrammar enforces a oneOf as an anyOf
            branches = node.pop("oneOf")
            others = node.get("anyOf")
            if not isinstance(others, list):
                node["anyOf"] = branches
            elif len(others) * len(branches) <= _MAX_BRANCH_PRODUCT:
                # Both: one anyOf of every pair (merged by lowering, below).
                node["anyOf"] = [{"allOf": [a, b]} for a in others for b in branches]
            else:
                keywords.add("anyOf")  # too many pairs: the oneOf's branches go too
        ref = node.get("$ref")
        if isinstance(ref, str) and (
            not ref.startswith("#") or resolve_local_ref(schema, ref) is None
        ):
            del node["$ref"]  # another document: anything
            keywords.add("$ref")
    schema, lost = inline_recursive_refs(schema)  # their siblings (root type) stay
    keywords |= lost
    schema, lost = lower_compositions(schema)  # anyOf from oneOf may have siblings
    keywords |= lost
    for node in subschemas(schema):
        for key in UNENFORCED_KEYWORDS.intersection(node):
            del node[key]
            keywords.add(key)
        if isinstance(node.get("$ref"), str) and set(node) - {"$ref"} - ANNOTATIONS:
            # A reference that could not be inlined: its siblings go (and are named).
            for key in [k for k in node if k != "$ref" and k not in ANNOTATIONS]:
                del node[key]
                keywords.add(key)
            keywords.add("$ref")
        if isinstance(node.get("anyOf"), list) and set(node) - {"anyOf"} - ANNOTATIONS:
            # Still beside other keywords (a branch that did not merge): the branches go,
            # the siblings (type, properties ...) stay enforced.
            del node["anyOf"]
            keywords.add("anyOf")
    return schema, keywords


def _relax_for_llguidance(cls: Any, params: StructuredOutputsParams) -> tuple[Any, frozenset[str]]:
    from engine.structured_output.llguidance_backend import regex_problem

    schema = copy.deepcopy(params.json)
    keywords: set[str] = set()
    for node in subschemas(schema):
        _drop_unusable_patterns(node, keywords, regex_problem)
        for key in LLGUIDANCE_UNSUPPORTED.intersection(node):
            del node[key]
            keywords.add(key)
    for node in _remote_refs(schema):
        del node["$ref"]
        keywords.add("$ref")
    for _ in range(_MAX_ROUNDS):
        attempt = params.derive(json=schema)
        try:
            cls.check(attempt, False)
            return schema, frozenset(keywords)
        except ValueError as exc:
            if not _relax_llguidance_error(str(exc), schema, keywords):
                raise
    raise ValueError("llguidance: too many unsupported features")


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_MISSING_RESOURCE = re.compile(r"Resource '([^']+)' is not present in a registry")


def _relax_llguidance_error(message: str, schema: Any, keywords: set[str]) -> bool:
    """Drop what llguidance's error names; False when it names nothing we can drop."""
    match = _UNIMPLEMENTED.search(message)
    if match:
        names = set(json.loads(f"[{match.group(1)}]"))
        for node in subschemas(schema):
            for key in names.intersection(node):
                del node[key]
        keywords.update(names)
        return bool(names)
    if "oneOf constraints are not supported" in message:
        for node in subschemas(schema):
            if isinstance(node.get("oneOf"), list):
                branches = node.pop("oneOf")
                if isinstance(node.get("anyOf"), list):
                    node.setdefault("allOf", []).append({"anyOf": branches})
                else:
                    node["anyOf"] = branches
        keywords.add("oneOf")
        return True
    match = _UNKNOWN_FORMAT.search(message)
    if match:
        # format is an annotation in JSON Schema 2020-12: not reported as relaxed.
        for node in subschemas(schema):
            if node.get("format") == match.group(1):
                del node["format"]
        return True
    if "patternProperty regexes" in message and "not disjoint" in message:
        # One entry for the union of the names, whose value may match any of the schemas.
        for node in subschemas(schema):
            props = node.get("patternProperties")
            if isinstance(props, dict) and len(props) > 1:
                union = "|".join(f"(?:{k})" for k in props)
                node["patternProperties"] = {union: {"anyOf": list(props.values())}}
        keywords.add("patternProperties")
        return True
    if "circular references with sibling keys" in message:
        # llguidance counts annotations as siblings too: a reference stands alone.
        changed = False
        for node in subschemas(schema):
            if isinstance(node.get("$ref"), str) and len(node) > 1:
                if set(node) - {"$ref"} - ANNOTATIONS:
                    keywords.add("$ref")
                for key in [k for k in node if k != "$ref"]:
                    del node[key]
                changed = True
        return changed
    if "min/maxProperties only supported when all keys listed" in message:
        # Where the properties are optional (or come from elsewhere: then everywhere).
        nodes = [n for n in subschemas(schema) if "minProperties" in n or "maxProperties" in n]
        optional = [n for n in nodes if isinstance(n.get("properties"), dict) and set(
            n["properties"]) - set(n.get("required") if isinstance(n.get("required"), list)
                                   else [])]
        for node in optional or nodes:
            for key in ("minProperties", "maxProperties"):
                if node.pop(key, None) is not None:
                    keywords.add(key)
        return bool(nodes)
    match = _MISSING_RESOURCE.search(message)
    if match:
        # A document llguidance would fetch: the metaschema $schema names (an annotation
        # here), or another document a reference points to ("anything").
        uri, changed = match.group(1), False
        if isinstance(schema, dict) and schema.get("$schema") == uri:
            del schema["$schema"]
            changed = True
        document = uri.split("#")[0]
        for node in subschemas(schema):
            ref = node.get("$ref")
            target = ref.split("#")[0] if isinstance(ref, str) else ""
            if target and (target == document or document.endswith("/" + target)):
                del node["$ref"]
                keywords.add("$ref")
                changed = True
        return changed
    return False


def _drop_unusable_patterns(node: dict[str, Any], keywords: set[str], problem: Any) -> None:
    pattern = node.get("pattern")
    if isinstance(pattern, str) and problem(pattern):
        del node["pattern"]
        keywords.add("pattern")
    props = node.get("patternProperties")
    if isinstance(props, dict):
        usable = {k: v for k, v in props.items() if not problem(k)}
        if len(usable) != len(props):
            node["patternProperties"] = usable
            keywords.add("patternProperties")


def _remote_refs(schema: Any) -> list[dict[str, Any]]:
    return [
        n for n in subschemas(schema)
        if isinstance(n.get("$ref"), str) and not n["$ref"].startswith("#")
    ]


# -- the plan cache ---------------------------------------------------------------------------
class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Any, CompilePlan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> CompilePlan | None:
        with self._lock:
            plan = self._items.get(key)
            if plan is not None:
                self._items.move_to_end(key)
            return plan

    def put(self, key: Any, plan: CompilePlan) -> None:
        with self._lock:
            self._items[key] = plan
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_PLANS = _LRU(_PLAN_CACHE_SIZE)
