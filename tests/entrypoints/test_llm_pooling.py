"""LLM(runner="pooling") against sentence-transformers and transformers.

Every model is a small random-weight one saved the way users get it
(tests/helpers/pooling_models.py). References: sentence-transformers' ``encode`` for
embedders, its ``CrossEncoder.predict`` for a BERT cross-encoder, transformers' own
forward for classifiers, the Qwen3-Reranker yes/no probability and reward heads. Each
engine runs several prompts of different lengths in one batch, so the packed
(unpadded) step and its per-request segments are what is checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, PoolingParams
from tests.helpers.pooling_models import (
    TEXTS,
    bert_model,
    decoder_model,
    qwen3_model,
    save_hf,
    save_sentence_transformer,
)

COSINE = 0.9999
SCORE_ATOL = 1e-4


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", runner="pooling", **kwargs)


def _cosines(engine_rows: list[list[float]], reference: torch.Tensor) -> torch.Tensor:
    ours = torch.tensor(engine_rows, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(ours, reference.double(), dim=-1)


# -- embedders ----------------------------------------------------------------------------------
EMBEDDERS = {  # name -> (builder, sentence-transformers pooling)
    "bert-cls": (lambda: bert_model("bert", num_labels=0), "cls"),
    "xlm-roberta-mean": (lambda: bert_model("xlm-roberta", num_labels=0), "mean"),
    "modernbert-mean": (lambda: bert_model("modernbert", num_labels=0), "mean"),
    "nomic-bert-mean": (lambda: bert_model("nomic-bert", num_labels=0), "mean"),
    "qwen3-lasttoken": (lambda: qwen3_model("embed"), "lasttoken"),
    "llama-lasttoken": (lambda: decoder_model("llama"), "lasttoken"),
    "mistral-mean": (lambda: decoder_model("mistral"), "mean"),
}


@pytest.fixture(scope="module", params=sorted(EMBEDDERS))
def embedder(request, tmp_path_factory) -> tuple[str, Path]:
    build, pooling = EMBEDDERS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model, tok = build()
    hf_dir = save_hf(model, tok, root / "hf")
    return request.param, save_sentence_transformer(hf_dir, root / "st", pooling)


def test_embeddings_match_sentence_transformers(embedder) -> None:
    from sentence_transformers import SentenceTransformer

    name, path = embedder
    reference = SentenceTransformer(str(path), device="cpu").encode(
        TEXTS, convert_to_tensor=True, batch_size=2)
    with _llm(path) as llm:
        outputs = llm.embed(TEXTS, use_tqdm=False)
        rows = [o.outputs.embedding for o in outputs]
        assert _cosines(rows, reference).min() >= COSINE, name
        # sentence-transformers' Normalize module: unit vectors, as the engine's default.
        norms = torch.tensor(rows).norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones(len(TEXTS)), atol=1e-5, rtol=0)
        # the same prompts one at a time (no batching effects) give the same vectors
        single = llm.embed(TEXTS[-1], use_tqdm=False)[0].outputs.embedding
        torch.testing.assert_close(torch.tensor(single), torch.tensor(rows[-1]),
                                   atol=1e-5, rtol=0)


def test_prompts_and_unnormalized_embeddings(tmp_path) -> None:
    """config_sentence_transformers.json prompts (the default one applied, another by
    name) and a model without a Normalize module (raw vectors, as sentence-transformers
    returns them)."""
    from sentence_transformers import SentenceTransformer

    model, tok = bert_model("bert", num_labels=0, seed=3)
    hf_dir = save_hf(model, tok, tmp_path / "hf")
    prompts = {"query": "query: ", "document": "passage: "}
    path = save_sentence_transformer(hf_dir, tmp_path / "st", "mean", normalize=False,
                                     prompts=prompts, default_prompt_name="query")
    st = SentenceTransformer(str(path), device="cpu")
    by_default = st.encode(TEXTS, convert_to_tensor=True)
    as_document = st.encode(TEXTS, convert_to_tensor=True, prompt_name="document")
    with _llm(path) as llm:
        ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        torch.testing.assert_close(ours, by_default.float(), atol=2e-4, rtol=2e-4)
        docs = llm.embed(TEXTS, prompt_name="document", use_tqdm=False)
        torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in docs]),
                                   as_document.float(), atol=2e-4, rtol=2e-4)
        with pytest.raises(ValueError, match="unknown prompt name 'nope'"):
            llm.embed("x", prompt_name="nope")


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path) -> None:
    model, tok = qwen3_model("embed", seed=5)
    hf_dir = save_hf(model, tok, tmp_path / "hf")
    path = save_sentence_transformer(hf_dir, tmp_path / "st", "lasttoken")
    with _llm(path, hf_overrides={"is_matryoshka": True}) as llm:
        full = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        cut = llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
        ours = torch.tensor([o.outputs.embedding for o in cut])
        expected = torch.nn.functional.normalize(full[:, :16], dim=-1)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
        raw = llm.embed(TEXTS[:1], pooling_params=PoolingParams(normalize=False),
                        use_tqdm=False)[0].outputs.embedding
        assert abs(torch.tensor(raw).norm().item() - 1.0) > 1e-3
        with pytest.raises(ValueError, match="exceeds the model's embedding size 64"):
            llm.embed("x", pooling_params=PoolingParams(dimensions=65))
    with _llm(path) as plain, pytest.raises(ValueError, match="matryoshka"):
        plain.embed("x", pooling_params=PoolingParams(dimensions=16))


# -- cross-encoders, classifiers, rerankers -------------------------------------------------
def test_bert_cross_encoder_scores_match_sentence_transformers(tmp_path) -> None:
    """Pairs encoded with token types (segment B is type 1) through the BERT pooler and
    classifier; scores are the sigmoid of the single logit, as CrossEncoder.predict."""
    from sentence_transformers import CrossEncoder

    model, tok = bert_model("bert", num_labels=1, seed=7)
    path = save_hf(model, tok, tmp_path / "ce")
    query, docs = TEXTS[0], TEXTS[1:]
    reference = torch.tensor(CrossEncoder(str(path), device="cpu").predict(
        [(query, d) for d in docs]), dtype=torch.float64)
    with _llm(path) as llm:
        scores = torch.tensor([o.outputs.score for o in llm.score(query, docs, use_tqdm=False)],
                              dtype=torch.float64)
        torch.testing.assert_close(scores, reference, atol=SCORE_ATOL, rtol=0)
        assert scores.argsort().tolist() == reference.argsort().tolist()
        # pairwise form: data_1[i] with data_2[i]
        pairwise = llm.score(docs, docs[::-1], use_tqdm=False)
        expected = CrossEncoder(str(path), device="cpu").predict(list(zip(docs, docs[::-1])))
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]),
                                   torch.tensor(expected), atol=SCORE_ATOL, rtol=0)
        with pytest.raises(ValueError, match="cannot embed"):
            llm.embed("x")


@pytest.mark.parametrize("kind", ["modernbert", "xlm-roberta", "qwen3", "qwen2"])
def test_classifier_probabilities_match_transformers(kind, tmp_path) -> None:
    if kind == "qwen3":
        model, tok = qwen3_model("classify", num_labels=3, seed=11)
    elif kind == "qwen2":
        model, tok = decoder_model("qwen2", "classify", num_labels=3, seed=11)
    else:
        model, tok = bert_model(kind, num_labels=3, seed=11)
    path = save_hf(model, tok, tmp_path / kind)
    with torch.no_grad():
        reference = torch.stack([
            torch.softmax(model(**tok(t, return_tensors="pt")).logits[0].double(), dim=-1)
            for t in TEXTS])
    with _llm(path) as llm:
        outputs = llm.classify(TEXTS, use_tqdm=False)
        probs = torch.tensor([o.outputs.probs for o in outputs], dtype=torch.float64)
        torch.testing.assert_close(probs, reference, atol=SCORE_ATOL, rtol=0)
        raw = llm.classify(TEXTS[:1], pooling_params=PoolingParams(activation=False),
                           use_tqdm=False)[0].outputs.probs
        torch.testing.assert_close(torch.softmax(torch.tensor(raw, dtype=torch.float64), -1),
                                   reference[0], atol=SCORE_ATOL, rtol=0)


def test_qwen3_reranker_from_causal_lm_scores_yes_probability(tmp_path) -> None:
    """vLLM's recipe for Qwen3-Reranker: a causal LM whose "yes" vs "no" logits at the
    last position score a formatted query/document prompt."""
    model, tok = qwen3_model("causal", seed=13)
    path = save_hf(model, tok, tmp_path / "reranker")
    no, yes = "no", "yes"  # single tokens of the demo vocabulary, as in Qwen3-Reranker
    ids = [tok.convert_tokens_to_ids(t) for t in (no, yes)]
    prompts = [f"<query>{TEXTS[0]}</query><doc>{d}</doc>" for d in TEXTS[1:]]
    with torch.no_grad():
        reference = torch.tensor([
            torch.softmax(model(**tok(p, return_tensors="pt")).logits[0, -1, ids].double(),
                          -1)[1].item() for p in prompts], dtype=torch.float64)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": [no, yes], "is_original_qwen3_reranker": True}
    with _llm(path, hf_overrides=overrides) as llm:
        got = torch.tensor([o.outputs.probs[0] for o in llm.classify(prompts, use_tqdm=False)],
                           dtype=torch.float64)
        torch.testing.assert_close(got, reference, atol=SCORE_ATOL, rtol=0)


def test_reward_scores_every_token(tmp_path) -> None:
    model, tok = qwen3_model("classify", num_labels=1, seed=17)
    path = save_hf(model, tok, tmp_path / "rm")
    with torch.no_grad():
        inputs = tok(TEXTS[1], return_tensors="pt")
        hidden = model.model(**inputs).last_hidden_state[0]
        reference = model.score(hidden).double()
    with _llm(path, convert="reward") as llm:
        (out,) = llm.reward(TEXTS[1], use_tqdm=False)
        assert tuple(out.outputs.data.shape) == (inputs["input_ids"].shape[1], 1)
        torch.testing.assert_close(out.outputs.data.double(), reference, atol=SCORE_ATOL,
                                   rtol=1e-4)


# -- limits and bad input ------------------------------------------------------------------------
def test_truncation_and_clear_errors(tmp_path) -> None:
    model, tok = qwen3_model("embed", seed=19)
    hf_dir = save_hf(model, tok, tmp_path / "hf")
    path = save_sentence_transformer(hf_dir, tmp_path / "st", "lasttoken", max_seq_length=16)
    long_text = " ".join(TEXTS)
    with _llm(path) as llm:
        assert llm.llm_engine.config.scheduler.max_model_len == 16  # sentence-transformers'
        with pytest.raises(ValueError, match="maximum context length is 16 tokens"):
            llm.embed(long_text)
        (cut,) = llm.embed(long_text, truncate_prompt_tokens=-1, use_tqdm=False)
        assert len(cut.prompt_token_ids) == 16
        (eight,) = llm.embed(long_text, truncate_prompt_tokens=8, use_tqdm=False)
        expected = tok(long_text, truncation=True, max_length=8)["input_ids"]
        assert eight.prompt_token_ids == expected
        with pytest.raises(ValueError, match="cannot classify"):
            llm.classify("x")
        with pytest.raises(ValueError, match="cannot generate"):
            llm.generate("x")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.embed([[10**7]])
        with pytest.raises(ValueError, match="empty"):
            llm.embed([[]])
        # the engine is still healthy and leaks no KV blocks after the refusals
        assert len(llm.embed(TEXTS[:4], use_tqdm=False)) == 4
        scheduler = llm.llm_engine.client.core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks


def test_pooling_options_refused_on_a_generating_engine() -> None:
    with LLM(dtype="float32") as llm, pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed("hello")
    with pytest.raises(ValueError, match="--runner pooling"):
        LLM(dtype="float32", runner="generate", convert="embed")


def test_cross_encoder_saved_by_sentence_transformers_keeps_its_activation(tmp_path) -> None:
    """A CrossEncoder saved with activation_fn Identity predicts raw logits; the
    engine's scores follow its config (config_sentence_transformers.json)."""
    from sentence_transformers import CrossEncoder

    model, tok = bert_model("bert", num_labels=1, seed=23)
    hf_dir = save_hf(model, tok, tmp_path / "hf")
    CrossEncoder(str(hf_dir), device="cpu", activation_fn=torch.nn.Identity()).save(
        str(tmp_path / "ce"))
    reference_model = CrossEncoder(str(tmp_path / "ce"), device="cpu")
    pairs = [(TEXTS[0], d) for d in TEXTS[1:]]
    reference = torch.tensor(reference_model.predict(pairs), dtype=torch.float64)
    # raw logits: far from what a sigmoid of them would give
    assert (torch.sigmoid(reference) - reference).abs().min() > 0.1
    with _llm(tmp_path / "ce") as llm:
        scores = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in scores],
                                                dtype=torch.float64),
                                   reference, atol=SCORE_ATOL, rtol=0)


