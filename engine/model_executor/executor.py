"""Executor: builds the model, the KV cache and the runner on the chosen platform.

The engine core talks to this one object; a multi-device executor (tensor / pipeline
parallel workers) will offer the same two calls.
"""

from __future__ import annotations

import logging

import torch

from engine.core.config import EngineConfig
from engine.core.interfaces import Platform
from engine.core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from engine.model_executor.model_loader import load_model
from engine.model_executor.model_runner import KVCacheSpec, ModelRunner

logger = logging.getLogger(__name__)


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
        platform.init_worker()
        platform.set_num_threads(config.device.num_threads)
        platform.seed_everything(config.model.seed)

        dtype = getattr(torch, config.model.dtype)
        why = platform.check_dtype(dtype)
        if why:
            raise ValueError(why)
        block_size = config.cache.block_size
        backend_cls = platform.get_attention_backend(config.device.attention_backend)
        self.attn_backend = backend_cls(block_size, platform.device())
        self.model = load_model(
            config.model.model, dtype, platform.device(), self.attn_backend,
            dense_gemm_kernels=platform.dense_gemm_kernels(),
            fused_ops=platform.fused_ops(),
        )
        weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

        spec = self.model.kv_cache_spec()
        self.kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_size, dtype)
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
        )
        self.runner.allocate_kv_cache(self.kv_spec, self.num_blocks)
        logger.info(
            "platform %s, attention %s, %.1f MiB weights, %d KV blocks of %d tokens",
            platform.name, backend_cls.name, weights_bytes / 2**20, self.num_blocks, block_size,
        )

    def _num_blocks(self, weights_bytes: int) -> int:
        cache = self.config.cache
        block_bytes = self.kv_spec.block_bytes(cache.block_size)
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
