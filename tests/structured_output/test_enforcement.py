"""What a JSON schema compiles to when a backend cannot enforce all of it: relaxed (only
the unsupported keywords dropped, and named) or, with ``strict``, refused naming them;
the compile cache and its counters; the engine-wide ``--structured-outputs-config``."""

from __future__ import annotations

import time

import pytest
import torch
from so_helpers import allowed_ids

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams, check_compilable
from engine.structured_output.enforcement import (
    NotEnforceableError,
    check_strict,
    plan_constraint,
    relaxed_keywords,
)
from engine.structured_output.manager import StructuredOutputManager
from engine.structured_output.openai_fields import (
    RELAXED_HEADER,
    apply_server_defaults,
    relaxed_headers,
    structured_outputs_from_request,
)
from engine.structured_output.selection import backend_class

VOCAB = 416
# Object-rooted, with a composition beside "type": xgrammar's best effort used to take
# the branches alone, and the second branch (an array of numbers) allowed [1.0].
OBJECT_ANY_OF = {
    "type": "object",
    "anyOf": [{"properties": {"a": {"type": "number"}}}, {"items": {"type": "number"}}],
}
OBJECT_ONE_OF_ROOT = {
    "type": "object",
    "oneOf": [{"properties": {"a": {"type": "number"}}}, {"items": {"type": "number"}}],
}
# Object-rooted, with a oneOf beside its properties whose branches overlap (both allow
# {"a": 1, "b": 1}): neither backend enforces it exactly.
OBJECT_ONE_OF = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    "additionalProperties": False,
}
# uniqueItems is beyond both backends; the rest (root type, required, enum, item types)
# is not.
UNIQUE = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "uniqueItems": True},
        "n": {"type": "integer"},
    },
    "required": ["tags", "n"],
    "additionalProperties": False,
}
NAMED_GROUPS = {"type": "string", "pattern": r"^(?<year>\d{4})-(?<month>\d{2})$"}


@pytest.fixture(scope="module")
def backends(tokenizer):
    return {
        name: backend_class(name)(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 1)
        for name in ("xgrammar", "llguidance")
    }


