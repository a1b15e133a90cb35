"""GPT-OSS against transformers (eager attention, float32): a tiny random model with one
sliding-window layer (window 8) and one full layer, learned attention sinks, YaRN RoPE,
4 experts top-2 with biases and the clamped SwiGLU; prompts longer than the window.
Then the same model as an MXFP4 checkpoint (experts quantized here by a float64 reference
quantizer, stored as ``*_blocks`` / ``*_scales`` with ``quant_method: mxfp4`` like the
GPT-OSS releases) against transformers running the dequantized weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

# The Triton attention backend runs interpreted on the CPU (as ci/test.sh sets it);
# set before engine.kernels is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from engine import LLM, SamplingParams
from tests.entrypoints.test_llm_equivalence import _hf_greedy, _prompts, assert_greedy_equivalent
from tests.helpers.hf_models import build_tokenizer
from tests.helpers.hf_reference import hf_logprobs
from tests.quantization.test_mxfp4 import reference_dequantize, reference_quantize

MAX_TOKENS = 10
ENGINE = {"dtype": "float32", "device": "cpu", "num_gpu_blocks_override": 64,
          "max_model_len": 96, "block_size": 8}
PROMPT_LENGTHS = [3, 13, 29]  # 13 and 29 are longer than the window of 8


def _config(vocab_size: int, tokenizer) -> object:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128},
        initializer_range=0.25, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _randomize(model) -> None:
    """Weights that exercise every GPT-OSS feature: sinks of order 1 (some heads mostly
    sink), non-zero biases, expert pre-activations large enough to hit the clamp."""
    g = torch.Generator().manual_seed(1)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                normal(p, 1.0)
            elif "norm" in name:
                normal(p, 0.1, 1.0)
            elif "experts.gate_up_proj" in name and not name.endswith("bias"):
                normal(p, 0.6)  # |gate/up| often above the limit of 7
            elif name.endswith("bias"):
                normal(p, 0.3)
            else:
                normal(p, 0.25)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> Path:
    from transformers import GptOssForCausalLM

    out = tmp_path_factory.mktemp("gpt-oss")
    tokenizer = build_tokenizer(out)
    torch.manual_seed(0)
    model = GptOssForCausalLM(_config(len(tokenizer), tokenizer))
    _randomize(model)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                          logprobs=1)


def _assert_matches_transformers(engine_dir: Path, hf, **engine) -> None:
    prompts = _prompts(hf.config.vocab_size, PROMPT_LENGTHS)
    with LLM(str(engine_dir), **ENGINE, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(),
                            use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outs):
        got = list(out.outputs[0].token_ids)
        want = _hf_greedy(hf, prompt, MAX_TOKENS)
        assert_greedy_equivalent(hf, prompt, got, want)
        if got == want:  # the sampled tokens' logprobs, as transformers scores them
            ref = hf_logprobs(hf, prompt + want)[len(prompt) - 1 : -1]
            expected = ref.gather(1, torch.tensor(want)[:, None]).squeeze(1)
            logprobs = torch.tensor([out.outputs[0].logprobs[j][t].logprob
                                     for j, t in enumerate(got)])
            torch.testing.assert_close(logprobs, expected.float(), atol=2e-4, rtol=0)
            compared += 1
    assert compared >= 2, "too many near-ties to compare logprobs"


def test_gpt_oss_matches_transformers(gpt_oss_dir):
    hf = _hf(gpt_oss_dir)
    # the features under test are live: sinks of order 1, a sliding layer, YaRN
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    assert float(hf.model.layers[0].self_attn.sinks.detach().abs().max()) > 0.5
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    _assert_matches_transformers(gpt_oss_dir, hf)


def test_gpt_oss_prefix_cache_chunked_prefill_and_preemption(gpt_oss_dir):
    """A shared three-block prefix, 16-token prefill chunks across the window and the
    smallest pool one sequence fits (two KV cache groups: full, sliding): prefix hits and
    preemptions happen, and the tokens are still transformers'."""
    hf = _hf(gpt_oss_dir)
    prefix = _prompts(hf.config.vocab_size, [24], seed=3)[0]
    prompts = [prefix + t for t in _prompts(hf.config.vocab_size, [6, 9, 12, 14], seed=4)]
    engine = {**ENGINE, "num_gpu_blocks_override": 13, "max_model_len": 64,
              "max_num_batched_tokens": 16, "enable_chunked_prefill": True}
    with LLM(str(gpt_oss_dir), **engine) as llm:
        first = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(), use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], _greedy(),
                            use_tqdm=False)
        assert llm.llm_engine.client.core.scheduler.num_preemptions_total > 0
    assert max(o.num_cached_tokens for o in rest) >= 16
    for prompt, out in zip(prompts, first + rest):
        want = _hf_greedy(hf, prompt, MAX_TOKENS)
        assert_greedy_equivalent(hf, prompt, list(out.outputs[0].token_ids), want)


