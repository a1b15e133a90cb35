"""End to end: with speculation the engine's samples follow the target's own distribution.

A tiny-vocabulary random Llama target and a smaller random draft (same vocabulary) are
built locally. Thousands of samples of one fixed prompt are compared, by a chi-square
test, with the target's exact distribution of the continuation, enumerated with
transformers in float64 (temperature, top-k and top-p applied exactly as the engine
applies them). Greedy speculation must reproduce plain greedy decoding token for token,
and a seeded request must repeat itself in another batch.

Why the first THREE tokens (``max_tokens=4``): the first token of a request always comes
from the prefill step, before any draft exists, and the scheduler never lets drafts run
past ``max_tokens - 1`` (the verification adds one token of its own). So with
``max_tokens=2`` no draft would ever be verified; with ``max_tokens=4`` the second step
verifies K = 2 drafts, i.e. tokens 2 and 3 (and maybe a bonus 4th) come from the
rejection sampler. The test checks the joint distribution of tokens 1-3.

The same check run with a deliberately wrong rule (patched into the in-process engine)
must fail, which shows that it has the power to see a broken sampler.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_executor.sampling.rejection_sampler import RejectionSampler

V = 8
PROMPT = list(range(V)) * 2  # every token has an earlier occurrence: n-gram lookup proposes
N = 3000
PASS_P = 1e-4
FAIL_P = 1e-8
SEQ_LEN = 3  # tokens compared per sample


# -- models -------------------------------------------------------------------------------
def _save_tokenizer(out: Path) -> None:
    """A word-level tokenizer of exactly V tokens (ids 0 = <s>, 1 = </s>, then t2..)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)