def _accepts(backends, tokenizer, plan, text: str) -> bool:
    """Whether the plan's compiled grammar takes ``text`` and then may stop."""
    grammar = backends[plan.backend].compile(plan.params, plan.lenient)
    if not grammar.accept_tokens(tokenizer.encode(text, add_special_tokens=False)):
        return False
    if grammar.is_terminated():
        return True
    mask = torch.zeros((1, (len(tokenizer) + 31) // 32), dtype=torch.int32)
    grammar.fill_bitmask(mask, 0)
    return tokenizer.eos_token_id in allowed_ids(mask, 0, len(tokenizer))


# -- the two failures of the issue -----------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_object_rooted_composition_never_yields_an_array(backends, tokenizer, backend):
    plan = plan_constraint(StructuredOutputsParams(json=OBJECT_ANY_OF, backend=backend,
                                                   disable_any_whitespace=True))
    assert plan.enforced  # xgrammar: "type" copied into each branch, exactly
    assert not _accepts(backends, tokenizer, plan, "[1.0]")
    assert _accepts(backends, tokenizer, plan, "{}")
    one_of = plan_constraint(StructuredOutputsParams(json=OBJECT_ONE_OF_ROOT, backend=backend,
                                                     disable_any_whitespace=True))
    assert one_of.relaxed == ("oneOf",)  # both branches take {}: not loosened silently
    assert not _accepts(backends, tokenizer, one_of, "[1.0]")
    assert _accepts(backends, tokenizer, one_of, "{}")


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_object_rooted_schema_never_yields_a_non_object(backends, tokenizer, backend):
    params = StructuredOutputsParams(json=OBJECT_ONE_OF, disable_any_whitespace=True,
                                     backend=backend)
    plan = plan_constraint(params)
    assert plan.relaxed == ("oneOf",) and not plan.lenient  # said, not silent
    assert plan.params.json.get("type") == "object" or all(
        b.get("type") == "object" for b in plan.params.json["anyOf"])
    for text in ("[1.0]", "1", '"a"', "null"):
        assert not _accepts(backends, tokenizer, plan, text), text
    sep = ", " if plan.backend == "xgrammar" else ","  # xgrammar's compact separators
    colon = ": " if plan.backend == "xgrammar" else ":"
    assert _accepts(backends, tokenizer, plan, "{" + f'"a"{colon}1' + "}")
    assert not _accepts(backends, tokenizer, plan, "{}")  # one of the branches is required
    assert not _accepts(backends, tokenizer, plan, "{" + f'"c"{colon}1' + "}")
    assert _accepts(backends, tokenizer, plan, "{" + f'"a"{colon}1{sep}"b"{colon}2' + "}")


def test_one_of_is_enforced_when_the_branches_are_disjoint():
    plan = plan_constraint(StructuredOutputsParams(
        json={"oneOf": [{"type": "integer"}, {"type": "string"}]}))
    assert plan.enforced and plan.relaxed == ()


def test_overlapping_one_of_is_reported_or_refused():
    schema = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}
    assert relaxed_keywords(StructuredOutputsParams(json=schema)) == ("oneOf",)
    with pytest.raises(NotEnforceableError, match="unsupported keyword.*oneOf") as info:
        check_compilable(StructuredOutputsParams(json=schema, strict=True))
    assert info.value.keywords == ("oneOf",) and "structured output" in str(info.value)


# -- relaxed: only the unsupported keywords go ------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_relaxed_schema_keeps_type_required_enum_and_items(backends, tokenizer, backend):
    plan = plan_constraint(StructuredOutputsParams(json=UNIQUE, disable_any_whitespace=True,
                                                   backend=backend))
    assert plan.relaxed == ("uniqueItems",) and not plan.lenient
    sep, colon = (", ", ": ") if plan.backend == "xgrammar" else (",", ":")

    def doc(**fields: str) -> str:
        return "{" + sep.join(f'"{k}"{colon}{v}' for k, v in fields.items()) + "}"

    assert _accepts(backends, tokenizer, plan, doc(tags=f'["x"{sep}"x"]', n="1"))  # relaxed
    assert not _accepts(backends, tokenizer, plan, doc(n="1"))  # required
    assert not _accepts(backends, tokenizer, plan, doc(tags='["z"]', n="1"))  # enum
    assert not _accepts(backends, tokenizer, plan, doc(tags='["x"]', n='"1"'))  # type
    assert not _accepts(backends, tokenizer, plan, "[1.0]")  # root type


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "string", "pattern": "(?<=a)b"}, "pattern"),  # look-behind
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref"),
    ],
)
def test_unenforceable_keywords_are_named(schema, keyword):
    plan = plan_constraint(StructuredOutputsParams(json=schema))
    assert keyword in plan.relaxed and not plan.lenient
    with pytest.raises(NotEnforceableError, match=keyword.replace("$", r"\$")):
        check_strict(plan, StructuredOutputsParams(json=schema, strict=True))


def test_a_fully_enforced_schema_is_not_refused_when_strict():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert check_compilable(StructuredOutputsParams(json=schema, strict=True)) == (
        "xgrammar", False)
    # xgrammar lowers allOf / $ref beside keywords exactly: still enforced in full.
    lowered = {"$defs": {"p": {"type": "object", "properties": {"a": {"type": "integer"}}}},
               "allOf": [{"$ref": "#/$defs/p"}, {"required": ["a"]}]}
    assert check_compilable(StructuredOutputsParams(json=lowered, strict=True,
                                                    backend="xgrammar")) == ("xgrammar", False)


# -- ECMA-262 regexes reach the backends -----------------------------------------------------
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_named_group_pattern_is_accepted_and_enforced(backends, tokenizer, backend):
    plan = plan_constraint(StructuredOutputsParams(json=NAMED_GROUPS, backend=backend))
    assert plan.enforced
    assert _accepts(backends, tokenizer, plan, '"2024-05"')
    assert not _accepts(backends, tokenizer, plan, '"2024-5"')
    regex = plan_constraint(StructuredOutputsParams(regex=r"(?<y>\d{4})-(?<m>\d{2})",
                                                    backend=backend))
    assert _accepts(backends, tokenizer, regex, "2024-05")
    assert not _accepts(backends, tokenizer, regex, "2024-5")


