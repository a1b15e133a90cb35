"""Executor: builds the model, the KV cache and the runner on the chosen platform.

The engine core talks to this one object; a multi-device executor (tensor / pipeline
parallel workers) will offer the same two calls.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.core.interfaces import Platform
from engine.core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.model_executor import kernel_report
from engine.model_executor.model_loader import load_model
from engine.model_executor.model_runner import KVCacheSpec, ModelRunner

logger = logging.getLogger(__name__)


def activation_dtype(config: EngineConfig, platform: Platform, dtype: torch.dtype) -> torch.dtype:
    """What the model computes in: the config's activation dtype, else for ``--dtype
    auto`` the platform's choice for these weights (recorded in the config), else the
    weights' own dtype."""
    model = config.model
    if model.activation_dtype is not None:
        return getattr(torch, model.activation_dtype)
    if not model.dtype_is_auto:
        return dtype
    activation = platform.activation_dtype(dtype)
    model.activation_dtype = str(activation).removeprefix("torch.")
    return activation


def load_platform_model(config: EngineConfig, platform: Platform) -> tuple[torch.nn.Module, Any]:
    """The model of ``config`` loaded for ``platform``: its dtypes checked, its linears on
    the platform's dense and quantized GEMM kernels, its layers on the platform's fused
    ops and attention backend (returned too)."""
    dtype = getattr(torch, config.model.dtype)
    activation = activation_dtype(config, platform, dtype)
    for wanted in {dtype, activation}:
        why = platform.check_dtype(wanted)
        if why:
            raise ValueError(why)
    backend_cls = platform.get_attention_backend(config.device.attention_backend)
    attn_backend = backend_cls(config.cache.block_size, platform.device())
    model = load_model(
        config.model.model, dtype, platform.device(), attn_backend,
        quantization=config.model.quantization,
        dense_gemm_kernels=platform.dense_gemm_kernels(),
        quantized_gemm_kernels=platform.quantized_gemm_kernels(),
        fused_ops=platform.fused_ops(),
        activation_dtype=activation,
    )
    return model, attn_backend


class Executor:
    """Single-device executor."""

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        if config.parallel.world_size > 1:
            raise ValueError(
                "tensor/pipeline parallelism (world size "
                f"{config.parallel.world_size}) is not available yet; use size 1"
            )
        self.config = config
        self.platform = platform
        platform.check_and_update_config(config)
        platform.init_worker(config.device.num_threads)
        platform.seed_everything(config.model.seed)

        dtype = getattr(torch, config.model.dtype)
        self.model, self.attn_backend = load_platform_model(config, platform)
        self.weights_bytes = weights_bytes = kernel_report.weight_bytes(self.model)
        block_size = config.cache.block_size

        # The KV cache holds the model dtype (vLLM's "auto"): a bf16 checkpoint computed in
        # float32 keeps bf16 K/V, which the attention kernels widen as they read.
        spec = self.model.kv_cache_spec()
        self.kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_size, dtype)
        from engine.spec_decode.factory import build_proposer

        self.proposer = build_proposer(
            config, platform, self.model, dtype, activation_dtype(config, platform, dtype)
        )
        # A draft's KV cache shares the block ids: every block costs both.
        self.draft_kv_spec = None if self.proposer is None else self.proposer.kv_cache_spec()
        draft_model = getattr(self.proposer, "model", None)
        if draft_model is not None:  # each tensor once: an EAGLE head shares the target's
            weights_bytes = kernel_report.weight_bytes(torch.nn.ModuleList([self.model, draft_model]))
            self.weights_bytes = weights_bytes
        self.num_blocks = self._num_blocks(weights_bytes)
        sched = config.scheduler
        self.runner = ModelRunner(
            self.model,
            self.attn_backend,
            platform,
            vocab_size=self.model.vocab_size,
            max_num_reqs=sched.max_num_seqs,
            max_model_len=sched.max_model_len,
            block_size=block_size,
            enforce_eager=config.model.enforce_eager,
            proposer=self.proposer,
        )
        self.runner.allocate_kv_cache(self.kv_spec, self.num_blocks)
        logger.info(
            "platform %s, attention %s, %.1f MiB weights, %d KV blocks of %d tokens",
            platform.name, self.attn_backend.name, weights_bytes / 2**20, self.num_blocks,
            block_size,
        )

    def runtime_info(self) -> dict[str, Any]:
        """What this executor runs with (benchmark reports): platform, dtypes, attention
        backend, quantization and weight bytes, the GEMM kernel of every linear (counted,
        and per layer type), forward graphs, and the platform's own kernel_info (the
        CPU's ISA level)."""
        model = self.config.model
        layers = kernel_report.report(self.model)
        return {
            "platform": self.platform.name,
            "attention_backend": self.attn_backend.name,
            "weight_dtype": model.dtype,
            "quantization": layers["quantization"],
            "weights_mib": layers["weights_mib"],
            "activation_dtype": model.activation_dtype or model.dtype,
            "kv_cache_dtype": str(self.kv_spec.dtype).removeprefix("torch."),
            "gemm_kernels": layers["gemm_kernels"],
            "layer_kernels": layers["layer_kernels"],
            "forward_graphs": self.runner.decode_graphs is not None,
            "speculative": self._speculative_info(),
            **self.platform.kernel_info(),
        }

    def _speculative_info(self) -> dict[str, Any] | None:
        spec = self.config.speculative
        if spec is None:
            return None
        return {"method": spec.method, "model": spec.model,
                "num_speculative_tokens": spec.num_speculative_tokens,
                **self.proposer.runtime_info()}

    def _num_blocks(self, weights_bytes: int) -> int:
        cache = self.config.cache
        block_bytes = self.kv_spec.block_bytes(cache.block_size)
        if self.draft_kv_spec is not None:
            block_bytes += self.draft_kv_spec.block_bytes(cache.block_size)
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            num_blocks = self.platform.kv_cache_bytes(cache, weights_bytes) // block_bytes
        # Never allocate more than every seat at full length could use.
        sched = self.config.scheduler
        blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        num_blocks = min(num_blocks, blocks_per_seq * sched.max_num_seqs + 1)
        if num_blocks < blocks_per_seq + 1:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens "
                f"({block_bytes} bytes each), fewer than one sequence of max_model_len="
                f"{sched.max_model_len} needs ({blocks_per_seq + 1}); raise the KV cache "
                "size (cpu_kvcache_space_gib / ENGINE_CPU_KVCACHE_SPACE, "
                "gpu_memory_utilization) or lower max_model_len"
            )
        return int(num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None
    ) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output, grammar_bitmask)
