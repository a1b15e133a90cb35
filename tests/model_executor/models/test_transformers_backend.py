"""The Transformers modeling backend (``model_impl``) against transformers itself.

Tiny random-weight models (2 layers, hidden 64, a ~390-token BPE vocabulary) of
architectures the engine does not implement natively run through transformers' own
modeling code on the engine's paged attention, linear layers and fused-MoE kernel; their
greedy tokens equal transformers' (float32, one prompt at a time, a divergence only at a
verified near-tie), with prompts longer than every sliding window / attention chunk.
Also: prefix-cache hits, chunked prefill and preemption; ``model_impl="transformers"`` on
Llama equal to the native Llama; the refusals and their reasons; what is reported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from tests.entrypoints.test_llm_equivalence import _hf_greedy, _prompts, assert_greedy_equivalent
from tests.helpers.hf_models import build_model_dir, build_tokenizer
from tests.helpers.hf_reference import load_hf_model

MAX_TOKENS = 6
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "block_size": 8,
          "num_gpu_blocks_override": 64}
BACKEND = {**ENGINE, "model_impl": "transformers"}
PROMPT_LENGTHS = [5, 37]  # 37 > every window (8) and attention chunk (8) below
SW = {"sliding_window": 8}
SW_TYPES = {**SW, "layer_types": ["sliding_attention", "full_attention"]}

# name -> (config class, config overrides). None of these architectures is registered
# natively; each one's attention calls transformers' attention interface.
DENSE = {
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, **SW,
                                "attn_logit_softcapping": 20.0,
                                "final_logit_softcapping": 10.0}),
    # Tied to its scaled embedding (a transformers module the backend keeps).
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, **SW_TYPES, "tie_word_embeddings": True}),
    "phi": ("PhiConfig", {}),
    "phi3": ("Phi3Config", {}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", SW),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5, "attention_multiplier": 0.2}),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
    "cohere": ("CohereConfig", {"logit_scale": 0.5}),
    "cohere2": ("Cohere2Config", {**SW, "logit_scale": 0.5}),
    "glm": ("GlmConfig", {}),
    "olmo_tied": ("OlmoConfig", {"tie_word_embeddings": True}),  # no lm_head.weight saved
    "glm4": ("Glm4Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.5}),
    "starcoder2": ("Starcoder2Config", SW),
    "ernie4_5": ("Ernie4_5Config", {}),
    "exaone4": ("Exaone4Config", SW_TYPES),
    "hunyuan": ("HunYuanDenseV1Config", {"head_dim": 16}),
    "apertus": ("ApertusConfig", {}),
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "seed_oss": ("SeedOssConfig", {"head_dim": 16}),
    "arcee": ("ArceeConfig", {}),
    "nemotron": ("NemotronConfig", {}),
    "helium": ("HeliumConfig", {"head_dim": 16}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"n_embd": 64, "n_layer": 2, "n_head": 4,
                                         "multi_query": True}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4}),  # Conv1D stays HF's
}
MOE = {
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                              "intermediate_size": 32}),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                        "intermediate_size": 32, "logits_scaling": 2.0}),
    "deepseek_v2": ("DeepseekV2Config", {
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "greedy"}),
    "glm4_moe": ("Glm4MoeConfig", {
        "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1}),
    # Chunked local attention on its rope layers (chunk 8), experts on every layer.
    "llama4_text": ("Llama4TextConfig", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1,
        "intermediate_size": 32, "intermediate_size_mlp": 128, "attention_chunk_size": 8,
        "interleave_moe_layer_step": 1}),
    "phimoe": ("PhimoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"moe_num_experts": 4, "moe_k": 2,
                                            "moe_intermediate_size": 32,
                                            "moe_layer_start_index": 1}),
    "dots1": ("Dots1Config", {
        "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1}),
}
# Experts on the platform's fused-MoE kernel (Llama 4's unfused experts stay HF's).
FUSED_MOE = {"olmoe", "granitemoe", "deepseek_v2", "glm4_moe", "phimoe", "ernie4_5_moe",
             "dots1"}
# Conv1D projections (GPT-2 style) are not nn.Linear: they stay transformers' modules.
KEEPS_HF_PROJECTIONS = {"gpt2"}


def build_tiny(out: Path, config_cls: str, overrides: dict[str, Any], seed: int = 0) -> Path:
    """Save a random 2-layer model of ``config_cls`` plus a tokenizer into ``out``."""
    tokenizer = build_tokenizer(out)
    kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False}
    if config_cls == "OPTConfig":
        del kwargs["num_key_value_heads"]
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            config_cls, overrides = {**DENSE, **MOE}[name]
            made[name] = build_tiny(tmp_path_factory.mktemp(name), config_cls, overrides)
        return made[name]

    return get


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def _check_against_hf(llm: LLM, hf: Any, prompts: list[list[int]]) -> list[Any]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(),
                           use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        got = list(out.outputs[0].token_ids)
        assert_greedy_equivalent(hf, prompt, got, _hf_greedy(hf, prompt, MAX_TOKENS))
    return outputs


def _model(llm: LLM) -> Any:
    return llm.llm_engine.client.core.executor.worker.model


@pytest.mark.parametrize("name", [*DENSE, *MOE])
def test_greedy_matches_transformers(tiny_models, name):
    path = tiny_models(name)
    hf = load_hf_model(path)
    # Forced: some of these architectures may gain a native class; the backend is tested.
    # 16-token steps: the long prompt is prefilled in chunks across every window; then a
    # prompt sharing its first 32 tokens is served from the prefix cache.
    with LLM(str(path), **BACKEND, max_num_batched_tokens=16) as llm:
        model = _model(llm)
        assert type(model).__name__ == "TransformersForCausalLM"
        assert model.hf_class_name == type(hf).__name__
        prompts = _prompts(hf.config.vocab_size, PROMPT_LENGTHS, seed=3)
        _check_against_hf(llm, hf, prompts)
        shared = prompts[-1][:32] + _prompts(hf.config.vocab_size, [3], seed=4)[0]
        (hit,) = _check_against_hf(llm, hf, [shared])
        assert hit.num_cached_tokens >= 24, hit.num_cached_tokens
    replaced = [m for m in model.modules() if type(m).__name__ == "EngineExperts"]
    assert bool(replaced) == (name in FUSED_MOE)
    if name not in KEEPS_HF_PROJECTIONS:
        assert not any(type(m) is torch.nn.Linear for m in model.modules())


def test_kv_spec_reports_windows_and_chunks(tiny_models):
    with LLM(str(tiny_models("gemma3")), **BACKEND) as llm:
        spec = _model(llm).kv_cache_spec()
        assert spec.sliding_windows == (8, None) and spec.num_layers == 2
        assert (spec.num_kv_heads, spec.head_size) == (2, 16)
    with LLM(str(tiny_models("llama4_text")), **BACKEND) as llm:
        spec = _model(llm).kv_cache_spec()
        # Llama 4: rope layers attend within chunks; every 4th layer (none of 2) is global.
        assert spec.attention_chunk_sizes == (8, 8)


def test_prefix_cache_chunked_prefill_and_preemption(tiny_models):
    """Gemma 2 (window 8, soft-caps): a shared 24-token prefix served from the cache,
    prefills cut into 16-token chunks, and few enough blocks that requests are preempted
    and recomputed: still transformers' tokens."""
    path = tiny_models("gemma2")
    hf = load_hf_model(path)
    prefix = _prompts(hf.config.vocab_size, [24], seed=7)[0]
    tails = _prompts(hf.config.vocab_size, [3, 17, 9, 30], seed=8)
    prompts = [prefix + t for t in tails]
    engine = {**BACKEND, "max_num_batched_tokens": 16, "max_model_len": 64,
              "enable_chunked_prefill": True, "enable_prefix_caching": True}
    with LLM(str(path), **engine) as llm:
        first = llm.generate({"prompt_token_ids": prefix + [5, 6]}, _greedy(), use_tqdm=False)
        assert first[0].num_cached_tokens == 0
        outputs = _check_against_hf(llm, hf, prompts)
        again = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(), use_tqdm=False)[0]
        assert again.num_cached_tokens >= 24  # the shared prefix came from the cache
        assert list(again.outputs[0].token_ids) == list(outputs[0].outputs[0].token_ids)
    # Two KV cache groups (sliding, full): a 15-token prompt holds 2 + 2 blocks, its decode
    # a third full one; four of them do not fit 13 blocks: some are preempted.
    with LLM(str(path), **{**engine, "num_gpu_blocks_override": 13}) as llm:
        _check_against_hf(llm, hf, _prompts(hf.config.vocab_size, [15, 15, 14, 13], seed=9))
        assert llm.llm_engine.client.core.scheduler.num_preemptions_total >= 1


