"""Kernel calls for the self-test driver (csrc/selftest_main.c), with their references.

A :class:`Suite` collects cases (inputs, a float64 or op-chain reference, a check), writes
them in the driver's format, runs a driver executable (natively, or under qemu-user for
another architecture) and checks every output, so a build that this machine cannot load
is held to the same references as the native ones.
"""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.interfaces import ActivationQuant
from engine.core.interfaces.attention import dequantize_kv, quantize_kv
from engine.plugins.cpu.native import QACT_CODES, QSTRATEGY_CODES
from engine.plugins.cpu.quant_gemm import pack_arguments
from engine.quantization.numerics import quantize_dequantize
from tests.plugins.cpu import references as refs

OP_GEMM_PACKED, OP_GEMM_PLAIN, OP_ATTENTION, OP_RMS_NORM = 1, 2, 3, 4
OP_SILU_AND_MUL, OP_ROTARY, OP_EMBEDDING, OP_ARGMAX = 5, 6, 7, 8
OP_QGEMM, OP_QUANT_ACT, OP_CATEGORICAL = 9, 10, 11
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int64: 3, torch.uint8: 4,
         torch.float8_e4m3fn: 5, torch.float8_e5m2: 6, torch.float64: 7}
DTYPES = {code: dtype for dtype, code in CODES.items()}
# op-chain tolerances of the fused elementwise kernels (as test_cpu_fused_ops.py)
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=0, rtol=2**-7),
       torch.float16: dict(atol=0, rtol=2**-10)}


@dataclass
class Case:
    name: str
    op: int
    ints: Sequence[int]
    floats: Sequence[float]
    arrays: Sequence[torch.Tensor]
    check: Callable[[list[torch.Tensor]], None]  # raises AssertionError when wrong


def _encode(case: Case) -> bytes:
    parts = [struct.pack("<ii", case.op, len(case.ints)), struct.pack(f"<{len(case.ints)}q",
                                                                      *case.ints)]
    parts += [struct.pack("<i", len(case.floats)),
              struct.pack(f"<{len(case.floats)}f", *case.floats)]
    parts.append(struct.pack("<i", len(case.arrays)))
    for array in case.arrays:
        data = array.contiguous().view(torch.uint8).numpy().tobytes()
        parts.append(struct.pack("<iq", CODES[array.dtype], len(data)) + data)
    return b"".join(parts)


def _decode(blob: bytes) -> list[tuple[int, list[torch.Tensor]]]:
    results, at = [], 0
    while at < len(blob):
        status, count = struct.unpack_from("<ii", blob, at)
        at += 8
        arrays = []
        for _ in range(count):
            code, size = struct.unpack_from("<iq", blob, at)
            at += 12
            raw = torch.frombuffer(bytearray(blob[at:at + size]), dtype=torch.uint8)
            arrays.append(raw.view(DTYPES[code]) if size else torch.empty(0, dtype=DTYPES[code]))
            at += size
        results.append((status, arrays))
    return results


