"""Abstract interfaces between the engine and hardware plugins.

A leaf package: it imports nothing else from ``engine`` (and no torch at import time),
so the model executor and every plugin can depend on it without cycles.
"""

from engine.core.interfaces.attention import (
    AttentionBackend,
    AttentionBatch,
    AttentionImpl,
    AttentionLayerSpec,
)
from engine.core.interfaces.communicator import Communicator
from engine.core.interfaces.fused_ops import FusedOps
from engine.core.interfaces.gemm import DenseGemmKernel, DenseLayerSpec
from engine.core.interfaces.lora import LoRAKernel
from engine.core.interfaces.graphs import ForwardGraph, ForwardGraphCapturer, GraphCaptureError
from engine.core.interfaces.moe import FusedMoEKernel, MoELayerSpec
from engine.core.interfaces.platform import DeviceCapability, Platform, ProbeResult
from engine.core.interfaces.quant import (
    ActivationQuant,
    QuantizedGemmKernel,
    QuantizedLayerSpec,
    QuantizedWeights,
    QuantMethod,
    select_quantized_kernel,
)

# Version of this plugin API; a plugin declares the version it was written against.
PLUGIN_API_VERSION = 1

__all__ = [
    "PLUGIN_API_VERSION",
    "ActivationQuant",
    "AttentionBackend",
    "AttentionBatch",
    "AttentionImpl",
    "AttentionLayerSpec",
    "Communicator",
    "DenseGemmKernel",
    "DeviceCapability",
    "DenseLayerSpec",
    "ForwardGraph",
    "ForwardGraphCapturer",
    "FusedMoEKernel",
    "FusedOps",
    "GraphCaptureError",
    "LoRAKernel",
    "MoELayerSpec",
    "Platform",
    "ProbeResult",
    "QuantMethod",
    "QuantizedGemmKernel",
    "QuantizedLayerSpec",
    "QuantizedWeights",
    "select_quantized_kernel",
]
