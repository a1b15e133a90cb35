"""Every output a compiled JSON schema admits validates against the schema, or against
the relaxed schema its plan names (``x-structured-output-relaxed``): the three invalid
outputs of SchemaStore schemas (an object root answered with ``[1.0]``, a root ``oneOf``
answered by a value matching two branches, an ``anyOf`` in array ``items`` matched by
none), each reduced to the pattern that let it through.

Outputs are drawn by random walks over the grammar's token masks (a uniform choice among
the allowed tokens, seeded), and known-invalid strings are fed to the grammar directly."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest
import torch

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.enforcement import _lenient_for, plan_constraint
from engine.structured_output.json_schema import (
    NEVER,
    close_objects,
    never_as_pattern,
    restrict_enums,
    subschemas,
    whole_integer_bounds,
)
from engine.structured_output.selection import backend_class

BACKENDS = ["auto", "xgrammar", "llguidance"]
SAMPLES = 24
MAX_TOKENS = 96

# 1. Object roots whose type used to be lost.
NODE = {"anyOf": [
    {"type": "array", "items": {"$ref": "#/definitions/node"}},
    {"type": "object", "properties": {"c": {"$ref": "#/definitions/node"}},
     "additionalProperties": False},
    {"type": "number"},
]}
# A recursive reference beside the root type: xgrammar's relaxed schema took the
# reference alone (its siblings dropped), and the recursion's number branch took 55.
OBJECT_RECURSIVE_REF = {"type": "object", "$ref": "#/definitions/node",
                        "definitions": {"node": NODE}}
# An anyOf beside the root type whose branches merge to fractional integer bounds
# (xgrammar refused to compile them): planning fell to xgrammar's best-effort mode, which
# takes the branches alone, and the root type was gone.
OBJECT_ANY_OF_BOUNDS = {
    "type": "object",
    "properties": {"n": {"type": "integer", "anyOf": [
        {"not": {"type": "string"}}, {"type": "number", "minimum": 0.5, "maximum": 2.5}]}},
    "required": ["n"],
    "anyOf": [{"required": ["n"]}, {"type": "array"}],
}
# 2. A root oneOf with overlapping object branches ({"b": true} matches both): objects
# closed for llguidance made the branches look disjoint, and it enforced the oneOf as if
# exclusive while accepting {"b": true}.
ROOT_ONE_OF = {"oneOf": [
    {"type": "object", "properties": {"a": {"type": "string"}}},
    {"type": "object", "required": ["b"]},
]}
# anyOf beside oneOf: xgrammar's relaxed schema dropped the oneOf's branches.
ANY_AND_ONE_OF = {"type": "object",
                  "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
                  "oneOf": [{"required": ["c"]}, {"required": ["d"]}]}
# 3. anyOf inside array items matched by none: xgrammar takes an enum / const alone,
# ignoring the type the branch inherits from beside the anyOf, and reads an empty anyOf
# (every branch's type disjoint from the items' type) as the empty string.
ITEMS_CONST = {"type": "array", "items": {"type": "integer", "anyOf": [
    {"const": "x"},
    {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}]}}
ITEMS_NONE = {"type": "array", "items": {"type": "string", "anyOf": [
    {"type": "object"}, {"type": "array", "minItems": 2, "items": {"type": "boolean"}}]}}
ITEMS_MIXED = {"type": "array", "items": {"anyOf": [
    {"type": "integer", "exclusiveMinimum": 2, "maximum": 9},
    {"enum": [1, "a", None], "type": ["string", "null"]},
    {"$ref": "#/definitions/d"},
    {"type": "object", "$ref": "#/definitions/d", "properties": {"e": {"const": 1}}}]},
    "definitions": {"d": {"type": "object", "properties": {"z": {"type": "boolean"}},
                          "required": ["z"]}}}

SCHEMAS = {
    "object_recursive_ref": OBJECT_RECURSIVE_REF,
    "object_any_of_bounds": OBJECT_ANY_OF_BOUNDS,
    "root_one_of": ROOT_ONE_OF,
    "any_and_one_of": ANY_AND_ONE_OF,
    "items_const": ITEMS_CONST,
    "items_none": ITEMS_NONE,
    "items_mixed": ITEMS_MIXED,
}


@pytest.fixture(scope="module")
def backends(tokenizer):
    return {
        name: backend_class(name)(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 1)
        for name in ("xgrammar", "llguidance")
    }


def relaxed_schema(schema: dict, keywords: tuple[str, ...]) -> dict:
    """``schema`` as the response's relaxed keywords describe it: a relaxed ``oneOf`` is
    an ``anyOf`` (exclusivity dropped), any other relaxed keyword is gone."""
    out = copy.deepcopy(schema)
    for node in list(subschemas(out)):
        for keyword in keywords:
            if keyword == "oneOf" and isinstance(node.get("oneOf"), list):
                branches = node.pop("oneOf")
                if "anyOf" in node:
                    node.setdefault("allOf", []).append({"anyOf": branches})
                else:
                    node["anyOf"] = branches
            elif keyword != "oneOf":
                node.pop(keyword, None)
    return out


def _plan(schema: dict, backend: str):
    return plan_constraint(StructuredOutputsParams(json=schema, backend=backend,
                                                   disable_any_whitespace=True))


def _allowed(grammar, vocab: int) -> list[int]:
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    grammar.fill_bitmask(mask, 0)
    bits = (mask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t < vocab]


def sample_outputs(backends, tokenizer, plan, seed: int, n: int = SAMPLES) -> list[str]:
    """Finished outputs of ``n`` random walks over the plan's grammar."""
    rng, eos, vocab, out = random.Random(seed), tokenizer.eos_token_id, len(tokenizer), []
    for _ in range(n):
        grammar = backends[plan.backend].compile(plan.params, plan.lenient)
        ids: list[int] = []
        for _ in range(MAX_TOKENS):
            if grammar.is_terminated():
                out.append(tokenizer.decode(ids))
                break
            allowed = _allowed(grammar, vocab)
            if eos in allowed and rng.random() < 0.5:
                out.append(tokenizer.decode(ids))
                break
            choices = [t for t in allowed if t != eos]
            if not choices:
                break
            token = rng.choice(choices)
            assert grammar.accept_tokens([token])
            ids.append(token)
    return out


