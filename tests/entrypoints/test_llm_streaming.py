"""Streaming through ``LLMEngine``: DELTA outputs of multi-byte UTF-8 text.

The model here is rewired (``greedy_cycle``) so that greedy decoding emits the UTF-8
bytes of ``CYCLE`` one single-byte token per step: every multi-byte character arrives
split across 2-4 tokens that each decode to U+FFFD alone. Reference: ``tokenizer.decode``
of the generated ids, and the same request run without streaming.
"""

from __future__ import annotations

import itertools

import pytest

from engine import SamplingParams
from engine.core.sampling_params import RequestOutputKind
from tests.helpers.hf_models import SAMPLE_TEXT, byte_token_ids
from tests.helpers.hf_reference import cpu_llm

CYCLE = "é日😀!"  # 2-, 3-, 4- and 1-byte characters; 10 distinct bytes
REPLACEMENT_CHAR = "\ufffd"
DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def cycle_llm(model_dir_factory):
    return cpu_llm(model_dir_factory("llama-gqa", greedy_cycle=CYCLE))


@pytest.fixture(scope="module")
def llm(llama_dir):
    return cpu_llm(llama_dir)


def _stream(llm, request_id: str, prompt, params: SamplingParams):
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return outputs


def test_model_emits_partial_utf8_tokens(cycle_llm):
    tokenizer = cycle_llm.get_tokenizer()
    out = cycle_llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=10),
                             use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == byte_token_ids(tokenizer, CYCLE.encode())
    assert sum(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in out.token_ids) == 9
    assert out.text == CYCLE


@pytest.mark.parametrize("prompt", ["Hello", "Café 日本"])
def test_delta_stream_never_splits_a_character(cycle_llm, prompt):
    tokenizer = cycle_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=25, output_kind=DELTA)
    outputs = _stream(cycle_llm, f"utf8-{prompt}", prompt, params)
    deltas = [o.outputs[0] for o in outputs]
    assert all(len(d.token_ids) == 1 for d in deltas)  # one output per step, text or not
    assert all(REPLACEMENT_CHAR not in d.text for d in deltas)
    token_ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert text == CYCLE * 2 + "é日"  # 25 bytes
    assert deltas[-1].finish_reason == "length"
    # The same request without streaming gives the same final text.
    final = cycle_llm.generate(prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                               use_tqdm=False)[0].outputs[0]
    assert final.text == text and list(final.token_ids) == token_ids


def test_character_cut_by_max_tokens_is_released_at_the_end(cycle_llm):
    """Output ending inside a character: the held-back bytes come out with the finish, as
    the U+FFFD that ``tokenizer.decode`` gives for them."""
    tokenizer = cycle_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=7, output_kind=DELTA)
    deltas = [o.outputs[0] for o in _stream(cycle_llm, "cut", "Hello", params)]
    assert all(REPLACEMENT_CHAR not in d.text for d in deltas[:-1])
    token_ids = [t for d in deltas for t in d.token_ids]
    assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids)
    assert tokenizer.decode(token_ids).startswith("é日" + REPLACEMENT_CHAR)


def test_cumulative_stream_only_grows_by_whole_characters(cycle_llm):
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            output_kind=RequestOutputKind.CUMULATIVE)
    outputs = _stream(cycle_llm, "cumulative", "Hello", params)
    texts = [o.outputs[0].text for o in outputs]
    assert all(REPLACEMENT_CHAR not in t for t in texts)
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert texts[-1] == CYCLE * 2


@pytest.mark.parametrize("include", [False, True])
def test_multibyte_stop_string_while_streaming(cycle_llm, include):
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["日😀"], output_kind=DELTA,
                            include_stop_str_in_output=include)
    outputs = _stream(cycle_llm, f"stop-{include}", "Hello", params)
    deltas = [o.outputs[0] for o in outputs]
    assert all(REPLACEMENT_CHAR not in d.text for d in deltas)
    if not include:  # the stop string's prefix "日" is held back, then dropped
        assert all("日" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == ("é日😀" if include else "é")
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "日😀")
    assert sum(len(d.token_ids) for d in deltas) == 9  # up to the emoji's last byte


def test_delta_stream_of_n_samples_matches_the_final_outputs(llm):
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode(SAMPLE_TEXT)[:20]}
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, logprobs=1,
                            output_kind=DELTA)
    outputs = _stream(llm, "delta-n", prompt, params)
    text, ids, logprobs = {}, {}, {}
    for out in outputs:
        for c in out.outputs:
            text[c.index] = text.get(c.index, "") + c.text
            ids[c.index] = ids.get(c.index, []) + list(c.token_ids)
            logprobs[c.index] = logprobs.get(c.index, []) + list(c.logprobs)
    final = llm.generate(prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                         use_tqdm=False)[0]
    for c in final.outputs:
        assert text[c.index] == c.text
        assert ids[c.index] == list(c.token_ids)
        assert logprobs[c.index] == c.logprobs


def test_abort_mid_stream_frees_everything(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True,
                            output_kind=DELTA)
    engine.add_request("to-abort", {"prompt_token_ids": list(range(5, 45))}, params)
    for _ in range(3):
        engine.step()
    engine.abort_request(["to-abort"])
    core = llm.llm_engine.client.core
    kv = core.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests() and not core.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert engine.step() == []
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
