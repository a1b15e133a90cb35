"""``LLM.beam_search`` (vLLM's algorithm, engine.core.beam_search) against transformers'
``generate(num_beams=W, num_return_sequences=W, do_sample=False)``.

Scoring definitions: vLLM (and the engine) rank by ``cum_logprob / seq_len **
length_penalty`` with ``seq_len`` = prompt + generated tokens (minus a final EOS);
transformers 5.x divides by the generated tokens INCLUDING the EOS. They coincide (both
rank by cumulative logprob) when every returned sequence has the same length: here
``ignore_eos`` on the engine side and ``min_new_tokens = max_new_tokens`` on transformers'
(EOS masked after its log-softmax, so the other logprobs are unchanged), which agree as
long as EOS is never a candidate, which the test checks. Under that definition the
returned SETS are compared exactly (tokens; cumulative logprobs within 1e-4, best first),
for several length penalties (which then cannot change the ranking).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine import BeamSearchParams
from engine.core.beam_search import BeamSearchInstance, get_beam_search_score
from engine.core.outputs import Logprob
from tests.helpers.hf_reference import cpu_llm, load_hf_model

MAX_TOKENS = 8
WIDTH = 3


@pytest.fixture(scope="module")
def hf(llama_dir):
    return load_hf_model(llama_dir)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return cpu_llm(llama_dir, block_size=16, enable_prefix_caching=True)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in (3, 20, 37)]


@torch.inference_mode()
def _hf_beams(model, prompt: list[int], width: int, length_penalty: float):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=width,
        num_return_sequences=width, do_sample=False, max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=True,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    seqs = [row[len(prompt):].tolist() for row in out.sequences]
    # transformers' score: cum_logprob / generated_len ** length_penalty
    cums = [float(s) * MAX_TOKENS ** length_penalty for s in out.sequences_scores]
    return seqs, cums


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_equals_transformers(llm, hf, length_penalty):
    prompts = _prompts(hf.config.vocab_size)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True,
                              length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outputs) == len(prompts)
    eos = hf.config.eos_token_id
    for prompt, output in zip(prompts, outputs):
        seqs = output.sequences
        assert len(seqs) == WIDTH
        for seq in seqs:
            assert seq.tokens[: len(prompt)] == prompt  # tokens include the prompt (vLLM)
            assert len(seq.generated_tokens) == MAX_TOKENS and seq.finish_reason == "length"
            assert len(seq.logprobs) == MAX_TOKENS
            # EOS never a candidate: the two definitions coincide here
            assert all(eos not in position for position in seq.logprobs)
            assert seq.text
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, length_penalty)
                  for s in seqs]
        assert scores == sorted(scores, reverse=True)  # best first
        want_seqs, want_cums = _hf_beams(hf, prompt, WIDTH, length_penalty)
        assert [s.generated_tokens for s in seqs] == want_seqs
        for seq, want in zip(seqs, want_cums):
            assert math.isclose(seq.cum_logprob, want, abs_tol=1e-4), (seq.cum_logprob, want)


def test_beam_width_one_is_greedy(llm, hf):
    from engine import SamplingParams

    prompt = _prompts(hf.config.vocab_size)[1]
    beam = llm.beam_search({"prompt_token_ids": prompt},
                           BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0]
    greedy = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0]
    assert beam.sequences[0].generated_tokens == list(greedy.outputs[0].token_ids)


def test_beams_share_prefix_blocks(llm, hf):
    """Every round's beams are full prompts, yet the prefix cache serves what earlier
    rounds (and sibling beams) computed: most looked-up tokens are hits."""
    core = llm.llm_engine.client.core
    llm.reset_prefix_cache()
    core.get_stats()  # start a fresh interval
    prompt = _prompts(hf.config.vocab_size)[2]  # 37 tokens: two full blocks of 16
    llm.beam_search({"prompt_token_ids": prompt},
                    BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
    stats = core.get_stats()
    # 1 + 7 * 4 one-token requests of >= 37 tokens each: without sharing nothing hits.
    assert stats.prefix_cache_queries >= 29 * 37
    assert stats.prefix_cache_hits >= 28 * 32, (stats.prefix_cache_hits,
                                                 stats.prefix_cache_queries)


@pytest.mark.parametrize("kwargs, name", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2.5, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
])
def test_bad_params_rejected(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**kwargs)


def test_bad_inputs_rejected(llm):
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search("hi", {"beam_width": 2, "max_tokens": 2})
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search({"prompt_token_ids": []}, BeamSearchParams(beam_width=2, max_tokens=2))


def _position(**logprobs: float) -> dict[int, Logprob]:
    return {int(k[1:]): Logprob(v) for k, v in logprobs.items()}


def test_eos_candidates_finish_and_length_penalty_ranks_them():
    """The bookkeeping alone (EOS id 1): an EOS candidate moves to the finished set with
    reason "stop"; the final ranking is vLLM's score over finished + live beams."""
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0)
    search = BeamSearchInstance([7, 8], params, {1}, max_model_len=64)
    search.advance([_position(t1=-0.1, t5=-1.0, t6=-2.0, t9=-3.0)])
    assert [b.tokens for b in search.beams] == [[7, 8, 5], [7, 8, 6]]
    assert [b.tokens for b in search.completed] == [[7, 8, 1]]
    search.advance([_position(t5=-0.5, t6=-0.6, t1=-5.0, t3=-5.5),
                    _position(t5=-0.1, t1=-0.2, t3=-6.0, t4=-7.0)])
    assert search.done
    out = search.finish(None).sequences
    # scores: [7,8,1] -0.1/2 = -0.05; [7,8,5,5] -1.5/4; [7,8,6,5] -2.1/4; [7,8,6,1] -2.2/3
    assert [s.tokens for s in out] == [[7, 8, 1], [7, 8, 5, 5]]
    assert out[0].finish_reason == "stop" and out[0].stop_reason == 1
    assert out[1].finish_reason == "length"
    # ignore_eos: EOS is an ordinary candidate
    search = BeamSearchInstance([7, 8], BeamSearchParams(beam_width=2, max_tokens=1,
                                                         ignore_eos=True), {1}, 64)
    search.advance([_position(t1=-0.1, t5=-1.0, t6=-2.0)])
    assert [b.tokens for b in search.beams] == [[7, 8, 1], [7, 8, 5]]
    assert not search.completed


def test_beam_reaching_max_model_len_finishes():
    search = BeamSearchInstance([3] * 6, BeamSearchParams(beam_width=1, max_tokens=5),
                                {1}, max_model_len=7)
    search.advance([_position(t4=-0.5, t5=-1.0)])
    assert search.done and not search.beams
    assert search.completed[0].finish_reason == "length"
