"""Structured outputs under speculative decoding, on the demo model.

A draft (n-gram lookup, the demo draft model, the demo EAGLE head) knows nothing of the
request's grammar: the grammar bitmask must be applied at every draft position (the core
fills one mask row per draft, assuming the drafts before it accepted, then rolls the
matcher back), so a draft the grammar forbids is rejected and the bonus token obeys the
grammar too. So every output -- greedy or sampled at temperature 1.0, in batches mixing
constrained and unconstrained requests -- must validate (jsonschema, ``re.fullmatch``,
choice membership, the grammar's regex twin), and greedy outputs must equal the same
engine without speculation token for token (and logprob for logprob).

Prompts repeat a valid instance of their constraint so n-gram lookup has matches, and
the JSON schema forces a run of identical enum values whose own repetition the lookup
finds; a recorder on the scheduler proves drafts were proposed to, and accepted for,
the *constrained* requests themselves, and ``get_spec_decoding_stats()`` that drafts were
verified during the batch.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine import SamplingParams
from engine.structured_output import StructuredOutputsParams
from tests.helpers.structured import satisfies
from tests.spec_decode.test_spec_decode_e2e import (
    METHODS,
    Zoo,
    assert_drafts_used,
    assert_nothing_leaked,
    assert_outputs_equal,
    core,
    run,
    spec_stats,
)

MAX_MODEL_LEN = 256

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        # A bounded run of one enum value: the output repeats itself, so lookup matches.
        "tags": {"type": "array", "items": {"enum": ["go"]}, "minItems": 3, "maxItems": 6},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                              "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags", "scores"],
    "additionalProperties": False,
}
JSON_EXAMPLE = '{"name":"ann","age":7,"color":"red","tags":["go","go","go","go"],"scores":[1,2]}'
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
WORDS = r"[a-z]{1,6}(,[a-z]{1,6}){2,4}"
CHOICES = ["alpha", "beta", "gamma"]
GBNF = 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [0-9] | [1-9] [0-9]'
GBNF_RE = r"\((\d|[1-9]\d)(\+(\d|[1-9]\d)){0,2}\)"
LARK = 'start: "<" NUM ("|" NUM)~0..2 ">"\nNUM: /[0-9]{1,3}/'
LARK_RE = r"<\d{1,3}(\|\d{1,3}){0,2}>"

# (name, prompt, constraint kwargs or None for an unconstrained request, max_tokens)
CASES: list[tuple[str, str, dict[str, Any] | None, int]] = [
    ("json", f"Record: {JSON_EXAMPLE}\nRecord: {JSON_EXAMPLE}\nRecord: ",
     {"json": SCHEMA, "disable_any_whitespace": True}, 160),
    ("plain-cat", "The cat sat on the mat. The cat sat on the mat. The cat sat on the", None,
     24),
    ("date", "Dates: 2024-01-15, 2024-01-15, 2024-01-15, ", {"regex": DATE}, 24),
    ("words", "abc,de,fgh abc,de,fgh abc,de,fgh ", {"regex": WORDS}, 48),
    ("plain-count", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", None, 24),
    ("choice", "beta beta beta beta ", {"choice": CHOICES}, 16),
    ("gbnf", "(1+2) (1+2) (1+2) (", {"grammar": GBNF}, 24),
]
LARK_CASE = ("lark", "<1|2> <1|2> <1|2> <", {"grammar": LARK}, 24)
GRAMMAR_RES = {GBNF: GBNF_RE, LARK: LARK_RE}
BACKENDS = ["xgrammar", "llguidance"]


def _constraint(kwargs: dict[str, Any] | None, backend: str) -> StructuredOutputsParams | None:
    return None if kwargs is None else StructuredOutputsParams(**kwargs, backend=backend)


def _validates(so: StructuredOutputsParams, text: str) -> bool:
    return satisfies(so, text, GRAMMAR_RES)


def assert_valid(params: list[SamplingParams], outs) -> None:
    """Every constrained output finished by its grammar ("stop") and validates."""
    bad = []
    for p, out in zip(params, outs):
        so, o = p.structured_outputs, out.outputs[0]
        if so is None:
            continue
        if o.finish_reason != "stop" or not _validates(so, o.text):
            bad.append((so.kind, o.finish_reason, o.stop_reason, o.text, list(o.token_ids)))
    assert not bad, "constrained outputs that do not validate:\n" + "\n".join(map(repr, bad))


class ConstrainedDrafts:
    """Wraps the scheduler's ``update_from_output``: drafts verified and accepted for
    the requests that have a structured-output constraint."""

    def __init__(self, llm, monkeypatch) -> None:
        scheduler = core(llm).scheduler
        original = scheduler.update_from_output
        self.drafts = self.accepted = 0

        def update(so, mro):
            for i, rid in enumerate(mro.req_ids):
                request = scheduler.requests.get(rid)
                drafts = so.scheduled_spec_decode_tokens.get(rid)
                if (request is None or request.sampling_params.structured_outputs is None
                        or not drafts or not mro.sampled_token_ids[i]):
                    continue
                self.drafts += len(drafts)
                self.accepted += len(mro.sampled_token_ids[i]) - 1
            return original(so, mro)

        monkeypatch.setattr(scheduler, "update_from_output", update)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, model_dir_factory):
    zoo = Zoo(tmp_path_factory.mktemp("spec_structured"), model_dir_factory)
    yield zoo
    zoo._llms.clear()


def _llm(zoo: Zoo, method: str | None):
    return zoo.llm("demo", method, max_model_len=MAX_MODEL_LEN)


def _cases(backend: str):
    # Lark grammars are llguidance's alone.
    return CASES + ([LARK_CASE] if backend == "llguidance" else [])


def _batch(temperature: float, backend: str, logprobs: int | None = None):
    prompts, params = [], []
    for i, (_, prompt, kwargs, max_tokens) in enumerate(_cases(backend)):
        prompts.append(prompt)
        params.append(SamplingParams(
            temperature=temperature, seed=None if temperature == 0 else 100 + i,
            max_tokens=max_tokens, logprobs=logprobs,
            structured_outputs=_constraint(kwargs, backend)))
    return prompts, params


@pytest.fixture(scope="module")
def plain_greedy(zoo):
    """backend -> the greedy batch's outputs without speculation (computed once)."""
    cache = {}

    def get(backend: str):
        if backend not in cache:
            prompts, params = _batch(0.0, backend, logprobs=1)
            cache[backend] = run(_llm(zoo, None), prompts, params)
            assert_valid(params, cache[backend])
        return cache[backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_greedy_constrained_equals_no_speculation(zoo, plain_greedy, method, backend,
                                                  monkeypatch):
    base, llm = _llm(zoo, None), _llm(zoo, method)
    want = plain_greedy(backend)
    prompts, params = _batch(0.0, backend, logprobs=1)
    recorder = ConstrainedDrafts(llm, monkeypatch)
    spec_stats(llm)
    got = run(llm, prompts, params)
    stats = spec_stats(llm)
    assert_valid(params, got)
    for (name, *_), g, w in zip(_cases(backend), got, want):
        if name.startswith("plain"):
            assert_outputs_equal(base, [g], [w])
            continue
        g, w = g.outputs[0], w.outputs[0]
        assert list(g.token_ids) == list(w.token_ids), (
            f"{name}:\ngot  {g.text!r} {list(g.token_ids)}\nwant {w.text!r} {list(w.token_ids)}")
        assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason,
                                                              w.stop_reason)
        assert len(g.logprobs) == len(g.token_ids), name  # one entry per token
        for j, (lp_g, lp_w) in enumerate(zip(g.logprobs, w.logprobs)):
            assert lp_g.keys() == lp_w.keys(), (name, j)
            for tok in lp_w:
                assert abs(lp_g[tok].logprob - lp_w[tok].logprob) < 1e-4, (name, j, tok)
    assert_drafts_used(stats, accepted=True)
    assert recorder.drafts > 0, f"no draft was verified for a constrained request: {stats}"
    assert recorder.accepted > 0, (
        f"constrained requests accepted none of their {recorder.drafts} drafts: {stats}")
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_sampled_constrained_outputs_validate(zoo, method, backend, monkeypatch):
    """Temperature 1.0, seeded: the draft proposes from its own (unconstrained)
    distribution, the rejection sampler verifies against the masked target one. Every
    constrained output validates, and the same seeds give the same tokens again (no
    matcher state leaks from the draft-row fills and rollbacks of the first run)."""
    llm = _llm(zoo, method)
    prompts, params = _batch(1.0, backend)
    recorder = ConstrainedDrafts(llm, monkeypatch)
    spec_stats(llm)
    got = run(llm, prompts, params)
    stats = spec_stats(llm)
    assert_valid(params, got)
    for out, p in zip(got, params):
        assert 0 < len(out.outputs[0].token_ids) <= p.max_tokens
    assert_drafts_used(stats, accepted=True)
    assert recorder.drafts > 0 and recorder.accepted > 0, (recorder.drafts, recorder.accepted)
    again = run(llm, prompts, params)
    assert [list(o.outputs[0].token_ids) for o in again] == [
        list(o.outputs[0].token_ids) for o in got]
    assert_nothing_leaked(llm)