def _build_llama(out: Path, *, hidden: int, layers: int, inter: int, heads: int,
                 kv_heads: int, seed: int, init_range: float = 0.3) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(out)
    config = LlamaConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        initializer_range=init_range, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return _build_llama(tmp_path_factory.mktemp("spec-target"), hidden=64, layers=2,
                        inter=128, heads=4, kv_heads=2, seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return _build_llama(tmp_path_factory.mktemp("spec-draft"), hidden=32, layers=1,
                        inter=64, heads=2, kv_heads=1, seed=1)


# -- the exact distribution ------------------------------------------------------------
def engine_top_p(probs: torch.Tensor, top_p: float, margin: float = 1e-4) -> torch.Tensor:
    """Top-p as engine/model_executor/sampling/topk_topp.py does it (float64): sort
    ascending, drop a token while the cumulative mass up to and including it is
    <= 1 - top_p (the most likely token always stays), renormalize the rest. Asserts
    that no token sits within ``margin`` of the threshold, where float32 could flip it."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1)
    cumulative = sorted_p.cumsum(dim=-1)
    gap = (cumulative - (1.0 - top_p)).abs()
    assert bool((gap[..., :-1] > margin).all()), "a token sits on the top-p boundary"
    drop = cumulative <= 1.0 - top_p
    drop[..., -1] = False
    kept = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(dim=-1, keepdim=True)


def engine_top_k(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """The ``top_k`` largest logits of each row (ties at the boundary kept)."""
    if top_k is None:
        return logits
    kth = logits.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
    return logits.masked_fill(logits < kth, float("-inf"))


_EXACT: dict[tuple, np.ndarray] = {}


def exact_distribution(model_dir: Path, top_p: float, temperature: float = 1.0,
                       top_k: int | None = None) -> np.ndarray:
    """``[V] * SEQ_LEN`` joint probabilities of the first SEQ_LEN generated tokens:
    each conditional tempered, cut to top-k, then to top-p of what is left."""
    key = (str(model_dir), top_p, temperature, top_k)
    if key in _EXACT:
        return _EXACT[key]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    prefixes = list(itertools.product(range(V), repeat=SEQ_LEN - 1))
    ids = torch.tensor([PROMPT + list(p) for p in prefixes])
    with torch.inference_mode():
        logits = model(ids).logits[:, len(PROMPT) - 1 :]  # [V^(L-1), L, V]
    cond = engine_top_p(engine_top_k(logits / temperature, top_k).softmax(-1), top_p)
    cond = cond.view([V] * (SEQ_LEN - 1) + [SEQ_LEN, V])
    joint = torch.ones([V] * SEQ_LEN, dtype=torch.float64)
    for pos in range(SEQ_LEN):
        # Token pos given the first pos tokens: any row with that history (later ones 0).
        given = cond[(slice(None),) * pos + (0,) * (SEQ_LEN - 1 - pos) + (pos,)]
        joint = joint * given.reshape([V] * (pos + 1) + [1] * (SEQ_LEN - 1 - pos))
    joint = joint.numpy()
    assert abs(joint.sum() - 1.0) < 1e-9
    _EXACT[key] = joint
    return joint


# -- statistics ---------------------------------------------------------------------------
def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; bins with expected count < 5 are merged into one. Any count
    where the probability is 0 gives p-value 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if (counts[probs <= 0] > 0).any():
        return 0.0
    expected = counts.sum() * probs
    small = expected < 5
    obs = list(counts[~small])
    exp = list(expected[~small])
    if expected[small].sum() > 0:
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.asarray(obs), np.asarray(exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(llm: LLM, params: SamplingParams) -> tuple[np.ndarray, object]:
    """Counts of the first SEQ_LEN tokens over ``params.n`` samples, and the spec stats."""
    llm.get_spec_decoding_stats()  # reset the window
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert len(out) == params.n
    counts = np.zeros([V] * SEQ_LEN, dtype=np.int64)
    for completion in out:
        tokens = list(completion.token_ids)
        assert len(tokens) == params.max_tokens
        counts[tuple(tokens[:SEQ_LEN])] += 1
    return counts, llm.get_spec_decoding_stats()


def params_for(top_p: float, seed: int | None, temperature: float = 1.0,
               top_k: int | None = None) -> SamplingParams:
    # n children of a seeded request get seeds seed + i: independent, reproducible.
    return SamplingParams(n=N, temperature=temperature, top_p=top_p, top_k=top_k or 0,
                          max_tokens=SEQ_LEN + 1, ignore_eos=True, detokenize=False,
                          seed=seed)


def _llm(target_dir: Path, speculative_config: dict | None) -> LLM:
    return LLM(str(target_dir), device="cpu", dtype="float32", max_model_len=64, seed=0,
               max_num_seqs=1024, max_num_batched_tokens=16384,
               speculative_config=speculative_config)


@pytest.fixture(scope="module")
def draft_llm(target_dir, draft_dir) -> LLM:
    return _llm(target_dir, {"method": "draft_model", "model": str(draft_dir),
                             "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def ngram_llm(target_dir) -> LLM:
    return _llm(target_dir, {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_min": 1, "prompt_lookup_max": 2})


def check(llm: LLM, target_dir: Path, top_p: float, seed: int | None,
          temperature: float = 1.0, top_k: int | None = None) -> tuple[float, object]:
    if seed is None:
        # Unseeded requests draw from the process's default generator (the engine runs
        # in this process): pin it so the test does not depend on what ran before.
        torch.manual_seed(1234)
    counts, stats = sample_counts(llm, params_for(top_p, seed, temperature, top_k))
    exact = exact_distribution(target_dir, top_p, temperature, top_k)
    pvalue = chi_square_pvalue(counts, exact)
    print(f"top_p={top_p} T={temperature} top_k={top_k} seed={seed}: p-value {pvalue:.3g}, "
          f"{stats}")
    return pvalue, stats


def _assert_speculated(stats) -> None:
    assert stats is not None and stats.num_draft_tokens > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert len(stats.num_accepted_tokens_per_pos) == 2 and stats.num_accepted_tokens_per_pos[1] > 0


# -- deliberately wrong rules -------------------------------------------------------------
def resample_from_p(monkeypatch) -> None:
    """After a rejection, draw from p instead of norm(max(0, p - q))."""
    original = RejectionSampler._final_tokens

    def wrong(self, probs, greedy, metadata, layout, num_accepted, final_rows, draft_probs):
        n = int(layout.num_drafts.sum())
        zeros = torch.zeros(n, metadata.vocab_size, device=(probs if probs is not None
                                                            else greedy).device)
        return original(self, probs, greedy, metadata, layout, num_accepted, final_rows, zeros)

    monkeypatch.setattr(RejectionSampler, "_final_tokens", wrong)


def always_accept(monkeypatch) -> None:
    def wrong(self, probs, greedy, metadata, draft_rows, drafts, draft_probs):
        return torch.ones(drafts.numel(), dtype=torch.bool, device=drafts.device)

    monkeypatch.setattr(RejectionSampler, "_accept", wrong)


# -- tests --------------------------------------------------------------------------------
def test_draft_model_temperature_1(draft_llm, target_dir):
    pvalue, stats = check(draft_llm, target_dir, top_p=1.0, seed=None)
    _assert_speculated(stats)
    assert pvalue > PASS_P, pvalue


def test_draft_model_top_p(draft_llm, target_dir):
    pvalue, stats = check(draft_llm, target_dir, top_p=0.8, seed=1000)
    _assert_speculated(stats)
    assert pvalue > PASS_P, pvalue


def test_draft_model_wrong_residual_fails(draft_llm, target_dir, monkeypatch):
    resample_from_p(monkeypatch)
    pvalue, stats = check(draft_llm, target_dir, top_p=1.0, seed=None)
    _assert_speculated(stats)
    assert pvalue < FAIL_P, pvalue


def test_ngram_temperature_1(ngram_llm, target_dir):
    pvalue, stats = check(ngram_llm, target_dir, top_p=1.0, seed=2000)
    _assert_speculated(stats)
    assert pvalue > PASS_P, pvalue


def test_ngram_always_accept_fails(ngram_llm, target_dir, monkeypatch):
    always_accept(monkeypatch)
    pvalue, stats = check(ngram_llm, target_dir, top_p=1.0, seed=2000)
    assert pvalue < FAIL_P, pvalue


@pytest.mark.slow
def test_ngram_top_p(ngram_llm, target_dir):
    pvalue, stats = check(ngram_llm, target_dir, top_p=0.8, seed=3000)
    _assert_speculated(stats)
    assert pvalue > PASS_P, pvalue


@pytest.mark.slow
def test_draft_model_always_accept_fails(draft_llm, target_dir, monkeypatch):
    always_accept(monkeypatch)
    pvalue, _ = check(draft_llm, target_dir, top_p=0.8, seed=1000)
    assert pvalue < FAIL_P, pvalue


@pytest.mark.slow
def test_ngram_wrong_residual_fails(ngram_llm, target_dir, monkeypatch):
    resample_from_p(monkeypatch)
    pvalue, _ = check(ngram_llm, target_dir, top_p=1.0, seed=2000)
    assert pvalue < FAIL_P, pvalue


@pytest.mark.slow
def test_draft_model_tempered_top_k(draft_llm, target_dir):
    pvalue, stats = check(draft_llm, target_dir, top_p=1.0, seed=4000, temperature=0.7,
                          top_k=5)
    _assert_speculated(stats)
    assert pvalue > PASS_P, pvalue


# -- the degenerate and the reproducible cases --------------------------------------------
PROMPTS = [PROMPT, [3, 4, 5, 3, 4], [7, 2, 2, 6, 1, 0, 5], [2] * 9]


@pytest.fixture(scope="module")
def plain_llm(target_dir) -> LLM:
    return _llm(target_dir, None)


@pytest.mark.parametrize("which", ["draft", "ngram"])
def test_greedy_speculation_equals_plain_greedy(request, plain_llm, which):
    """Temperature 0: drafts are kept iff they are the argmax, so the output is exactly
    plain greedy decoding's."""
    spec_llm = request.getfixturevalue(f"{which}_llm")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    want = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, params, use_tqdm=False)]
    spec_llm.get_spec_decoding_stats()
    got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    stats = spec_llm.get_spec_decoding_stats()
    assert stats.num_draft_tokens > 0


def test_seeded_request_repeats_itself_in_another_batch(draft_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True,
                            detokenize=False, seed=77)
    alone = draft_llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, detokenize=False)
    batch = draft_llm.generate(PROMPTS, [others, params, others, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