def accepts(backends, tokenizer, plan, text: str) -> bool:
    grammar = backends[plan.backend].compile(plan.params, plan.lenient)
    if not grammar.accept_tokens(tokenizer.encode(text, add_special_tokens=False)):
        return False
    return grammar.is_terminated() or tokenizer.eos_token_id in _allowed(grammar, len(tokenizer))


def _spellings(text: str) -> list[str]:
    """``text`` (compact JSON) and with xgrammar's compact separators."""
    return [text, text.replace(",", ", ").replace(":", ": ")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_output_validates(backends, tokenizer, name, backend):
    schema = SCHEMAS[name]
    plan = _plan(schema, backend)
    check = relaxed_schema(schema, plan.relaxed)
    outputs = sample_outputs(backends, tokenizer, plan, seed=len(name))
    assert len(outputs) >= 4, "too few finished walks to say anything"
    for text in outputs:
        document = json.loads(text)
        errors = [e.message for e in jsonschema.Draft202012Validator(check).iter_errors(document)]
        assert not errors, (name, plan.backend, plan.relaxed, text, errors)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name, invalid",
    [
        ("object_recursive_ref", ["[1.0]", "55", "[]", '"a"']),
        ("object_any_of_bounds", ["[1.0]", "[]", '{"n":"a"}', '{"n":1.5}', "{}"]),
        ("root_one_of", ["[1.0]", "1"]),
        ("any_and_one_of", ["[1.0]", '{"c":1}', '{"a":1}']),
        ("items_const", ['["x"]', "[1]", "[,]", '[{"a":1}]']),
        ("items_none", ["[,]", '[""]', "[[true,true]]", "[{}]"]),
        ("items_mixed", ['[1]', '[2]', '[10]', '["a",null,{}]', '[{"e":1}]', '[{"z":1}]']),
    ],
)
def test_known_invalid_strings_are_rejected(backends, tokenizer, name, invalid, backend):
    plan = _plan(SCHEMAS[name], backend)
    check = relaxed_schema(SCHEMAS[name], plan.relaxed)
    for text in invalid:
        if text != "[,]":  # not JSON at all
            assert not jsonschema.Draft202012Validator(check).is_valid(json.loads(text)), text
        for spelling in _spellings(text):
            assert not accepts(backends, tokenizer, plan, spelling), (plan.backend, spelling)


