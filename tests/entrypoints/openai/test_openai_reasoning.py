"""``engine serve --reasoning-parser deepseek_r1`` with the real openai client.

The tiny model's tokenizer has ``<think>`` / ``</think>`` added as special tokens, and its
weights are rewired (``make_greedy_cycle``) so that greedy decoding after the prompt
writes ``<think>plan</think>yes!`` forever. Checked: ``reasoning_content`` / ``reasoning``
and ``content`` split non-streamed and streamed; structured outputs constrain only what
follows ``</think>`` (the reasoning runs free, then the grammar forces its choice); an
unknown parser name is a CLI error listing the names.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess
from tests.helpers.hf_models import build_model_dir, byte_token_ids, make_greedy_cycle

openai = pytest.importorskip("openai")

CYCLE_TEXT = ("<think>", "plan", "</think>", "yes!")
NUM_CYCLE_TOKENS = 10  # <think> p l a n </think> y e s !


@pytest.fixture(scope="module")
def reasoning_model_dir(tmp_path_factory):
    import torch
    import transformers
    from transformers import AddedToken, AutoTokenizer

    out = build_model_dir(tmp_path_factory.mktemp("reasoning-model"), vocab_size=400)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)],
                   special_tokens=True)
    tok.save_pretrained(out)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    cycle = [start, *byte_token_ids(tok, b"plan"), end, *byte_token_ids(tok, b"yes!")]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    make_greedy_cycle(model, cycle)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def server(reasoning_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(reasoning_model_dir, log, ["--reasoning-parser", "deepseek_r1"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        proc.assert_no_orphans()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


MESSAGES = [{"role": "user", "content": "What is the plan?"}]


def test_non_streamed_split(client):
    resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, temperature=0,
                                          max_tokens=NUM_CYCLE_TOKENS - 1)
    message = resp.choices[0].message.model_dump()
    assert message["reasoning_content"] == "plan"
    assert message["reasoning"] == "plan"
    assert message["content"] == "yes"
    # Cut off while thinking: all reasoning, no content.
    resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, temperature=0,
                                          max_tokens=4)
    message = resp.choices[0].message.model_dump()
    assert (message["reasoning_content"], message["content"]) == ("pla", None)


def test_streamed_split(client):
    stream = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, temperature=0,
                                            max_tokens=NUM_CYCLE_TOKENS - 1, stream=True)
    reasoning, content, order = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            if delta.get("reasoning_content"):
                assert delta.get("reasoning") == delta["reasoning_content"]
                reasoning.append(delta["reasoning_content"])
                order.append("r")
            if delta.get("content"):
                content.append(delta["content"])
                order.append("c")
    assert "".join(reasoning) == "plan" and "".join(content) == "yes"
    assert len(reasoning) > 1  # streamed as it was generated, not at the end
    assert order == sorted(order, key=lambda k: k != "r")  # reasoning first, then content


def test_structured_output_applies_after_reasoning(client):
    # The grammar does not touch the reasoning; after </think> it forces "no" (the model
    # alone would write "yes!").
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["no"]}})
    message = resp.choices[0].message.model_dump()
    assert (message["reasoning_content"], message["content"]) == ("plan", "no")
    assert resp.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, temperature=0, max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"choice": ["no"]}})
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("plan", "no")


def test_responses_reasoning_item(client):
    # /v1/responses: the reasoning is an output item of its own, before the message.
    resp = client.responses.create(model=SERVED_NAME, input="What is the plan?", temperature=0,
                                   max_output_tokens=NUM_CYCLE_TOKENS - 1)
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.summary == [] and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == "plan"
    assert message.type == "message" and resp.output_text == "yes"
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model=SERVED_NAME, input="What is the plan?",
                                          temperature=0, stream=True,
                                          max_output_tokens=NUM_CYCLE_TOKENS - 1))
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert "response.reasoning_text.done" in types[:first_text]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "plan"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    assert events[-1].response.output_text == "yes"


def test_unknown_parser_is_a_cli_error():
    from engine.cli import main

    result = CliRunner().invoke(main, ["serve", "--reasoning-parser", "nope"])
    assert result.exit_code == 2
    assert "nope" in result.output
    for name in ("deepseek_r1", "qwen3", "granite", "gpt_oss"):
        assert name in result.output
