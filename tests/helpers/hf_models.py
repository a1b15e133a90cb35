"""Tiny random-weight Hugging Face model directories, built locally (no hub).

Weights use a large init range so the next-token distribution is peaked: greedy
decoding then has few near-ties and engine-vs-transformers comparisons are meaningful.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in "
    "fixed-size blocks, and a scheduler hands out a token budget every step. "
    "Once upon a time, a hacker wrote an inference engine that was fast and small. "
    "Caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e, emoji \U0001F600 and more text. "
) * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ChatML with BOS and a system block listing the tools (a template that renders `tools`).
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTools:{% for t in tools %} "
    "{{ t['function']['name'] }}({{ t['function']['parameters']['properties'] | list "
    "| join(', ') }}){% endfor %}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE
)


def build_tokenizer(
    out_dir: Path, vocab_size: int = 384, chat_template: str = CHAT_TEMPLATE
) -> Any:
    """Train a byte-level BPE on a few sentences and save it as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT], trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return fast


ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "llama-mha": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=4),
    "llama-mqa-tied": dict(arch="LlamaForCausalLM", num_attention_heads=4,
                           num_key_value_heads=1, tie_word_embeddings=True),
    "llama-headdim48": dict(arch="LlamaForCausalLM", hidden_size=96, num_attention_heads=2,
                            num_key_value_heads=1),
    "mistral": dict(arch="MistralForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=4096),
    "mistral-sw": dict(arch="MistralForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                       sliding_window=12),
    "qwen2": dict(arch="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24),
    # Mixture-of-experts: 8 experts, top-2.
    "mixtral": dict(arch="MixtralForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                    sliding_window=None),
    "qwen2-moe": dict(arch="Qwen2MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3-moe": dict(arch="Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0]),
    # DeepSeek-V3: multi-head latent attention (q LoRA, interleaved rope), layer 0 dense,
    # layer 1 MoE with grouped sigmoid routing (4 groups of 2, 2 kept) and a shared expert.
    "deepseek-v3": dict(arch="DeepseekV3ForCausalLM", num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True),
    # Phi-3 / Phi-4-mini: fused qkv / gate_up tensors; LongRoPE whose long factors take
    # over beyond position 32, on 3/4 of each head (partial rotary).
    "phi3-longrope": dict(arch="Phi3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, original_max_position_embeddings=32,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.6],
                                           "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]}),
    # OLMo 2: post-norms, q/k norms over the whole projection.
    "olmo2": dict(arch="Olmo2ForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    # Granite 3: the four multipliers, none of them 1.
    "granite": dict(arch="GraniteForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                    embedding_multiplier=4.0, residual_multiplier=0.5,
                    attention_multiplier=0.1, logits_scaling=2.0),
    # SmolLM3: layer 1 without RoPE (and, as transformers derives it, with a window of 8).
    "smollm3": dict(arch="SmolLM3ForCausalLM", num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, no_rope_layers=[1, 0, 1], use_sliding_window=True,
                    sliding_window=8, tie_word_embeddings=True),
    # GLM-4: sandwich norms, interleaved RoPE on half of each head, q/k/v biases.
    "glm4": dict(arch="Glm4ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
    # Ernie 4.5: interleaved RoPE in float32, biases on every projection.
    "ernie45": dict(arch="Ernie4_5ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, use_bias=True),
    # Gemma family: window 8 on the sliding layers, soft-caps small enough to bite.
    "gemma": dict(arch="GemmaForCausalLM", num_attention_heads=4, num_key_value_heads=1,
                  head_dim=16, tie_word_embeddings=True),
    "gemma2": dict(arch="Gemma2ForCausalLM", num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3": dict(arch="Gemma3ForCausalLM", config="Gemma3TextConfig", num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=3.0,
                   attn_logit_softcapping=5.0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1000000.0}}),
    # Cohere2: parallel attention + MLP, interleaved RoPE on the sliding layers only.
    "cohere2": dict(arch="Cohere2ForCausalLM", num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=8, logit_scale=0.5,
                    layer_norm_eps=1e-5, tie_word_embeddings=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Mamba-2: 8 heads of 16 (expand 2), 2 groups, d_state 16, SSD chunks of 16.
    "mamba2": dict(arch="Mamba2ForCausalLM", num_heads=8, head_dim=16, expand=2, n_groups=2,
                   state_size=16, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5),
    # Mamba-1: d_inner 128, d_state 16, dt rank 8, tied head, float32 residual.
    "mamba1": dict(arch="MambaForCausalLM", state_size=16, conv_kernel=4, time_step_rank=8,
                   layer_norm_epsilon=1e-5, residual_in_fp32=True, tie_word_embeddings=True),
    # Jamba: attention at 1 and 3 (no positions), Mamba-1 at 0 and 2, MoE (4 experts, top
    # 2) at 0 and 3 so that both mixers meet both feed-forward kinds.
    "jamba": dict(arch="JambaForCausalLM", num_hidden_layers=4, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=3, expert_layer_offset=0,
                  num_experts=4, num_experts_per_tok=2, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, mamba_d_state=16,
                  mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
    # Bamba: 4 layers, attention at 1 (RoPE on half of each head), Mamba-2 elsewhere.
    "bamba": dict(arch="BambaForCausalLM", num_hidden_layers=4, attn_layer_indices=[1],
                  num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                  mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                  mamba_expand=2, mamba_chunk_size=16),
    # Granite 4.0-H, dense: attention (no positions) at 1, Mamba-2 elsewhere, multipliers.
    "granitemoehybrid": dict(arch="GraniteMoeHybridForCausalLM", num_hidden_layers=4,
                             layer_types=["mamba", "attention", "mamba", "mamba"],
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
                             shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                             mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                             mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=4.0,
                             residual_multiplier=0.5, attention_multiplier=0.1,
                             logits_scaling=2.0),
    # Falcon-H1: attention and Mamba-2 side by side in each of 3 layers, the muP
    # multipliers away from 1, the mixer's gated RMSNorm normalizing before the gate.
    "falcon_h1": dict(
        arch="FalconH1ForCausalLM", num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True,
        mamba_norm_before_gate=True, embedding_multiplier=1.5, lm_head_multiplier=0.5,
        key_multiplier=0.7, attention_in_multiplier=0.8, attention_out_multiplier=1.2,
        ssm_in_multiplier=1.1, ssm_out_multiplier=0.9, mlp_multipliers=[1.3, 0.6],
        ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7]),
    # Nemotron-H: Mamba-2 ("M"), attention without RoPE ("*"), squared-ReLU MLP ("-").
    "nemotron_h": dict(
        arch="NemotronHForCausalLM", hybrid_override_pattern="M*-M-", num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        layer_norm_epsilon=1e-5),
    # Qwen3-Next: gated DeltaNet at 0, 1, 3 (2 key heads, 4 value heads), gated full
    # attention at 2 (RoPE on a quarter of each head); MoE (4 experts, top 2, shared
    # expert) except the dense layer 1.
    "qwen3_next": dict(
        arch="Qwen3NextForCausalLM", num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention",
                     "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1]),
}


def build_model_dir(
    out_dir: Path,
    variant: str = "llama-gqa",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    init_range: float = 0.25,
    chat_template: str = CHAT_TEMPLATE,
    greedy_cycle: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random model of ``variant`` plus a tokenizer into ``out_dir``.

    ``greedy_cycle``: rewire the weights so greedy decoding emits this text's UTF-8 bytes
    forever, one byte token per step (see :func:`make_greedy_cycle`).
    """
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, chat_template=chat_template)
    spec = dict(ARCH_CONFIGS[variant])
    arch = spec.pop("arch")
    # "config": the config class where it is not the architecture's name with "Config".
    config_cls = getattr(transformers, spec.pop("config", None)
                         or arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=init_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    kwargs.update(spec)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config)
    if greedy_cycle is not None:
        make_greedy_cycle(model, byte_token_ids(tokenizer, greedy_cycle.encode()))
    model = model.to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def byte_token_ids(tokenizer: Any, data: bytes) -> list[int]:
    """The single-byte token of each byte (byte-level BPE keeps all 256 in its alphabet)."""
    byte_to_char = _gpt2_bytes_to_unicode()
    return [tokenizer.convert_tokens_to_ids(byte_to_char[b]) for b in data]


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which ByteLevel pre-tokenizers use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@torch.no_grad()
def make_greedy_cycle(model: Any, cycle: list[int]) -> None:
    """Turn a Llama-style model into a bigram table whose argmax walks ``cycle``.

    Zeroing every block's output projections leaves the residual stream equal to the
    input embedding; embeddings are one-hot (slot ``i`` for ``cycle[i]``, one shared slot
    for every other token) and the LM head maps slot ``i`` to ``cycle[i + 1]`` and the
    shared slot to ``cycle[0]``, each with a margin of 32 nats. The cycle's tokens must be
    distinct so that "the next token" is a function of the current one.
    """
    if len(set(cycle)) != len(cycle):
        raise ValueError(f"greedy cycle tokens must be distinct, got {cycle}")
    hidden = model.config.hidden_size
    if len(cycle) + 1 > hidden:
        raise ValueError(f"a cycle of {len(cycle)} tokens needs hidden_size > {len(cycle)}")
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    other = len(cycle)
    embed = model.model.embed_tokens.weight
    embed.zero_()
    embed[:, other] = 1.0
    head = model.lm_head.weight
    head.zero_()
    head[cycle[0], other] = 4.0  # normed one-hot is sqrt(hidden) = 8 -> logit 32
    for i, token in enumerate(cycle):
        embed[token].zero_()
        embed[token, i] = 1.0
        head[cycle[(i + 1) % len(cycle)], i] = 4.0
