"""The engine's greedy output equals transformers' on small random models.

Reference: transformers ``generate`` run one prompt at a time, unpadded, float32. A
divergence is accepted only where transformers' own top-2 logprobs at that position are
within 1e-3 (a near-tie), which the check verifies; after it the sequences may differ.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.hf_reference import cpu_llm as _engine
from tests.helpers.hf_reference import load_hf_model as _hf_model

MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 5, 16, 17, 33, 48]


def _prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def assert_greedy_equivalent(model, prompt: list[int], got: list[int], want: list[int],
                             tie: float = 1e-3) -> None:
    """``got == want`` up to a verified near-tie (top-2 logprobs within ``tie``) in
    transformers' distribution."""
    for j, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        ctx = torch.tensor([prompt + want[:j]])
        logprobs = model(ctx).logits[0, -1].double().log_softmax(-1)
        top = logprobs.topk(2)
        gap = float(top.values[0] - top.values[1])
        assert gap < tie and g in top.indices.tolist(), (
            f"diverged at output {j}: engine {g}, transformers {w}, top-2 gap {gap:.2e}"
        )
        return
    assert len(got) == len(want), (got, want)


def _greedy() -> SamplingParams:
    # min_tokens = max_tokens: EOS is masked exactly as transformers' min_new_tokens does.
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


@pytest.mark.parametrize(
    "variant",
    ["llama-gqa", "llama-mha", "llama-mqa-tied", "llama-headdim48", "mistral", "mistral-sw",
     "qwen2", "qwen3"],
)
def test_greedy_matches_transformers_per_architecture(model_dir_factory, variant):
    path = model_dir_factory(variant)
    hf = _hf_model(path)
    llm = _engine(path)
    prompts = _prompts(hf.config.vocab_size)
    for prompt in prompts:  # one at a time, like the reference
        out = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0]
        assert_greedy_equivalent(hf, prompt, list(out.outputs[0].token_ids), _hf_greedy(hf, prompt))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(model_dir_factory, rope):
    path = model_dir_factory("llama-gqa", rope_parameters={"rope_theta": 10000.0, **rope})
    hf = _hf_model(path)
    llm = _engine(path)
    for prompt in _prompts(hf.config.vocab_size, lengths=[7, 40]):
        out = llm.generate(prompt, _greedy(), use_tqdm=False)[0]
        assert_greedy_equivalent(hf, prompt, list(out.outputs[0].token_ids), _hf_greedy(hf, prompt))


@pytest.fixture(scope="module")
def llama_reference(llama_dir):
    hf = _hf_model(llama_dir)
    prompts = _prompts(hf.config.vocab_size, lengths=[3, 16, 17, 30, 47, 9, 64, 21])
    return hf, prompts, [_hf_greedy(hf, p) for p in prompts]


def _check_batch(llm: LLM, reference) -> None:
    hf, prompts, expected = reference
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order kept
    for prompt, out, want in zip(prompts, outputs, expected):
        assert_greedy_equivalent(hf, prompt, list(out.outputs[0].token_ids), want)


def test_all_at_once_matches_one_at_a_time(llama_dir, llama_reference):
    _check_batch(_engine(llama_dir), llama_reference)


def test_without_the_cpu_c_kernels(llama_dir, llama_reference, monkeypatch):
    """The torch-op path a machine without a C compiler runs (plain K layout, SDPA
    decode, unfused norms, rotary and argmax) gives the same greedy tokens."""
    from engine.plugins.cpu import attention as cpu_attention
    from engine.plugins.cpu import native

    monkeypatch.setattr(native, "load_kernels", lambda: None)
    monkeypatch.setattr(cpu_attention, "load_kernels", lambda: None)
    llm = _engine(llama_dir)
    runner = llm.llm_engine.client.core.executor.runner
    assert runner.platform.fused_ops() is None
    model = runner.model.model
    assert model.norm.fused_ops is None and model.layers[0].self_attn.attn.impl.kernels is None
    _check_batch(llm, llama_reference)


def test_chunked_prefill_under_small_token_budget(llama_dir, llama_reference):
    llm = _engine(llama_dir, max_num_batched_tokens=8, enable_chunked_prefill=True)
    _check_batch(llm, llama_reference)


def test_preemption_under_small_kv_pool(llama_dir, llama_reference):
    llm = _engine(llama_dir, num_gpu_blocks_override=12, block_size=8, max_model_len=80)
    _check_batch(llm, llama_reference)
    stats = llm.llm_engine.client.core.get_stats()
    assert stats.num_preemptions > 0


def test_prefix_caching_on_and_off_agree(llama_dir):
    hf = _hf_model(llama_dir)
    rng = random.Random(1)
    shared = [rng.randrange(5, hf.config.vocab_size) for _ in range(40)]
    prompts = [shared + [rng.randrange(5, hf.config.vocab_size) for _ in range(k)]
               for k in (1, 4, 9, 16)]
    expected = [_hf_greedy(hf, p) for p in prompts]
    for caching in (False, True):
        llm = _engine(llama_dir, enable_prefix_caching=caching)
        llm.generate(prompts[0], _greedy(), use_tqdm=False)  # warm the cache
        outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
        for prompt, out, want in zip(prompts, outputs, expected):
            assert_greedy_equivalent(hf, prompt, list(out.outputs[0].token_ids), want)
        stats = llm.llm_engine.client.core.get_stats()
        if caching:
            assert stats.prefix_cache_hits > 0
            assert all(o.num_cached_tokens >= 32 for o in outputs)
        else:
            assert stats.prefix_cache_hits == 0


