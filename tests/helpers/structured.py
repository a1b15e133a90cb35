"""Whether a generated text satisfies its structured-output constraint (an independent
check: jsonschema for JSON, Python's re for regexes)."""

from __future__ import annotations

import json
import re

import jsonschema

from engine.structured_output import StructuredOutputsParams

# A schema neither backend enforces in full (uniqueItems): it compiles relaxed.
UNIQUE = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3,
                 "uniqueItems": True},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["tags", "n"],
    "additionalProperties": False,
}


def satisfies(so: StructuredOutputsParams, text: str, grammar_res: dict[str, str] | None = None
              ) -> bool:
    """``grammar_res`` maps a grammar's text to a regex its language equals (grammars have
    no independent checker here)."""
    if so.kind == "json":
        try:
            jsonschema.validate(json.loads(text), so.json)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if so.kind == "regex":
        return re.fullmatch(so.regex, text) is not None
    if so.kind == "choice":
        return text in so.choice
    if so.kind == "grammar" and grammar_res is not None:
        return re.fullmatch(grammar_res[so.grammar], text) is not None
    raise AssertionError(f"no check for a {so.kind} constraint")
