"""A tiny random Llama checkpoint (config, safetensors, fast tokenizer), built locally."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache "
        "in blocks; a scheduler hands out a token budget every step. ") * 4


def build_tiny_llama(out_dir: Path, *, seed: int = 0, vocab_size: int = 320,
                     num_kv_heads: int = 2, init_range: float = 0.25) -> Path:
    """Save a 2-layer, hidden-64 LlamaForCausalLM with random weights (large init range:
    a peaked next-token distribution, so greedy decoding has few near-ties)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
        rms_norm_eps=1e-5, initializer_range=init_range, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
