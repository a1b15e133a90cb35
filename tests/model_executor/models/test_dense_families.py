"""Dense decoder families against transformers (float32, greedy): Phi-3 with LongRoPE on
3/4 of each head and fused checkpoint tensors, OLMo 2 (post-norms, whole-projection q/k
norms), Granite (its four multipliers), SmolLM3 (a NoPE layer, a sliding one), GLM-4
(sandwich norms, interleaved half rotary) and Ernie 4.5 (interleaved rotary, biases).

The reference is transformers' own cached generation (``generate`` with its per-step
logits). For Phi-3 past ``original_max_position_embeddings`` (32) it is transformers'
model decoding one token at a time over its cache, so that position 32 on gets the long
factors (transformers' rotary module switching by itself): ``generate`` instead drops the
cache at that point and recomputes every earlier key with the long factors, which a paged
cache cannot mirror (see engine/model_executor/models/phi3.py). A divergence is
tolerated only at a verified near-tie, and the sampled tokens' logprobs must match up to
it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.entrypoints.test_llm_equivalence import _prompts
from tests.helpers.equivalence import assert_outputs_equivalent
from tests.helpers.hf_reference import (
    assert_matches_reference,
    hf_generate_with_logprobs,
    load_hf_model,
    sampled_logprobs,
)

MAX_TOKENS = 16
ENGINE = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 96,
          "max_model_len": 128, "block_size": 8}
VARIANTS = ["phi3-longrope", "olmo2", "granite", "smollm3", "glm4", "ernie45"]
BIASED = {"glm4", "ernie45"}  # their projections carry biases: made random, not zero
# Prompts end at or before position 31 (transformers prefills a longer prompt with the
# long factors throughout, which no paged cache can mirror), generation runs past it.
PROMPT_LENGTHS = [3, 17, 30]


def _greedy(logprobs: int | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens,
                          logprobs=logprobs)


@torch.inference_mode()
def _hf_stepwise(hf, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with transformers' model over its own cache, one token a step
    (no cache reset where LongRoPE switches factors)."""
    from transformers import DynamicCache

    cache, ids, tokens, logits = DynamicCache(config=hf.config), prompt, [], []
    for _ in range(max_tokens):
        start = len(prompt) + len(tokens) - len(ids)
        step = hf(torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                  cache=cache, use_cache=True).logits[0, -1]
        mask = step.clone()
        mask[hf.config.eos_token_id] = float("-inf")  # min_tokens, as generate masks it
        tokens.append(int(mask.argmax()))
        logits.append(step)
        ids = tokens[-1:]
    return tokens, torch.stack(logits).double().log_softmax(-1)


