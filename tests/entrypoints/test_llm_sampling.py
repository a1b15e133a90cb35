"""Sampling through the offline API: n samples, seeds, stop conditions, bad parameters.

References: the engine's own greedy run (stop conditions must cut it exactly where the
stop string / token occurs), ``tokenizer.decode`` for text, and the KV cache manager's
block tables and free count for sharing and leaks.
"""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.core.sampling_params import RequestOutputKind
from tests.helpers.hf_models import SAMPLE_TEXT
from tests.helpers.hf_reference import cpu_llm

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return cpu_llm(llama_dir)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


def _core(llm):
    return llm.llm_engine.client.core


def _assert_no_leak(llm) -> None:
    kv = _core(llm).scheduler.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert not _core(llm).has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks


def _tokens(llm, params, prompts):
    return [list(c.token_ids) for out in llm.generate(prompts, params, use_tqdm=False)
            for c in out.outputs]


# -- n > 1 ----------------------------------------------------------------------------------
def test_n_samples_are_distinct_indexed_and_reproducible(llm, tokenizer):
    prompt = {"prompt_token_ids": tokenizer.encode(SAMPLE_TEXT)[:40]}
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 4 and all(len(s) == 8 for s in samples)
    for c in first.outputs:
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_n_samples_share_the_prompt_kv_blocks(llm, tokenizer):
    llm.reset_prefix_cache()
    block_size = llm.llm_engine.config.cache.block_size
    prompt = tokenizer.encode(SAMPLE_TEXT)[:45]  # 2 full blocks + a partial one
    engine = llm.llm_engine
    _core(llm).get_stats()  # start a fresh stats interval
    engine.add_request("shared", {"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4))
    engine.step()  # the prefill of all three children
    kv = _core(llm).scheduler.kv_cache_manager
    tables = [kv.get_block_ids(f"{i}_shared")[0] for i in range(3)]
    num_full = len(prompt) // block_size
    assert tables[0][:num_full] == tables[1][:num_full] == tables[2][:num_full]
    assert len({t[num_full] for t in tables}) == 3  # the partial block is each child's own
    stats = _core(llm).get_stats()
    assert stats.prefix_cache_hits == 2 * num_full * block_size  # children 1 and 2 hit
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].num_cached_tokens == num_full * block_size
    _assert_no_leak(llm)


# -- seeds ----------------------------------------------------------------------------------
def test_seed_reproduces_across_batch_mixes(llm, tokenizer):
    ids = tokenizer.encode(SAMPLE_TEXT)
    target = {"prompt_token_ids": ids[:23]}
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    alone = _tokens(llm, seeded, [target])[0]

    others = [{"prompt_token_ids": ids[50:50 + n]} for n in (5, 37, 16)]
    noise = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in (3, 12, 7)]
    mix_a = llm.generate([others[0], target, others[1]], [noise[0], seeded, noise[1]],
                         use_tqdm=False)
    mix_b = llm.generate([others[2], others[1], others[0], target],
                         [noise[2], SamplingParams(temperature=0.0, max_tokens=4), noise[1],
                          seeded], use_tqdm=False)
    assert list(mix_a[1].outputs[0].token_ids) == alone
    assert list(mix_b[3].outputs[0].token_ids) == alone
    # A different seed gives a different sample (the seed is really used).
    assert _tokens(llm, seeded.clone(seed=43), [target])[0] != alone


def test_seed_reproduces_across_preemption(llama_dir, tokenizer):
    """A KV pool too small for the batch: requests are preempted and recomputed, yet
    every seeded sample equals the one it gives alone."""
    small = cpu_llm(llama_dir, num_gpu_blocks_override=12, block_size=8, max_model_len=80,
                    max_num_batched_tokens=16)
    ids = tokenizer.encode(SAMPLE_TEXT)
    prompts = [{"prompt_token_ids": ids[i * 30 : i * 30 + 30]} for i in range(3)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)
              for s in (1, 2, 3)]
    alone = [_tokens(small, p, [prompt])[0] for prompt, p in zip(prompts, params)]
    assert _tokens(small, params, prompts) == alone
    assert _core(small).scheduler.num_preemptions_total > 0
    _assert_no_leak(small)


# -- stop conditions ------------------------------------------------------------------------
def _greedy_reference(llm, prompt: str, max_tokens: int = 16):
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                       use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def _boundary_stop_string(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A 4-character stop string whose first occurrence in the decoded ``ids`` spans the
    boundary before token ``k`` (2 characters each side); returns it and ``k``."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    for k in range(1, len(ids)):
        b = len(tokenizer.decode(ids[:k], skip_special_tokens=True))
        after = len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True))
        s = full[b - 2 : b + 2]
        if b >= 2 and after >= b + 2 and REPLACEMENT_CHAR not in s and full.index(s) == b - 2:
            return s, k
    raise AssertionError(f"no clean token boundary in {full!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm, tokenizer, include):
    ids, text = _greedy_reference(llm, "The quick brown fox")
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    stop, k = _boundary_stop_string(tokenizer, ids)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop, "never-seen"],
                            include_stop_str_in_output=include)
    out = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
    cut = text.index(stop) + (len(stop) if include else 0)
    assert out.text == text[:cut]
    assert list(out.token_ids) == ids[: k + 1]  # up to the token that completed the match
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    _assert_no_leak(llm)


