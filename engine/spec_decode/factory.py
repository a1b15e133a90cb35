"""Build the proposer a speculative config names, on the target's platform."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.core.interfaces import Platform
from engine.spec_decode.proposer import NgramDraftProposer, Proposer

logger = logging.getLogger(__name__)


def build_proposer(
    config: EngineConfig,
    platform: Platform,
    target: torch.nn.Module,
    kv_dtype: torch.dtype,
    activation_dtype: torch.dtype,
) -> Proposer | None:
    """The proposer of ``config.speculative`` (None when speculation is off). A draft
    model or EAGLE head loads like the target: same dtype, platform kernels and
    attention backend class, its own backend instance and KV cache."""
    spec = config.speculative
    if spec is None:
        return None
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        return NgramDraftProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from engine.spec_decode.draft_model import DraftModelProposer, EagleProposer

    model, backend = _load_draft(config, platform, kv_dtype, activation_dtype)
    if spec.method == "eagle":
        model.share_target(target)
        cls: type = EagleProposer
    else:
        cls = DraftModelProposer
    sched = config.scheduler
    proposer = cls(
        k, model, backend, platform, kv_dtype,
        max_num_reqs=sched.max_num_seqs,
        max_blocks_per_seq=-(-sched.max_model_len // config.cache.block_size),
        enforce_eager=config.model.enforce_eager,
    )
    logger.info("speculative decoding: %s from %s, %d tokens per step", spec.method,
                spec.model, k)
    return proposer


def _load_draft(
    config: EngineConfig, platform: Platform, kv_dtype: torch.dtype,
    activation_dtype: torch.dtype,
) -> tuple[torch.nn.Module, Any]:
    from engine.model_executor.model_loader import load_model, load_model_files

    spec = config.speculative
    files = load_model_files(spec.model)
    if spec.method == "eagle":
        # The EAGLE authors' configs call their heads LlamaForCausalLM: the method, not
        # the architecture name, says how to build it.
        from engine.model_executor.models.eagle_llama import EagleLlamaForCausalLM

        files = dataclasses.replace(
            files, model_cls=EagleLlamaForCausalLM, architecture="EagleLlamaForCausalLM"
        )
    from engine.core.plugins import get_plugin_registry

    backend_cls = get_plugin_registry().select_attention_backend(
        platform, config.device.attention_backend)
    backend = backend_cls(config.cache.block_size, platform.device())
    model = load_model(
        files, kv_dtype, platform.device(), backend,
        dense_gemm_kernels=platform.dense_gemm_kernels(),
        fused_ops=platform.fused_ops(),
        activation_dtype=activation_dtype,
    )
    return model, backend
