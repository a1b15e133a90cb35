"""What a request's output must conform to: a JSON schema, any JSON object, a regex, a
fixed choice, a grammar or a structural tag (exactly one).

Field names follow vLLM's ``StructuredOutputsParams`` so code written for it works here.
Construction validates what is cheap and backend-independent, so a bad request fails
where the user made it: JSON schemas are checked against the JSON Schema metaschema
(``jsonschema``), with the regexes of ``pattern`` / ``patternProperties`` checked as
ECMA-262 regexes as JSON Schema defines them (not as Python's ``re`` reads them), and a
``regex`` constraint is checked the same way. Whether a backend can compile the
constraint, and what of a JSON schema it would have to relax, is checked later, without
a tokenizer, by :func:`engine.structured_output.selection.check_compilable`.

Beyond vLLM's fields: ``strict`` (refuse a JSON schema that cannot be enforced in full
instead of relaxing the keywords a backend lacks; OpenAI's ``json_schema.strict``).
``disable_any_whitespace`` and ``strict`` left as None take the engine's
``--structured-outputs-config`` defaults.
"""

from __future__ import annotations

import copy
import json as _json
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

BACKEND_NAMES = ("auto", "xgrammar", "llguidance")
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's generated text (set exactly one of the first six)."""

    json: dict[str, Any] | str | None = None  # a JSON schema (dict or JSON text)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF/GBNF (``root ::= ...``) or Lark (``start: ...``)
    structural_tag: str | None = None  # JSON text: {"structures": [...], "triggers": [...]}
    # No whitespace between JSON tokens beyond single separators (vLLM's option); None:
    # the engine's default (--structured-outputs-config), else False.
    disable_any_whitespace: bool | None = None
    # Fail instead of falling back to the other backend when the chosen one cannot compile.
    disable_fallback: bool = False
    backend: str | None = None  # "auto", "xgrammar", "llguidance"; None = engine default
    # A JSON schema no backend enforces in full is refused (ValueError naming the
    # keywords) instead of compiled with those keywords relaxed; None: the engine default.
    strict: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            self.json = _parse_json_text("json", self.json)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = _json.dumps(self.structural_tag)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self._validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        unknown = sorted(set(values) - FIELD_NAMES)
        if unknown:
            raise ValueError(
                f"unknown structured_outputs field(s): {', '.join(map(str, unknown))}; "
                f"known: {', '.join(sorted(FIELD_NAMES))}"
            )
        return cls(**values)

    def derive(self, **changes: Any) -> StructuredOutputsParams:
        """A copy with ``changes``, not validated again: for constraints the engine
        derives from a validated one (regexes rewritten, a schema relaxed ...)."""
        derived = copy.copy(self)
        for name, value in changes.items():
            setattr(derived, name, value)
        return derived

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, json_object, regex, choice, grammar,
        structural_tag."""
        return next(k for k in _KINDS if _is_set(getattr(self, k)))

    # -- validation -----------------------------------------------------------------------
    def _validate(self) -> None:
        chosen = [k for k in _KINDS if _is_set(getattr(self, k))]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {got}"
            )
        if not isinstance(self.disable_fallback, bool):
            _fail("disable_fallback", self.disable_fallback, "must be a boolean")
        for name in ("disable_any_whitespace", "strict"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a boolean")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail("json_object", self.json_object, "must be a boolean")
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            _fail("backend", self.backend, f"must be one of {', '.join(BACKEND_NAMES)}")
        kind = chosen[0]
        if kind == "json":
            check_json_schema(self.json)
        elif kind == "regex":
            _check_nonempty_str("regex", self.regex)
            check_regex(self.regex)
        elif kind == "choice":
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                _fail("choice", self.choice, "must be a non-empty list of strings")
            if any(c == "" for c in self.choice):
                _fail("choice", self.choice, "must not contain empty strings")
        elif kind == "grammar":
            _check_nonempty_str("grammar", self.grammar)
        elif kind == "structural_tag":
            _check_nonempty_str("structural_tag", self.structural_tag)
            tag = _parse_json_text("structural_tag", self.structural_tag)
            if not isinstance(tag, dict):
                _fail("structural_tag", self.structural_tag, "must be a JSON object")


def with_defaults(
    params: StructuredOutputsParams,
    *,
    backend: str | None = None,
    disable_any_whitespace: bool | None = None,
    strict: bool | None = None,
) -> StructuredOutputsParams:
    """``params`` with the fields it leaves unset (None) taken from engine-wide defaults
    (``--structured-outputs-config``); ``params`` itself when nothing changes."""
    changes: dict[str, Any] = {}
    for name, value in (("backend", backend), ("disable_any_whitespace", disable_any_whitespace),
                        ("strict", strict)):
        if getattr(params, name) is None and value is not None:
            changes[name] = value
    return params.derive(**changes) if changes else params


def check_json_schema(schema: Any) -> None:
    """Raise ValueError unless ``schema`` is a JSON Schema object that is valid against
    its metaschema (the draft its ``$schema`` names; 2020-12 when it names none), its
    ``format: regex`` values (``pattern``, ``patternProperties``) read as ECMA-262."""
    if not isinstance(schema, dict):
        _fail("json", schema, "must be a JSON Schema object (a dict or its JSON text)")
    depth = nesting_depth(schema)
    if depth > MAX_CONSTRAINT_DEPTH:
        _fail("json", "...", f"nests {depth} levels deep; at most {MAX_CONSTRAINT_DEPTH} are "
              "accepted")
    try:
        text = _json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        text = None  # not JSON data: checked (and refused) without the cache
    problem = _schema_problem(text) if text is not None else _schema_problem_of(schema)
    if problem is not None:
        raise ValueError(problem)


@lru_cache(maxsize=1024)
def _schema_problem(text: str) -> str | None:
    return _schema_problem_of(_json.loads(text))


def _schema_problem_of(schema: dict[str, Any]) -> str | None:
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema, format_checker=_format_checker(validator))
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        message = exc.message
        if exc.validator == "format" and exc.validator_value == "regex":
            message = f"{message} ({_regex_error(exc.instance)})"
        return f"invalid structured_outputs.json: not a valid JSON Schema at {where}: {message}"
    return None


def _format_checker(validator: Any) -> Any:
    """The metaschema's format checker with ``regex`` as JSON Schema defines it."""
    import jsonschema

    from engine.structured_output import ecma_regex

    base = validator.FORMAT_CHECKER
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(base.checkers)
    checker.checkers["regex"] = (ecma_regex.is_valid, ())
    return checker


