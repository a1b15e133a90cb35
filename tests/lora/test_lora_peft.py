"""Multi-LoRA serving against PEFT (transformers + ``PeftModel``, float32, greedy).

Tiny Llama (GQA) and Qwen2 (q/k/v biases) bases and random PEFT adapters (both A and B
random, see :mod:`tests.helpers.lora_models`) are built once per module. Each engine
output (greedy tokens, the sampled tokens' logprobs and the top-k logprobs) must equal
PEFT's reference for that request's adapter (or the plain base without one), a token
divergence being tolerated only at a verified near-tie of the reference (top-2 within
1e-3), logprobs within 2e-4 until then (the tolerances of
:func:`tests.helpers.hf_reference.assert_matches_reference`). PEFT unmerged vs merged
differ by < 4e-5 on these adapters, well inside that.

What is exercised: one batch mixing four adapters and base prompts with ``max_loras=2``
(the scheduler rotates adapters) and prompts longer than the 32-token chunk; adapters of
ranks 4 .. 32, rsLoRA and per-module rank / alpha patterns in one batch; the prefix
cache kept per adapter; refusals (DoRA, embed_tokens / lm_head / modules_to_save
targets, rank above ``max_lora_rank``, an adapter for another base, missing files,
``lora_request`` without ``enable_lora``) with the engine serving on afterwards;
``add_lora`` / ``remove_lora`` / ``list_loras``; the host LRU (``max_cpu_loras`` below the
adapters used); n-gram speculative decoding (drafts accepted on a greedy-cycle base,
rejected on a random one); chat; the same mixed batch on Qwen2; and (slow) tensor
parallelism and an int4 weight-only quantized base (compressed-tensors W4A16, PEFT on
its dequantized float32 weights).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LoRARequest, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, cpu_llm, sampled_logprobs
from tests.helpers.lora_models import (
    ALL_TARGETS,
    BAD_ADAPTERS,
    GOOD_ADAPTERS,
    build_adapter_set,
    build_llama_base,
    build_qwen2_base,
    generate_reference,
    load_peft_model,
    make_peft_adapter,
)

MAX_TOKENS = 10
TOP_K = 3
TIE = 1e-3
ATOL = 2e-4
CHUNK = 32  # max_num_batched_tokens: the long prompts are prefilled in several chunks
PROMPT_LENGTHS = [6, 45, 70]
LORA_IDS = {spec.name: i + 1 for i, spec in enumerate(GOOD_ADAPTERS)}
LORA_IDS.update(cyc_all=50, cyc_out=51)  # the cycle model's adapters (n-gram test)
CYCLE = "QZXJWYGBMDFHLNRSUEIA"
MIXED = ["r8_all", "r4_qv", "r16_down", "r32_all"]  # 4 adapters with max_loras=2
ENGINE: dict[str, Any] = {
    "enable_lora": True, "max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 8,
    "max_model_len": 128, "block_size": 8, "enable_chunked_prefill": True,
    "max_num_batched_tokens": CHUNK, "max_num_seqs": 8, "enable_prefix_caching": True,
}


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens,
                          logprobs=TOP_K)


def make_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


class Fixture:
    """One base, its adapters and PEFT's references (computed lazily, memoized)."""

    def __init__(self, base: Path, adapters: dict[str, Path]) -> None:
        self.base = base
        self.adapters = adapters
        self.vocab = _vocab(base)
        self._models: dict[str | None, Any] = {}
        self._refs: dict[tuple, Any] = {}

    def request(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        return LoRARequest(name, LORA_IDS[name], str(self.adapters[name]))

    def ref(self, name: str | None, prompt: list[int], max_tokens: int = MAX_TOKENS):
        key = (name, tuple(prompt), max_tokens)
        if key not in self._refs:
            if name not in self._models:
                self._models[name] = load_peft_model(
                    self.base, None if name is None else self.adapters[name])
            (self._refs[key],) = generate_reference(self._models[name], [prompt], max_tokens,
                                                    TOP_K)
        return self._refs[key]


def _vocab(base: Path) -> int:
    import json

    return json.loads((base / "config.json").read_text())["vocab_size"]


def assert_equals_peft(fx: Fixture, output: Any, name: str | None, prompt: list[int],
                       label: str = "", max_tokens: int = MAX_TOKENS) -> None:
    """``output`` (a RequestOutput, greedy with logprobs) equals PEFT's reference for
    adapter ``name``: tokens up to a near-tie, sampled and top-k logprobs until then."""
    ref = fx.ref(name, prompt, max_tokens)
    completion = output.outputs[0]
    got = list(completion.token_ids)
    where = f"{label} adapter={name} prompt_len={len(prompt)}"
    try:
        assert_matches_reference(got, sampled_logprobs(completion), ref.tokens, ref.logprobs,
                                 tie=TIE, atol=ATOL)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}\n engine {got}\n peft   {ref.tokens}") from None
    agree = next((j for j, (g, w) in enumerate(zip(got, ref.tokens)) if g != w), len(got))
    for j in range(agree):
        for token, lp in completion.logprobs[j].items():
            want = float(ref.logprobs[j, token])
            assert abs(lp.logprob - want) <= ATOL, (
                f"{where}: step {j} token {token} logprob {lp.logprob} vs peft {want}")


