"""Tensor-parallel linear, QKV, embedding and LM-head layers against unsharded float64
references.

One two-rank gloo world (forked ranks) builds every layer with ``tp`` = its TP
communicator, loads the FULL checkpoint tensors through the parameters' weight loaders
(``load_named_weights``, as the model loader does; once from torch tensors, once from
lazy safetensors slices) and compares each rank's output with plain torch math on the
full weights. The row-parallel g_idx rebasing, replicated-KV arithmetic beyond two ranks
and vocab shards are checked without processes through a fake communicator (weight
loading and column-parallel forwards need no collectives).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn

from engine.core.interfaces import Communicator
from engine.distributed import GlooCommunicator
from engine.distributed.parallel_state import (
    ParallelLayout,
    destroy_parallel_state,
    init_parallel_state,
)
from engine.model_executor.layers.embedding import LMHead, VocabEmbedding, VocabShard
from engine.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    _rebased_group_index,
)
from engine.model_executor.lazy_tensor import LazyTensor
from engine.model_executor.weight_utils import (
    StackedParam,
    load_named_weights,
    safetensors_weights_iterator,
)
from engine.quantization.gptq import GPTQConfig

WORLD = 2
F64 = torch.float64

# sizes: hidden, column out, row in / out, MLP intermediate, attention, vocab (odd:
# ceil(37 / 2) = 19 rows per rank, the last rank's 19th row is padding)
HIDDEN, COL_OUT, ROW_IN, ROW_OUT, INTER = 8, 10, 6, 5, 6
HEAD, NUM_HEADS, VOCAB = 4, 4, 37
TOKENS = 5

STACKED = (
    StackedParam(".qkv_proj.", ".q_proj.", "q"),
    StackedParam(".qkv_proj.", ".k_proj.", "k"),
    StackedParam(".qkv_proj.", ".v_proj.", "v"),
    StackedParam(".gate_up_proj.", ".gate_proj.", 0),
    StackedParam(".gate_up_proj.", ".up_proj.", 1),
)


def make_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    ckpt = {
        "col.weight": randn(COL_OUT, HIDDEN), "col.bias": randn(COL_OUT),
        "row.weight": randn(ROW_OUT, ROW_IN), "row.bias": randn(ROW_OUT),
        "mlp.gate_proj.weight": randn(INTER, HIDDEN), "mlp.gate_proj.bias": randn(INTER),
        "mlp.up_proj.weight": randn(INTER, HIDDEN), "mlp.up_proj.bias": randn(INTER),
        "embed.weight": randn(VOCAB, HIDDEN),
        "lm_head.weight": randn(VOCAB, HIDDEN), "lm_head.bias": randn(VOCAB),
    }
    for name, kv_heads in (("attn_kv2", 2), ("attn_kv1", 1)):
        ckpt[f"{name}.q_proj.weight"] = randn(NUM_HEADS * HEAD, HIDDEN)
        ckpt[f"{name}.q_proj.bias"] = randn(NUM_HEADS * HEAD)
        for proj in ("k_proj", "v_proj"):
            ckpt[f"{name}.{proj}.weight"] = randn(kv_heads * HEAD, HIDDEN)
            ckpt[f"{name}.{proj}.bias"] = randn(kv_heads * HEAD)
    return ckpt


class Block(nn.Module):
    def __init__(self, **layer) -> None:
        super().__init__()
        for name, module in layer.items():
            setattr(self, name, module)


class TinyTPModel(nn.Module):
    """Every tensor-parallel layer once (``tp`` None: unsharded)."""

    def __init__(self, tp: Communicator | None) -> None:
        super().__init__()
        common = {"dtype": F64, "device": "cpu"}
        self.col = ColumnParallelLinear(HIDDEN, COL_OUT, bias=True, tp=tp, **common)
        self.row = RowParallelLinear(ROW_IN, ROW_OUT, bias=True, tp=tp, **common)
        self.mlp = Block(gate_up_proj=MergedLinear(HIDDEN, {0: INTER, 1: INTER}, bias=True,
                                                   tp=tp, **common))
        self.attn_kv2 = Block(qkv_proj=QKVLinear(HIDDEN, HEAD, NUM_HEADS, 2, bias=True, tp=tp,
                                                 **common))
        self.attn_kv1 = Block(qkv_proj=QKVLinear(HIDDEN, HEAD, NUM_HEADS, 1, bias=True, tp=tp,
                                                 **common))
        self.embed = VocabEmbedding(VOCAB, HIDDEN, tp=tp, **common)
        self.lm_head = LMHead(VOCAB, HIDDEN, bias=True, tp=tp, **common)


def load(model: nn.Module, weights) -> None:
    filled = load_named_weights(model, weights, stacked=STACKED)
    assert filled == set(dict(model.named_parameters()))


def inputs(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(TOKENS, HIDDEN, generator=gen, dtype=F64),
        "x_row": torch.randn(TOKENS, ROW_IN, generator=gen, dtype=F64),
        # ids on both shards, both shard edges and the last real row
        "ids": torch.tensor([0, 18, 19, 36, 5, 25, 18, 0]),
    }


def ref_linear(x: torch.Tensor, ckpt: dict, name: str) -> torch.Tensor:
    """x W^T + b on the full checkpoint weights, in float64."""
    return x @ ckpt[f"{name}.weight"].T + ckpt[f"{name}.bias"]


def cols(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    n = t.shape[-1] // parts
    return t[..., part * n:(part + 1) * n]


def close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert got.dtype == expected.dtype, (what, got.dtype, expected.dtype)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=what)


def check_model(model: TinyTPModel, ckpt: dict, rank: int, parts: int) -> None:
    """Each layer's output on this rank == its part of the unsharded reference."""
    io = inputs()
    x, x_row, ids = io["x"], io["x_row"], io["ids"]
    with torch.no_grad():
        close(model.col(x), cols(ref_linear(x, ckpt, "col"), rank, parts), "column")

        # each rank feeds its slice of the input features; the sum is the full output
        close(model.row(cols(x_row, rank, parts)), ref_linear(x_row, ckpt, "row"), "row")

        gate_up = model.mlp.gate_up_proj
        gate, up = gate_up.split(gate_up(x))
        close(gate, cols(ref_linear(x, ckpt, "mlp.gate_proj"), rank, parts), "gate")
        close(up, cols(ref_linear(x, ckpt, "mlp.up_proj"), rank, parts), "up")

        for name, kv_heads in (("attn_kv2", 2), ("attn_kv1", 1)):
            qkv = getattr(model, name).qkv_proj
            assert qkv.num_heads == NUM_HEADS // parts
            # kv heads split when there are enough, else replicated: rank r holds head
            # r // (parts // kv_heads)
            kv_parts = min(kv_heads, parts)
            kv_part = rank // (parts // kv_parts)
            assert qkv.num_kv_heads == kv_heads // kv_parts
            q, k, v = qkv.split(qkv(x))
            close(q, cols(ref_linear(x, ckpt, f"{name}.q_proj"), rank, parts), f"{name} q")
            close(k, cols(ref_linear(x, ckpt, f"{name}.k_proj"), kv_part, kv_parts),
                  f"{name} k")
            close(v, cols(ref_linear(x, ckpt, f"{name}.v_proj"), kv_part, kv_parts),
                  f"{name} v")

        close(model.embed(ids), ckpt["embed.weight"][ids], "embedding")

        logits = model.lm_head(x)
        expected = (x @ ckpt["lm_head.weight"].T + ckpt["lm_head.bias"]).float()
        assert logits.dtype == torch.float32 and logits.shape == (TOKENS, VOCAB)
        torch.testing.assert_close(logits, expected, msg="lm head")


