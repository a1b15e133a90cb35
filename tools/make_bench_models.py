#!/usr/bin/env python3
"""Build the random-weight reference models of the CPU benchmark (issue "engine bench").

Two ``LlamaForCausalLM`` directories, exactly as the reference workload specifies:
transformers' default init after ``torch.manual_seed(0)``, vocab 16000,
max_position_embeddings 2048, rope_theta 1e4, rms_norm_eps 1e-5, untied embeddings,
saved as bfloat16 safetensors:

* ``llama-tiny``:  hidden 512,  intermediate 1536, 8 layers,  8 heads / 2 KV heads (40.5M)
* ``llama-small``: hidden 1024, intermediate 2816, 16 layers, 16 heads / 4 KV heads (213M)

The benchmark feeds token ids, but the loader still needs tokenizer files, so each
directory also gets a byte-level BPE of vocab 16000 trained on local text (the Python
standard library's sources: always present, deterministic). Output goes to a directory
given on the command line, never into the repository::

    python tools/make_bench_models.py [OUT_DIR]      # default /tmp/engine-bench-models
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

DEFAULT_OUT = Path("/tmp/engine-bench-models")
VOCAB_SIZE = 16000
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CORPUS_BYTES = 8 << 20  # enough text for 16000 merges, a few seconds to train

MODELS: dict[str, dict[str, int]] = {
    "llama-tiny": {
        "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 2,
    },
    "llama-small": {
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 4,
    },
}


def local_corpus(limit_bytes: int = CORPUS_BYTES) -> Iterator[str]:
    """Python standard library sources, in sorted order, up to ``limit_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total >= limit_bytes:
            return


def build_tokenizer(out_dir: Path):
    """Train and save a byte-level BPE with exactly ``VOCAB_SIZE`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(local_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"the BPE reached {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}: more text needed"
        )
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: Path, name: str, tokenizer) -> Path:
    """Save ``MODELS[name]`` (seed 0, default init, bf16) plus the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = out_dir / name
    model_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODELS[name],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params / 1e6:.1f}M parameters -> {model_dir}")
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    out_dir = args.out_dir.resolve()
    if out_dir == repo or repo in out_dir.parents:
        parser.error(f"{out_dir} is inside the repository; pick a directory outside it")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir / "tokenizer")
    for name in args.models:
        build_model(out_dir, name, tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