class Suite:
    """The cases of one self-test run."""

    def __init__(self, seed: int = 0) -> None:
        self.cases: list[Case] = []
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(dtype)

    # -- cases --------------------------------------------------------------------------
    def gemm(self, m: int, n: int, k: int, act, wdt, bias: bool, packed: bool = True) -> None:
        x, w = self.randn(m, k, dtype=act), self.randn(n, k, dtype=wdt)
        b = self.randn(n, dtype=act) if bias else None

        def check(outs):
            refs.assert_gemm_close(outs[0].view(m, n), x, w, b)

        self.cases.append(Case(
            f"gemm_{'packed' if packed else 'plain'} {m}x{n}x{k} {act}/{wdt} bias={bias}",
            OP_GEMM_PACKED if packed else OP_GEMM_PLAIN, (m, n, k, CODES[act], CODES[wdt], bias),
            (), [x, w, *([b] if bias else [])], check))

    def qgemm(self, m: int, encoding: str, bits: int, n: int, k: int, group: int, *,
              act: ActivationQuant | None = None, shards=None, act_order: bool = False,
              zeros: bool = True, act_dtype=torch.float32, bias: bool = False) -> None:
        """Pack and multiply canonical quantized weights (quant_gemm.pack_arguments)."""
        w = refs.quantized_weights(self.gen, encoding, bits, n, k, group, zeros=zeros, act=act,
                                   shards=shards, act_order=act_order, act_dtype=act_dtype)
        params, codes, scales, zero, perm, act_scales = pack_arguments(w)
        x = self.randn(m, k, dtype=act_dtype) * 3
        b = self.randn(n, dtype=act_dtype) if bias else None
        optional = [t for t in (zero, perm, act_scales, b) if t is not None]

        def check(outs):
            refs.assert_qgemm_close(outs[0].view(m, n), refs.qgemm_reference(w, x, b), act_dtype)

        self.cases.append(Case(
            f"qgemm {m}x{n}x{k} {encoding}{bits} g{group} act={act} shards={shards} "
            f"act_order={act_order} {act_dtype}", OP_QGEMM,
            (m, CODES[act_dtype], zero is not None, act_scales is not None, bias,
             *params.words()), (), [x, codes, scales, *optional], check))

    def quantize_activations(self, m: int, k: int, act: ActivationQuant, scale: float) -> None:
        x = self.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
        tensor = torch.tensor(scale)

        def check(outs):
            want = quantize_dequantize(x, act, static_scale=None if act.dynamic else tensor,
                                       global_scale=tensor if act.encoding == "nvfp4" else None)
            assert torch.equal(outs[0].view(m, k), want), "not bit-identical to numerics.py"

        self.cases.append(Case(
            f"quantize_activations {m}x{k} {act}", OP_QUANT_ACT,
            (m, k, CODES[torch.float32], QACT_CODES[act.encoding], QSTRATEGY_CODES[act.strategy],
             act.dynamic, act.group_size or 0), (scale,), [x], check))

    def attention(self, seq_lens: Sequence[int], heads: int, kv_heads: int, head_size: int,
                  block_size: int, q_dtype, cache_dtype, pairs: bool, window: int = 0,
                  splits: int = 0, kv_scales: tuple[float, float] | None = None) -> None:
        """``pairs``: whether the build stores bf16 keys in dim pairs (AVX512-BF16).
        ``kv_scales``: an fp8 ``cache_dtype``'s, the keys and values given in ``q_dtype``
        (quantized by the store; the reference reads the dequantized codes)."""
        per_seq = max(-(-n // block_size) for n in seq_lens)
        num_blocks = len(seq_lens) * per_seq + 1
        order = torch.randperm(num_blocks - 1, generator=self.gen) + 1
        tables = order.view(len(seq_lens), per_seq).to(torch.int64)
        slots = num_blocks * block_size
        fp8 = kv_scales is not None
        src_dtype = q_dtype if fp8 else cache_dtype
        k_scale, v_scale = kv_scales or (1.0, 1.0)
        keys = self.randn(slots, kv_heads, head_size, dtype=src_dtype) * (3 * k_scale if fp8 else 1)
        values = self.randn(slots, kv_heads, head_size, dtype=src_dtype) * (5 * v_scale if fp8
                                                                            else 1)
        query = self.randn(len(seq_lens), heads, head_size, dtype=q_dtype)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        scale = head_size**-0.5
        stored_v = quantize_kv(values, v_scale, cache_dtype) if fp8 else values.to(cache_dtype)

        def check(outs):
            k_ref = dequantize_kv(quantize_kv(keys, k_scale, cache_dtype), k_scale) if fp8 else keys
            v_ref = dequantize_kv(stored_v, v_scale) if fp8 else values
            ref = refs.attention_reference(query, k_ref, v_ref, tables, lens, scale, window)
            got = outs[0].view(ref.shape).double()
            if fp8:  # exact codes read by float32 FMAs (never vdpbf16ps): as a float cache
                atol = refs.attention_tolerance(q_dtype, q_dtype, False) * 5 * v_scale
            else:
                atol = refs.attention_tolerance(q_dtype, cache_dtype, pairs)
            torch.testing.assert_close(got, ref, atol=atol, rtol=0)
            v_cache = outs[1].view(num_blocks, kv_heads, block_size, head_size)  # V rows
            v_slots = v_cache.transpose(1, 2).reshape(stored_v.shape)
            assert torch.equal(v_slots.view(torch.uint8), stored_v.view(torch.uint8)), (
                "the stored values differ")

        extra = (CODES[src_dtype],) if fp8 else ()
        self.cases.append(Case(
            f"attention {seq_lens} {heads}/{kv_heads}x{head_size} bs{block_size} "
            f"{q_dtype}/{cache_dtype} window={window} splits={splits} scales={kv_scales}",
            OP_ATTENTION,
            (len(seq_lens), heads, kv_heads, head_size, block_size, num_blocks,
             CODES[cache_dtype], CODES[q_dtype], window, splits, per_seq, *extra),
            (scale, 0.0, k_scale, v_scale), [query, keys, values, tables, lens], check))

    def rms_norm(self, rows: int, hidden: int, dtype, residual: bool) -> None:
        x, w = self.randn(rows, hidden, dtype=dtype), (torch.rand(hidden) + 0.5).to(dtype)
        res = self.randn(rows, hidden, dtype=dtype) if residual else None

        def check(outs):
            want, summed = refs.rms_norm_reference(x, w, 1e-5, res)
            torch.testing.assert_close(outs[0].view(rows, hidden), want, **TOL[dtype])
            if residual:
                torch.testing.assert_close(outs[1].view(rows, hidden), summed, atol=0, rtol=0)

        self.cases.append(Case(f"rms_norm {rows}x{hidden} {dtype} residual={residual}",
                               OP_RMS_NORM, (rows, hidden, CODES[dtype], residual), (1e-5,),
                               [x, w, *([res] if residual else [])], check))

    def silu_and_mul(self, rows: int, inter: int, dtype) -> None:
        x = self.randn(rows, 2 * inter, dtype=dtype)

        def check(outs):
            torch.testing.assert_close(outs[0].view(rows, inter), refs.silu_and_mul_reference(x),
                                       **TOL[dtype])

        self.cases.append(Case(f"silu_and_mul {rows}x{inter} {dtype}", OP_SILU_AND_MUL,
                               (rows, inter, CODES[dtype]), (), [x], check))

    def rotary(self, rows: int, heads: int, head_size: int, dtype) -> None:
        x = self.randn(rows, heads * head_size, dtype=dtype)
        positions = torch.randint(0, 64, (rows,), generator=self.gen)
        angles = torch.arange(64)[:, None] * (1e4 ** (-torch.arange(0, head_size, 2) / head_size))
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)

        def check(outs):
            want = refs.rotary_reference(x, positions, cos_sin, head_size)
            torch.testing.assert_close(outs[0].view(want.shape), want, **TOL[dtype])

        self.cases.append(Case(f"rotary {rows}x{heads}x{head_size} {dtype}", OP_ROTARY,
                               (rows, heads, head_size, 64, CODES[dtype]), (),
                               [x, positions, cos_sin], check))

    def embedding(self, ids: int, vocab: int, hidden: int, table_dtype, out_dtype) -> None:
        table = self.randn(vocab, hidden, dtype=table_dtype)
        index = torch.randint(0, vocab, (ids,), generator=self.gen)

        def check(outs):
            assert torch.equal(outs[0].view(ids, hidden), table[index].to(out_dtype))

        self.cases.append(Case(f"embedding {table_dtype}->{out_dtype}", OP_EMBEDDING,
                               (ids, vocab, hidden, CODES[table_dtype], CODES[out_dtype]), (),
                               [index, table], check))

    def argmax(self, rows: int, cols: int) -> None:
        x = self.randn(rows, cols)
        x[0, 3] = x[0, cols - 2] = x[0].max() + 1  # a tie: the first index
        x[1, 5] = float("nan")  # a NaN wins, as in torch

        def check(outs):
            assert torch.equal(outs[0], x.argmax(dim=-1))

        self.cases.append(Case(f"argmax {rows}x{cols}", OP_ARGMAX, (rows, cols), (), [x], check))

    def categorical(self, rows: int, cols: int) -> None:
        probs = torch.rand(rows, cols, generator=self.gen) ** 4
        probs[probs < 0.05] = 0.0
        u = torch.rand(rows, generator=self.gen, dtype=torch.float64)

        def check(outs):
            running = probs.double().cumsum(dim=1)
            expected = (running <= u.unsqueeze(1) * running[:, -1:]).sum(dim=1)
            assert torch.equal(outs[0], expected)

        self.cases.append(Case(f"categorical {rows}x{cols}", OP_CATEGORICAL, (rows, cols), (),
                               [probs, u], check))

    # -- running ------------------------------------------------------------------------
    def run(self, command: list[str], work: Path, env: dict[str, str] | None = None) -> str:
        """Run the driver (``command`` + the two file names); check every case, raising
        one AssertionError that lists all the wrong ones. Returns the driver's stdout."""
        cases_path, out_path = work / "cases.bin", work / "out.bin"
        cases_path.write_bytes(b"".join(_encode(c) for c in self.cases))
        proc = subprocess.run([*command, str(cases_path), str(out_path)], capture_output=True,
                              text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise AssertionError(f"{command[0]} exited {proc.returncode}: {proc.stderr[-2000:]}")
        results = _decode(out_path.read_bytes())
        assert len(results) == len(self.cases), f"{len(results)} results, {len(self.cases)} cases"
        failures = []
        for case, (status, outs) in zip(self.cases, results):
            try:
                assert status == 0, f"status {status}"
                case.check(outs)
            except AssertionError as exc:
                failures.append(f"{case.name}: {str(exc).splitlines()[0]}")
        if failures:
            raise AssertionError(f"{len(failures)} of {len(self.cases)} cases failed:\n"
                                 + "\n".join(failures))
        return proc.stdout


def standard_suite(pairs: bool) -> Suite:
    """Every kernel, every dtype combination the engine runs, the shapes that cut register
    blocks and panels (``pairs``: the build has AVX512-BF16's dim-pair keys)."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    suite = Suite()
    for act, wdt in ((f32, f32), (bf16, bf16), (f16, f16), (f32, bf16), (f32, f16)):
        for m, n, k in ((1, 16, 2), (3, 96, 80), (7, 208, 130), (53, 64, 600)):
            suite.gemm(m, n, k, act, wdt, bias=m % 2 == 1)
        for m in (1, 4, 9, 30):
            suite.gemm(m, 96, 100, act, wdt, bias=m == 9, packed=False)
    for q_dtype, cache_dtype in ((f32, f32), (bf16, bf16), (f16, f16), (f32, bf16)):
        suite.attention([1, 15, 16, 17, 70], 8, 2, 32, 16, q_dtype, cache_dtype, pairs)
        suite.attention([45, 3, 48], 4, 1, 16, 8, q_dtype, cache_dtype, pairs, window=37,
                        splits=3)
    for dtype in (f32, bf16, f16):
        suite.rms_norm(5, 80, dtype, residual=True)
        suite.rms_norm(3, 48, dtype, residual=False)
        suite.silu_and_mul(4, 40, dtype)
        suite.rotary(5, 3, 32, dtype)
        suite.embedding(6, 50, 24, bf16, dtype)
    suite.argmax(4, 3000)
    suite.categorical(9, 3000)
    for m in (1, 2, 5, 9):  # decode blocks of every row count, then the prefill schedule
        suite.qgemm(m, "int", 4, 80, 192, 64, bias=m == 5)
        suite.qgemm(m, "int", 8, 48, 192, 192, zeros=False)
        suite.qgemm(m, "fp8", 8, 64, 256, 128)
        suite.qgemm(m, "nvfp4", 4, 48, 128, 16)
    suite.qgemm(3, "int", 4, 64, 256, 32, act_order=True)
    suite.qgemm(20, "int", 4, 32, 128, 128, act_dtype=bf16, bias=True)
    # int4 x bf16 on vdpbf16ps levels: decode (two accumulator sets), the dequantizing
    # prefill (QINT4_DEQUANTIZE_ROWS), symmetric codes, act-order
    suite.qgemm(1, "int", 4, 64, 256, 64, act_dtype=bf16, zeros=False)
    suite.qgemm(70, "int", 4, 80, 128, 32, act_dtype=bf16, bias=True)
    suite.qgemm(3, "int", 4, 64, 256, 32, act_order=True, act_dtype=bf16)
    dynamic_int8, static_fp8 = ActivationQuant("int8", "token", True), ActivationQuant(
        "fp8", "tensor", False)
    nvfp4 = ActivationQuant("nvfp4", "group", True, 16)
    for m in (2, 30):
        suite.qgemm(m, "int", 8, 64, 128, 128, act=dynamic_int8, zeros=False)
        suite.qgemm(m, "fp8", 8, 64, 128, 128, act=static_fp8, shards=(32, 16, 16))
        suite.qgemm(m, "nvfp4", 4, 48, 128, 16, act=nvfp4, shards=(16, 32))
    for act, scale in ((dynamic_int8, 0.0), (static_fp8, 0.3), (nvfp4, 0.7),
                       (ActivationQuant("fp8", "group", True, 32), 0.0)):
        suite.quantize_activations(5, 96, act, scale)
    # fp8 KV caches, quantized by write_kv and dequantized as read (last: the cases above
    # keep the inputs they were tuned with)
    for q_dtype in (f32, bf16):
        for cache_dtype, scales in ((torch.float8_e4m3fn, (0.05, 2.5)),
                                    (torch.float8_e5m2, (3.0, 0.25))):
            suite.attention([1, 15, 16, 17, 70], 8, 2, 32, 16, q_dtype, cache_dtype, pairs,
                            kv_scales=scales)
            suite.attention([45, 3, 48], 4, 1, 16, 8, q_dtype, cache_dtype, pairs, window=37,
                            splits=3, kv_scales=scales)
    return suite