def test_llama_through_transformers_equals_native(tmp_path, caplog):
    path = build_model_dir(tmp_path / "llama", "llama-gqa")
    caplog.set_level(logging.INFO, logger="engine.model_executor.worker")
    prompts = [{"prompt_token_ids": p} for p in _prompts(200, [4, 19, 40], seed=5)]
    with LLM(str(path), **ENGINE) as native:
        assert type(_model(native)).__name__ == "LlamaForCausalLM"
        want = native.generate(prompts, _greedy(), use_tqdm=False)
    with LLM(str(path), **ENGINE, model_impl="transformers") as llm:
        model = _model(llm)
        assert model.hf_class_name == "LlamaForCausalLM"
        from engine.model_executor.models.transformers_backend.norm import HFRMSNorm

        from engine.model_executor.models.transformers_backend.mlp import FusedGatedMLP

        # Two norms per layer and the final one run on the engine's RMSNorm kernel, each
        # layer's MLP as one gate/up GEMM and the fused activation.
        assert sum(isinstance(m, HFRMSNorm) for m in model.modules()) == 2 * 2 + 1
        assert sum(isinstance(m, FusedGatedMLP) for m in model.modules()) == 2
        info = llm.llm_engine.client.core.executor.runtime_info()
        assert info["model_impl"] == "transformers (LlamaForCausalLM)"
        assert "model implementation transformers (LlamaForCausalLM)" in caplog.text
        got = llm.generate(prompts, _greedy(), use_tqdm=False)
    hf = load_hf_model(path)
    for prompt, w, g in zip(prompts, want, got):
        ids = prompt["prompt_token_ids"]
        assert_greedy_equivalent(hf, ids, list(g.outputs[0].token_ids),
                                 list(w.outputs[0].token_ids))


