"""Batch-invariant Triton kernels (engine.kernels.batch_invariant) and attention in the mode.

The property is bitwise: a row's result computed alone equals the same row computed
among others (1, 3, 17, 64 rows, at different places), and for attention the same query
token computed as a decode, inside a speculative verification, inside a prefill chunk
or in one whole prefill. Closeness to float64 shows the kernels compute the right thing.
Under TRITON_INTERPRET=1 (conftest.py) ``tl.dot`` is a numpy matmul of the fixed tile
shape; the interpreter rounds float32 to bfloat16 by truncation, so bf16 results are
compared with float64 at a bf16 tolerance only. numpy's BLAS is not row-invariant on
every CPU (OpenBLAS's AVX2 sgemm rounds some rows of a tile differently from others, by
their place in its register blocks; its AVX-512 kernels do not), while one MMA
accumulation chain per output element is: the module's fixture makes the interpreted dot
that chain, so what is tested is the kernels' tiling and order, on any CPU. On a GPU the
same tests run with real ``tl.dot`` (ci/gpu_kernel_shim.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.core.interfaces.gemm import DenseLayerSpec
from engine.kernels import stats
from engine.kernels.batch_invariant import (
    TritonBatchInvariantGemm,
    log_softmax,
    matmul,
    rms_norm,
    softmax,
    triton_batch_invariant_available,
)
from engine.kernels.triton_backend import NUM_KV_SPLITS_ENV, TritonAttentionBackend
from engine.kernels.unified_attention import choose_num_kv_splits, unified_attention

BATCHES = ((1, 0), (3, 1), (17, 16), (64, 37))  # (rows, target's place)


@pytest.fixture(autouse=True)
def _interpreted_dot_is_one_chain_per_element(monkeypatch):
    """The interpreter's ``tl.dot`` as each output element's own in-order fp32 sum over K
    (einsum's sum-of-products loop), never a BLAS kernel whose rounding of a row depends
    on the row's place in the tile."""
    import numpy as np
    from triton.runtime import interpreter

    plain_dot = interpreter.InterpreterBuilder.create_dot

    def chained_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...ik,...kj->...ij", a.data, b.data, optimize=False)
        return interpreter.TensorHandle(product.astype(d.data.dtype) + d.data,
                                        d.dtype.scalar)

    if os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", chained_dot)


@pytest.fixture(autouse=True)
def _mode_follows_the_environment(monkeypatch):
    """Each test starts with the process's mode unset (following ENGINE_BATCH_INVARIANT),
    and an in-process engine's worker setting it (set_batch_invariant) is undone after:
    later tests' backends would otherwise run in the mode."""
    from engine.core import batch_invariance

    monkeypatch.setattr(batch_invariance, "_enabled", None)
MATMUL_BATCHES = (*BATCHES, (200, 150))  # a second BLOCK_M tile of rows too


def _batches(target: torch.Tensor, pool: torch.Tensor, batches=BATCHES):
    """``(batch, place)``: ``target`` [1, ...] placed among rows of ``pool``."""
    for rows, place in batches:
        others = pool[: rows - 1]
        yield torch.cat([others[:place], target, others[place:]]), place


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


# ----------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
def test_matmul_row_is_bitwise_equal_in_any_batch(x_dtype, w_dtype):
    gen = torch.Generator().manual_seed(0)
    k, n = 150, 40  # K: several BLOCK_K steps and a masked tail
    w = torch.randn(n, k, generator=gen).to(w_dtype)
    bias = torch.randn(n, generator=gen).to(x_dtype)
    target = torch.randn(1, k, generator=gen).to(x_dtype)
    pool = torch.randn(256, k, generator=gen).to(x_dtype)
    alone = matmul(target, w, bias)
    for batch, place in _batches(target, pool, MATMUL_BATCHES):
        got = matmul(batch, w, bias)
        assert torch.equal(got[place], alone[0]), f"row moved in a batch of {len(batch)}"
    ref = F.linear(target.double(), w.double(), bias.double())
    assert _rel_err(alone, ref) < (1e-5 if x_dtype == torch.float32 else 2e-2)
    # A 3-D input is its rows; a strided one (a slice) too.
    assert torch.equal(matmul(pool[:6].view(2, 3, k), w).view(6, n), matmul(pool[:6], w))
    wide = torch.cat([pool[:5], pool[:5]], dim=1)[:, :k]
    assert torch.equal(matmul(wide, w), matmul(pool[:5], w))


def test_gemm_kernel_offers_itself_only_where_it_runs():
    spec = DenseLayerSpec(64, 32, torch.bfloat16, torch.device("cpu"), batch_invariant=True)
    assert TritonBatchInvariantGemm.batch_invariant and TritonBatchInvariantGemm.keeps_layout
    assert TritonBatchInvariantGemm.can_implement(spec) is None  # interpreted CPU tensors
    assert triton_batch_invariant_available("cuda")
    assert not triton_batch_invariant_available("meta")
    fp8 = DenseLayerSpec(64, 32, torch.float8_e4m3fn, torch.device("cpu"))
    assert "float16" in TritonBatchInvariantGemm.can_implement(fp8)
    kernel = TritonBatchInvariantGemm()
    w = torch.randn(32, 64)
    x = torch.randn(5, 64)
    assert kernel.prepare(w, spec) is w
    assert torch.equal(kernel.apply(w, x), matmul(x, w))


# ---------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("width", [96, 5000])  # one chunk; two chunks (BLOCK 4096)
def test_rms_norm_row_is_bitwise_equal_in_any_batch(width):
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(width, generator=gen) + 0.5
    target = torch.randn(1, width, generator=gen)
    target_res = torch.randn(1, width, generator=gen)
    pool = torch.randn(256, width, generator=gen)
    pool_res = torch.randn(256, width, generator=gen)
    alone = rms_norm(target, w, 1e-6)
    res_alone = target_res.clone()
    alone_sum = rms_norm(target, w, 1e-6, res_alone)
    assert torch.equal(res_alone, target + target_res)  # the sum written back
    for (batch, place), (res, _) in zip(_batches(target, pool), _batches(target_res, pool_res)):
        assert torch.equal(rms_norm(batch, w, 1e-6)[place], alone[0])
        res = res.clone()
        assert torch.equal(rms_norm(batch, w, 1e-6, res)[place], alone_sum[0])
        assert torch.equal(res[place], res_alone[0])
    assert _rel_err(alone, F.rms_norm(target.double(), (width,), w.double(), 1e-6)) < 1e-6
    summed = (target + target_res).double()
    assert _rel_err(alone_sum, F.rms_norm(summed, (width,), w.double(), 1e-6)) < 1e-6


def test_rms_norm_of_heads_and_strided_rows():
    """Per-head q/k norms read [tokens, heads, head_size] slices of a fused projection."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 3 * 4 * 32, generator=gen)
    w = torch.rand(32, generator=gen) + 0.5
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # strided tokens, contiguous heads
    got = rms_norm(q, w, 1e-5)
    assert got.shape == (20, 32)
    assert torch.equal(got, rms_norm(q.reshape(20, 32).contiguous(), w, 1e-5))
    ref = F.rms_norm(q.double(), (32,), w.double(), 1e-5).reshape(20, 32)
    assert _rel_err(got, ref) < 1e-6
    bf16 = rms_norm(q.to(torch.bfloat16), w.to(torch.bfloat16), 1e-5)
    assert bf16.dtype == torch.bfloat16 and _rel_err(bf16, ref) < 2e-2


def test_rms_norm_gemma_matches_gemma_rms_norm():
    from engine.model_executor.layers.norm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen)
    res = torch.randn(6, 64, generator=gen)
    norm = GemmaRMSNorm(64, 1e-6, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen) * 0.1)
    want, want_sum = norm(x, res.clone())
    res_got = res.clone()
    got = rms_norm(x, norm.weight, 1e-6, res_got, gemma=True)
    assert torch.equal(res_got, want_sum) and _rel_err(got, want.double()) < 1e-6


# ------------------------------------------------------------------------ log_softmax


@pytest.mark.parametrize("vocab", [1000, 9000])  # one chunk; three chunks
def test_log_softmax_row_is_bitwise_equal_in_any_batch(vocab):
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1, vocab, generator=gen) * 4
    target[0, :7] = float("-inf")  # banned tokens
    pool = torch.randn(256, vocab, generator=gen) * 4
    alone = log_softmax(target)
    for batch, place in _batches(target, pool):
        assert torch.equal(log_softmax(batch)[place], alone[0])
    ref = torch.log_softmax(target.double(), dim=-1)
    finite = ref.isfinite()
    assert torch.equal(alone.isfinite(), finite)
    assert (alone.double() - ref)[finite].abs().max() < 1e-5
    half = log_softmax(target.to(torch.bfloat16))
    assert half.dtype == torch.float32
    probs = softmax(target)
    for batch, place in _batches(target, pool):
        assert torch.equal(softmax(batch)[place], probs[0])
    assert (probs.double() - ref.exp()).abs().max() < 1e-6


# ------------------------------------------------ the GPU platforms' ops and offers


def test_gpu_platforms_offer_the_invariant_kernels_only_in_the_mode(monkeypatch):
    from engine.kernels.batch_invariant_ops import BatchInvariantFusedOps
    from engine.plugins.cuda.platform import CUDAPlatform
    from engine.plugins.rocm.platform import ROCmPlatform
    from engine.plugins.xpu.platform import XPUPlatform

    for cls in (CUDAPlatform, ROCmPlatform, XPUPlatform):
        monkeypatch.setenv("ENGINE_BATCH_INVARIANT", "1")
        platform = cls()
        assert platform.dense_gemm_kernels()[0] is TritonBatchInvariantGemm
        assert isinstance(platform.fused_ops(), BatchInvariantFusedOps)
        monkeypatch.setenv("ENGINE_BATCH_INVARIANT", "0")
        assert platform.dense_gemm_kernels() == [] and platform.fused_ops() is None


def test_invariant_fused_ops_match_the_layers_torch_paths():
    """RMSNorm through the ops equals HF's order to fp32 rounding; the torch ops (silu,
    rotary, embedding, argmax) equal the layers' own torch paths bit for bit."""
    from engine.kernels.batch_invariant_ops import BatchInvariantFusedOps
    from engine.model_executor.layers.activation import SiluAndMul
    from engine.model_executor.layers.norm import RMSNorm
    from engine.model_executor.layers.rotary import RopeScaling, RotaryEmbedding

    ops = BatchInvariantFusedOps()
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 64, generator=gen).to(dtype)
        res = torch.randn(6, 64, generator=gen).to(dtype)
        plain = RMSNorm(64, 1e-5, dtype=dtype, device="cpu")
        fused = RMSNorm(64, 1e-5, dtype=dtype, device="cpu", fused_ops=ops)
        with torch.no_grad():
            plain.weight.copy_(torch.rand(64, generator=gen) + 0.5)
            fused.weight.copy_(plain.weight)
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        assert _rel_err(fused(x), plain(x).double()) < tol
        want, want_sum = plain(x, res.clone())
        res_fused = res.clone()
        got, got_sum = fused(x, res_fused)
        assert got_sum is res_fused and _rel_err(got, want.double()) < tol
        if dtype == torch.float32:
            assert torch.equal(got_sum, want_sum)
        gate_up = torch.randn(5, 96, generator=gen).to(dtype)
        assert torch.equal(SiluAndMul(ops, dtype)(gate_up), SiluAndMul()(gate_up))
        scaling = RopeScaling("default", 10000.0, 64)
        rope = RotaryEmbedding(32, scaling, dtype=dtype, device="cpu")
        rope_fused = RotaryEmbedding(32, scaling, dtype=dtype, device="cpu", fused_ops=ops)
        qkv = torch.randn(5, 5 * 32, generator=gen).to(dtype)
        positions = torch.tensor([0, 3, 9, 63, 1])
        q = qkv[:, : 3 * 32]  # a strided slice, rotated in place
        want = rope.apply(q.clone(), rope.prepare(positions))
        rope_fused.apply(q, rope_fused.prepare(positions))
        assert torch.equal(q, want)
    table = torch.randn(50, 8, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, 49, 7])
    assert torch.equal(ops.embedding(ids, table, torch.float32), table[ids].float())
    with pytest.raises(ValueError, match="token ids"):
        ops.embedding(torch.tensor([50]), table)
    logits = torch.randn(4, 30, generator=gen)
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))


