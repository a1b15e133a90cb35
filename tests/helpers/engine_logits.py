"""Logits of an engine model over a whole prompt, outside the engine's step loop: one
prefill through a fresh paged cache (blocks 0 .. n - 1), for comparing with a
reference's logits at every prompt position."""

from __future__ import annotations

import torch

from engine.core.interfaces import AttentionBatch
from engine.model_executor.forward_context import ForwardContext, set_forward_context
from engine.plugins.cpu.attention import CPUAttentionBackend


def prefill_logits(model, tokens: list[int], block_size: int = 4,
                   cache_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float32 ``[len(tokens), vocab]`` logits of ``model`` (built with a CPU attention
    backend of ``block_size``) at every position of ``tokens``."""
    backend = CPUAttentionBackend(block_size=block_size, device=torch.device("cpu"))
    spec = model.kv_cache_spec()
    n = len(tokens)
    nblocks = -(-n // block_size)
    shape = backend.get_kv_cache_shape(nblocks, block_size, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(spec.num_layers)]
    batch = AttentionBatch(
        num_reqs=1,
        num_tokens=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(nblocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n),
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.no_grad(), set_forward_context(ForwardContext(backend.build_metadata(batch), caches)):
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(n))).float()