def run(llm, fx: Fixture, jobs: list[tuple[str | None, list[int]]],
        max_tokens: int = MAX_TOKENS):
    """Generate ``jobs`` ((adapter name or None, prompt) each) in one call."""
    return llm.generate([{"prompt_token_ids": p} for _, p in jobs], greedy(max_tokens),
                        lora_request=[fx.request(n) for n, _ in jobs], use_tqdm=False)


def check_batch(llm, fx: Fixture, jobs, label: str = "", max_tokens: int = MAX_TOKENS):
    outs = run(llm, fx, jobs, max_tokens)
    assert len(outs) == len(jobs)
    for (name, prompt), out in zip(jobs, outs):
        assert list(out.prompt_token_ids) == prompt
        assert_equals_peft(fx, out, name, prompt, label, max_tokens)
    return outs


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Fixture:
    root = tmp_path_factory.mktemp("lora_llama")
    base = build_llama_base(root / "base")
    return Fixture(base, build_adapter_set(base, root / "adapters"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Fixture:
    root = tmp_path_factory.mktemp("lora_qwen2")
    base = build_qwen2_base(root / "base")
    return Fixture(base, build_adapter_set(base, root / "adapters"))


@pytest.fixture(scope="module")
def bad_adapters(llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_bad")
    return build_adapter_set(llama.base, root, [spec for spec, _ in BAD_ADAPTERS])


@pytest.fixture(scope="module")
def llama_llm(llama):
    llm = cpu_llm(llama.base, **ENGINE)
    yield llm
    llm.shutdown()


# ----------------------------------------------------------------------------- tests


def test_peft_fixtures_change_the_base(llama):
    """The reference side itself: every adapter changes the base's greedy tokens (an
    adapter with B = 0 would make the equivalence tests vacuous), and merged == unmerged."""
    prompt = make_prompts(llama.vocab, [20], seed=7)[0]
    base = llama.ref(None, prompt)
    for name in llama.adapters:
        ref = llama.ref(name, prompt)
        assert ref.tokens != base.tokens, name
    for name in ("r8_patterns", "r16_mlp_rslora"):
        merged = generate_reference(load_peft_model(llama.base, llama.adapters[name],
                                                    merged=True), [prompt], MAX_TOKENS)[0]
        torch.testing.assert_close(merged.logprobs, llama.ref(name, prompt).logprobs,
                                   atol=1e-4, rtol=0)


def test_mixed_batch_llama(llama, llama_llm):
    """Four adapters and the base in one generate call, two adapter slots (the scheduler
    must rotate), prompts longer than one chunk."""
    prompts = make_prompts(llama.vocab)
    jobs = [(name, p) for p in prompts for name in [*MIXED, None]]
    check_batch(llama_llm, llama, jobs, "mixed")


def test_ranks_rslora_and_patterns_in_one_batch(llama, llama_llm):
    """Ranks 4, 8, 16, 32 in one batch under max_lora_rank=32; rsLoRA (alpha / sqrt(r))
    and per-module rank_pattern / alpha_pattern scale like PEFT's."""
    prompts = make_prompts(llama.vocab, [9, 40], seed=1)
    names = ["r4_qv", "r8_attn_rslora", "r8_patterns", "r16_mlp_rslora", "r32_all"]
    check_batch(llama_llm, llama, [(n, p) for p in prompts for n in names], "ranks")


def test_prefix_cache_is_per_adapter(llama, llama_llm):
    """The same prompt under adapter A, then B, then the base: neither B nor the base may
    reuse A's cached KV; A again (and B again) does hit its own."""
    prompt = make_prompts(llama.vocab, [41], seed=2)[0]
    a, b = "r8_all", "r4_qv"
    first = check_batch(llama_llm, llama, [(a, prompt)], "cache A")[0]
    assert first.num_cached_tokens == 0
    second = check_batch(llama_llm, llama, [(b, prompt)], "cache B after A")[0]
    assert second.num_cached_tokens == 0, "adapter B reused adapter A's cached prefix"
    base = check_batch(llama_llm, llama, [(None, prompt)], "cache base after A, B")[0]
    assert base.num_cached_tokens == 0, "the base reused an adapter's cached prefix"
    again = check_batch(llama_llm, llama, [(a, prompt)], "cache A again")[0]
    assert again.num_cached_tokens > 0, "adapter A missed its own cached prefix"
    b_again = check_batch(llama_llm, llama, [(b, prompt)], "cache B again")[0]
    assert b_again.num_cached_tokens > 0, "adapter B missed its own cached prefix"


def _without(src: Path, dst: Path, drop: str) -> Path:
    shutil.copytree(src, dst)
    (dst / drop).unlink()
    return dst


def test_refusals_leave_the_engine_serving(llama, llama_llm, bad_adapters, tmp_path):
    """Each adapter the engine cannot serve is a ValueError naming the problem; after
    each, a good request (and the same id with a good adapter) still works and the bad
    adapter is not listed."""
    good = llama.adapters["r8_all"]
    cases = [(bad_adapters[spec.name], word) for spec, word in BAD_ADAPTERS]
    cases += [
        (_without(good, tmp_path / "no_config", "adapter_config.json"), "adapter_config"),
        (_without(good, tmp_path / "no_weights", "adapter_model.safetensors"),
         "adapter_model|weight|safetensors"),
        (tmp_path / "does_not_exist", "does_not_exist|not found|no such|exist"),
    ]
    prompt = make_prompts(llama.vocab, [12], seed=3)[0]
    for i, (path, word) in enumerate(cases):
        lora_id = 100 + i
        bad = LoRARequest(f"bad{i}", lora_id, str(path))
        with pytest.raises(ValueError, match=f"(?i){word}"):
            llama_llm.generate([{"prompt_token_ids": prompt}], greedy(), lora_request=bad,
                               use_tqdm=False)
        assert lora_id not in llama_llm.list_loras(), path.name
        with pytest.raises(ValueError, match=f"(?i){word}"):
            llama_llm.add_lora(bad)
        assert lora_id not in llama_llm.list_loras(), path.name
        check_batch(llama_llm, llama, [("r4_qv", prompt), (None, prompt)],
                    f"after refusing {path.name}")
    # a refused id is free for a good adapter afterwards
    reuse = LoRARequest("reuse", 100, str(llama.adapters["r16_down"]))
    out = llama_llm.generate([{"prompt_token_ids": prompt}], greedy(), lora_request=reuse,
                             use_tqdm=False)
    assert_equals_peft(llama, out[0], "r16_down", prompt, "reused id")


def test_refusal_in_a_batch_serves_nothing_half_way(llama, llama_llm, bad_adapters):
    """A batch with one bad adapter among good ones raises, and the next batch is
    served normally (no request of the failed call left running)."""
    prompt = make_prompts(llama.vocab, [15], seed=4)[0]
    bad = LoRARequest("dora", 150, str(bad_adapters["dora"]))
    with pytest.raises(ValueError, match="(?i)dora"):
        llama_llm.generate([{"prompt_token_ids": prompt}] * 2, greedy(),
                           lora_request=[llama.request("r8_all"), bad], use_tqdm=False)
    check_batch(llama_llm, llama, [("r8_all", prompt), (None, prompt)], "after bad batch")


def test_add_remove_list_loras(llama, llama_llm):
    """add_lora loads ahead of use, list_loras reports it, remove_lora drops it (False
    for an unknown id) and a removed adapter can be used again by request."""
    a, b = llama.request("r16_mlp_rslora"), llama.request("r8_patterns")
    for r in (a, b):
        llama_llm.remove_lora(r.lora_int_id)
    assert a.lora_int_id not in llama_llm.list_loras()
    assert llama_llm.add_lora(a) is True
    assert llama_llm.add_lora(b) is True
    assert {a.lora_int_id, b.lora_int_id} <= llama_llm.list_loras()
    prompt = make_prompts(llama.vocab, [33], seed=5)[0]
    check_batch(llama_llm, llama, [("r16_mlp_rslora", prompt), ("r8_patterns", prompt)],
                "preloaded")
    assert llama_llm.remove_lora(a.lora_int_id) is True
    assert a.lora_int_id not in llama_llm.list_loras()
    assert b.lora_int_id in llama_llm.list_loras()
    assert llama_llm.remove_lora(a.lora_int_id) is False
    assert llama_llm.remove_lora(9999) is False
    check_batch(llama_llm, llama, [("r16_mlp_rslora", prompt)], "after remove")


def test_chat_with_lora(llama, llama_llm):
    """llm.chat with a lora_request equals PEFT on the chat-templated prompt."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    tok = AutoTokenizer.from_pretrained(llama.base)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    out = llama_llm.chat(messages, greedy(), lora_request=llama.request("r4_qv"),
                         use_tqdm=False)
    assert list(out[0].prompt_token_ids) == list(prompt)
    assert_equals_peft(llama, out[0], "r4_qv", list(prompt), "chat")


def test_enable_lora_false_refuses_lora_request(llama):
    """A lora_request to an engine without enable_lora is a ValueError."""
    llm = cpu_llm(llama.base, max_model_len=128)
    try:
        prompt = make_prompts(llama.vocab, [8], seed=6)[0]
        with pytest.raises(ValueError, match="(?i)lora"):
            llm.generate([{"prompt_token_ids": prompt}], greedy(),
                         lora_request=llama.request("r8_all"), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)
        assert_equals_peft(llama, out[0], None, prompt, "no-lora engine")
    finally:
        llm.shutdown()


def test_host_lru_eviction_and_reload(llama):
    """max_cpu_loras=2 with five adapters used in turn: evicted adapters are read again
    from disk and give the same outputs; the host cache (the in-process worker's
    manager, looked at directly) never holds more than 2 and does reload."""
    llm = cpu_llm(llama.base, **{**ENGINE, "max_cpu_loras": 2, "enable_prefix_caching": False})
    try:
        manager = llm.llm_engine.client.core.executor.worker.lora_manager
        loads = []
        load = manager._load
        manager._load = lambda request: (loads.append(request.lora_int_id), load(request))[1]
        prompt = make_prompts(llama.vocab, [37], seed=8)[0]
        names = ["r8_all", "r4_qv", "r16_down", "r32_all", "r8_attn_rslora"]
        first = {}
        for name in names * 2:
            out = check_batch(llm, llama, [(name, prompt)], "lru")[0]
            tokens = list(out.outputs[0].token_ids)
            assert first.setdefault(name, tokens) == tokens, name
            assert len(manager._host) <= 2, list(manager._host)
        # every adapter was evicted before its second use, so read at least twice
        assert all(loads.count(LORA_IDS[n]) >= 2 for n in names), loads
        # and all of them in one batch (two device slots, two host slots)
        check_batch(llm, llama, [(n, prompt) for n in names], "lru batch")
        assert len(manager._host) <= 2, list(manager._host)
        assert {LORA_IDS[n] for n in names} <= llm.list_loras()
    finally:
        llm.shutdown()


def _repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts repeating a motif, so that prompt lookup proposes drafts."""
    rng = random.Random(9)
    prompts = []
    for n in (5, 7):
        motif = [rng.randrange(5, vocab) for _ in range(n)]
        prompts.append((motif * 8)[:40])
    return prompts


@pytest.fixture(scope="module")
def cycle(tmp_path_factory) -> Fixture:
    """A greedy-cycle base (tests.helpers.hf_models.make_greedy_cycle: it emits CYCLE's
    bytes forever, 32-nat margins) with two faint adapters: the cycle survives them (so
    n-gram drafts are accepted) while the other tokens' logprobs move by ~16 nats (so the
    top-k logprobs show whether the adapter was applied in the verifying pass)."""
    from tests.helpers.hf_models import build_model_dir

    root = tmp_path_factory.mktemp("lora_cycle")
    base = build_model_dir(root / "base", "llama-gqa", greedy_cycle=CYCLE)
    adapters = {
        "cyc_all": make_peft_adapter(base, root / "cyc_all", r=8, lora_alpha=16,
                                     target_modules=ALL_TARGETS, seed=3, delta_std=0.002),
        "cyc_out": make_peft_adapter(base, root / "cyc_out", r=16, lora_alpha=16,
                                     target_modules=["o_proj", "down_proj"], seed=4,
                                     delta_std=0.002),
    }
    return Fixture(base, adapters)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}


def test_ngram_spec_decode_with_lora(llama, cycle):
    """n-gram speculative decoding with adapters: PEFT's greedy tokens and logprobs.
    On the cycle model drafts are accepted; on the random one they are proposed and
    rejected."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cycle.base)
    prompts = [tok(CYCLE[:6])["input_ids"], tok(CYCLE[3:] + CYCLE[:5])["input_ids"]]
    llm = cpu_llm(cycle.base, **{**ENGINE, "enable_prefix_caching": False},
                  speculative_config=NGRAM)
    try:
        jobs = [(n, p) for p in prompts for n in ["cyc_all", "cyc_out", None]]
        outs = check_batch(llm, cycle, jobs, "ngram cycle", max_tokens=24)
        assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids or any(
            {t: round(lp.logprob) for t, lp in a.items()}
            != {t: round(lp.logprob) for t, lp in b.items()}
            for a, b in zip(outs[0].outputs[0].logprobs, outs[2].outputs[0].logprobs))
        stats = llm.get_spec_decoding_stats()
        assert stats.num_accepted_tokens > 0, f"no draft was accepted: {stats}"
    finally:
        llm.shutdown()
    llm = cpu_llm(llama.base, **{**ENGINE, "enable_prefix_caching": False},
                  speculative_config=NGRAM)
    try:
        jobs = [(n, p) for p in _repetitive_prompts(llama.vocab)
                for n in ["r8_all", "r32_all", "r4_qv", None]]
        check_batch(llm, llama, jobs, "ngram random", max_tokens=16)
        stats = llm.get_spec_decoding_stats()
        assert stats.num_draft_tokens > stats.num_accepted_tokens, (
            f"no draft was proposed and rejected: {stats}")
    finally:
        llm.shutdown()


def test_mixed_batch_qwen2(qwen2):
    """Qwen2 (biased q/k/v): four adapters + base, two slots, chunked prefill; adapters of
    every rank, rsLoRA and patterns."""
    llm = cpu_llm(qwen2.base, **ENGINE)
    try:
        prompts = make_prompts(qwen2.vocab)
        check_batch(llm, qwen2, [(n, p) for p in prompts for n in [*MIXED, None]], "qwen2")
        names = ["r8_attn_rslora", "r8_patterns", "r16_mlp_rslora"]
        check_batch(llm, qwen2, [(n, p) for p in prompts[:2] for n in names], "qwen2 ranks")
    finally:
        llm.shutdown()


def test_adapter_for_another_base_is_refused(llama, qwen2):
    """A Llama adapter on the Qwen2 base (other MLP width and KV heads) is refused by
    shape, and the engine serves on. Also checked: PEFT refuses it too."""
    prompt = make_prompts(qwen2.vocab, [10], seed=10)[0]
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_peft_model(qwen2.base, llama.adapters["r8_all"])
    llm = cpu_llm(qwen2.base, **{**ENGINE, "max_num_seqs": 4})
    try:
        for name in ("r8_all", "r16_down"):  # all targets / only down_proj
            wrong = LoRARequest(f"llama-{name}", 200 + LORA_IDS[name],
                                str(llama.adapters[name]))
            with pytest.raises(ValueError, match="(?i)shape|size|mismatch|fit|expect|features|another base"):
                llm.generate([{"prompt_token_ids": prompt}], greedy(), lora_request=wrong,
                             use_tqdm=False)
            assert wrong.lora_int_id not in llm.list_loras()
        check_batch(llm, qwen2, [("r8_all", prompt), (None, prompt)], "qwen2 after refusal")
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_lora(llama):
    """Two tensor-parallel ranks (column-parallel B rows, row-parallel A columns): the
    mixed batch equals PEFT's."""
    llm = cpu_llm(llama.base, **ENGINE, tensor_parallel_size=2)
    try:
        prompts = make_prompts(llama.vocab, [6, 45], seed=11)
        names = [*MIXED, "r8_patterns", None]
        check_batch(llm, llama, [(n, p) for p in prompts for n in names], "tp2")
    finally:
        llm.shutdown()


QUANT_FIXTURES = Path(__file__).resolve().parents[1] / "data" / "quant-fixtures"


@pytest.mark.slow
def test_int4_quantized_base_lora(tmp_path_factory):
    """An adapter over a compressed-tensors W4A16 (int4, group 64) base: the engine runs
    the quantized base, PEFT the same weights dequantized to float32 (the fixture's
    weight-only references are exact in float32)."""
    quant = QUANT_FIXTURES / "ct-w4a16-g64"
    if not quant.is_dir():
        pytest.skip("quant fixtures absent")
    from tests.helpers.lora_models import dequantized_copy

    root = tmp_path_factory.mktemp("lora_quant")
    dense = dequantized_copy("ct-w4a16-g64", root / "dense")
    adapters = {
        "r8_all": make_peft_adapter(dense, root / "r8_all", r=8, lora_alpha=16,
                                    target_modules=ALL_TARGETS, seed=31, delta_std=0.01),
        "r16_down": make_peft_adapter(dense, root / "r16_down", r=16, lora_alpha=16,
                                      target_modules=["down_proj"], seed=32, delta_std=0.01),
    }
    fx = Fixture(dense, adapters)
    llm = cpu_llm(quant, **{**ENGINE, "max_lora_rank": 16})
    try:
        prompts = make_prompts(fx.vocab, [7, 40], seed=12)
        check_batch(llm, fx, [(n, p) for p in prompts for n in ["r8_all", "r16_down", None]],
                    "int4 base")
    finally:
        llm.shutdown()
