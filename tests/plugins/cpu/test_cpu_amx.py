"""The AMX tile path of the bf16 GEMM (csrc/gemm_amx.h).

On a CPU with AMX the ``kernels`` fixture of the other tests runs the amx level for real
(and test_cpu_native checks it reports its tiles). Everywhere the avx512_bf16 level runs,
the same source is also built with ENGINE_AMX_EMULATE, which swaps the six tile
instructions for plain C of their documented semantics: the work items, the tails (short
row blocks, odd column blocks), the load-time self-check and the dispatch between tiles
and vdpbf16ps are then checked against float64 on CPUs without AMX. (CPUs without
AVX512-BF16 cannot run the rest of that build, so they have no emulated AMX test.)
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from engine.core.interfaces import DenseLayerSpec
from engine.plugins.cpu import kernel_build, native
from engine.plugins.cpu.gemm import CPUPackedGemm
from tests.plugins.cpu.references import assert_gemm_close

_AMX = kernel_build.LEVELS["amx"]
EMULATED = kernel_build.IsaLevel(
    "amx_emulated", "x86_64",
    tuple(f for f in _AMX.flags if not f.startswith("-mamx")) + ("-DENGINE_AMX_EMULATE=1",),
    _AMX.requires - {"amx_tile", "amx_bf16"}, -1,
)


def _emulated_kernels() -> native.CPUKernels:
    path = kernel_build.built_library(os.environ.get("CC") or "cc", EMULATED)
    return native.CPUKernels(ctypes.CDLL(str(path)), path)


if EMULATED.runs_on(kernel_build.machine(), kernel_build.cpu_flags()):

    @pytest.fixture(scope="module")
    def tiles() -> native.CPUKernels:
        return _emulated_kernels()

    def test_the_emulated_tiles_pass_their_self_check_and_report_amx(tiles):
        assert tiles.level == "amx_emulated" and tiles.has_amx and tiles.has_bf16_dot

    @pytest.mark.parametrize(("out_features", "in_features"),
                             [(64, 64), (96, 128), (208, 96), (48, 320), (64, 100)])
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_tile_gemm_matches_float64(tiles, out_features, in_features, with_bias):
        """Rows 32 and up go to the tiles (K a multiple of 32), in blocks of 32 with a
        padded tail; narrow panels (208 = 3 x 64 + 16, 96 = 64 + 32) end in an odd
        16-column block; K = 100 and fewer rows stay on vdpbf16ps."""
        gemm = CPUPackedGemm(tiles)
        spec = DenseLayerSpec(in_features, out_features, torch.bfloat16, torch.device("cpu"))
        gen = torch.Generator().manual_seed(out_features + in_features)
        weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
        bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
        x = torch.randn(100, in_features, generator=gen).bfloat16()
        packed = gemm.prepare(weight, spec)
        for m in (1, 6, 31, 32, 33, 48, 64, 100):
            assert_gemm_close(gemm.apply(packed, x[:m], bias), x[:m], weight, bias)