def test_tensor_parallel_embeddings_equal_one_rank(tmp_path) -> None:
    """Two worker processes (gloo), each holding half the heads and matrices: the
    pooled results cross the worker wire and equal the single-rank ones."""
    model, tok = bert_model("bert", num_labels=0, seed=29)
    hf_dir = save_hf(model, tok, tmp_path / "hf")
    path = save_sentence_transformer(hf_dir, tmp_path / "st", "mean")
    with _llm(path) as one:
        single = torch.tensor([o.outputs.embedding for o in one.embed(TEXTS, use_tqdm=False)])
    with _llm(path, tensor_parallel_size=2) as two:
        split = torch.tensor([o.outputs.embedding for o in two.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)


def test_triton_encoder_attention_end_to_end(tmp_path) -> None:
    """The GPU plugins' Triton encoder kernel (under TRITON_INTERPRET=1, as CI runs it)
    behind a whole ModernBERT embedder, local windowed layers included, equals the CPU
    backend's result."""
    model, tok = bert_model("modernbert", num_labels=0, seed=31)
    hf_dir = save_hf(model, tok, tmp_path / "hf")
    path = save_sentence_transformer(hf_dir, tmp_path / "st", "mean")
    with _llm(path) as cpu:
        expected = torch.tensor([o.outputs.embedding for o in cpu.embed(TEXTS, use_tqdm=False)])
    with _llm(path, attention_backend="triton") as triton:
        got = torch.tensor([o.outputs.embedding for o in triton.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