def check_param_sizes(model: TinyTPModel, full: TinyTPModel, parts: int) -> None:
    """Sharded layers hold ~1/parts of the unsharded parameters."""
    def numel(module: nn.Module, name: str) -> int:
        return getattr(module, name).numel()

    halved = [("col", "weight"), ("col", "bias"), ("row", "weight"),
              ("mlp.gate_up_proj", "weight"), ("mlp.gate_up_proj", "bias"),
              ("attn_kv2.qkv_proj", "weight"), ("attn_kv2.qkv_proj", "bias")]
    for layer, pname in halved:
        mine = numel(model.get_submodule(layer), pname)
        whole = numel(full.get_submodule(layer), pname)
        assert mine * parts == whole, (layer, pname, mine, whole)
    # the row-parallel bias is added once after the reduction: every rank holds it whole
    assert model.row.bias.shape == full.row.bias.shape
    # replicated kv heads: q split, k/v whole
    kv1, kv1_full = model.attn_kv1.qkv_proj, full.attn_kv1.qkv_proj
    assert kv1.weight.shape == (NUM_HEADS * HEAD // parts + 2 * HEAD, HIDDEN)
    assert kv1_full.weight.shape == (NUM_HEADS * HEAD + 2 * HEAD, HIDDEN)
    rows = -(-VOCAB // parts)
    for name in ("embed", "lm_head"):
        assert getattr(model, name).weight.shape == (rows, HIDDEN)
        assert getattr(full, name).weight.shape == (VOCAB, HIDDEN)


def _worker(rank: int, port: int, ckpt: dict, files: list[Path]) -> None:
    torch.set_num_threads(1)
    layout = ParallelLayout(tensor_parallel_size=WORLD, rank=rank)
    state = init_parallel_state(GlooCommunicator, layout, f"tcp://127.0.0.1:{port}",
                                timeout_s=60)
    try:
        assert state.tp.world_size == WORLD and state.tp.rank == rank
        eager = TinyTPModel(state.tp)
        load(eager, ckpt.items())
        check_model(eager, ckpt, rank, WORLD)
        check_param_sizes(eager, TinyTPModel(None), WORLD)
        # this rank's vocab padding row is zero (rank 1: row 18 of 19)
        if rank == WORLD - 1:
            assert not eager.lm_head.weight[-1].any() and not eager.embed.weight[-1].any()
            assert not eager.lm_head.bias[-1].any()

        lazy_weights = list(safetensors_weights_iterator(files, lazy=True))
        assert all(isinstance(t, LazyTensor) for _, t in lazy_weights)
        lazy = TinyTPModel(state.tp)
        load(lazy, lazy_weights)
        eager_params = dict(eager.named_parameters())
        for name, param in lazy.named_parameters():
            assert torch.equal(param, eager_params[name]), name
        check_model(lazy, ckpt, rank, WORLD)
    finally:
        destroy_parallel_state()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, torch.Tensor]:
    return make_checkpoint()


def test_unsharded_layers_match_reference(checkpoint):
    """The harness itself: with ``tp=None`` every layer is the full reference."""
    model = TinyTPModel(None)
    load(model, checkpoint.items())
    check_model(model, checkpoint, rank=0, parts=1)


def test_two_rank_tensor_parallel_layers_match_reference(checkpoint, tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(checkpoint, str(path))
    mp.start_processes(_worker, args=(_free_port(), checkpoint, [path]), nprocs=WORLD,
                       start_method="fork")


# --- without processes: a communicator whose collectives must not be called -----------


class FakeTP(Communicator):
    """rank / world_size only: weight loading and column-parallel forwards never
    communicate."""

    def all_reduce(self, tensor):
        raise AssertionError("no collective expected")

    all_gather = reduce_scatter = broadcast = send = recv = barrier = all_reduce


@pytest.mark.parametrize(("tp", "kv_heads", "expected_heads"), [
    (4, 2, [0, 0, 1, 1]),  # replicated on 2 consecutive ranks each
    (4, 1, [0, 0, 0, 0]),
    (4, 4, [0, 1, 2, 3]),  # split
    (2, 2, [0, 1]),
])
def test_qkv_kv_head_of_each_rank(checkpoint, tp, kv_heads, expected_heads):
    gen = torch.Generator().manual_seed(3)
    num_heads = 8
    wq = torch.randn(num_heads * HEAD, HIDDEN, generator=gen, dtype=F64)
    wk = torch.randn(kv_heads * HEAD, HIDDEN, generator=gen, dtype=F64)
    wv = torch.randn(kv_heads * HEAD, HIDDEN, generator=gen, dtype=F64)
    x = inputs()["x"]
    for rank in range(tp):
        layer = QKVLinear(HIDDEN, HEAD, num_heads, kv_heads, bias=False, dtype=F64,
                          device="cpu", tp=FakeTP(rank, tp))
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            layer.weight.weight_loader(layer.weight, w, shard)
        assert layer.num_heads == num_heads // tp and layer.num_kv_heads == max(1, kv_heads // tp)
        q, k, v = layer.split(layer(x))
        per_rank = num_heads // tp
        close(q, (x @ wq.T)[:, rank * per_rank * HEAD:(rank + 1) * per_rank * HEAD], "q")
        head = expected_heads[rank]
        kv_local = layer.num_kv_heads
        span = slice(head * kv_local * HEAD, (head + 1) * kv_local * HEAD)
        close(k, (x @ wk.T)[:, span], f"k rank {rank}")
        close(v, (x @ wv.T)[:, span], f"v rank {rank}")
        # the query heads of this rank read kv head(s) of their own GQA group
        group = num_heads // kv_heads
        q_heads = range(rank * per_rank, (rank + 1) * per_rank)
        kv_global = range(head * kv_local, (head + 1) * kv_local)
        assert {h // group for h in q_heads} <= set(kv_global)


def test_qkv_rejects_unsplittable_heads():
    with pytest.raises(ValueError, match="not a multiple of the 3 key/value heads"):
        QKVLinear(HIDDEN, HEAD, 12, 3, bias=False, dtype=F64, device="cpu", tp=FakeTP(0, 4))
    with pytest.raises(ValueError, match="attention heads"):
        QKVLinear(HIDDEN, HEAD, 6, 2, bias=False, dtype=F64, device="cpu", tp=FakeTP(0, 4))


def test_column_parallel_rejects_uneven_output():
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        ColumnParallelLinear(HIDDEN, COL_OUT, bias=False, dtype=F64, device="cpu",
                             tp=FakeTP(0, 3))


@pytest.mark.parametrize(("vocab", "tp"), [(37, 2), (5, 4), (3, 4), (8, 4)])
def test_vocab_shards_cover_the_vocabulary(vocab, tp):
    shards = [VocabShard.of(vocab, FakeTP(r, tp)) for r in range(tp)]
    rows = -(-vocab // tp)
    assert all(s.num_rows == rows for s in shards)
    covered = [i for s in shards for i in range(s.start, s.start + s.num_real)]
    assert covered == list(range(vocab))
    full = torch.randn(vocab, 3, dtype=F64, generator=torch.Generator().manual_seed(4))
    for rank, shard in enumerate(shards):
        emb = VocabEmbedding(vocab, 3, dtype=F64, device="cpu", tp=FakeTP(rank, tp))
        emb.weight.fill_(float("nan"))
        emb.weight.weight_loader(emb.weight, full)
        expected = torch.zeros(rows, 3, dtype=F64)
        expected[:shard.num_real] = full[shard.start:shard.start + shard.num_real]
        assert torch.equal(emb.weight.detach(), expected)  # padding zeroed, not left NaN


# --- row-parallel g_idx (GPTQ / compressed-tensors act-order) ------------------------


def test_rebased_group_index_trivial():
    g_idx = torch.arange(16) // 4  # K=16, group 4: groups 0..3
    assert _rebased_group_index(g_idx, 0, 0, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert _rebased_group_index(g_idx, 0, 1, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_rebased_group_index_act_order_within_a_rank():
    # each rank's features stay in its own groups, in a permuted order: allowed
    g_idx = torch.tensor([1, 0, 0, 1, 0, 1, 1, 0, 3, 2, 2, 3, 3, 2, 3, 2])
    assert _rebased_group_index(g_idx, 0, 1, 2).tolist() == [1, 0, 0, 1, 1, 0, 1, 0]
    assert _rebased_group_index(g_idx, 0, 0, 2).tolist() == g_idx[:8].tolist()


def test_rebased_group_index_refuses_cross_rank_act_order():
    g_idx = torch.arange(16) // 4
    permuted = g_idx[torch.tensor([0, 12, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 4, 13, 14, 15])]
    for rank in range(2):
        with pytest.raises(ValueError, match="act-order"):
            _rebased_group_index(permuted, 0, rank, 2)
    with pytest.raises(ValueError, match="act-order"):
        _rebased_group_index(g_idx.flip(0), 0, 0, 2)


def _gptq_row(rank: int, parts: int, group: int, k: int = 64, n: int = 16):
    cfg = GPTQConfig(bits=4, group_size=group, sym=True, desc_act=False,
                     checkpoint_format="gptq")
    return RowParallelLinear(k, n, bias=False, dtype=torch.float32, device="cpu",
                             tp=FakeTP(rank, parts), quant_method=cfg.linear_method(("x",)))


def _gptq_checkpoint(group: int, g_idx: torch.Tensor, k: int = 64, n: int = 16) -> dict:
    groups = k // group
    gen = torch.Generator().manual_seed(5)
    return {
        "qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen,
                                 dtype=torch.int64).to(torch.int32),
        "qzeros": torch.randint(0, 2**31 - 1, (groups, n // 8), generator=gen,
                                dtype=torch.int64).to(torch.int32),
        "scales": torch.rand(groups, n, generator=gen) + 0.5,
        "g_idx": g_idx.to(torch.int32),
    }


def test_gptq_row_parallel_loader_splits_and_rebases():
    k, group = 64, 16  # 4 groups, 2 per rank
    ckpt = _gptq_checkpoint(group, torch.arange(k) // group)
    for rank in range(2):
        layer = _gptq_row(rank, 2, group)
        for name, tensor in ckpt.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor)
        assert torch.equal(layer.qweight, ckpt["qweight"][rank * 4:(rank + 1) * 4])
        assert torch.equal(layer.qzeros, ckpt["qzeros"][rank * 2:(rank + 1) * 2])
        assert torch.equal(layer.scales, ckpt["scales"][rank * 2:(rank + 1) * 2])
        assert layer.g_idx.tolist() == [(torch.arange(32) // group).tolist()]


def test_gptq_row_parallel_loader_refuses_cross_rank_act_order():
    k, group = 64, 16
    g_idx = (torch.arange(k) // group).flip(0)
    layer = _gptq_row(0, 2, group)
    with pytest.raises(ValueError, match="act-order"):
        layer.g_idx.weight_loader(layer.g_idx, g_idx.to(torch.int32))


def test_gptq_channelwise_row_parallel_loads():
    """group_size=-1: one scale group for the whole K, so its [1, N] scales, [1, N/8]
    qzeros and all-zero g_idx stay whole on every rank."""
    k = 64
    ckpt = _gptq_checkpoint(k, torch.zeros(k, dtype=torch.int64))
    layer = _gptq_row(1, 2, -1)
    for name, tensor in ckpt.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    assert torch.equal(layer.scales, ckpt["scales"])  # the one group, whole
    assert torch.equal(layer.qzeros, ckpt["qzeros"])
    assert not layer.g_idx.any()
