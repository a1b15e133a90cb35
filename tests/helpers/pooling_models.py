"""Small random-weight pooling models saved the way users get them (no hub).

Embedders are saved as sentence-transformers directories (modules.json, 1_Pooling,
Normalize) from transformers models; cross-encoders and classifiers as plain
transformers ``*ForSequenceClassification`` directories; the Qwen3-Reranker shape as a
causal LM whose "yes" / "no" logits score. Tokenizers are trained in memory: WordPiece
with [CLS] / [SEP] and token types for BERT, byte-level BPE with ``<s> ... </s>`` (pad
id 1, RoBERTa's padding_idx) for XLM-R, and the demo model's for the decoders
(its chat template removed: sentence-transformers 6 would otherwise wrap every text in
it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "embedding models are served next to chat models in retrieval pipelines",
    "a reranker scores how well a document answers a query",
    "paris is the capital of france and berlin the capital of germany",
    "what is the capital of france",
    "sentence transformers pool token states into one vector",
]
TEXTS = [
    "what is the capital of france",
    "paris is the capital of france",
    "the quick brown fox",
    "a",
    "embedding models pool token states into one vector for retrieval of documents",
]


def bert_tokenizer() -> Any:
    """WordPiece with ``[CLS] A [SEP] (B [SEP])`` and token types 0 / 1."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS * 4, trainers.WordPieceTrainer(
        vocab_size=160, special_tokens=specials, show_progress=False))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)


def roberta_tokenizer() -> Any:
    """Byte-level BPE with ``<s> A </s> (</s> B </s>)``; ``<pad>`` is id 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", bos), ("</s>", eos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>",
        model_max_length=64, model_input_names=["input_ids", "attention_mask"])


def decoder_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engine.assets import demo_model_path

    tok = AutoTokenizer.from_pretrained(demo_model_path())
    tok.chat_template = None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def save_hf(model: Any, tokenizer: Any, out: Path) -> Path:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_sentence_transformer(hf_dir: Path, out: Path, pooling: str, normalize: bool = True,
                              max_seq_length: int = 64, prompts: dict[str, str] | None = None,
                              default_prompt_name: str | None = None) -> Path:
    """A sentence-transformers directory over ``hf_dir`` (``pooling``: cls / mean /
    lasttoken)."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models

    transformer = models.Transformer(str(hf_dir), max_seq_length=max_seq_length)
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling)]
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(modules=modules, device="cpu", prompts=prompts,
                             default_prompt_name=default_prompt_name)
    st.save(str(out))
    return out


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def bert_model(kind: str, num_labels: int = 1, seed: int = 0) -> tuple[Any, Any]:
    """(model, tokenizer) of ``kind``: bert / xlm-roberta / modernbert / nomic-bert, bare
    (``num_labels`` 0) or a sequence classifier."""
    import transformers as tf

    _seeded(seed)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=80)
    if kind == "bert":
        tok = bert_tokenizer()
        config = tf.BertConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **common)
        bare, head = tf.BertModel, tf.BertForSequenceClassification
    elif kind == "xlm-roberta":
        tok = roberta_tokenizer()
        config = tf.XLMRobertaConfig(vocab_size=len(tok), pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, type_vocab_size=1, **common)
        bare, head = tf.XLMRobertaModel, tf.XLMRobertaForSequenceClassification
    elif kind == "modernbert":
        tok = bert_tokenizer()
        config = tf.ModernBertConfig(
            vocab_size=len(tok), hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=96, max_position_embeddings=80, global_attn_every_n_layers=2,
            local_attention=8, pad_token_id=tok.pad_token_id, cls_token_id=tok.cls_token_id,
            sep_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id,
            eos_token_id=tok.sep_token_id, classifier_pooling="mean")
        bare, head = tf.ModernBertModel, tf.ModernBertForSequenceClassification
    elif kind == "nomic-bert":
        tok = bert_tokenizer()
        config = tf.NomicBertConfig(vocab_size=len(tok), head_dim=16,
                                    pad_token_id=tok.pad_token_id, **common)
        bare, head = tf.NomicBertModel, tf.NomicBertForSequenceClassification
    else:
        raise ValueError(kind)
    if num_labels:
        config.num_labels = num_labels
        model = head(config)
    else:
        model = (bare(config, add_pooling_layer=False) if kind in ("bert", "xlm-roberta")
                 else bare(config))
    return _randomized(model).eval(), tok


def decoder_model(family: str, kind: str = "embed", num_labels: int = 1, seed: int = 0
                  ) -> tuple[Any, Any]:
    """(model, tokenizer) of a Llama-family ``family`` (llama / mistral / qwen2): a bare
    ``*Model`` (``kind`` embed) or a ``*ForSequenceClassification`` (classify)."""
    import transformers as tf

    _seeded(seed)
    tok = decoder_tokenizer()
    config_cls, bare, head = {
        "llama": (tf.LlamaConfig, tf.LlamaModel, tf.LlamaForSequenceClassification),
        "mistral": (tf.MistralConfig, tf.MistralModel, tf.MistralForSequenceClassification),
        "qwen2": (tf.Qwen2Config, tf.Qwen2Model, tf.Qwen2ForSequenceClassification),
    }[family]
    config = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, pad_token_id=tok.pad_token_id)
    if kind == "classify":
        config.num_labels = num_labels
        return _randomized(head(config)).eval(), tok
    return _randomized(bare(config)).eval(), tok


def qwen3_model(kind: str, num_labels: int = 1, seed: int = 0) -> tuple[Any, Any]:
    """(model, tokenizer): a bare Qwen3Model (embedder), a Qwen3ForSequenceClassification
    or a Qwen3ForCausalLM (the Qwen3-Reranker shape)."""
    import transformers as tf

    _seeded(seed)
    tok = decoder_tokenizer()
    config = tf.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    if kind == "embed":
        model = tf.Qwen3Model(config)
    elif kind == "classify":
        config.num_labels = num_labels
        model = tf.Qwen3ForSequenceClassification(config)
    elif kind == "causal":
        model = tf.Qwen3ForCausalLM(config)
    else:
        raise ValueError(kind)
    return _randomized(model).eval(), tok


def _randomized(model: Any) -> Any:
    """Weights with enough spread that pooling differences show (HF inits norms to 1
    and biases to 0; a test should see them load)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model
