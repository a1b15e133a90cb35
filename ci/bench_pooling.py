#!/usr/bin/env python3
"""Embedding throughput: this engine's ``LLM.embed`` against sentence-transformers'
``encode(batch_size=32)`` on the same model, in one process, side by side.

The model is a random-weight BERT of bge-small's shape (384 wide, 12 layers, 12 heads,
WordPiece over /usr/share/dict/words), saved as a sentence-transformers directory (CLS
pooling, Normalize), unless ``--model`` names one. The inputs are ``--num-texts``
sentences of random dictionary words, ``--min-words`` to ``--max-words`` long (a
retrieval corpus: many short inputs of uneven length). Each side gets one warm-up pass,
then ``--repeats`` measured passes alternating engine / sentence-transformers; the figures
are medians in texts per second, with the ratios (against sentence-transformers in
float32, as users run it, and against its best dtype here: bf16 too where the CPU has
bf16 dot products) and the smallest cosine similarity of each side's embeddings to
sentence-transformers' float32 ones (the check that all computed the same thing). Threads: both sides use torch's (the engine's CPU platform sizes its own).

    python ci/bench_pooling.py                         # engine in fp32 and bf16 (if native)
    python ci/bench_pooling.py --engine-dtype float32 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

WORDS = Path("/usr/share/dict/words")


def _corpus_words() -> list[str]:
    if WORDS.is_file():
        words = [w.strip().lower() for w in WORDS.read_text(errors="ignore").split()]
        words = [w for w in words if w.isalpha() and w.isascii() and 2 < len(w) < 12]
        if len(words) > 1000:
            return words
    rng = random.Random(0)  # no dictionary: pronounceable random words
    return ["".join(rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou")
                    for _ in range(rng.randint(1, 4))) for _ in range(20000)]


def build_model(out: Path, words: list[str]) -> Path:
    """A bge-small-shaped random BERT as a sentence-transformers directory."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import models as tok_models
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(tok_models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(words, trainers.WordPieceTrainer(
        vocab_size=30522, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=512)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(fast), hidden_size=384, num_hidden_layers=12,
                        num_attention_heads=12, intermediate_size=1536,
                        max_position_embeddings=512, pad_token_id=fast.pad_token_id)
    hf_dir = out / "hf"
    BertModel(config, add_pooling_layer=False).save_pretrained(hf_dir)
    fast.save_pretrained(hf_dir)
    transformer = models.Transformer(str(hf_dir), max_seq_length=512)
    st = SentenceTransformer(modules=[transformer, models.Pooling(384, "cls"), models.Normalize()],
                             device="cpu")
    st.save(str(out / "st"))
    return out / "st"


def make_texts(words: list[str], n: int, lo: int, hi: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(lo, hi))) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers directory")
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--min-words", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-dtype", action="append", default=None,
                        help="engine dtype(s) to run (repeatable); default: float32, and "
                             "bfloat16 where the CPU has bf16 dot products")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from engine import LLM

    words = _corpus_words()
    workdir = tempfile.mkdtemp(prefix="engine-bench-pooling-")
    model = Path(args.model) if args.model else build_model(Path(workdir), words)
    texts = make_texts(words, args.num_texts, args.min_words, args.max_words)
    dtypes = args.engine_dtype or ["float32"] + (["bfloat16"] if _native_bf16() else [])
    # sentence-transformers as users run it (float32), and in bf16 where the engine runs
    # bf16 too (its best dtype here).
    peers = {dtype: SentenceTransformer(str(model), device="cpu",
                                        model_kwargs={"dtype": getattr(torch, dtype)})
             for dtype in dict.fromkeys(["float32", *dtypes])}

    engines = {dtype: LLM(str(model), runner="pooling", dtype=dtype) for dtype in dtypes}

    def run_engine(llm: LLM) -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])

    def run_st(st: SentenceTransformer) -> torch.Tensor:
        return st.encode(texts, batch_size=32, convert_to_tensor=True)

    reference = run_st(peers["float32"]).float()
    results: dict[str, list[float]] = {}
    cosines: dict[str, float] = {}
    for dtype, st in peers.items():
        cosines[f"sentence-transformers {dtype}"] = float(torch.nn.functional.cosine_similarity(
            run_st(st).double(), reference.double(), dim=-1).min())  # and warm-up
        results[f"sentence-transformers {dtype}"] = []
    for dtype, llm in engines.items():
        got = run_engine(llm)  # warm-up
        cosines[f"engine {dtype}"] = float(torch.nn.functional.cosine_similarity(
            got.double(), reference.double(), dim=-1).min())
        results[f"engine {dtype}"] = []
    for _ in range(args.repeats):
        for dtype, llm in engines.items():
            start = time.perf_counter()
            run_engine(llm)
            results[f"engine {dtype}"].append(len(texts) / (time.perf_counter() - start))
        for dtype, st in peers.items():
            start = time.perf_counter()
            run_st(st)
            results[f"sentence-transformers {dtype}"].append(
                len(texts) / (time.perf_counter() - start))
    medians = {name: statistics.median(values) for name, values in results.items()}
    base = medians["sentence-transformers float32"]
    best_peer = max(v for k, v in medians.items() if k.startswith("sentence"))
    tokenizer = peers["float32"].tokenizer
    tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    from engine.plugins.cpu import kernel_build

    report = {
        "cpu": kernel_build.cpu_model_name(),
        "isa": kernel_build.select_level().name,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "texts": len(texts),
        "mean_tokens": tokens / len(texts),
        "texts_per_s": {k: round(v, 1) for k, v in medians.items()},
        "ratio_vs_sentence_transformers_float32": {
            k: round(v / base, 2) for k, v in medians.items() if k.startswith("engine")},
        "ratio_vs_best_sentence_transformers": {
            k: round(v / best_peer, 2) for k, v in medians.items() if k.startswith("engine")},
        "min_cosine_vs_sentence_transformers_float32": cosines,
    }
    print(json.dumps(report, indent=2))
    for llm in engines.values():
        llm.shutdown()


def _native_bf16() -> bool:
    from engine.plugins.cpu import kernel_build

    return any(lv.name in ("avx512_bf16", "amx") for lv in kernel_build.runnable_levels())


if __name__ == "__main__":
    main()
