"""The worker's thread under async scheduling (executor.StepThread): steps run in the order
sent, and a step's output reaches the caller when the step sent after it starts its
forward (so the caller's Python runs while that forward computes), or at once when no
step follows."""

from __future__ import annotations

import threading

import pytest

from engine.model_executor.executor import StepThread

WAIT_S = 10.0


class FakeRunner:
    on_forward_start = None


class FakeWorker:
    """execute_model(so): waits for ``so["go"]`` (if any) before its forward starts, then
    records the order and returns ``so["out"]`` (or raises ``so["error"]``)."""

    def __init__(self) -> None:
        self.runner = FakeRunner()
        self.order: list[str] = []
        self.forward_started: dict[str, threading.Event] = {}

    def execute_model(self, so, grammar_bitmask):
        if "go" in so:
            assert so["go"].wait(WAIT_S)
        if "error" in so:
            raise so["error"]
        self.runner.on_forward_start()
        self.forward_started.setdefault(so["out"], threading.Event()).set()
        self.order.append(so["out"])
        if "hold" in so:
            assert so["hold"].wait(WAIT_S)
        return so["out"]


@pytest.fixture
def thread():
    t = StepThread()
    yield t
    t.shutdown()


def test_a_step_is_handed_over_as_the_next_one_starts_its_forward(thread):
    worker = FakeWorker()
    first_may_end, second_may_start = threading.Event(), threading.Event()
    first = thread.submit_step(worker, {"out": "a", "hold": first_may_end}, None)
    second = thread.submit_step(worker, {"out": "b", "go": second_may_start}, None)
    first_may_end.set()
    # "a" ended, but "b" was sent before it ended and has not started its forward.
    assert not first.done()
    assert not second.done()
    second_may_start.set()
    assert first.result(WAIT_S) == "a"
    assert second.result(WAIT_S) == "b"  # nothing follows it: handed over at its end
    assert worker.order == ["a", "b"]
    assert worker.runner.on_forward_start is None  # unhooked after every step


def test_a_lone_step_is_handed_over_when_it_ends(thread):
    worker = FakeWorker()
    assert thread.submit_step(worker, {"out": "a"}, None).result(WAIT_S) == "a"


def test_a_failing_step_hands_over_the_one_before_and_raises(thread):
    worker = FakeWorker()
    first_may_end = threading.Event()
    first = thread.submit_step(worker, {"out": "a", "hold": first_may_end}, None)
    failing = thread.submit_step(worker, {"error": RuntimeError("boom")}, None)
    first_may_end.set()
    assert first.result(WAIT_S) == "a"
    with pytest.raises(RuntimeError, match="boom"):
        failing.result(WAIT_S)


def test_a_call_runs_after_the_steps_and_hands_over_a_held_one(thread):
    worker = FakeWorker()
    first_may_end = threading.Event()
    first = thread.submit_step(worker, {"out": "a", "hold": first_may_end}, None)
    # A step sent, then a call: the call waits for the step; the step's output is
    # handed over before the call runs (the call is no forward).
    threading.Timer(0.05, first_may_end.set).start()
    seen = thread.call(lambda: (first.done(), list(worker.order)))
    assert seen == (True, ["a"])
