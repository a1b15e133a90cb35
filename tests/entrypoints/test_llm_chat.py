"""``LLM.chat``: the prompt is exactly transformers' rendering of the chat template.

Reference: ``tokenizer.apply_chat_template(..., add_generation_prompt=True,
tokenize=False)`` of the model directory's own tokenizer, tokenized without adding
special tokens again (the template already holds BOS), and ``LLM.generate`` on those ids.
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.helpers.hf_models import TOOLS_CHAT_TEMPLATE
from tests.helpers.hf_reference import cpu_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Tell me about the quick brown fox"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def llm(model_dir_factory):
    """A model whose chat template starts with BOS and renders ``tools``."""
    return cpu_llm(model_dir_factory("llama-gqa", chat_template=TOOLS_CHAT_TEMPLATE))


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def _render(tokenizer, messages, **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _assert_prompt(out, tokenizer, rendered: str) -> None:
    assert out.prompt == rendered
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1  # no duplicated BOS
    assert out.prompt_token_ids[0] == tokenizer.bos_token_id


def test_chat_one_conversation(llm, tokenizer):
    outputs = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert len(outputs) == 1
    rendered = _render(tokenizer, CONVERSATION)
    assert rendered.endswith("<|im_start|>assistant\n")
    _assert_prompt(outputs[0], tokenizer, rendered)
    direct = llm.generate({"prompt_token_ids": outputs[0].prompt_token_ids}, GREEDY,
                          use_tqdm=False)[0]
    assert outputs[0].outputs[0].token_ids == direct.outputs[0].token_ids
    assert outputs[0].outputs[0].text == direct.outputs[0].text


def test_chat_list_of_conversations_keeps_order(llm, tokenizer):
    conversations = [
        CONVERSATION,
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": [{"type": "text", "text": "two"},
                                      {"type": "text", "text": "parts"}]}],
    ]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert len(outputs) == 3
    _assert_prompt(outputs[0], tokenizer, _render(tokenizer, CONVERSATION))
    _assert_prompt(outputs[1], tokenizer, _render(tokenizer, conversations[1]))
    # OpenAI-style text parts are joined with newlines before rendering.
    _assert_prompt(outputs[2], tokenizer,
                   _render(tokenizer, [{"role": "user", "content": "two\nparts"}]))


def test_chat_tools_reach_the_template(llm, tokenizer):
    out = llm.chat(CONVERSATION, GREEDY, tools=TOOLS, use_tqdm=False)[0]
    rendered = _render(tokenizer, CONVERSATION, tools=TOOLS)
    assert "Tools: get_weather(city, unit)" in rendered
    _assert_prompt(out, tokenizer, rendered)


def test_chat_template_override_and_continue_final_message(llm, tokenizer):
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n" \
               "{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    out = llm.chat(messages, GREEDY, chat_template=template, add_generation_prompt=False,
                   continue_final_message=True, use_tqdm=False)[0]
    rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             continue_final_message=True)
    assert rendered.endswith("[assistant] Hel")
    _assert_prompt(out, tokenizer, rendered)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "wizard", "content": "hi"}], "role"),
        ([{"role": "user"}], "content"),
        ([], "messages"),
        ("hello", "messages"),
    ],
)
def test_bad_conversations_are_rejected(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    kv = llm.llm_engine.client.core.scheduler.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks
