"""Which GEMM kernel each linear of a loaded model got: what ``engine bench``, ``engine
plugins --model`` and the executor's runtime info report."""

from __future__ import annotations

from typing import Any

from torch import nn


def _kernel_of(module: nn.Module) -> tuple[bool, str | None]:
    """(whether ``module`` is a linear, its kernel's description); unpacked dense
    weights run ``F.linear``."""
    kernel = getattr(module, "quant_kernel", None)
    if kernel is None:
        if not hasattr(module, "gemm_kernel") or getattr(module, "weight", None) is None:
            return False, None
        kernel = module.gemm_kernel
    if kernel is None:
        return True, "F.linear"
    return True, getattr(kernel, "description", kernel.name)


def kernel_counts(model: nn.Module) -> dict[str, int]:
    """kernel description -> how many linears run it."""
    counts: dict[str, int] = {}
    for module in model.modules():
        is_linear, name = _kernel_of(module)
        if is_linear:
            counts[name] = counts.get(name, 0) + 1
    return counts


def layer_kernels(model: nn.Module) -> dict[str, str]:
    """Layer type (the module's own name: qkv_proj, o_proj, gate_up_proj, down_proj,
    lm_head, ...) -> its kernel, with the quantization scheme for quantized layers;
    layers of one type that got different kernels list each."""
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        is_linear, kernel = _kernel_of(module)
        if not is_linear:
            continue
        method = getattr(module, "quant_method", None)
        scheme = getattr(method, "scheme", None) if getattr(module, "quant_kernel", None) else None
        label = f"{kernel} [{scheme}]" if scheme else kernel
        kinds = found.setdefault(name.rsplit(".", 1)[-1], [])
        if label not in kinds:
            kinds.append(label)
    return {kind: " / ".join(labels) for kind, labels in found.items()}


def quantization_scheme(model: nn.Module) -> str | None:
    """The scheme of the model's quantized linears (None: none is quantized)."""
    schemes: list[str] = []
    for module in model.modules():
        if getattr(module, "quant_kernel", None) is not None:
            scheme = module.quant_method.scheme
            if scheme not in schemes:
                schemes.append(scheme)
    return " + ".join(schemes) or None


def _tensor_bytes(model: nn.Module, skip: set[int] = frozenset()) -> int:
    """Bytes of the model's parameters and buffers, each tensor once, but those in
    ``skip`` (ids)."""
    seen: set[int] = set(skip)
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold: parameters and buffers (quantized layers keep
    their packed codes and scales as buffers), each tensor once."""
    return _tensor_bytes(model)


def streamed_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads whole: every tensor but the tables a step
    reads rows of (an embedding's: its tokens' rows; the rotary cos/sin cache: its
    positions'), unless a linear shares one (a tied LM head streams the embedding). What
    a batch-1 step's memory floor is made of, with the KV cache."""
    from engine.model_executor.layers.embedding import LMHead, VocabEmbedding
    from engine.model_executor.layers.rotary import RotaryEmbedding

    def ids(module: nn.Module) -> set[int]:
        return {id(t) for t in (*module.parameters(), *module.buffers())}

    lookups: set[int] = set()
    for module in model.modules():
        if isinstance(module, (VocabEmbedding, nn.Embedding, RotaryEmbedding)):
            lookups |= ids(module)
    for module in model.modules():
        if _kernel_of(module)[0] or isinstance(module, LMHead):
            lookups -= ids(module)
    return _tensor_bytes(model, skip=lookups)


def report(model: nn.Module) -> dict[str, Any]:
    return {"quantization": quantization_scheme(model),
            "weights_mib": round(weight_bytes(model) / 2**20, 2),
            "gemm_kernels": kernel_counts(model), "layer_kernels": layer_kernels(model)}
