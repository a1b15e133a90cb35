"""Structured outputs through an engine core in its own process: the constraint crosses
the ZeroMQ socket inside SamplingParams (msgspec) and is enforced there, and a grammar
the core cannot compile comes back as finish_reason abort with the error."""

from __future__ import annotations

import re

import pytest

from engine import EngineArgs, SamplingParams
from engine.core.engine_io import EngineCoreRequest
from engine.frontend.llm_engine import LLMEngine
from engine.core.mp_client import SyncMPClient
from engine.core.request import FinishReason
from engine.structured_output import StructuredOutputsParams


@pytest.fixture(scope="module")
def mp_engine(llama_dir):
    config = EngineArgs(
        model=str(llama_dir), device="cpu", dtype="float32", max_model_len=128
    ).create_engine_config()
    engine = LLMEngine(config, client=SyncMPClient(config))
    yield engine
    engine.shutdown()


def test_constraints_hold_in_a_core_process(mp_engine):
    regex = r"[a-z]{3}-\d{2}"
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex=regex, backend=b),
        )
        for s, b in ((0, "xgrammar"), (1, "llguidance"))
    ]
    for i, p in enumerate(params):
        mp_engine.add_request(f"c{i}", "Hello there", p)
    finished = {}
    while mp_engine.has_unfinished_requests():
        for output in mp_engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    for i in range(len(params)):
        assert finished[f"c{i}"].finish_reason == "stop"
        assert re.fullmatch(regex, finished[f"c{i}"].text), finished[f"c{i}"].text


def test_core_side_compile_error_comes_back_as_abort(mp_engine):
    bad = StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1})
    client = mp_engine.client
    client.add_request(EngineCoreRequest("bad", [5, 6], SamplingParams(structured_outputs=bad)))
    for _ in range(100):
        outputs = [o for o in client.get_output().outputs if o.request_id == "bad"]
        if outputs:
            break
    assert outputs[0].finish_reason == FinishReason.ABORT
    assert "structured output error" in outputs[0].stop_reason