def _regex_error(regex: Any) -> str:
    from engine.structured_output import ecma_regex

    try:
        ecma_regex.check(regex)
    except ValueError as exc:
        return f"not an ECMA-262 regex: {exc}"
    return "not an ECMA-262 regex"


def check_regex(regex: str) -> None:
    """Raise ValueError unless ``regex`` is an ECMA-262 regex a structured-output backend
    can enforce (written in the form the backends read)."""
    from engine.structured_output import ecma_regex
    from engine.structured_output.selection import check_regex_syntax

    try:
        unsupported = ecma_regex.features(regex)
    except ValueError as exc:
        _fail("regex", regex, f"not an ECMA-262 regular expression: {exc}")
    if unsupported:
        _fail("regex", regex, f"uses {', '.join(sorted(unsupported))}, which no "
              "structured-output backend enforces")
    check_regex_syntax(ecma_regex.to_backend(regex), shown=regex)


def _parse_json_text(name: str, text: str) -> Any:
    try:
        return _json.loads(text)
    except ValueError as exc:
        raise ValueError(f"invalid structured_outputs.{name}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"invalid structured_outputs.{name}: JSON nested too deeply") from None


# Deeper schemas are refused: every consumer (metaschema check, backends) recurses.
MAX_CONSTRAINT_DEPTH = 64


def nesting_depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (iterative: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_nonempty_str(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        _fail(name, value, "must be a non-empty string")


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def _fail(name: str, value: Any, why: str) -> None:
    shown = repr(value)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    raise ValueError(f"invalid structured_outputs.{name}={shown}: {why}")


FIELD_NAMES = frozenset(f.name for f in fields(StructuredOutputsParams))
