"""Encoder-only pooling models (BERT, RoBERTa, XLM-RoBERTa, ModernBERT, NomicBERT)
against transformers.

Small random-weight transformers models are saved as safetensors and loaded through the
engine's loader; a flat batch of three requests of different lengths runs through the
CPU backend's encoder attention under a forward context, as the runner runs it. The
reference is transformers in float64, per request and once padded with an attention
mask; the engine computes in float32, so the tolerances leave room for any CPU's
float32 rounding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.core.interfaces import AttentionBatch
from engine.core.pooling_params import PoolingParams
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.model_executor.layers.pooler import PoolingBatch, PoolingType
from engine.model_executor.model_loader import load_model
from engine.model_executor.models.bert import (
    BertForSequenceClassification,
    BertModel,
    RobertaForSequenceClassification,
    RobertaModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.modernbert import (
    ModernBertForSequenceClassification,
    ModernBertModel,
)
from engine.model_executor.models.nomic_bert import (
    NomicBertForSequenceClassification,
    NomicBertModel,
)
from engine.model_executor.models.registry import MODEL_REGISTRY
from engine.plugins.cpu.attention import CPUAttentionBackend

CPU = torch.device("cpu")
LENS = (5, 13, 9)  # longer than ModernBERT's test window of 8 (4 keys either side)
VOCAB = 120
ATOL = RTOL = 2e-4


# -- configs and reference models ------------------------------------------------------------
def bert_config(**overrides: Any) -> Any:
    from transformers import BertConfig

    base = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128,
            "max_position_embeddings": 64, "type_vocab_size": 2}
    return BertConfig(**{**base, **overrides})


def roberta_config(xlm: bool = False, **overrides: Any) -> Any:
    from transformers import RobertaConfig, XLMRobertaConfig

    base = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128,
            "max_position_embeddings": 64, "type_vocab_size": 1, "pad_token_id": 1,
            "bos_token_id": 0, "eos_token_id": 2}
    return (XLMRobertaConfig if xlm else RobertaConfig)(**{**base, **overrides})


def modernbert_config(**overrides: Any) -> Any:
    from transformers import ModernBertConfig

    base = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "intermediate_size": 96,
            "max_position_embeddings": 64, "global_attn_every_n_layers": 2,
            "local_attention": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "cls_token_id": 1, "sep_token_id": 2, "global_rope_theta": 160_000.0,
            "local_rope_theta": 10_000.0}
    return ModernBertConfig(**{**base, **overrides})


def nomic_config(**overrides: Any) -> Any:
    from transformers import NomicBertConfig

    base = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 64,
            "type_vocab_size": 2, "rope_parameters": {"rope_type": "default",
                                                      "rope_theta": 1000.0}}
    return NomicBertConfig(**{**base, **overrides})


def hf_model(cls_name: str, config: Any, seed: int = 0) -> torch.nn.Module:
    """A transformers model with every weight random (norms around 1), in eval mode."""
    import transformers

    # SDPA: transformers' eager path turns a padded row whose sliding window holds only
    # padding into NaN, which then spreads through the later layers' padded values.
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name.lower()
            p.normal_(1.0 if norm and name.endswith("weight") else 0.0, 0.2 if norm else 0.08)
    return model


def save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path


def load(path: Path) -> tuple[torch.nn.Module, CPUAttentionBackend]:
    backend = CPUAttentionBackend(16, CPU)
    return load_model(path, "float32", CPU, backend), backend


# -- running the engine model as the runner does --------------------------------------------
def requests(seed: int = 1, lens: tuple[int, ...] = LENS) -> list[torch.Tensor]:
    """Token ids that avoid the special ids (RoBERTa's padding id 1 above all)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lens]


def pair_token_types(lens: tuple[int, ...] = LENS) -> list[torch.Tensor]:
    """A sentence-pair encoding: the second part of each request has token type 1."""
    return [torch.cat([torch.zeros(n // 2 + 1), torch.ones(n - n // 2 - 1)]).long()
            for n in lens]


def encoder_batch(lens: tuple[int, ...]) -> AttentionBatch:
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq_lens = np.asarray(lens, dtype=np.int32)
    total = int(starts[-1])
    return AttentionBatch(
        num_reqs=len(lens), num_tokens=total,
        query_start_loc=torch.from_numpy(starts), seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.zeros(len(lens), -(-max(lens) // 16), dtype=torch.int32),
        slot_mapping=torch.full((total,), -1, dtype=torch.int64),
        max_query_len=max(lens), max_seq_len=max(lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )


@torch.no_grad()
def run_flat(model: torch.nn.Module, backend: CPUAttentionBackend, ids: list[torch.Tensor],
             token_types: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The requests back to back in one flat batch: ``[T, hidden]``."""
    lens = tuple(len(x) for x in ids)
    positions = torch.cat([torch.arange(n) for n in lens])
    types = None if token_types is None else torch.cat(token_types)
    with set_forward_context(ForwardContext(backend.build_metadata(encoder_batch(lens)), [])):
        return model(torch.cat(ids), positions, types)


def split(hidden: torch.Tensor, lens: tuple[int, ...] = LENS) -> list[torch.Tensor]:
    return list(hidden.split(list(lens)))


def pooling_batch(task: str, lens: tuple[int, ...] = LENS, **params: Any) -> PoolingBatch:
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    return PoolingBatch(starts, np.asarray(lens, dtype=np.int64),
                        [PoolingParams(task=task, **params) for _ in lens])


# -- the transformers references -----------------------------------------------------------
@torch.no_grad()
def reference_each(model: torch.nn.Module, ids: list[torch.Tensor],
                   token_types: list[torch.Tensor] | None = None, out: str = "hidden"
                   ) -> list[torch.Tensor]:
    """transformers' output per request, alone (float64)."""
    model = model.double()
    results = []
    for i, x in enumerate(ids):
        kwargs = {} if token_types is None else {"token_type_ids": token_types[i][None]}
        result = model(input_ids=x[None], **kwargs)
        results.append(result.last_hidden_state[0] if out == "hidden" else result.logits[0])
    return results


@torch.no_grad()
def reference_padded(model: torch.nn.Module, ids: list[torch.Tensor], pad_id: int,
                     token_types: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """transformers' last hidden states of one right-padded batch with a mask."""
    model = model.double()
    longest = max(len(x) for x in ids)
    batch = torch.full((len(ids), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(ids), longest, dtype=torch.long)
    types = torch.zeros(len(ids), longest, dtype=torch.long)
    for i, x in enumerate(ids):
        batch[i, : len(x)], mask[i, : len(x)] = x, 1
        if token_types is not None:
            types[i, : len(x)] = token_types[i]
    kwargs = {} if token_types is None else {"token_type_ids": types}
    hidden = model(input_ids=batch, attention_mask=mask, **kwargs).last_hidden_state
    return [hidden[i, : len(x)] for i, x in enumerate(ids)]


def assert_rows_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g.double(), w, atol=ATOL, rtol=RTOL)


# -- hidden states ----------------------------------------------------------------------------
BASE_CASES = {
    "bert_gelu": ("BertModel", BertModel, lambda: bert_config(), 0),
    "bert_gelu_new": ("BertModel", BertModel, lambda: bert_config(hidden_act="gelu_new"), 0),
    "roberta": ("RobertaModel", RobertaModel, lambda: roberta_config(), 1),
    "xlm_roberta": ("XLMRobertaModel", XLMRobertaModel, lambda: roberta_config(xlm=True), 1),
    "modernbert": ("ModernBertModel", ModernBertModel, lambda: modernbert_config(), 0),
    "modernbert_biases": (
        "ModernBertModel", ModernBertModel,
        lambda: modernbert_config(norm_bias=True, attention_bias=True, mlp_bias=True,
                                  hidden_activation="gelu_pytorch_tanh"), 0),
    "nomic_bert": ("NomicBertModel", NomicBertModel, lambda: nomic_config(), 0),
}


@pytest.mark.parametrize("case", list(BASE_CASES))
def test_hidden_states_match_transformers(case: str, tmp_path: Path) -> None:
    cls_name, engine_cls, make_config, pad_id = BASE_CASES[case]
    reference = hf_model(cls_name, make_config())
    model, backend = load(save(reference, tmp_path))
    assert type(model) is engine_cls
    ids = requests()
    got = split(run_flat(model, backend, ids))
    assert_rows_close(got, reference_each(reference, ids))
    assert_rows_close(got, reference_padded(reference, ids, pad_id))


@pytest.mark.parametrize("case", ["bert_gelu", "xlm_roberta", "modernbert_biases"])
def test_platform_kernels_match_transformers(case: str, tmp_path: Path) -> None:
    """Built as the CPU worker builds it: the platform's dense GEMM kernels (repacked
    weights) and fused ops (embedding lookup, in-place rotary, GeGLU)."""
    from engine.plugins.cpu.platform import CPUPlatform

    cls_name, _, make_config, _ = BASE_CASES[case]
    reference = hf_model(cls_name, make_config())
    platform = CPUPlatform()
    backend = CPUAttentionBackend(16, CPU)
    model = load_model(save(reference, tmp_path), "float32", CPU, backend,
                       dense_gemm_kernels=platform.dense_gemm_kernels(),
                       fused_ops=platform.fused_ops())
    ids = requests()
    assert_rows_close(split(run_flat(model, backend, ids)), reference_each(reference, ids))


def test_bert_pair_token_types_match_transformers(tmp_path: Path) -> None:
    reference = hf_model("BertModel", bert_config())
    model, backend = load(save(reference, tmp_path))
    assert BertModel.uses_token_type_ids and not ModernBertModel.uses_token_type_ids
    ids, types = requests(), pair_token_types()
    got = split(run_flat(model, backend, ids, types))
    assert_rows_close(got, reference_each(reference, ids, types))
    assert_rows_close(got, reference_padded(reference, ids, 0, types))
    zeros = split(run_flat(model, backend, ids, None))  # None: all type 0
    assert not torch.allclose(zeros[1], got[1], atol=1e-3)


def test_modernbert_local_layers_are_windowed(tmp_path: Path) -> None:
    reference = hf_model("ModernBertModel", modernbert_config())
    model, backend = load(save(reference, tmp_path))
    windows = [layer.attn.attn.spec.sliding_window for layer in model.layers]
    assert windows == [None, 8, None]
    assert all(not layer.attn.attn.spec.causal for layer in model.layers)
    # The window matters at these lengths: without it the long request differs.
    for layer in model.layers:
        layer.attn.attn.impl.spec = dataclasses.replace(layer.attn.attn.spec,
                                                        sliding_window=None)
    unwindowed = split(run_flat(model, backend, requests()))
    want = reference_each(reference, requests())
    assert not torch.allclose(unwindowed[1].double(), want[1], atol=1e-3)


# -- pooling: embeddings and classifier logits ---------------------------------------------
def test_embeddings_pool_the_cls_row(tmp_path: Path) -> None:
    reference = hf_model("BertModel", bert_config())
    model, backend = load(save(reference, tmp_path))
    assert model.pooler.pooling is PoolingType.CLS and model.pooler.head is None
    hidden = run_flat(model, backend, requests())
    embeds = model.pooler(hidden, pooling_batch("embed", normalize=True))
    want = [F.normalize(h[0], dim=-1) for h in reference_each(reference, requests())]
    assert_rows_close(embeds, want)
    with pytest.raises(ValueError, match="classify"):
        model.pooler(hidden, pooling_batch("classify", activation=False))


CLASSIFIER_CASES = {
    "bert_1": ("BertForSequenceClassification", BertForSequenceClassification,
               lambda: bert_config(num_labels=1)),
    "bert_3": ("BertForSequenceClassification", BertForSequenceClassification,
               lambda: bert_config(num_labels=3)),
    "roberta_3": ("RobertaForSequenceClassification", RobertaForSequenceClassification,
                  lambda: roberta_config(num_labels=3)),
    "xlm_roberta_1": ("XLMRobertaForSequenceClassification",
                      XLMRobertaForSequenceClassification,
                      lambda: roberta_config(xlm=True, num_labels=1)),
    "modernbert_cls_1": ("ModernBertForSequenceClassification",
                         ModernBertForSequenceClassification,
                         lambda: modernbert_config(num_labels=1, classifier_pooling="cls")),
    "modernbert_mean_3": ("ModernBertForSequenceClassification",
                          ModernBertForSequenceClassification,
                          lambda: modernbert_config(num_labels=3, classifier_pooling="mean",
                                                    classifier_bias=True, norm_bias=True)),
    "nomic_bert_3": ("NomicBertForSequenceClassification", NomicBertForSequenceClassification,
                     lambda: nomic_config(num_labels=3)),
}


@pytest.mark.parametrize("case", list(CLASSIFIER_CASES))
def test_classifier_logits_match_transformers(case: str, tmp_path: Path) -> None:
    cls_name, engine_cls, make_config = CLASSIFIER_CASES[case]
    config = make_config()
    reference = hf_model(cls_name, config)
    model, backend = load(save(reference, tmp_path))
    assert type(model) is engine_cls
    mean = getattr(config, "classifier_pooling", "cls") == "mean"
    assert model.pooler.pooling is (PoolingType.MEAN if mean else PoolingType.CLS)
    ids = requests()
    pairs = (BertForSequenceClassification, NomicBertForSequenceClassification)
    types = pair_token_types() if engine_cls in pairs else None
    hidden = run_flat(model, backend, ids, types)
    logits = model.pooler(hidden, pooling_batch("classify", activation=False))
    want = reference_each(reference, ids, types, out="logits")
    assert want[0].shape == (config.num_labels,)
    assert_rows_close(logits, want)
    probs = model.pooler(hidden, pooling_batch("classify", activation=True))
    for p, w in zip(probs, want):
        expected = torch.sigmoid(w) if w.numel() == 1 else torch.softmax(w, dim=-1)
        torch.testing.assert_close(p.double(), expected, atol=ATOL, rtol=RTOL)


# -- tensor parallel ---------------------------------------------------------------------------
def _tp_worker(rank: int, port: int, cases: list[tuple[Path, list, list]]) -> None:
    from engine.distributed import GlooCommunicator
    from engine.distributed.parallel_state import (
        ParallelLayout,
        destroy_parallel_state,
        init_parallel_state,
    )

    torch.set_num_threads(1)
    layout = ParallelLayout(tensor_parallel_size=2, rank=rank)
    state = init_parallel_state(GlooCommunicator, layout, f"tcp://127.0.0.1:{port}",
                                timeout_s=60)
    try:
        for path, want_hidden, want_logits in cases:
            backend = CPUAttentionBackend(16, CPU)
            model = load_model(path, "float32", CPU, backend, parallel=state)
            hidden = run_flat(model, backend, requests())
            assert_rows_close(split(hidden), want_hidden)
            logits = model.pooler(hidden, pooling_batch("classify", activation=False))
            assert_rows_close(logits, want_logits)
    finally:
        destroy_parallel_state()


def test_two_rank_tensor_parallel_matches_transformers(tmp_path: Path) -> None:
    """Heads, MLP features and the vocabulary split over two ranks (the fused ModernBERT
    tensors cut per shard, then per rank) give transformers' results on each rank."""
    import socket

    import torch.multiprocessing as mp

    cases = []
    for cls_name, config in (
            ("BertForSequenceClassification", bert_config(num_labels=3)),
            ("ModernBertForSequenceClassification",
             modernbert_config(num_labels=3, classifier_pooling="mean"))):
        reference = hf_model(cls_name, config)
        path = save(reference, tmp_path / cls_name)
        ids = requests()
        base = getattr(reference, reference.base_model_prefix)
        cases.append((path, reference_each(base, ids), reference_each(reference, ids,
                                                                       out="logits")))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_tp_worker, args=(port, cases), nprocs=2, start_method="fork")


# -- checkpoint names --------------------------------------------------------------------------
def build(engine_cls: type, config: Any) -> tuple[torch.nn.Module, CPUAttentionBackend]:
    backend = CPUAttentionBackend(16, CPU)
    ctx = ModelInitContext(dtype=torch.float32, device=CPU, attn_backend=backend)
    return engine_cls(config, ctx).eval(), backend


def test_bert_model_loads_a_prefixed_checkpoint_with_an_mlm_head() -> None:
    config = bert_config()
    reference = hf_model("BertForMaskedLM", config)
    names = set(reference.state_dict())
    assert any(n.startswith("cls.") for n in names) and all(
        n.startswith(("bert.", "cls.")) for n in names)
    model, backend = build(BertModel, config)
    loaded = model.load_weights(reference.state_dict().items())
    assert "encoder.layer.0.attention.qkv_proj.weight" in loaded
    ids = requests()
    got = split(run_flat(model, backend, ids))
    assert_rows_close(got, reference_each(reference.bert, ids))


def test_modernbert_model_loads_classifier_checkpoint_names() -> None:
    """A bare ModernBertModel takes the ``model.``-prefixed base of a classifier and
    skips its head; the classifier takes the same checkpoint whole."""
    config = modernbert_config(num_labels=2)
    reference = hf_model("ModernBertForSequenceClassification", config)
    state = reference.state_dict()
    bare, _ = build(ModernBertModel, config)
    loaded = bare.load_weights(state.items())
    assert not any(name.startswith("head.") for name in loaded)
    classifier, _ = build(ModernBertForSequenceClassification, config)
    loaded = classifier.load_weights(state.items())
    assert {"head.dense.weight", "head.classifier.weight", "layers.1.attn.Wqkv.weight",
            "layers.0.mlp.Wi.weight"} <= loaded


def test_missing_and_unexpected_tensors_fail_clearly() -> None:
    config = bert_config()
    state = hf_model("BertModel", config).state_dict()
    model, _ = build(BertModel, config)
    lacking = {k: v for k, v in state.items() if k != "encoder.layer.1.output.dense.weight"}
    with pytest.raises(ValueError, match=r"lacks.*encoder\.layer\.1\.output\.dense\.weight"):
        model.load_weights(lacking.items())
    extra = {**state, "encoder.layer.0.attention.self.rotary.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="does not expect"):
        model.load_weights(extra.items())
    classifier, _ = build(BertForSequenceClassification, bert_config(num_labels=2))
    with pytest.raises(ValueError, match=r"lacks.*head\.out_proj\.weight"):
        classifier.load_weights(state.items())  # a bare checkpoint has no classifier


# NomicBERT's remote-code names (the Hub's nomic-embed-text checkpoints) for transformers'.
_NOMIC_LEGACY = (("embeddings.LayerNorm.", "emb_ln."), (".self_attn.o_proj.", ".attn.out_proj."),
                 (".mlp.up_proj.", ".mlp.fc11."), (".mlp.gate_proj.", ".mlp.fc12."),
                 (".mlp.down_proj.", ".mlp.fc2."), (".post_attention_layernorm.", ".norm1."),
                 (".post_mlp_layernorm.", ".norm2."))


def legacy_nomic_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' NomicBERT tensors under the remote-code names, q/k/v fused."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("layers."):
            name = "encoder." + name
        for native, legacy in _NOMIC_LEGACY:
            name = name.replace(native, legacy)
        out[name] = tensor
    for i in range(2):
        prefix = f"encoder.layers.{i}.self_attn."
        out[f"encoder.layers.{i}.attn.Wqkv.weight"] = torch.cat(
            [out.pop(f"{prefix}{p}_proj.weight") for p in "qkv"])
    return out


def test_nomic_bert_loads_remote_code_checkpoints() -> None:
    """The Hub's remote-code nomic-embed-text layout and config spelling."""
    from transformers import NomicBertConfig

    reference = hf_model("NomicBertModel", nomic_config())
    legacy = legacy_nomic_checkpoint(reference.state_dict())
    assert "encoder.layers.1.attn.Wqkv.weight" in legacy and "emb_ln.weight" in legacy
    config = NomicBertConfig(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_inner=96,
                             n_positions=64, rotary_emb_base=1000, rotary_emb_fraction=1.0,
                             activation_function="swiglu", prenorm=False,
                             layer_norm_epsilon=1e-12, qkv_proj_bias=False)
    model, backend = build(NomicBertModel, config)
    model.load_weights(legacy.items())
    ids, types = requests(), pair_token_types()
    got = split(run_flat(model, backend, ids, types))
    assert_rows_close(got, reference_each(reference, ids, types))
    config.prenorm = True
    with pytest.raises(ValueError, match="prenorm"):
        build(NomicBertModel, config)


# -- configs ---------------------------------------------------------------------------------
def test_unsupported_configs_are_refused() -> None:
    config = bert_config()
    config.position_embedding_type = "relative_key"
    with pytest.raises(ValueError, match="position_embedding_type"):
        build(BertModel, config)
    with pytest.raises(ValueError, match="activation 'mish'"):
        build(BertModel, bert_config(hidden_act="mish"))
    decoder = bert_config()
    decoder.is_decoder = True
    with pytest.raises(ValueError, match="decoders"):
        build(BertModel, decoder)


def test_encoders_report_no_kv_cache() -> None:
    for cls, config in ((BertModel, bert_config()), (ModernBertModel, modernbert_config())):
        spec = build(cls, config)[0].kv_cache_spec()
        assert (spec.num_layers, spec.head_size, spec.sliding_windows) == (0, 16, ())


def test_modernbert_rope_thetas_follow_layer_type() -> None:
    model, _ = build(ModernBertModel, modernbert_config(global_rope_theta=5000.0,
                                                       local_rope_theta=700.0))
    thetas = {kind: rotary.scaling.theta for kind, rotary in model.rotary.items()}
    assert thetas == {"full_attention": 5000.0, "sliding_attention": 700.0}


def test_architectures_are_registered() -> None:
    classes = (BertModel, BertForSequenceClassification, RobertaModel,
               RobertaForSequenceClassification, XLMRobertaModel,
               XLMRobertaForSequenceClassification, ModernBertModel,
               ModernBertForSequenceClassification, NomicBertModel,
               NomicBertForSequenceClassification)
    for cls in classes:
        assert MODEL_REGISTRY.resolve([cls.__name__]) is cls
