"""StructuredOutputManager: background compiles, readiness, failures, the bulk bitmask
(row order, mixed backends, draft rows, padding), matcher advance and cleanup."""

from __future__ import annotations

import time

import pytest
import torch
from so_helpers import allowed_ids

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.structured_output.bitmask import bitmask_for_sampling_rows
from engine.structured_output.manager import StructuredOutputManager

VOCAB = 416


@pytest.fixture
def manager(tokenizer):
    mgr = StructuredOutputManager.from_tokenizer(tokenizer, VOCAB, num_threads=2)
    yield mgr
    mgr.shutdown()


def _request(rid: str) -> Request:
    return Request(rid, [1, 2], SamplingParams())


def _wait_ready(mgr: StructuredOutputManager, *rids: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(mgr.is_ready(_request(r)) for r in rids):
        assert not mgr.pop_failures(), "compile failed"
        assert time.monotonic() < deadline, "compile did not finish"
        mgr.wait_for_compiles(0.05)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_nothing_loads_before_a_constrained_request(tokenizer):
    loads = []
    mgr = StructuredOutputManager(lambda: loads.append(1) or (tokenizer, [1]), VOCAB)
    assert mgr._pool is None and not loads and not mgr.has_pending_compiles()
    mgr.shutdown()


def test_compile_ready_bitmask_accept_terminate(manager, tokenizer):
    manager.add_request("a", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request("b", StructuredOutputsParams(regex="[0-9]+", backend="llguidance"))
    _wait_ready(manager, "a", "b")
    # Order of the rows follows the ids given, whatever the backend.
    mask = manager.grammar_bitmask(["b", "a"])
    assert mask.dtype == torch.int32 and tuple(mask.shape) == (2, VOCAB // 32)
    digits = {t for t in range(len(tokenizer)) if tokenizer.decode([t]).isdigit()}
    assert allowed_ids(mask, 0, VOCAB) == digits
    assert _ids(tokenizer, "y")[0] in allowed_ids(mask, 1, VOCAB)
    assert manager.accept_tokens("a", _ids(tokenizer, "yes"))
    assert not manager.is_terminated("a")
    assert allowed_ids(manager.grammar_bitmask(["a"]), 0, VOCAB) == {tokenizer.eos_token_id}
    assert manager.accept_tokens("a", [tokenizer.eos_token_id])
    assert manager.is_terminated("a")
    assert not manager.accept_tokens("b", _ids(tokenizer, "x"))


def test_failed_compile_is_reported_once(manager):
    # Unsatisfiable: no backend compiles it.
    schema = {"type": "integer", "minimum": 5, "maximum": 1}
    manager.add_request("bad", StructuredOutputsParams(json=schema))
    deadline = time.monotonic() + 30
    failures = []
    while not failures and time.monotonic() < deadline:
        manager.wait_for_compiles(0.05)
        failures = manager.pop_failures()
    assert failures and failures[0][0] == "bad" and "minimum" in failures[0][1]
    assert not manager.is_ready(_request("bad")) and manager.pop_failures() == []


def test_auto_falls_back_when_xgrammar_cannot(manager, tokenizer):
    # xgrammar would ignore the maxLength beside a pattern; llguidance enforces it.
    schema = {"allOf": [{"type": "string"}, {"maxLength": 2, "pattern": "^[a-z]*$"}]}
    manager.add_request("u", StructuredOutputsParams(json=schema))
    _wait_ready(manager, "u")
    assert type(manager._entries["u"].backend).__name__ == "LLGuidanceBackend"
    assert manager.accept_tokens("u", _ids(tokenizer, '"ab'))
    mask = manager.grammar_bitmask(["u"])
    assert allowed_ids(mask, 0, VOCAB) == {_ids(tokenizer, '"')[0]}


def test_draft_rows_follow_the_drafts_and_leave_state(manager, tokenizer):
    manager.add_request("d", StructuredOutputsParams(regex="ab(c|d)e"))
    _wait_ready(manager, "d")
    a, b, c, x = (_ids(tokenizer, ch)[0] for ch in "abcx")
    mask = manager.grammar_bitmask(["d"], {"d": [a, b, x, c]})
    assert mask.shape[0] == 5
    assert allowed_ids(mask, 0, VOCAB) >= {a} and b not in allowed_ids(mask, 0, VOCAB)
    assert b in allowed_ids(mask, 1, VOCAB)
    assert c in allowed_ids(mask, 2, VOCAB)
    assert (mask[3:] == -1).all()  # after the rejected draft x: anything
    assert manager.accept_tokens("d", [a])  # the drafts were rolled back


def test_remove_request_cancels_and_forgets(manager):
    manager.add_request("r", StructuredOutputsParams(regex="a"))
    manager.remove_request("r")
    assert not manager.is_ready(_request("r")) and not manager.has_pending_compiles()
    manager.add_request("r", StructuredOutputsParams(regex="a"))  # the id is free again
    with pytest.raises(ValueError, match="already"):
        manager.add_request("r", StructuredOutputsParams(regex="a"))


def test_scheduled_request_without_grammar_is_an_error(manager):
    manager.add_request("w", StructuredOutputsParams(regex="a"))
    with pytest.raises(RuntimeError, match="no compiled grammar"):
        manager.grammar_bitmask(["never-added"])


def test_bitmask_for_sampling_rows():
    mask = torch.tensor([[1], [2]], dtype=torch.int32)
    out = bitmask_for_sampling_rows(mask, ["b", "d"], ["a", "b", "c", "d"])
    assert out.tolist() == [[-1], [1], [-1], [2]]
    assert bitmask_for_sampling_rows(mask, ["a", "b"], ["a", "b"]) is mask
    # A constrained request that does not sample this step (mid-prefill) is skipped.
    assert bitmask_for_sampling_rows(mask, ["x", "b"], ["b"]).tolist() == [[2]]
    assert bitmask_for_sampling_rows(mask, ["x", "y"], ["b"]) is None
    with pytest.raises(ValueError, match="rows"):
        bitmask_for_sampling_rows(mask, ["a"], ["a"])


def test_best_effort_compile_says_what_is_not_enforced(manager, tokenizer, caplog):
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    with caplog.at_level("WARNING", logger="engine.structured_output.manager"):
        manager.add_request("u", StructuredOutputsParams(json=schema))
        _wait_ready(manager, "u")
    assert "best-effort" in caplog.text and "uniqueItems" in caplog.text
    assert manager.accept_tokens("u", _ids(tokenizer, '["a"'))  # the rest is still enforced
    assert not manager.accept_tokens("u", _ids(tokenizer, ',"c"'))
