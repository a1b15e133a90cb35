"""Constrained generation end to end on tiny random-weight models.

Random weights produce garbage, which is what constrained decoding must fix: every output
that finishes with "stop" must validate against its JSON schema (jsonschema), fullmatch
its regex or be one of the choices, across seeds, temperatures and both backends.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.core.engine_io import EngineCoreRequest
from engine.core.request import FinishReason
from engine.structured_output import StructuredOutputsParams
from tests.helpers.structured import satisfies

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", "it depends"]
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time"]


def _llm(path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return _llm(llama_dir)


def _constrained_batch(backend: str) -> list[tuple[str, SamplingParams]]:
    kinds = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, backend=backend),
        StructuredOutputsParams(regex=REGEX, backend=backend),
        StructuredOutputsParams(choice=CHOICES, backend=backend),
    ]
    batch = []
    for i, (temperature, seed) in enumerate([(0.0, None), (0.7, 0), (0.7, 1), (1.0, 2), (1.5, 3)]):
        for so in kinds:
            params = SamplingParams(
                temperature=temperature, seed=seed, max_tokens=48, structured_outputs=so
            )
            batch.append((PROMPTS[i % len(PROMPTS)], params))
    return batch


def _check_outputs(batch, outputs) -> None:
    finished = {"json": 0, "regex": 0, "choice": 0}
    for (_, params), out in zip(batch, outputs):
        so, completion = params.structured_outputs, out.outputs[0]
        if completion.finish_reason == "stop":
            assert satisfies(so, completion.text), (so.kind, completion.text)
            finished[so.kind] += 1
    # Bounded constraints always finish; the schema is small enough to finish mostly.
    assert finished["regex"] == finished["choice"] == len(batch) // 3, finished
    assert finished["json"] >= len(batch) // 6, finished


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_every_stopped_output_satisfies_its_constraint(llm, backend):
    batch = _constrained_batch(backend)
    outputs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    _check_outputs(batch, outputs)


def test_padded_vocab_model_auto_backend(padded_model_dir):
    """Logits wider than the tokenizer: the padding ids are never allowed."""
    llm = _llm(padded_model_dir)
    batch = _constrained_batch("auto")[:6]
    outputs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    for (_, params), out in zip(batch, outputs):
        completion = out.outputs[0]
        assert max(completion.token_ids) < 416
        if completion.finish_reason == "stop":
            assert satisfies(params.structured_outputs, completion.text), completion.text


def test_unconstrained_requests_unchanged_by_constrained_neighbours(llama_dir):
    llm = _llm(llama_dir)
    plain = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.8, seed=5, max_tokens=12),
    ]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    core = llm.llm_engine.client.core
    assert core.structured_output_manager._pool is None  # unconstrained runs paid nothing
    constrained = [params for _, params in _constrained_batch("auto")[:3]]
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2], PROMPTS[2]],
        [plain[0], constrained[0], plain[1], constrained[1], constrained[2]],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    for out, so in zip((mixed[1], mixed[3], mixed[4]), constrained):
        if out.outputs[0].finish_reason == "stop":
            assert satisfies(so.structured_outputs, out.outputs[0].text)


def test_terminated_grammar_stops_even_with_ignore_eos(llm):
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=30,
            ignore_eos=True,
            structured_outputs=StructuredOutputsParams(choice=CHOICES, backend=b),
        )
        for s in range(2)
        for b in ("xgrammar", "llguidance")
    ]
    for out in llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text in CHOICES


@pytest.mark.parametrize(
    "so, message",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "properties/a/type"),
        ({"regex": "[a-z"}, "regex"),
        ({"grammar": "root ::= missing_rule"}, "missing_rule"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
    ],
)
def test_bad_constraints_raise_before_reaching_the_core(llm, so, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=so), use_tqdm=False)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3  # the engine is fine afterwards


def test_core_compile_failure_aborts_only_that_request(llm):
    """Bypassing the front end's check, the core finishes the request with an error."""
    core = llm.llm_engine.client.core
    bad = StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1})
    core.add_request(EngineCoreRequest("bad", [5, 6, 7], SamplingParams(structured_outputs=bad)))
    core.add_request(
        EngineCoreRequest("good", [5, 6, 7], SamplingParams(max_tokens=4), max_tokens=4)
    )
    finished = {}
    for _ in range(200):
        for out in core.step().outputs:
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == 2:
            break
    assert finished["bad"].finish_reason == FinishReason.ABORT
    assert "structured output error" in finished["bad"].stop_reason
    assert "minimum" in finished["bad"].stop_reason
    assert finished["good"].finish_reason == FinishReason.LENGTH
    assert not core.has_unfinished_requests()


def test_compiling_grammar_does_not_block_other_requests(llm):
    """While one request's grammar compiles, the others run; then it runs too."""
    import threading

    core = llm.llm_engine.client.core
    manager = core.structured_output_manager
    release = threading.Event()
    real_compile = manager._compile

    def slow_compile(params):
        assert release.wait(30)
        return real_compile(params)

    manager._compile = slow_compile
    try:
        so = StructuredOutputsParams(choice=CHOICES)
        core.add_request(
            EngineCoreRequest(
                "slow",
                [5, 6, 7],
                SamplingParams(temperature=0.0, structured_outputs=so, max_tokens=16),
                max_tokens=16,
            )
        )
        core.add_request(
            EngineCoreRequest(
                "free", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5), max_tokens=5
            )
        )
        done = {}
        for _ in range(50):
            for out in core.step().outputs:
                done.setdefault(out.request_id, []).append(out)
            if any(o.finished for o in done.get("free", [])):
                break
        assert any(o.finished for o in done["free"]) and "slow" not in done
        release.set()
        for _ in range(500):
            for out in core.step().outputs:
                done.setdefault(out.request_id, []).append(out)
            if any(o.finished for o in done.get("slow", [])):
                break
        tokens = [t for o in done["slow"] for t in o.new_token_ids]
        assert done["slow"][-1].finish_reason == FinishReason.STOP
        text = llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
        assert text in CHOICES
    finally:
        release.set()
        manager._compile = real_compile


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice_yields_valid_calls(llm, tool_choice):
    from engine.structured_output.openai_fields import structured_outputs_from_request
    from engine.structured_output.tool_choice import ToolCallHandler

    body = {"tools": TOOLS, "tool_choice": tool_choice}
    so = structured_outputs_from_request(body)
    assert so.disable_any_whitespace  # random weights would pad with whitespace forever
    # Random weights: whether a call closes within max_tokens depends on the draw, so
    # every prompt runs greedy and under several seeds; every call that closes is checked.
    settings = [(0.0, None)] + [(t, s) for s in range(1, 4) for t in (0.8, 1.2)]
    prompts = [p for p in PROMPTS for _ in settings]
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=64, structured_outputs=so)
        for _ in PROMPTS for t, s in settings
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    handler = ToolCallHandler.from_request(TOOLS, tool_choice)
    parameters = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    stopped = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert stopped
    for completion in stopped:
        extracted = handler.extract(completion.text)
        assert extracted.tool_calls and extracted.content is None, completion.text
        for call in extracted.tool_calls:
            schema = parameters[call.name] or {"type": "object", "properties": {}}
            jsonschema.validate(json.loads(call.arguments), schema)
