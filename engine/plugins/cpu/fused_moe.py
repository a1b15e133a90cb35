"""The CPU plugin's fused-MoE kernel: bulk permutation and one GEMM per expert.

The (token, choice) pairs are sorted by expert once (argsort), the tokens gathered in that
order, and each expert's contiguous run of rows goes through its two GEMMs with the gated
activation between them; the routing weights scale the rows and one ``index_add_`` sums
each token's choices. The GEMMs are the plugin's C packed GEMM (csrc/gemm.c, the dense
linears' kernel): every expert's weights are repacked into its panel layout once after
loading (:meth:`CPUFusedMoE.prepare_weights`), which streams them near the memory
bandwidth (a Mixtral-shaped layer at 4 rows per expert, bf16, Zen 4: 1.6x torch's
matmuls). Without the native kernels, or for shapes / dtypes the packed GEMM does not
take, torch's GEMMs (oneDNN / MKL) run on the plain weights. The Python loop is over experts that
received tokens (at most ``E`` GEMM pairs per layer), never over tokens. Expert biases,
GPT-OSS's clamped SwiGLU (``swigluoai``) and ungated experts (``gated=False``: ``act(w13
x)``, e.g. Nemotron-H's ``relu2``) follow the interface's definitions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from engine.core.batch_invariance import batch_invariant_enabled, fixed_shape_linear
from engine.core.interfaces import FusedMoEKernel, MoELayerSpec
from engine.core.interfaces.moe import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, UNGATED_ACTIVATIONS


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
_UNGATED = {"silu": F.silu, "gelu": F.gelu, "relu2": _relu2}
assert set(_UNGATED) == set(UNGATED_ACTIVATIONS)


def _gated(act: str, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``act(gate) * up``, or GPT-OSS's clamped SwiGLU for ``swigluoai``."""
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if act == "swigluoai":
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))
    return _ACTIVATIONS[act](gate) * up


def _packing_kernels(w13: torch.Tensor, w2: torch.Tensor):
    """The C kernels when they can run both projections of every expert (None: not)."""
    from engine.plugins.cpu.native import DTYPE_CODES, CPUKernels, load_kernels

    if w13.dtype not in DTYPE_CODES or w2.dtype != w13.dtype or w13.device.type != "cpu":
        return None
    if (CPUKernels.gemm_refusal(w13.shape[1], w13.shape[2]) is not None
            or CPUKernels.gemm_refusal(w2.shape[1], w2.shape[2]) is not None):
        return None
    return load_kernels()


class CPUFusedMoE(FusedMoEKernel):
    name = "cpu_grouped_gemm"
    supports_expert_bias = True
    supports_ungated = True

    @classmethod
    def can_implement(cls, spec: MoELayerSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"runs on the CPU, not {spec.device.type}"
        if not spec.gated:
            if spec.activation not in _UNGATED:
                return (f"ungated activation {spec.activation!r} is not one of "
                        f"{sorted(_UNGATED)}")
        elif spec.activation not in (*_ACTIVATIONS, "swigluoai"):
            return (f"activation {spec.activation!r} is not one of "
                    f"{sorted(_ACTIVATIONS) + ['swigluoai']}")
        if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            return f"dtype {spec.dtype} is not supported"
        return None

    def __init__(self) -> None:
        self._native = None  # the C kernels once prepare_weights packed the experts

    def prepare_weights(self, w13: torch.Tensor, w2: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert's ``[2I, H]`` and ``[H, I]`` repacked for the C GEMM (the same
        shapes, the values in panel order); unchanged where it cannot run them."""
        kernels = _packing_kernels(w13, w2)
        if kernels is None:
            return w13, w2
        packed = []
        for weights in (w13, w2):
            flat = torch.empty_like(weights)
            for expert in range(weights.shape[0]):
                flat[expert].view(-1).copy_(kernels.pack(weights[expert], weights.dtype))
            packed.append(flat)
        self._native = kernels
        return packed[0], packed[1]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        if self._native is not None:
            return self._native.gemm(weight.view(-1), x, bias)
        # an expert's row count follows the batch: in batch-invariant mode one GEMM
        # shape for every call (torch's GEMMs pick their reduction order by shape)
        linear = fixed_shape_linear if batch_invariant_enabled() else F.linear
        return linear(x, weight, bias)

    def apply(self, hidden, w13, w2, topk_weights, topk_ids, activation="silu", *,
              w13_bias=None, w2_bias=None, gated=True):
        inter = w2.shape[2]
        if w13.shape[1] != (2 * inter if gated else inter):
            raise ValueError(f"w13 {tuple(w13.shape)} does not fit {'gated' if gated else 'ungated'}"
                             f" experts of intermediate size {inter}")
        if not gated and activation not in _UNGATED:
            raise ValueError(f"ungated activation {activation!r} is not one of {sorted(_UNGATED)}")
        num_tokens, top_k = topk_ids.shape
        out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        with record_function("moe.permute"):
            flat = topk_ids.flatten()
            pairs = torch.nonzero(flat >= 0).flatten()
            if pairs.numel() == 0:
                return out.to(hidden.dtype)
            experts = flat[pairs]
            order = torch.argsort(experts, stable=True)
            pairs, experts = pairs[order], experts[order]
            counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()
            tokens = pairs // top_k
            rows = hidden.index_select(0, tokens)
        linear = self._linear
        done = torch.empty(len(pairs), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        start = 0
        with record_function("moe.expert_gemms"):
            for expert, count in enumerate(counts):
                if not count:
                    continue
                segment = rows[start : start + count]
                bias13 = None if w13_bias is None else w13_bias[expert]
                bias2 = None if w2_bias is None else w2_bias[expert]
                gate_up = linear(segment, w13[expert], bias13)
                if gated:
                    activated = _gated(activation, gate_up, inter)
                else:
                    activated = _UNGATED[activation](gate_up)
                done[start : start + count] = linear(activated, w2[expert], bias2)
                start += count
        with record_function("moe.combine"):
            scale = topk_weights.flatten()[pairs].unsqueeze(1)
            out.index_add_(0, tokens, done.float() * scale)
            return out.to(hidden.dtype)