# -------------------------------------------------------------------------- attention

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 2, 1, 32, 16
LONG = 600  # a lone decode this long splits its keys outside the mode
SCALE = 0.2


def _request(seq: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One request's q (a row per position), K and V over its whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(seq, h, HEAD_SIZE, generator=gen).to(dtype)
            for name, h in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}


def _attend(reqs: list[tuple[dict, int]], seed: int, **kwargs) -> list[torch.Tensor]:
    """Each ``(request, query_len)``'s last ``query_len`` rows, computed in one call over a
    paged cache whose blocks are scattered by ``seed``."""
    seqs = [r["k"].shape[0] for r, _ in reqs]
    per_req = [-(-s // BLOCK_SIZE) for s in seqs]
    num_blocks = sum(per_req) + 2
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    dtype = reqs[0][0]["k"].dtype
    cache = torch.full((2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), float("nan"),
                       dtype=dtype)
    tables = torch.zeros(len(reqs), max(per_req), dtype=torch.int32)
    used = 0
    for i, ((req, _), n) in enumerate(zip(reqs, per_req)):
        tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
        pos = torch.arange(seqs[i])
        slot = tables[i].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        flat = cache.view(2, -1, KV_HEADS, HEAD_SIZE)
        flat[0, slot], flat[1, slot] = req["k"], req["v"]
    q_lens = [q for _, q in reqs]
    q = torch.cat([req["q"][s - ql:] for (req, ql), s in zip(reqs, seqs)])
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, cache, out, qsl, torch.tensor(seqs, dtype=torch.int32), tables,
                      max(q_lens), max(seqs), SCALE, **kwargs)
    return list(out.split(q_lens))


def _reference_row(req: dict, position: int) -> torch.Tensor:
    """float64 attention of the query at ``position`` over keys 0..position."""
    q = req["q"][position].double()  # [H, D]
    k = req["k"][: position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = req["v"][: position + 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    probs = torch.softmax(torch.einsum("hd,shd->hs", q, k) * SCALE, dim=-1)
    return torch.einsum("hs,shd->hd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_row_is_bitwise_equal_in_every_step_kind(dtype):
    """The last query token of a long request: a decode alone, a decode among others, in
    a speculative verification, at the end of a short and of a long prefill chunk.

    float32 shows the most bits (outside the mode the lone decode splits its keys and
    differs, checked below); bfloat16 is where decode and prefill tiles differ outside
    the mode, though the interpreter's bf16 output rounding hides most of that."""
    target = _request(LONG, 0, dtype)
    others = [_request(s, 10 + i, dtype) for i, s in enumerate((40, 3, 70))]
    assert choose_num_kv_splits(1, KV_HEADS, 1, LONG, 2) > 1  # would split outside the mode
    before = stats.launches.snapshot()
    alone = _attend([(target, 1)], seed=0, batch_invariant=True)[0][-1]
    rows = {
        "decode among others": _attend([(others[0], 5), (target, 1), (others[1], 1)],
                                       seed=1, batch_invariant=True)[1][-1],
        "verification": _attend([(others[2], 1), (target, 4)], seed=2,
                                batch_invariant=True)[1][-1],
        "prefill chunk": _attend([(target, 37), (others[0], 40)], seed=3,
                                 batch_invariant=True)[0][-1],
        "long prefill chunk": _attend([(others[1], 3), (target, 150)], seed=4,
                                      batch_invariant=True)[1][-1],
    }
    after = stats.launches.snapshot()
    assert after["split_kv_attention"] == before["split_kv_attention"]
    for kind, row in rows.items():
        assert torch.equal(row, alone), f"{kind} differs from the lone decode"
    ref = _reference_row(target, LONG - 1)
    assert _rel_err(alone, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    if dtype == torch.float32:  # the check can see a difference: the split-KV one
        split = _attend([(target, 1)], seed=0)[0][-1]
        assert not torch.equal(split, rows["long prefill chunk"])
    with pytest.raises(ValueError, match="cannot split"):
        _attend([(target, 1)], seed=0, batch_invariant=True, num_kv_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_rows_equal_the_whole_prefill(dtype):
    """Every row of a prompt, prefilled in one step or in chunks of 7 / 16 tokens (each
    chunk continuing over the keys cached before it), next to other requests."""
    seq = 45
    target = _request(seq, 5, dtype)
    other = _request(30, 6, dtype)
    whole = _attend([(target, seq)], seed=0, batch_invariant=True)[0]
    for chunk in (7, 16):
        rows = []
        for end in range(chunk, seq + chunk, chunk):
            end = min(end, seq)
            part = {name: t[:end] for name, t in target.items()}
            q_len = end - sum(r.shape[0] for r in rows)
            rows.append(_attend([(other, 1), (part, q_len)], seed=end,
                                batch_invariant=True)[1])
        assert torch.equal(torch.cat(rows), whole), f"chunks of {chunk} differ"
    ref = torch.stack([_reference_row(target, p) for p in range(seq)])
    assert _rel_err(whole, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_backend_reads_the_mode_and_never_splits(monkeypatch):
    from engine.core.interfaces.attention import AttentionBatch, AttentionLayerSpec

    monkeypatch.delenv(NUM_KV_SPLITS_ENV, raising=False)
    monkeypatch.setenv("ENGINE_BATCH_INVARIANT", "1")
    backend = TritonAttentionBackend(16, torch.device("cpu"), num_compute_units=132)
    assert backend.batch_invariant
    backend.make_impl(AttentionLayerSpec(num_heads=8, head_size=64, num_kv_heads=2, scale=1.0))
    one = torch.tensor([0, 1], dtype=torch.int32)
    decode = AttentionBatch(1, 1, one, torch.tensor([4096], dtype=torch.int32),
                            torch.zeros(1, 256, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int64), 1, 4096)
    metadata = backend.build_metadata(decode)
    assert metadata.num_kv_splits == 1 and metadata.batch_invariant
    off = TritonAttentionBackend(16, torch.device("cpu"), num_compute_units=132,
                                 batch_invariant=False)
    off.make_impl(AttentionLayerSpec(num_heads=8, head_size=64, num_kv_heads=2, scale=1.0))
    assert off.build_metadata(decode).num_kv_splits > 1
    monkeypatch.setenv(NUM_KV_SPLITS_ENV, "3")
    with pytest.raises(ValueError, match="cannot split"):
        TritonAttentionBackend(16, torch.device("cpu"))


def _backend_metadata(backend, query_lens: list[int], seq_lens: list[int], tables):
    from engine.core.interfaces.attention import AttentionBatch

    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seqs = torch.tensor(seq_lens, dtype=torch.int32)
    batch = AttentionBatch(len(query_lens), int(qsl[-1]), qsl, seqs, tables,
                           torch.full((int(qsl[-1]),), -1, dtype=torch.int64),
                           max(query_lens), max(seq_lens), qsl.numpy(), seqs.numpy())
    return backend.build_metadata(batch)


def test_mla_and_encoder_layers_in_the_mode():
    """Through the backend in the mode: an MLA query token as a decode equals it at the end
    of a prefill chunk next to another request; an encoder request alone equals it next
    to a longer one (whose length would otherwise size the tiles). Under the interpreter
    this checks the wiring: numpy's matmul already keeps a row's sums whatever the tile's
    row count, so only a GPU shows what the fixed tiles prevent."""
    from engine.core.interfaces.attention import AttentionLayerSpec

    lora, rope, heads, block = 16, 8, 4, 8
    backend = TritonAttentionBackend(block, torch.device("cpu"), batch_invariant=True)
    gen = torch.Generator().manual_seed(8)
    entries = {n: torch.randn(n, lora + rope, generator=gen) for n in (40, 13)}
    queries = {n: torch.randn(n, heads, lora + rope, generator=gen) for n in (40, 13)}
    mla = backend.make_impl(AttentionLayerSpec(heads, lora + rope, 1, 0.3, kv_lora_rank=lora))

    def mla_rows(reqs: list[tuple[int, int]]) -> list[torch.Tensor]:
        """(sequence, query_len) pairs; entries stored at scattered blocks."""
        per = [-(-n // block) for n, _ in reqs]
        perm = torch.randperm(sum(per) + 1, generator=gen)
        cache = torch.full((sum(per) + 1, block, lora + rope), float("nan"))
        tables = torch.zeros(len(reqs), max(per), dtype=torch.int32)
        used = 0
        for i, ((n, _), width) in enumerate(zip(reqs, per)):
            tables[i, :width] = perm[used : used + width].to(torch.int32)
            used += width
            pos = torch.arange(n)
            cache.view(-1, lora + rope)[tables[i].long()[pos // block] * block
                                        + pos % block] = entries[n]
        q = torch.cat([queries[n][n - ql:] for n, ql in reqs])
        metadata = _backend_metadata(backend, [ql for _, ql in reqs], [n for n, _ in reqs],
                                     tables)
        return list(mla.forward(q, None, None, cache, metadata).split([ql for _, ql in reqs]))

    decode = mla_rows([(40, 1)])[0][-1]
    assert torch.equal(mla_rows([(13, 13), (40, 9)])[1][-1], decode)

    encoder = backend.make_impl(AttentionLayerSpec(heads, 32, 2, 0.2, causal=False))
    q, k, v = (torch.randn(45, h, 32, generator=gen).to(torch.bfloat16)
               for h in (heads, 2, 2))

    def encode(lengths: list[int]) -> torch.Tensor:
        total = sum(lengths)
        tables = torch.zeros(len(lengths), 1, dtype=torch.int32)
        metadata = _backend_metadata(backend, lengths, lengths, tables)
        return encoder.forward(q[-total:], k[-total:], v[-total:], None, metadata)

    assert torch.equal(encode([37, 8])[-8:], encode([8]))


# ------------------------------------------------------------------------- end to end

E2E_TARGET = [(7 * i + 3) % 290 + 5 for i in range(21)]
E2E_OTHERS = [[(11 * i + j) % 290 + 5 for i in range(n)] for j, n in ((1, 3), (2, 13), (3, 9))]


def test_engine_tokens_and_logprobs_are_bitwise_equal_alone_and_in_a_batch(
    llama_dir, monkeypatch
):
    """The whole engine on the CPU platform with the Triton attention backend in the mode:
    a prompt's greedy tokens and top logprobs alone equal those among three others (its
    21-token prefill chunked differently by a 16-token budget, decodes mixed with the
    others' prefill chunks) and those of an engine whose 32-token budget prefills it in
    one step. The GEMMs, norms and sampler here are the CPU platform's in
    its own batch-invariant mode; the attention is the Triton kernel's. (Outside the mode
    the batched run's logprobs differ in the last bits.) Speculative verification reaches
    this backend as one decode row per token (test_triton_e2e), so the decode-vs-
    verification property is the kernel test's above."""
    from engine import LLM, SamplingParams

    monkeypatch.setenv("ENGINE_BATCH_INVARIANT", "1")
    monkeypatch.delenv(NUM_KV_SPLITS_ENV, raising=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=3)
    kwargs = {"device": "cpu", "dtype": "float32", "max_model_len": 64,
              "max_num_batched_tokens": 16, "block_size": 8, "attention_backend": "triton",
              "batch_invariant": True, "enable_prefix_caching": False}

    def target_run(llm, target: list[int], others: list[list[int]], place: int) -> list:
        prompts = [{"prompt_token_ids": p} for p in others]
        prompts.insert(place, {"prompt_token_ids": target})
        out = llm.generate(prompts, params, use_tqdm=False)[place].outputs[0]
        return [(token, sorted((k, v.logprob) for k, v in step.items()))
                for token, step in zip(out.token_ids, out.logprobs)]

    before = stats.launches.snapshot()
    llm = LLM(str(llama_dir), **kwargs)
    alone = target_run(llm, E2E_TARGET, [], 0)
    assert target_run(llm, E2E_TARGET, E2E_OTHERS, 1) == alone
    assert target_run(llm, E2E_TARGET, E2E_OTHERS[:1], 1) == alone
    llm = LLM(str(llama_dir), **{**kwargs, "max_num_batched_tokens": 32})
    assert target_run(llm, E2E_TARGET, E2E_OTHERS, 3) == alone
    after = stats.launches.snapshot()
    assert after["unified_attention"] > before["unified_attention"]
    assert after["split_kv_attention"] == before["split_kv_attention"]