@pytest.mark.parametrize("variant", ["qwen2", "mixtral", "qwen3-moe"])
def test_forced_transformers_impl_on_native_architectures(tmp_path, variant):
    """Checkpoints transformers 5 converts at load (Mixtral's block_sparse_moe.experts.{e}.w1
    -> mlp.experts.gate_up_proj) load through the same renamings, per expert."""
    path = build_model_dir(tmp_path / variant, variant)
    hf = load_hf_model(path)
    with LLM(str(path), **BACKEND) as llm:
        model = _model(llm)
        assert model.hf_class_name == type(hf).__name__
        _check_against_hf(llm, hf, _prompts(hf.config.vocab_size, [6, 33], seed=2))
    assert (variant != "qwen2") == any(type(m).__name__ == "EngineExperts"
                                       for m in model.modules())


# -- refusals -------------------------------------------------------------------------
def _config_dir(out: Path, config: Any, extra: dict[str, Any] | None = None) -> Path:
    """A model directory with ``config`` and a placeholder weight file (the refusals come
    before any weight is read)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    config.save_pretrained(out)
    if extra:
        raw = json.loads((out / "config.json").read_text())
        raw.update(extra)
        (out / "config.json").write_text(json.dumps(raw))
    save_file({"placeholder": torch.zeros(1)}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(("case", "impl", "message"), [
    ("t5", "auto", "encoder-decoder"),
    ("bart", "transformers", "encoder-decoder"),
    ("remote", "auto", "remote code"),
    ("falcon", "transformers", "_supports_attention_backend is False"),
    ("llava", "transformers", "multimodal"),
    ("neox_engine", "engine", "not supported"),
    ("neox_bad_impl", "vllm", "model_impl 'vllm' is not one of auto, engine, transformers"),
    ("unknown_class", "auto", "FooForCausalLM.* is not a causal LM class of transformers"),
])
def test_refusals_name_the_reason(tmp_path, case, impl, message):
    from engine.model_executor.model_loader import load_model_files

    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2}
    configs = {
        "t5": lambda: transformers.T5Config(vocab_size=64, d_model=32, num_layers=1,
                                            architectures=["T5ForConditionalGeneration"]),
        "bart": lambda: transformers.BartConfig(vocab_size=64, d_model=32,
                                                architectures=["BartForCausalLM"]),
        "remote": lambda: transformers.LlamaConfig(**small, architectures=["MyLlama"]),
        "falcon": lambda: transformers.FalconConfig(**small, architectures=["FalconForCausalLM"]),
        "llava": lambda: transformers.LlavaConfig(architectures=["LlavaForConditionalGeneration"]),
        "neox_engine": lambda: transformers.GPTNeoXConfig(**small,
                                                          architectures=["GPTNeoXForCausalLM"]),
        "unknown_class": lambda: transformers.GPTNeoXConfig(**small,
                                                            architectures=["FooForCausalLM"]),
        "neox_bad_impl": lambda: transformers.GPTNeoXConfig(**small,
                                                            architectures=["GPTNeoXForCausalLM"]),
    }
    extra = {"auto_map": {"AutoModelForCausalLM": "modeling_my.MyLlama"}} if case == "remote" \
        else None
    path = _config_dir(tmp_path / case, configs[case](), extra)
    with pytest.raises(ValueError, match=message):
        load_model_files(path, model_impl=impl)


def test_engine_args_and_cli_carry_model_impl(tiny_models):
    from click.testing import CliRunner

    from engine.cli.plugins_cmd import plugins
    from engine.core.engine_args import EngineArgs

    path = str(tiny_models("gpt_neox"))  # not a native architecture: auto picks the backend
    config = EngineArgs(model=path, model_impl="transformers").create_engine_config()
    assert config.model.model_impl == "transformers"
    with pytest.raises(ValueError, match="not supported"):
        EngineArgs(model=path, model_impl="engine").create_engine_config()
    result = CliRunner().invoke(plugins, ["--model", path, "--device", "cpu", "--json",
                                          "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["model"]["model_impl"] == "transformers (GPTNeoXForCausalLM)"
    assert report["model"]["layer_kernels"]  # the replaced linears are on engine kernels
    assert report["transformers_backend"]["transformers"] == transformers.__version__
    table = CliRunner().invoke(plugins, ["--model", path, "--device", "cpu", "--dtype",
                                         "float32", "--model-impl", "transformers"])
    assert table.exit_code == 0, table.output
    assert "model implementation transformers (GPTNeoXForCausalLM)" in table.output
    assert "transformers backend: transformers" in table.output


@pytest.mark.parametrize(("name", "parallel"), [
    ("gemma2", {"tensor_parallel_size": 2}),  # colwise / rowwise plan: heads sharded
    ("olmoe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
], ids=["gemma2-tp2", "olmoe-tp2-ep"])
def test_tensor_parallel_matches_one_process(tiny_models, name, parallel):
    from tests.helpers.equivalence import assert_outputs_equivalent

    path = str(tiny_models(name))
    prompts = [{"prompt_token_ids": p} for p in _prompts(300, [3, 17, 30], seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            logprobs=2)
    with LLM(path, **BACKEND) as ref:
        want = ref.generate(prompts, params, use_tqdm=False)
    with LLM(path, **BACKEND, **parallel) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert_outputs_equivalent(want, got)


def test_pipeline_parallel_is_refused(tiny_models):
    from types import SimpleNamespace

    from engine.model_executor.model_loader import load_model_files
    from engine.model_executor.models.interface import ModelInitContext

    files = load_model_files(tiny_models("olmo"), model_impl="transformers")
    assert files.impl == "transformers" and not files.model_cls.supports_pipeline_parallel
    ctx = ModelInitContext(dtype=torch.float32, device=torch.device("cpu"), attn_backend=None,
                           parallel=SimpleNamespace(pp_size=2, tp_size=1))
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        files.model_cls(files.hf_config, ctx)


def test_no_attention_mask_is_built():
    """The engine's attention name is in transformers' AttentionInterface, not its mask
    interface: the mask builders return None (no T x T mask) for full and sliding layers."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        create_causal_mask,
        create_sliding_window_causal_mask,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from engine.model_executor.models.transformers_backend.attention import (
        ENGINE_ATTENTION,
        engine_attention_forward,
        register_engine_attention,
    )

    register_engine_attention()
    assert ALL_ATTENTION_FUNCTIONS[ENGINE_ATTENTION] is engine_attention_forward
    assert ENGINE_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    config = transformers.MistralConfig(hidden_size=32, num_attention_heads=2,
                                        num_hidden_layers=1, sliding_window=4)
    config._attn_implementation = ENGINE_ATTENTION
    embeds, positions = torch.zeros(1, 9, 32), torch.arange(9)[None]
    for make in (create_causal_mask, create_sliding_window_causal_mask):
        assert make(config, embeds, None, None, position_ids=positions) is None