def test_gpt_oss_on_the_triton_attention_backend_matches_transformers(gpt_oss_dir):
    """The GPU plugins' attention kernels (interpreted) with sinks and the window."""
    _assert_matches_transformers(gpt_oss_dir, _hf(gpt_oss_dir), attention_backend="triton")


def _write_mxfp4_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Copy ``src`` to ``dst`` with every expert projection as MXFP4 blocks / scales;
    return the float32 dequantized expert tensors (transformers' layout) by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    dense: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj",
                                                    "experts.down_proj"))]:
        weight = tensors.pop(name)  # [E, in, out]
        blocks, scales = reference_quantize(weight.transpose(1, 2).double())  # [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dense[name] = reference_dequantize(blocks, scales).transpose(1, 2).float()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dense


def test_gpt_oss_mxfp4_checkpoint_matches_transformers_on_dequantized_weights(
        gpt_oss_dir, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    dense = _write_mxfp4_checkpoint(gpt_oss_dir, tmp_path / "mxfp4")
    # transformers' own MXFP4 loader (dequantizing, as on a machine without its kernels)
    # reads the checkpoint as the float64 reference decodes it: the format is the real one
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    original = dict(_hf(gpt_oss_dir).named_parameters())
    params = dict(hf.named_parameters())
    for name, value in dense.items():
        assert torch.equal(params[name].float(), value), name
        # quantization moved the weights (the comparison would prove less otherwise)
        assert not torch.equal(original[name], value)
    _assert_matches_transformers(tmp_path / "mxfp4", hf)


def test_gpt_oss_mxfp4_loads_the_dequantized_experts(gpt_oss_dir, tmp_path, monkeypatch):
    """The engine's experts hold exactly the reference dequantization, de-interleaved
    (gate rows, then up rows) and transposed to ``[E, out, in]`` (read before the CPU
    kernel would repack them for its GEMM)."""
    from engine.core.interfaces import FusedMoEKernel
    from engine.model_executor.model_loader import load_model
    from engine.model_executor.models.gpt_oss import GptOssMoE
    from engine.plugins.cpu.attention import CPUAttentionBackend
    from engine.plugins.cpu.fused_moe import CPUFusedMoE

    monkeypatch.setattr(CPUFusedMoE, "prepare_weights", FusedMoEKernel.prepare_weights)

    dense = _write_mxfp4_checkpoint(gpt_oss_dir, tmp_path / "mxfp4")
    backend = CPUAttentionBackend(block_size=8, device=torch.device("cpu"))
    net = load_model(tmp_path / "mxfp4", torch.float32, "cpu", backend,
                     fused_moe_kernels=[CPUFusedMoE])
    layers = [m for m in net.modules() if isinstance(m, GptOssMoE)]
    assert len(layers) == 2
    for i, layer in enumerate(layers):
        experts = layer.experts
        gate_up = dense[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, H, 2I]
        want = torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), dim=2).transpose(1, 2)
        assert torch.equal(experts.w13, want)
        down = dense[f"model.layers.{i}.mlp.experts.down_proj"]  # [E, I, H]
        assert torch.equal(experts.w2, down.transpose(1, 2))
        assert not hasattr(experts, "gate_up_proj_blocks")  # dropped after dequantizing

