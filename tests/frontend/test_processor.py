"""Processor (prompt -> validated EngineCoreRequests), chat templates, tokenizer loading."""

from __future__ import annotations

import pytest

from engine.frontend.chat_template import render_chat_template
from engine.frontend.processor import Processor
from engine.core.sampling_params import SamplingParams
from engine.core.tokenizer import TokenDecoder, get_eos_token_ids, load_tokenizer
from tests.helpers.tiny_tokenizer import CHAT_TEMPLATE, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture()
def proc(tok):
    return Processor(
        tok,
        max_model_len=32,
        eos_token_id=tok.eos_token_id,
        extra_eos_token_ids={4},
        vocab_size=len(tok),
    )


# -- prompts --------------------------------------------------------------------------------
def test_text_prompt_is_tokenized_with_bos(proc, tok):
    processed = proc.process("r1", "Hello world", SamplingParams())
    assert processed.prompt == "Hello world"
    assert processed.prompt_token_ids == tok.encode("Hello world")
    assert processed.prompt_token_ids[0] == tok.bos_token_id
    (child,) = processed.child_requests
    assert child.request_id == "r1" and child.prompt_token_ids == processed.prompt_token_ids
    assert child.eos_token_id == tok.eos_token_id
    no_bos = proc.process("r2", "Hello world", SamplingParams(), add_special_tokens=False)
    assert no_bos.prompt_token_ids == tok.encode("Hello world", add_special_tokens=False)


def test_token_and_dict_prompts(proc, tok):
    ids = tok.encode("Hi there")
    assert proc.process("a", ids, SamplingParams()).prompt_token_ids == ids
    by_ids = proc.process("b", {"prompt_token_ids": ids}, SamplingParams())
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    by_text = proc.process("c", {"prompt": "Hi there"}, SamplingParams())
    assert by_text.prompt == "Hi there" and by_text.prompt_token_ids == ids


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (3.5, "prompt must be a string, a list of token ids"),
        ({"text": "hi"}, "exactly one key"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one key"),
        ({"prompt": [1, 2]}, r"prompt\['prompt'\] must be a string"),
        (["a", "b"], "item 0 is 'a'"),
        ([1, True], "item 1 is True"),
        ([], "The prompt is empty"),
        ([5, 420], r"token id 420, outside the vocabulary \[0, 420\)"),
        ([5, -1], "token id -1"),
        ({"prompt": "hi", "multi_modal_data": {"image": []}}, "takes text only"),
        ({"multi_modal_data": {}}, "exactly one of 'prompt' or 'prompt_token_ids'"),
        ({"prompt": "hi", "prompt_token_ids": [1], "multi_modal_data": {}},
         "exactly one of 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_bad_prompts_raise_value_errors_naming_the_problem(proc, prompt, match):
    with pytest.raises(ValueError, match=match):
        proc.process("r", prompt, SamplingParams())


def test_prompt_length_against_max_model_len(proc):
    with pytest.raises(
        ValueError, match="The prompt \\(40 tokens\\) is longer than the maximum model length of 32"
    ):
        proc.process("r", [5] * 40, SamplingParams())
    with pytest.raises(ValueError, match="The prompt \\(32 tokens\\)"):
        proc.process("r", [5] * 32, SamplingParams())
    processed = proc.process("r", [5] * 31, SamplingParams(max_tokens=100))
    assert processed.child_requests[0].max_tokens == 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(proc):
    ids = list(range(10, 50))  # 40 tokens: too long unless truncated
    processed = proc.process("r", ids, SamplingParams(truncate_prompt_tokens=5))
    assert processed.prompt_token_ids == ids[-5:]


def test_max_tokens_resolution(proc):
    ids = [5] * 10
    assert (
        proc.process("a", ids, SamplingParams(max_tokens=None)).child_requests[0].max_tokens == 22
    )
    assert proc.process("b", ids, SamplingParams(max_tokens=7)).child_requests[0].max_tokens == 7
    clamped = proc.process("c", ids, SamplingParams(max_tokens=50, min_tokens=30))
    assert clamped.child_requests[0].max_tokens == 22
    assert clamped.params.min_tokens == 22


def test_extra_eos_ids_merged_into_a_copy(proc, tok):
    user = SamplingParams(stop_token_ids=[7])
    processed = proc.process("r", "Hi", user)
    assert user.stop_token_ids == [7]  # the caller's object is untouched
    assert processed.params is not user
    assert set(processed.params.stop_token_ids) == {4, 7}
    assert processed.child_requests[0].sampling_params.all_stop_token_ids == {4, 7}
    ignoring = proc.process("r2", "Hi", SamplingParams(ignore_eos=True))
    assert not ignoring.params.stop_token_ids


def test_bad_words_tokenized_with_and_without_leading_space(proc, tok):
    processed = proc.process("r", "Hi", SamplingParams(bad_words=["world", " fox"]))
    expected = []
    for word in ("world", "fox"):
        plain = tok.encode(word, add_special_tokens=False)
        spaced = tok.encode(" " + word, add_special_tokens=False)
        expected.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expected.append(spaced)
    assert processed.params.bad_words_token_ids == expected
    assert len(expected) > 2  # at least one word got a distinct spaced variant


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(stop=["x"], detokenize=False), "detokenize"),
        (SamplingParams(stop_token_ids=[999]), r"stop_token_ids contains token id\(s\) \[999\]"),
        (SamplingParams(allowed_token_ids=[1, 420]), "allowed_token_ids"),
        (SamplingParams(logit_bias={500: 1.0}), "logit_bias"),
        (SamplingParams(logprobs=1000), "logprobs=1000 exceeds the vocabulary size"),
        (SamplingParams(bad_words=["  "]), "bad_words"),
    ],
)
def test_bad_params_rejected(proc, params, match):
    with pytest.raises(ValueError, match=match):
        proc.process("r", "Hi", params)


