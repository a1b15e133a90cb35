"""What a request's output must conform to: a JSON schema, any JSON object, a regex, a
fixed choice, a grammar or a structural tag (exactly one).

Field names follow vLLM's ``StructuredOutputsParams`` so code written for it works here.
Construction validates what is cheap and backend-independent, so a bad request fails
where the user made it: JSON schemas are checked against the JSON Schema metaschema
(``jsonschema``) and regexes are parsed by the backends' own regex parsers (their dialect,
not Python's). Whether a backend can compile the constraint is checked later, without a
tokenizer, by :func:`engine.structured_output.selection.check_compilable`.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
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
    # No whitespace between JSON tokens beyond single separators (vLLM's option).
    disable_any_whitespace: bool = False
    # Fail instead of falling back to the other backend when the chosen one cannot compile.
    disable_fallback: bool = False
    backend: str | None = None  # "auto", "xgrammar", "llguidance"; None = engine default

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
        for name in ("disable_any_whitespace", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
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


def check_json_schema(schema: Any) -> None:
    """Raise ValueError unless ``schema`` is a JSON Schema object that is valid against
    its metaschema (the draft its ``$schema`` names; 2020-12 when it names none)."""
    import jsonschema

    if not isinstance(schema, dict):
        _fail("json", schema, "must be a JSON Schema object (a dict or its JSON text)")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(
            f"invalid structured_outputs.json: not a valid JSON Schema at {where}: {exc.message}"
        ) from None


def check_regex(regex: str) -> None:
    """Raise ValueError unless a structured-output backend can parse ``regex``."""
    from engine.structured_output.selection import check_regex_syntax

    check_regex_syntax(regex)


def _parse_json_text(name: str, text: str) -> Any:
    try:
        return _json.loads(text)
    except ValueError as exc:
        raise ValueError(f"invalid structured_outputs.{name}: not valid JSON ({exc})") from None


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