# -- llguidance: a grammar completed inside an accepted run -------------------------------
FORCED_PROMPT = "(0) (0) (0) (0) ("  # every method drafts "0", ")" -- which the target keeps
FORCED = [("regex", {"regex": r"\(\d\)"}),
          ("choice", {"choice": ["(0)", "(1)"]}),
          ("lark", {"grammar": LARK})]


@pytest.mark.parametrize("method", METHODS)
def test_llguidance_grammar_completed_by_an_accepted_draft(zoo, method):
    """With llguidance a matcher is *stopped* as soon as the grammar is complete (no EOS
    needed; without speculation the request stops right there, with no EOS token).
    Here the drafts "0", ")" complete the grammar and the bonus token is EOS (the only
    token the mask allows after a complete grammar), so the step emits ["0", ")", EOS]
    at once. The output must still be the non-speculative one: finish "stop", the same
    token ids (no trailing EOS), and it must validate. (Failed before 770b9d0 with
    finish "abort": the scheduler fed all of [")", EOS] to the stopped matcher.)"""
    base, llm = _llm(zoo, None), _llm(zoo, method)
    params = [SamplingParams(temperature=0.0, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(**kw,
                                                                        backend="llguidance"))
              for _, kw in FORCED]
    prompts = [FORCED_PROMPT] * len(params)
    want = run(base, prompts, params)
    assert_valid(params, want)
    spec_stats(llm)
    got = run(llm, prompts, params)
    assert_drafts_used(spec_stats(llm), accepted=True)
    problems = []
    for (name, _), g, w in zip(FORCED, got, want):
        g, w = g.outputs[0], w.outputs[0]
        if (g.finish_reason, list(g.token_ids)) != (w.finish_reason, list(w.token_ids)):
            problems.append(f"{name}: got {g.finish_reason} {g.stop_reason!r} {list(g.token_ids)}"
                            f", want {w.finish_reason} {list(w.token_ids)}")
    assert not problems, "\n".join(problems)
    assert_valid(params, got)
    assert_nothing_leaked(llm)