QUANT_FIXTURES = Path(__file__).resolve().parents[2] / "data" / "quant-fixtures"


@pytest.mark.parametrize("fixture", ["ct-w4a16-g64", "gptq-desc-act-g64"])
def test_quantized_checkpoint_through_the_backend(fixture):
    """A quantized Llama (llm-compressor / gptqmodel output) forced through the backend: its
    linears are the engine's quantized layers (format methods, platform kernels); greedy
    tokens equal the tool's own reference (weight-only int4: the same dequantized
    weights, measured to ~1e-6 / 4e-4 of the logits)."""
    from safetensors.torch import load_file

    path = QUANT_FIXTURES / fixture
    ref = load_file(str(path / "reference.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), **BACKEND) as llm:
        model = _model(llm)
        assert model.hf_class_name == "LlamaForCausalLM"
        from engine.model_executor.models.transformers_backend.norm import HFRMSNorm

        from engine.model_executor.models.transformers_backend.mlp import FusedGatedMLP

        # Two norms per layer and the final one run on the engine's RMSNorm kernel, each
        # layer's MLP as one gate/up GEMM and the fused activation.
        assert sum(isinstance(m, HFRMSNorm) for m in model.modules()) == 2 * 2 + 1
        assert sum(isinstance(m, FusedGatedMLP) for m in model.modules()) == 2
        methods = {type(m.quant_method).__name__ for m in model.modules()
                   if hasattr(m, "quant_method")}
        assert methods - {"UnquantizedLinearMethod"}, methods
        for i in range(4):
            ids = ref[f"prompt{i}.input_ids"].tolist()
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            assert list(out.outputs[0].token_ids) == ref[f"prompt{i}.greedy_tokens"][:8].tolist()


def test_attention_sinks_are_refused(tmp_path):
    """GPT-OSS's learned sinks would be dropped silently by a plain attention layer."""
    path = build_tiny(tmp_path / "gpt_oss", "GptOssConfig", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 32, **SW_TYPES})
    with pytest.raises(ValueError, match="attention sinks"):
        LLM(str(path), **BACKEND)