def test_stop_token_ids(llm, tokenizer):
    ids, _ = _greedy_reference(llm, "Once upon a time")
    j = next(j for j in range(3, len(ids)) if ids[j] not in ids[:j])
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ids[j]])
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == ids[: j + 1]  # the stop token is kept in token_ids ...
    assert out.text == tokenizer.decode(ids[:j], skip_special_tokens=True)  # ... not in text
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[j])


def test_stop_string_finishes_each_sample_on_its_own(llm, tokenizer):
    prompt = {"prompt_token_ids": tokenizer.encode(SAMPLE_TEXT)[:10]}
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True)
    full = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    text = full[0].text
    stop = next(text[i : i + 2] for i in range(len(text) - 1)
                if REPLACEMENT_CHAR not in text[i : i + 2])
    outs = llm.generate(prompt, params.clone(stop=[stop]), use_tqdm=False)[0].outputs
    for got, want in zip(outs, full):
        if stop in want.text:
            assert got.text == want.text[: want.text.index(stop)]
            assert (got.finish_reason, got.stop_reason) == ("stop", stop)
            assert list(got.token_ids) == list(want.token_ids[: len(got.token_ids)])
        else:
            assert (got.text, got.finish_reason) == (want.text, "length")
    assert outs[0].finish_reason == "stop"
    _assert_no_leak(llm)


def test_min_tokens_holds_off_eos(llm, tokenizer):
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0})
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and eos not in out.token_ids[:3]
    assert out.finish_reason == "stop"


def test_max_tokens_none_fills_the_context(llm):
    max_model_len = llm.llm_engine.config.scheduler.max_model_len
    prompt = {"prompt_token_ids": list(range(5, 105))}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == max_model_len - 100
    assert out.finish_reason == "length"


def test_allowed_token_ids_and_truncate_prompt_tokens(llm, tokenizer):
    allowed = [40, 41, 42]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=12, allowed_token_ids=allowed,
                            truncate_prompt_tokens=5)
    out = llm.generate(SAMPLE_TEXT[:200], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == tokenizer.encode(SAMPLE_TEXT[:200])[-5:]
    assert set(out.outputs[0].token_ids) <= set(allowed)


def test_detokenize_false_gives_ids_only(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    with_text = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate("Hello", params.clone(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert ids_only.text == "" and ids_only.token_ids == with_text.token_ids
    assert all(lp.decoded_token is None for pos in ids_only.logprobs for lp in pos.values())
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in ids_only.logprobs] == [
        {t: lp.logprob for t, lp in pos.items()} for pos in with_text.logprobs
    ]
    with pytest.raises(ValueError, match="detokenize"):
        llm.generate("Hello", params.clone(detokenize=False, stop=["x"]), use_tqdm=False)


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_offline_calls_take_final_outputs_only_and_leave_the_params_alone(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outs = llm.generate(["Once", "upon"], params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert [(len(o.outputs[0].token_ids), o.finished) for o in outs] == [(4, True), (4, True)]
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate("Once", ["greedy"], use_tqdm=False)
    _assert_no_leak(llm)


def test_eos_stops_unless_ignore_eos(llm, tokenizer):
    eos = tokenizer.eos_token_id
    towards_eos = {"temperature": 0.0, "max_tokens": 5, "logit_bias": {eos: 100.0}}
    out = llm.generate("Hello", SamplingParams(**towards_eos), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [eos]
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", None)
    out = llm.generate("Hello", SamplingParams(**towards_eos, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [eos] * 5
    assert out.finish_reason == "length"


# -- bad parameters -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -2}, "logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"seed": "abc"}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"tempreature": 0.5}, "tempreature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def _mutated(**changes) -> SamplingParams:
    """Valid at construction, made invalid afterwards (as user code may do)."""
    params = SamplingParams(max_tokens=4)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(logprobs=100_000), "logprobs"),
        (SamplingParams(prompt_logprobs=100_000), "prompt_logprobs"),
        (SamplingParams(stop_token_ids=[1_000_000]), "stop_token_ids"),
        (SamplingParams(allowed_token_ids=[1_000_000]), "allowed_token_ids"),
        (SamplingParams(logit_bias={1_000_000: 1.0}), "logit_bias"),
        (_mutated(temperature=-1.0), "temperature"),
        (_mutated(top_p=0.0), "top_p"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_request_is_rejected_without_breaking_the_engine(llm, params, field):
    good = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = _tokens(llm, greedy, [good])
    # The good request is queued first; the bad one must abort it, not leave it behind.
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        llm.generate([good, "Hello there"], [greedy, params], use_tqdm=False)
    _assert_no_leak(llm)
    assert _tokens(llm, greedy, [good]) == want
    _assert_no_leak(llm)


def test_bad_prompts_and_param_lists_are_rejected(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    _assert_no_leak(llm)
