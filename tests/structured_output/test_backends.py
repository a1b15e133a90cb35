"""Both backends on the tiny byte-level tokenizer: masks against hand-derived token sets,
accept / rollback / terminate / reset, bulk fills equal single fills, vocab padding."""

from __future__ import annotations

import pytest
import torch
from so_helpers import allowed_ids, new_bitmask

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.selection import backend_class

BACKENDS = ["xgrammar", "llguidance"]
PADDED_VOCAB = 416  # logits wider than the 384-id tokenizer


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    cls = backend_class(request.param)
    return cls(tokenizer, PADDED_VOCAB, [tokenizer.eos_token_id], num_threads=1)


def _text_tokens(tokenizer) -> dict[int, str]:
    """Non-special token id -> its text (ids of incomplete UTF-8 bytes left out)."""
    special = set(tokenizer.all_special_ids)
    out = {}
    for t in range(len(tokenizer)):
        text = tokenizer.decode([t])
        if t not in special and text and "\ufffd" not in text:
            out[t] = text
    return out


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_choice_first_token_mask_is_every_prefix_token(backend, tokenizer):
    choices = ["yes", "no", "maybe later"]
    grammar = backend.compile(StructuredOutputsParams(choice=choices))
    bitmask = new_bitmask(1, PADDED_VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    expected = {
        t for t, text in _text_tokens(tokenizer).items() if any(c.startswith(text) for c in choices)
    }
    assert allowed_ids(bitmask, 0, PADDED_VOCAB) == expected
    assert not allowed_ids(bitmask, 0, PADDED_VOCAB) & set(range(len(tokenizer), PADDED_VOCAB))


def test_accept_rollback_terminate_reset(backend, tokenizer):
    eos = tokenizer.eos_token_id
    grammar = backend.compile(StructuredOutputsParams(regex=r"ab+c"))
    ids = _encode(tokenizer, "abbc")
    assert not grammar.is_terminated()
    assert grammar.accept_tokens(ids[:-1])
    grammar.rollback(len(ids) - 1)
    assert grammar.accept_tokens(ids)
    bitmask = new_bitmask(1, PADDED_VOCAB)
    if not grammar.is_terminated():  # xgrammar: complete, waiting for the stop token
        grammar.fill_bitmask(bitmask, 0)
        assert allowed_ids(bitmask, 0, PADDED_VOCAB) == {eos}
        assert grammar.accept_tokens([eos])
    assert grammar.is_terminated()
    grammar.reset()
    assert not grammar.is_terminated()
    assert not grammar.accept_tokens(_encode(tokenizer, "x"))


def test_validate_tokens_leaves_state(backend, tokenizer):
    grammar = backend.compile(StructuredOutputsParams(regex=r"[0-9]{2}-[0-9]{2}"))
    ids = _encode(tokenizer, "12-34")
    bad = ids[:2] + _encode(tokenizer, "x")
    assert grammar.validate_tokens(ids) == len(ids)
    assert grammar.validate_tokens(bad) == 2
    assert grammar.accept_tokens(ids)


def test_bulk_fill_equals_single_fills(backend, tokenizer):
    specs = [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(regex=r"[a-c]+"),
        StructuredOutputsParams(choice=["left", "right"]),
    ]
    grammars = [backend.compile(p) for p in specs]
    grammars[0].accept_tokens(_encode(tokenizer, '{"a'))
    single = new_bitmask(5, PADDED_VOCAB)
    for row, g in zip((4, 0, 2), grammars):
        g.fill_bitmask(single, row)
    bulk = new_bitmask(5, PADDED_VOCAB)
    backend.fill_bitmasks(grammars, [4, 0, 2], bulk)
    for row in (0, 2, 4):
        assert torch.equal(bulk[row], single[row])
    assert (bulk[[1, 3]] == -1).all()  # rows not asked for stay untouched


def test_rejected_token_reports_false(backend, tokenizer):
    grammar = backend.compile(StructuredOutputsParams(choice=["yes", "no"]))
    assert not grammar.accept_tokens(_encode(tokenizer, "x"))


@pytest.mark.parametrize(
    "spec",
    [
        {"grammar": 'root ::= "a" ("b" | "c")*'},
        {"grammar": 'start: "a" ("b" | "c")*'},
    ],
)
def test_ebnf_and_lark_grammars(backend, tokenizer, spec):
    grammar = backend.compile(StructuredOutputsParams(**spec))
    assert grammar.accept_tokens(_encode(tokenizer, "abcb"))
    assert not grammar.validate_tokens(_encode(tokenizer, "d"))


def test_structural_tag_constrains_only_inside_the_tag(backend, tokenizer):
    tag = {
        "structures": [
            {
                "begin": "<f>",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                },
                "end": "</f>",
            }
        ],
        "triggers": ["<f"],
    }
    params = StructuredOutputsParams(structural_tag=tag)
    grammar = backend.compile(params)
    assert grammar.accept_tokens(_encode(tokenizer, 'free text <f>{"a": 12}</f> more'))
    bad = backend.compile(params)
    assert bad.validate_tokens(_encode(tokenizer, '<f>{"b"')) < len(_encode(tokenizer, '<f>{"b"'))


def test_special_tokens_never_allowed_as_text(backend, tokenizer):
    grammar = backend.compile(StructuredOutputsParams(json={"type": "string"}))
    assert grammar.accept_tokens(_encode(tokenizer, '"ab'))
    bitmask = new_bitmask(1, PADDED_VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    assert not allowed_ids(bitmask, 0, PADDED_VOCAB) & set(tokenizer.all_special_ids)