def _hf_generate(hf, prompt: list[int], max_tokens: int = MAX_TOKENS
                 ) -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy tokens and the float64 logprobs of each step's raw logits
    (step by step over the cache past a LongRoPE model's original context)."""
    original = getattr(hf.config, "original_max_position_embeddings", None)
    if original is not None and len(prompt) + max_tokens > original:
        return _hf_stepwise(hf, prompt, max_tokens)
    return hf_generate_with_logprobs(hf, prompt, max_tokens)


def _with_random_biases(path: Path, out: Path) -> Path:
    """A copy of the model directory whose biases (zeros as initialized) are random."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name, tensor in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype) * 0.5
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_family_matches_transformers(model_dir_factory, tmp_path, variant):
    path = model_dir_factory(variant)
    if variant in BIASED:
        path = _with_random_biases(path, tmp_path / variant)
    hf = load_hf_model(path)
    prompts = _prompts(hf.config.vocab_size, PROMPT_LENGTHS)
    with LLM(str(path), **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(logprobs=1),
                            use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want, ref = _hf_generate(hf, prompt)
        got = out.outputs[0]
        assert_matches_reference(list(got.token_ids), sampled_logprobs(got), want, ref)


def test_longrope_table_matches_transformers(model_dir_factory):
    """The engine's cos / sin at each position: transformers' short-factor ones inside
    the original context, its long-factor ones beyond (as its rotary module gives them
    when that position is the newest token), both scaled by the attention factor."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from engine.model_executor.layers.rotary import rotary_for_config

    hf = load_hf_model(model_dir_factory("phi3-longrope"))
    head = hf.config.hidden_size // hf.config.num_attention_heads
    ours = rotary_for_config(hf.config, head, dtype=torch.float32, device="cpu")
    theirs = Phi3RotaryEmbedding(hf.config)
    x = torch.zeros(1, dtype=torch.float32)
    half = ours.head_size // 2
    for p in (0, 5, 31, 32, 40, 127):
        cos, sin = theirs(x, torch.tensor([[p]]))
        got_cos, got_sin = ours.cos_sin(torch.tensor([p]))
        torch.testing.assert_close(got_cos.flatten(), cos[0, 0, :half], atol=0, rtol=0)
        torch.testing.assert_close(got_sin.flatten(), sin[0, 0, :half], atol=0, rtol=0)
    short, long = ours.cos_sin(torch.tensor([31]))[0], ours.cos_sin(torch.tensor([32]))[0]
    assert not torch.equal(short, long)  # the long factors do take over
    # The step-by-step reference is generate's own decoding where no reset happens.
    prompt = _prompts(hf.config.vocab_size, [5], seed=2)[0]
    tokens, logprobs = _hf_stepwise(hf, prompt, 8)
    want, ref = _hf_generate(hf, prompt, 8)
    assert tokens == want
    torch.testing.assert_close(logprobs, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefix_cache_chunked_prefill_and_preemption(model_dir_factory, variant):
    """Each family (Phi-3: LongRoPE crossing position 32) with a shared two-block prefix,
    a 16-token step budget (prompts are prefilled in chunks) and a pool too small for the
    batch: outputs still equal transformers'."""
    path = model_dir_factory(variant)
    hf = load_hf_model(path)
    prefix = _prompts(hf.config.vocab_size, [16], seed=3)[0]
    tails = _prompts(hf.config.vocab_size, [6, 9, 12, 14], seed=4)
    prompts = [prefix + t for t in tails]
    # The smallest pool one sequence fits (SmolLM3's sliding and full layers make
    # one-layer KV cache groups, each with its own table).
    blocks = 21 if variant == "smollm3" else 10
    engine = {**ENGINE, "num_gpu_blocks_override": blocks, "max_model_len": 64,
              "max_num_batched_tokens": 16,
              "enable_chunked_prefill": True, "enable_prefix_caching": True}
    with LLM(str(path), **engine) as llm:
        core = llm.llm_engine.client.core
        first = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(logprobs=1),
                             use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                            _greedy(logprobs=1), use_tqdm=False)
        preemptions = core.scheduler.num_preemptions_total
    outs = first + rest
    assert preemptions > 0
    assert max(o.num_cached_tokens for o in rest) >= 16, [o.num_cached_tokens for o in rest]
    for prompt, out in zip(prompts, outs):
        want, ref = _hf_generate(hf, prompt)
        got = out.outputs[0]
        assert_matches_reference(list(got.token_ids), sampled_logprobs(got), want, ref)


@pytest.mark.parametrize("variant", ["phi3-longrope", "olmo2"])
def test_tensor_parallel_matches_one_process(model_dir_factory, variant):
    """Two ranks give the one-process outputs. Phi-3: its fused qkv_proj / gate_up_proj
    tensors are cut into q / k / v (gate / up) before each rank takes its heads. OLMo 2:
    the q / k norms over the whole projection reduce their mean square over the ranks."""
    path = model_dir_factory(variant)
    prompts = [{"prompt_token_ids": p} for p in _prompts(200, [3, 9, 17, 30], seed=1)]
    params = _greedy(logprobs=2)
    with LLM(str(path), **ENGINE) as ref:
        want = ref.generate(prompts, params, use_tqdm=False)
        total = ref.llm_engine.client.core.executor.weights_bytes
    with LLM(str(path), **ENGINE, tensor_parallel_size=2) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        per_rank = llm.llm_engine.client.core.executor.rank_weights_bytes
    assert_outputs_equivalent(want, got)
    assert all(0.3 * total < b < 0.8 * total for b in per_rank), (per_rank, total)


def test_fused_checkpoint_tensors_are_cut_by_the_config():
    """A fused tensor becomes its parts (views, in order); one whose rows disagree with
    the config, or a quantized one, is a clear error rather than a silent misload."""
    from engine.model_executor.models.phi3 import unfuse_checkpoint

    splits = ((".qkv_proj.", ((".q_proj.", 4), (".k_proj.", 2), (".v_proj.", 2))),)
    fused = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    parts = dict(unfuse_checkpoint([("l.qkv_proj.weight", fused), ("l.o.weight", fused)],
                                   splits))
    assert list(parts) == ["l.q_proj.weight", "l.k_proj.weight", "l.v_proj.weight", "l.o.weight"]
    assert torch.equal(torch.cat([parts[f"l.{p}_proj.weight"] for p in "qkv"]), fused)
    with pytest.raises(ValueError, match="has 7 rows, the config implies 8"):
        list(unfuse_checkpoint([("l.qkv_proj.weight", fused[:7])], splits))
    with pytest.raises(ValueError, match="only unquantized"):
        list(unfuse_checkpoint([("l.qkv_proj.qweight", fused)], splits))
