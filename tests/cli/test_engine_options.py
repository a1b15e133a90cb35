"""The engine options every engine-building command shares: ``--speculative-config``
parses to the dict EngineArgs takes, and reaches EngineArgs on generate, bench and serve.

Engine construction is stubbed (it records its arguments, then fails), so no model loads
and speculative decoding itself need not work here.
"""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from engine.cli import main
from engine.cli.options import parse_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def test_parses_a_json_object():
    assert parse_speculative_config(None, None, json.dumps(NGRAM)) == NGRAM
    assert parse_speculative_config(None, None, None) is None


@pytest.mark.parametrize(("text", "message"), [
    ("{method: ngram}", "not valid JSON (Expecting property name"),
    ('{"num_speculative_tokens": 3', "not valid JSON"),
    ("[3]", "must be a JSON object"),
    ('"ngram"', "got str"),
])
def test_rejects_bad_json_and_non_objects(text, message):
    with pytest.raises(click.BadParameter, match=message.replace("(", r"\(")):
        parse_speculative_config(None, None, text)


def test_bad_json_is_a_usage_error_naming_the_option():
    result = CliRunner().invoke(main, ["bench", "latency", "--speculative-config", "{oops"])
    assert result.exit_code == 2
    assert "Invalid value for '--speculative-config': not valid JSON" in result.output
    assert "line 1 column 2" in result.output  # json's own position of the error


class _Recorded(Exception):
    pass


@pytest.fixture
def recorded(monkeypatch) -> list[dict]:
    """Stub the engines the commands build; each records its EngineArgs keywords."""
    import engine
    from engine.entrypoints.async_llm import AsyncLLM

    calls: list[dict] = []

    def fake_llm(**kwargs):
        calls.append(kwargs)
        raise ValueError("stub engine")

    def fake_from_engine_args(args, **kwargs):
        calls.append({"speculative_config": args.speculative_config,
                      "usage_context": args.usage_context})
        raise ValueError("stub engine")

    monkeypatch.setattr(engine, "LLM", fake_llm)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(fake_from_engine_args))
    return calls


@pytest.mark.parametrize("command", [
    ["generate", "hello"],
    ["bench", "throughput"],
    ["bench", "latency"],
    ["serve"],
])
def test_the_dict_reaches_engine_args(recorded, command):
    result = CliRunner().invoke(main, [*command, "--speculative-config", json.dumps(NGRAM)])
    assert "stub engine" in result.output, result.output
    assert recorded[-1]["speculative_config"] == NGRAM


def test_serve_builds_its_engine_for_an_api_server(recorded):
    """``engine serve`` takes the API server's defaults (a 2048-token step budget)."""
    result = CliRunner().invoke(main, ["serve"])
    assert "stub engine" in result.output, result.output
    assert recorded[-1]["usage_context"] == "api_server"


def test_without_the_option_engine_args_get_none(recorded):
    CliRunner().invoke(main, ["generate", "hello"])
    assert recorded[-1]["speculative_config"] is None


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4},
    {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4},
])
def test_the_resolved_config_survives_the_core_process_handoff(llama_dir, spec):
    """``engine serve`` resolves EngineArgs in the front end and hands the core process
    the EngineConfig as JSON (``mp_client.CoreProcess`` writes it, ``core_proc`` reads
    it back): the speculative part must come out equal. (The config is set by hand, so
    this holds whatever the draft resolution does.)"""
    from engine.core.config import EngineConfig, SpeculativeConfig
    from engine.core.engine_args import EngineArgs

    config = EngineArgs(model=str(llama_dir), device="cpu").create_engine_config()
    config = config.model_copy(update={"speculative": SpeculativeConfig(**spec)})
    child = EngineConfig.model_validate_json(config.model_dump_json())
    assert child.speculative == config.speculative
    assert child.speculative.model_dump(exclude_none=True, exclude={"adaptive"}) == spec
