"""Quantized checkpoints: one module per format family, registered through the plugin
registry's ``engine_register_quant_methods`` hook (the built-ins by the in-tree
``quantization`` plugin, exactly as a third party's).

:func:`resolve_quantization` decides what a model loads with: the checkpoint's
``quantization_config`` names its format (``quant_method``); ``--quantization NAME``
(vLLM's names) must agree with it, asks for online FP8 of an unquantized checkpoint
(``fp8``), or asks for a kernel family (``gptq_marlin``, ``awq_marlin``, ``marlin``), which
the layers then only take from kernels of that family. Formats describe tensors; the
GEMM kernels are the platform's (:meth:`Platform.quantized_gemm_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.interfaces import QuantizedGemmKernel, QuantMethod

# --quantization names that ask for a kernel family over a checkpoint's own format
KERNEL_FAMILIES = {"gptq_marlin": ("gptq",), "awq_marlin": ("awq",),
                   "marlin": ("gptq", "awq", "compressed-tensors")}


@dataclass(frozen=True)
class KernelFamily:
    """A filter on the platform's quantized kernels (``--quantization gptq_marlin``)."""

    family: str
    requested: str

    def __call__(self, kernel: type[QuantizedGemmKernel]) -> bool:
        return getattr(kernel, "family", "") == self.family

    def describe(self) -> str:
        return f"--quantization {self.requested} asks for a {self.family} kernel"


@dataclass(frozen=True)
class QuantizationPlan:
    """What a model loads with: the checkpoint format and, optionally, a kernel filter."""

    method: QuantMethod
    kernel_filter: KernelFamily | None = None

    def describe(self) -> str:
        return self.method.describe()


def registered_formats() -> dict[str, type[QuantMethod]]:
    """Checkpoint formats by ``quant_method`` name, from every loaded plugin (a name two
    plugins both claim is a ValueError naming both, as for KV connectors)."""
    from engine.core.plugins import get_plugin_registry
    from engine.core.plugins.registry import contributions_by_name

    found = contributions_by_name("quantization method", get_plugin_registry().quant_methods())
    return {name: cls for name, (_plugin, cls) in found.items()}


def _checkpoint_config(hf_config: Any) -> dict[str, Any] | None:
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    return dict(raw)


def _unknown(name: str, formats: dict[str, type[QuantMethod]], requested: bool = False
             ) -> ValueError:
    import os

    known = ", ".join(sorted(formats)) or "none"
    if requested:  # --quantization also takes the kernel families
        known += f" (or a kernel family: {', '.join(sorted(KERNEL_FAMILIES))})"
    hint = ""
    if os.environ.get("ENGINE_PLUGINS"):
        hint = (f" (ENGINE_PLUGINS={os.environ['ENGINE_PLUGINS']} limits the plugins loaded; "
                "the built-in formats come from the 'quantization' plugin)")
    return ValueError(f"quantization method {name!r} is not supported; installed: {known}{hint}")


def resolve_quantization(hf_config: Any, requested: str | None = None) -> QuantizationPlan | None:
    """The plan for a checkpoint (None: unquantized), or a ValueError saying why the
    checkpoint or ``--quantization`` cannot be honoured."""
    formats = registered_formats()
    config = _checkpoint_config(hf_config)
    stored = None if config is None else str(config.get("quant_method", "")).lower()
    requested = requested.strip().lower() if requested else None
    if requested in KERNEL_FAMILIES:
        allowed = KERNEL_FAMILIES[requested]
        if stored not in allowed:
            what = f"a {stored} checkpoint" if stored else "an unquantized checkpoint"
            raise ValueError(f"--quantization {requested} runs {' or '.join(allowed)} "
                             f"checkpoints, not {what}")
        family = KernelFamily("marlin", requested)
    elif requested is not None:
        if requested not in formats:
            raise _unknown(requested, formats, requested=True)
        if stored is None:
            if requested != "fp8":
                raise ValueError(f"--quantization {requested} needs a {requested} checkpoint; "
                                 "this one is unquantized (only fp8 quantizes at load)")
            return QuantizationPlan(formats["fp8"].online())
        if requested != stored:
            raise ValueError(f"--quantization {requested} contradicts the checkpoint, which is "
                             f"quantized with {stored}")
        family = None
    else:
        family = None
    if stored is None:
        return None
    if stored not in formats:
        raise _unknown(stored, formats)
    return QuantizationPlan(formats[stored].from_config(config), family)
