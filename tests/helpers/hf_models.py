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


def build_tokenizer(out_dir: Path, vocab_size: int = 384) -> Any:
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
    fast.chat_template = CHAT_TEMPLATE
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
}


def build_model_dir(
    out_dir: Path,
    variant: str = "llama-gqa",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    init_range: float = 0.25,
    **overrides: Any,
) -> Path:
    """Save a tiny random model of ``variant`` plus a tokenizer into ``out_dir``."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    spec = dict(ARCH_CONFIGS[variant])
    arch = spec.pop("arch")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
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
    model = model_cls(config).to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
