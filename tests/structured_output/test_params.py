"""StructuredOutputsParams validation, SamplingParams wiring, the msgspec round trip and
the tokenizer-free compile check (with its auto fallback)."""

from __future__ import annotations

import msgspec
import pytest

from engine.core.engine_io import EngineCoreRequest
from engine.core.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams, check_compilable
from engine.structured_output.selection import backend_order, compile_plan

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": {"type": "objectx"}}, "not a valid JSON Schema at type"),
        ({"json": {"properties": {"a": {"minimum": "3"}}}}, "at properties/a/minimum"),
        ({"json": '{"type": "object"'}, "not valid JSON"),
        ({"json": [1, 2]}, "must be a JSON Schema object"),
        ({"regex": "(ab"}, "regex='(ab'"),
        ({"regex": ""}, "must be a non-empty string"),
        ({"choice": []}, "non-empty list of strings"),
        ({"choice": ["a", 3]}, "non-empty list of strings"),
        ({"choice": ["a", ""]}, "empty strings"),
        ({"grammar": "  "}, "non-empty string"),
        ({"structural_tag": "[1]"}, "must be a JSON object"),
        ({"json_object": True, "backend": "outlines"}, "backend"),
        ({"json_object": "yes"}, "must be a boolean"),
    ],
)
def test_invalid_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        StructuredOutputsParams(**kwargs)


def test_json_text_is_parsed_and_kinds_resolve():
    params = StructuredOutputsParams(json='{"type": "string"}')
    assert params.json == {"type": "string"} and params.kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(json_object=False, regex="a").kind == "regex"


def test_regex_uses_backend_dialect_not_python():
    # \p{L} is fine for llguidance (Rust regex) though Python's re rejects it.
    assert StructuredOutputsParams(regex=r"\p{L}+").regex == r"\p{L}+"


def test_sampling_params_accepts_dict_and_rejects_junk():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"choices": ["a"]})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(choice=["x", "y"], backend="llguidance"),
        StructuredOutputsParams(regex=r"\d+"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(grammar='root ::= "a"'),
    ],
)
def test_survives_msgspec_round_trip(so):
    request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=so))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params.structured_outputs == so
    assert decoded.sampling_params == request.sampling_params


def test_unconstrained_params_round_trip_without_the_field():
    request = EngineCoreRequest("r", [1], SamplingParams())
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params.structured_outputs is None


def test_backend_order():
    assert backend_order(StructuredOutputsParams(regex="a")) == ("xgrammar", "llguidance")
    assert backend_order(StructuredOutputsParams(regex="a", disable_fallback=True)) == ("xgrammar",)
    assert backend_order(StructuredOutputsParams(regex="a", backend="llguidance")) == (
        "llguidance",
    )
    assert backend_order(StructuredOutputsParams(regex="a"), default="llguidance") == (
        "llguidance",
    )


def test_compile_plan_strict_first_then_best_effort():
    assert compile_plan(StructuredOutputsParams(json=SCHEMA)) == [
        ("xgrammar", False),
        ("llguidance", False),
        ("llguidance", True),
        ("xgrammar", True),
    ]
    assert compile_plan(StructuredOutputsParams(regex="a", backend="xgrammar")) == [
        ("xgrammar", False)
    ]


def test_check_compilable_prefers_xgrammar_and_falls_back():
    assert check_compilable(StructuredOutputsParams(json=SCHEMA)) == ("xgrammar", False)
    # xgrammar ignores allOf itself, but this one merges exactly into one schema.
    all_of = {"allOf": [{"type": "string"}, {"maxLength": 3}]}
    assert check_compilable(StructuredOutputsParams(json=all_of)) == ("xgrammar", False)
    # uniqueItems is beyond both: llguidance enforces the rest, xgrammar would lose allOf.
    all_of_unique = {"allOf": [{"type": "array"}, {"uniqueItems": True}]}
    assert check_compilable(StructuredOutputsParams(json=all_of_unique)) == ("llguidance", True)
    # \p{L} is beyond xgrammar's regex parser; llguidance takes it.
    assert check_compilable(StructuredOutputsParams(regex=r"\p{L}+")) == ("llguidance", False)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        {"not": {"type": "string"}},
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/remote.json"}}},
    ],
)
def test_unenforceable_keywords_compile_on_a_best_effort_basis(schema):
    assert check_compilable(StructuredOutputsParams(json=schema)) == ("llguidance", True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"grammar": "start: missing"}, "missing"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
    ],
)
def test_check_compilable_names_the_problem(kwargs, message):
    # (A pattern with look-behind is relaxed, or refused when strict: test_enforcement.)
    with pytest.raises(ValueError, match=message) as info:
        check_compilable(StructuredOutputsParams(**kwargs))
    assert "xgrammar" in str(info.value) and "llguidance" in str(info.value)