def test_bad_request_fields(proc):
    with pytest.raises(ValueError, match="request_id"):
        proc.process("", "Hi", SamplingParams())
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        proc.process("r", "Hi", {"temperature": 0})
    with pytest.raises(ValueError, match="cache_salt"):
        proc.process("r", "Hi", SamplingParams(), cache_salt=5)


def test_n_fans_out_into_seeded_children(proc):
    params = SamplingParams(n=3, seed=100, prompt_logprobs=2, temperature=0.8)
    processed = proc.process("req", "Hi", params, arrival_time=5.0, priority=2, cache_salt="s")
    assert processed.child_request_ids == ["0_req", "1_req", "2_req"]
    assert [c.sampling_params.seed for c in processed.child_requests] == [100, 101, 102]
    assert all(c.sampling_params.n == 1 for c in processed.child_requests)
    assert [c.sampling_params.prompt_logprobs for c in processed.child_requests] == [2, None, None]
    assert all(
        c.arrival_time == 5.0 and c.priority == 2 and c.cache_salt == "s"
        for c in processed.child_requests
    )
    assert processed.params.n == 3 and params.seed == 100
    unseeded = proc.process("u", "Hi", SamplingParams(n=2))
    assert [c.sampling_params.seed for c in unseeded.child_requests] == [None, None]


# -- chat templates ---------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello 😀"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "日本語?"},
]


def test_chat_template_matches_transformers(proc, tok):
    rendered = proc.apply_chat_template(MESSAGES)
    assert rendered == tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    no_prompt = proc.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt == tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False
    )
    roomy = Processor(tok, max_model_len=256, eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    processed = roomy.process("chat", rendered, SamplingParams(), add_special_tokens=False)
    assert processed.prompt_token_ids.count(tok.bos_token_id) == 1  # from the template only


def test_chat_template_given_explicitly_and_template_kwargs(proc, tok):
    template = (
        "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}]{{ m['content'] }}{% endfor %}"
    )
    rendered = proc.apply_chat_template(MESSAGES[:2], chat_template=template, greeting="hey")
    assert rendered == "[system|hey]Be brief.[user|hey]Hello 😀"


def test_text_parts_are_joined(proc):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert proc.apply_chat_template(parts) == proc.apply_chat_template(
        [{"role": "user", "content": "a\nb"}]
    )


def test_missing_chat_template_error():
    bare = make_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        render_chat_template(bare, MESSAGES)
    assert render_chat_template(bare, MESSAGES, chat_template=CHAT_TEMPLATE).startswith(
        "<s><|im_start|>system"
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages must be a list"),
        ([], "must not be empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\]\['role'\] must be one of"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "parts must be"),
    ],
)
def test_bad_messages(proc, messages, match):
    with pytest.raises(ValueError, match=match):
        proc.apply_chat_template(messages)


def test_continue_final_message_checks(proc):
    with pytest.raises(ValueError, match="cannot both be true"):
        proc.apply_chat_template(MESSAGES[:3], continue_final_message=True)
    with pytest.raises(ValueError, match="last message to be from the assistant"):
        proc.apply_chat_template(MESSAGES, add_generation_prompt=False, continue_final_message=True)


# -- tokenizer loading ------------------------------------------------------------------------
def test_load_tokenizer_roundtrip_and_errors(tmp_path, tok):
    tok.save_pretrained(tmp_path / "model")
    loaded = load_tokenizer(tmp_path / "model")
    text = "Café 日本 😀 <|im_end|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.chat_template == tok.chat_template
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match="is not a local directory"):
        load_tokenizer(tmp_path / "missing")


def test_eos_ids(tok):
    assert get_eos_token_ids(tok, None) == (tok.eos_token_id, set())
    assert get_eos_token_ids(tok, [tok.eos_token_id, 4]) == (tok.eos_token_id, {4})
    assert get_eos_token_ids(None, [3, 4]) == (3, {4})
    assert get_eos_token_ids(None, 7) == (7, set())


def test_token_decoder_caches_single_token_text(tok):
    decoder = TokenDecoder(tok)
    ids = tok.encode("Café 😀", add_special_tokens=False)
    assert decoder.decode_tokens(ids) == [tok.decode([i]) for i in ids]
    assert decoder.decode_token(10_000) == ""