def test_ecma_invalid_pattern_is_refused():
    with pytest.raises(ValueError, match="ECMA-262"):
        StructuredOutputsParams(json={"type": "string", "pattern": r"^(?P<year>\d{4})$"})
    with pytest.raises(ValueError, match="ECMA-262"):
        StructuredOutputsParams(json={"type": "string", "pattern": r"^\d+\Z"})


def test_property_escapes_go_to_llguidance_only():
    # xgrammar reads [\p{L}] as the letters p { L }: it must never get one.
    plan = plan_constraint(StructuredOutputsParams(json={"type": "string", "pattern": r"^\p{L}+$"}))
    assert plan.backend == "llguidance" and plan.enforced
    forced = plan_constraint(StructuredOutputsParams(
        json={"type": "string", "pattern": r"^\p{L}+$"}, backend="xgrammar"))
    assert forced.relaxed == ("pattern",)


# -- request fields and server defaults ------------------------------------------------------
def test_strict_from_openai_fields():
    body = {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "u", "schema": UNIQUE, "strict": True}}}
    assert structured_outputs_from_request(body).strict is True
    body["response_format"]["json_schema"]["strict"] = False
    assert structured_outputs_from_request(body).strict is False
    assert structured_outputs_from_request({"structured_outputs": {"json": UNIQUE,
                                                                  "strict": True}}).strict
    tools = [{"type": "function", "function": {"name": "f", "parameters": UNIQUE,
                                               "strict": True}}]
    forced = structured_outputs_from_request(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert forced.strict is True
    with pytest.raises(ValueError, match="strict must be a boolean"):
        structured_outputs_from_request({"response_format": {
            "type": "json_schema", "json_schema": {"schema": UNIQUE, "strict": "yes"}}})


def test_server_defaults_fill_what_the_request_leaves_unset():
    from engine.core.config import StructuredOutputsConfig

    config = StructuredOutputsConfig.from_value(
        '{"backend": "guidance", "disable_any_whitespace": true, "strict": true}')
    assert config.backend == "llguidance"
    params = apply_server_defaults(StructuredOutputsParams(json=UNIQUE), config)
    assert (params.backend, params.disable_any_whitespace, params.strict) == (
        "llguidance", True, True)
    mine = StructuredOutputsParams(json=UNIQUE, backend="xgrammar",
                                   disable_any_whitespace=False, strict=False)
    assert apply_server_defaults(mine, config) == mine  # the request's own values win
    assert apply_server_defaults(None, config) is None
    with pytest.raises(ValueError):
        StructuredOutputsConfig.from_value({"backend": "outlines"})
    with pytest.raises(ValueError, match="JSON object"):
        StructuredOutputsConfig.from_value("[1]")


def test_relaxed_header():
    assert relaxed_headers(("oneOf", "patternProperties")) == {
        RELAXED_HEADER: "oneOf,patternProperties"}
    assert relaxed_headers(()) == {} and relaxed_headers(None) == {}


def test_cli_option_and_engine_config(llama_dir):
    import click

    from engine.cli.options import ENGINE_OPTION_NAMES, parse_structured_outputs_config
    from engine.core.engine_args import EngineArgs

    assert "structured_outputs_config" in ENGINE_OPTION_NAMES
    assert parse_structured_outputs_config(None, None, '{"backend": "xgrammar"}') == {
        "backend": "xgrammar"}
    for bad in ('{"backend": "outlines"}', "{nope", '{"reasoning": 1}'):
        with pytest.raises(click.BadParameter):
            parse_structured_outputs_config(None, None, bad)
    config = EngineArgs(model=str(llama_dir), structured_outputs_config={
        "backend": "llguidance", "disable_any_whitespace": True}).create_engine_config()
    assert config.structured_outputs.backend == "llguidance"
    assert config.structured_outputs.disable_any_whitespace
    round_trip = type(config).model_validate_json(config.model_dump_json())
    assert round_trip.structured_outputs == config.structured_outputs
    manager = StructuredOutputManager.from_engine_config(config, VOCAB)
    assert manager.default_backend == "llguidance" and manager.default_disable_any_whitespace


# -- the manager: cache, counters, engine defaults -------------------------------------------
def _request(rid: str) -> Request:
    return Request(rid, [1, 2], SamplingParams())


def _wait(mgr: StructuredOutputManager, rid: str, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        failures = mgr.pop_failures()
        if failures or mgr.is_ready(_request(rid)):
            return failures
        mgr.wait_for_compiles(0.05)
    raise AssertionError("compile did not finish")


def test_compile_cache_hits_and_compile_time(tokenizer):
    mgr = StructuredOutputManager.from_tokenizer(tokenizer, VOCAB, num_threads=1)
    try:
        schema = {"type": "object", "properties": {"q": {"type": "integer"}}}
        mgr.add_request("a", StructuredOutputsParams(json=schema))
        assert _wait(mgr, "a") == []
        # The same constraint, keys in another order: a cache hit.
        mgr.add_request("b", StructuredOutputsParams(json=dict(reversed(list(schema.items())))))
        assert _wait(mgr, "b") == []
        snap = mgr.stats.snapshot()
        assert (snap["misses"], snap["hits"], snap["count"]) == (1, 1, 2)
        assert snap["sum"] > 0 and snap["buckets"][-1][1] == 2
        assert mgr.accept_tokens("b", tokenizer.encode('{"q"', add_special_tokens=False))
    finally:
        mgr.shutdown()


def test_engine_strict_default_fails_the_compile_naming_the_keyword(tokenizer):
    mgr = StructuredOutputManager.from_tokenizer(tokenizer, VOCAB, strict=True)
    try:
        mgr.add_request("u", StructuredOutputsParams(json=UNIQUE))
        failures = _wait(mgr, "u")
        assert failures and "uniqueItems" in failures[0][1] and "strict" in failures[0][1]
        mgr.add_request("ok", StructuredOutputsParams(json=UNIQUE, strict=False))  # the request's
        assert _wait(mgr, "ok") == []
    finally:
        mgr.shutdown()


def test_engine_whitespace_default(tokenizer):
    schema = {"type": "array", "items": {"type": "integer"}}
    space = tokenizer.encode(" ", add_special_tokens=False)[0]
    for compact, rid in ((True, "c"), (False, "f")):
        mgr = StructuredOutputManager.from_tokenizer(
            tokenizer, VOCAB, disable_any_whitespace=compact, backend="llguidance")
        try:
            mgr.add_request(rid, StructuredOutputsParams(json=schema))
            assert _wait(mgr, rid) == []
            assert mgr.accept_tokens(rid, tokenizer.encode("[", add_special_tokens=False))
            allowed = allowed_ids(mgr.grammar_bitmask([rid]), 0, VOCAB)
            assert (space in allowed) is not compact
        finally:
            mgr.shutdown()


def test_relaxed_compile_is_logged(tokenizer, caplog):
    mgr = StructuredOutputManager.from_tokenizer(tokenizer, VOCAB)
    try:
        with caplog.at_level("WARNING", logger="engine.structured_output.manager"):
            mgr.add_request("u", StructuredOutputsParams(json=OBJECT_ONE_OF))
            assert _wait(mgr, "u") == []
        assert "not enforced: oneOf" in caplog.text
    finally:
        mgr.shutdown()


def test_metrics_render_structured_output_families():
    from engine.entrypoints.openai.metrics import ServerMetrics

    plan_constraint(StructuredOutputsParams(json={"type": "string", "maxLength": 7}))
    metrics = ServerMetrics("m")
    metrics.observe_structured_output(("oneOf", "uniqueItems"))
    metrics.observe_structured_output(())
    metrics.observe_structured_output(None)
    text = metrics.render().decode()
    for line in (
        'engine:structured_output_compile_seconds_bucket{le="+Inf",model_name="m",stage="check"}',
        'engine:structured_output_cache_hits_total{model_name="m",stage="check"}',
        'engine:structured_output_cache_misses_total{model_name="m",stage="check"}',
        'engine:structured_output_requests_total{enforcement="relaxed",model_name="m"} 1.0',
        'engine:structured_output_requests_total{enforcement="full",model_name="m"} 1.0',
        'engine:structured_output_relaxed_keywords_total{keyword="uniqueItems",model_name="m"} 1.0',
    ):
        assert line in text, line
    misses = next(ln for ln in text.splitlines()
                  if ln.startswith("engine:structured_output_cache_misses_total"))
    assert float(misses.split()[-1]) >= 1