def test_bfloat16_logprobs_close_to_transformers(llama_dir):
    hf = _hf_model(llama_dir)
    llm = _engine(llama_dir, dtype="bfloat16")
    prompt = _prompts(hf.config.vocab_size, lengths=[20])[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=3)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    seq = prompt + list(out.token_ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([seq])).logits[0].double().log_softmax(-1)
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        want = float(ref[len(prompt) - 1 + j, tok])
        assert abs(lp[tok].logprob - want) < 0.1, (j, lp[tok].logprob, want)


@pytest.mark.parametrize(
    "variant", ["llama-gqa", "llama-mqa-tied", "llama-headdim48", "mistral-sw", "qwen2", "qwen3"]
)
def test_bfloat16_batched_logprobs_close_to_transformers(model_dir_factory, variant):
    """bf16 end to end, several requests per step (the CPU plugin's bf16 GEMMs at M > 1,
    the tied head's GEMV, paged decode attention over dim-pair keys, windows, biases):
    scored by transformers in float32, the engine's tokens must be as close as
    transformers' own bfloat16 model is (its error is the floor bf16 allows)."""
    path = model_dir_factory(variant)
    hf = _hf_model(path)
    hf_bf16 = _hf_model(path).to(torch.bfloat16)
    llm = _engine(path, dtype="bfloat16")
    prompts = _prompts(hf.config.vocab_size, lengths=[3, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine_err, hf_bf16_err = _logprob_errors(hf, hf_bf16, prompts, outs)
    assert engine_err <= 1.25 * hf_bf16_err + 0.02, (engine_err, hf_bf16_err)


def _logprob_errors(hf, hf_bf16, prompts, outs) -> tuple[float, float]:
    """The largest distance of the engine's sampled-token logprobs, and of transformers'
    bfloat16 model's, from transformers' float32 ones on the engine's sequences."""
    engine_err = hf_bf16_err = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        ids = torch.tensor([prompt + tokens])
        with torch.inference_mode():
            ref = hf(ids).logits[0].double().log_softmax(-1)
            ref_bf16 = hf_bf16(ids).logits[0].double().log_softmax(-1)
        for j, (tok, lp) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            pos = len(prompt) - 1 + j
            want = float(ref[pos, tok])
            engine_err = max(engine_err, abs(lp[tok].logprob - want))
            hf_bf16_err = max(hf_bf16_err, abs(float(ref_bf16[pos, tok]) - want))
    return engine_err, hf_bf16_err


def _narrow_weight_levels() -> list[str]:
    """ISA levels this CPU runs that have no bf16 dot products (where --dtype auto keeps a
    bf16 checkpoint's weights and computes in float32), lowest first."""
    from engine.plugins.cpu import kernel_build

    return [lv.name for lv in kernel_build.runnable_levels() if not lv.bf16_dot]


@pytest.mark.parametrize(
    "variant,level",
    [("llama-gqa", level) for level in _narrow_weight_levels()]
    + [(v, _narrow_weight_levels()[-1])
       for v in ("llama-mqa-tied", "mistral-sw", "qwen2", "qwen3")],
)
def test_a_bf16_checkpoint_without_bf16_dot_products_computes_in_float32(
    model_dir_factory, variant, level, monkeypatch
):
    """--dtype auto on a CPU without bf16 arithmetic (the level forced through
    $ENGINE_CPU_ISA): bf16 weights and KV cache, float32 activations, the C kernels of that
    level throughout. Scored by transformers in float32 on the same bf16 weights, the
    tokens are greedy-equivalent and the logprobs far closer than transformers' own bf16
    model gets (only the KV cache's rounding separates the two)."""
    monkeypatch.setenv("ENGINE_CPU_ISA", level)
    path = model_dir_factory(variant, dtype=torch.bfloat16)
    hf = _hf_model(path)  # float32 arithmetic on the checkpoint's bf16 values
    hf_bf16 = _hf_model(path, dtype=torch.bfloat16)
    llm = LLM(str(path), device="cpu", max_model_len=128)  # dtype auto
    runtime = llm.llm_engine.client.core.executor.runtime_info()
    assert runtime["isa_level"] == level
    assert (runtime["weight_dtype"], runtime["activation_dtype"], runtime["kv_cache_dtype"]) == (
        "bfloat16", "float32", "bfloat16")
    assert "F.linear" not in runtime["gemm_kernels"], runtime["gemm_kernels"]
    prompts = _prompts(hf.config.vocab_size, lengths=[3, 17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        # near-ties up to what a bf16 KV cache may move a logprob by (bounded below)
        tokens = list(out.outputs[0].token_ids)
        assert_greedy_equivalent(hf, prompt, tokens, _hf_greedy(hf, prompt, 8), tie=0.02)
    engine_err, hf_bf16_err = _logprob_errors(hf, hf_bf16, prompts, outs)
    assert engine_err <= 0.5 * hf_bf16_err + 1e-3, (engine_err, hf_bf16_err)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="does not exist|not found|no such"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_unknown_architecture_is_a_clear_error(tmp_path, llama_dir):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(str(bad), device="cpu")


def test_prompt_longer_than_max_model_len_is_rejected(llama_dir):
    llm = _engine(llama_dir, max_model_len=32)
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate([7] * 40, _greedy(), use_tqdm=False)
    # The engine is still usable afterwards, and nothing leaked.
    out = llm.generate([7] * 4, _greedy(), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
