"""Relaxed and strict JSON schemas through the offline ``LLM`` on a tiny random model:
what a relaxed schema still enforces holds for every finished output; a strict request
is refused naming the keyword (per request up front, engine-wide by the core)."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.structured_output.ecma_regex import schema_patterns_to_python
from tests.helpers.structured import UNIQUE

OBJECT_ONE_OF = {
    "type": "object",
    "oneOf": [
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"enum": [True]}}, "additionalProperties": False},
    ],
}
NAMED_GROUPS = {"type": "object",
                "properties": {"d": {"type": "string", "pattern": r"^(?<y>\d{4})-(?<m>\d{2})$"}},
                "required": ["d"], "additionalProperties": False}


def _without(schema, keyword):
    out = copy.deepcopy(schema)
    for prop in out.get("properties", {}).values():
        prop.pop(keyword, None)
    out.pop(keyword, None)
    return out


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=32)


def _generate(llm, schema, backend, n=6, **so):
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=48,
                       structured_outputs=StructuredOutputsParams(
                           json=schema, disable_any_whitespace=True, backend=backend, **so))
        for seed in range(n)
    ]
    return [out.outputs[0] for out in llm.generate(["Data:"] * n, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_relaxed_schema_still_enforces_the_rest(llm, backend):
    outputs = _generate(llm, UNIQUE, backend)
    finished = [o.text for o in outputs if o.finish_reason == "stop"]
    assert finished, [o.text for o in outputs]
    for text in finished:  # everything but uniqueItems holds
        jsonschema.validate(json.loads(text), _without(UNIQUE, "uniqueItems"))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_object_rooted_one_of_yields_objects(llm, backend):
    outputs = _generate(llm, OBJECT_ONE_OF, backend)
    for completion in outputs:
        if completion.finish_reason == "stop":
            document = json.loads(completion.text)
            assert isinstance(document, dict), completion.text
            jsonschema.validate(document, {**OBJECT_ONE_OF, "anyOf": OBJECT_ONE_OF["oneOf"],
                                           "oneOf": [True]})
        else:
            assert completion.text.startswith("{"), completion.text


def test_named_group_pattern_is_enforced(llm):
    for backend in ("xgrammar", "llguidance"):
        outputs = _generate(llm, NAMED_GROUPS, backend, n=3)
        for completion in outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text),
                                schema_patterns_to_python(NAMED_GROUPS))


def test_strict_request_is_refused_naming_the_keyword(llm):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=UNIQUE, strict=True))
    with pytest.raises(ValueError, match="unsupported keyword.*uniqueItems"):
        llm.generate("Data:", params, use_tqdm=False)
    assert llm.generate("Data:", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs


def test_engine_wide_strict_default(llama_dir):
    strict = LLM(str(llama_dir), device="cpu", dtype="float32", max_model_len=128,
                 max_num_seqs=4, structured_outputs_config={"strict": True})
    refused, allowed = strict.generate(
        ["Data:", "Data:"],
        [SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(json=UNIQUE)),
         SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(
             json=UNIQUE, strict=False, disable_any_whitespace=True))],
        use_tqdm=False)
    assert refused.outputs[0].finish_reason == "abort"
    assert "uniqueItems" in refused.outputs[0].stop_reason
    assert allowed.outputs[0].finish_reason in ("stop", "length")