@pytest.mark.parametrize("backend", BACKENDS)
def test_root_type_is_enforced_not_relaxed(backend):
    for name in ("object_recursive_ref", "object_any_of_bounds", "any_and_one_of"):
        plan = _plan(SCHEMAS[name], backend)
        assert "type" not in plan.relaxed and not plan.lenient, (name, plan.relaxed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_one_of_is_named_relaxed(backends, tokenizer, backend):
    plan = _plan(ROOT_ONE_OF, backend)
    # {"b": true} matches both branches: either refused, or the oneOf is named relaxed.
    if any(accepts(backends, tokenizer, plan, s) for s in _spellings('{"b":true}')):
        assert "oneOf" in plan.relaxed
    both = _plan(ANY_AND_ONE_OF, backend)
    assert "oneOf" in both.relaxed and "anyOf" not in both.relaxed


def test_one_of_with_disjoint_object_branches_stays_enforced():
    schema = {"oneOf": [
        {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "a"}}},
        {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "b"}}}]}
    assert _plan(schema, "auto").enforced


def test_close_objects_leaves_one_of_branches_open():
    closed = close_objects({"type": "object", "properties": {"x": {"type": "object",
                            "properties": {"y": {}}}},
                            "oneOf": [{"$ref": "#/$defs/a"}, {"properties": {"q": {}}}],
                            "$defs": {"a": {"properties": {"p": {}}}}})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["oneOf"][1]
    assert "additionalProperties" not in closed["$defs"]["a"]


def test_xgrammar_rewrites_keep_meaning():
    assert restrict_enums({"type": "integer", "enum": [1, "a", 2.5]}) == {"enum": [1]}
    assert restrict_enums({"anyOf": [{"type": "integer", "const": "x"}, {"type": "null"}]}) \
        == {"anyOf": [{"type": "null"}]}
    assert whole_integer_bounds({"type": "integer", "minimum": 0.5, "exclusiveMaximum": 2.5}) \
        == {"type": "integer", "minimum": 1, "maximum": 2}
    assert whole_integer_bounds({"type": "integer", "exclusiveMinimum": 2, "maximum": 7.5}) \
        == {"type": "integer", "minimum": 3, "maximum": 7}
    unchanged = {"type": "integer", "exclusiveMinimum": 2}  # xgrammar compiles it as it is
    assert whole_integer_bounds(unchanged) is unchanged
    assert never_as_pattern({"type": "array", "items": {"anyOf": []}}) == \
        {"type": "array", "items": NEVER}
    assert never_as_pattern({"anyOf": [{"anyOf": []}, {"type": "null"}]}) == \
        {"anyOf": [{"type": "null"}]}


def test_xgrammar_best_effort_keeps_the_type_beside_an_any_of(backends, tokenizer):
    """The last resort (nothing compiles even relaxed) gets the lowered schema: the root
    type is copied into the branches instead of being dropped with them."""
    params = StructuredOutputsParams(json={"type": "object", "anyOf": [
        {"properties": {"a": {"type": "number"}}}, {"items": {"type": "number"}}]},
        disable_any_whitespace=True)
    lowered, lost = _lenient_for("xgrammar", params)
    assert not lost
    assert all(b.get("type") == "object" for b in lowered.json["anyOf"])
    grammar = backends["xgrammar"].compile(lowered, True)
    assert not grammar.accept_tokens(tokenizer.encode("[1.0]", add_special_tokens=False))
