"""Phi-3 / Phi-4: the Llama decoder with checkpoint-fused projections and LongRoPE.

- The checkpoint holds ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` already fused.
  They are cut back into their q / k / v and gate / up parts at load time (lazily, no
  read) and loaded through the ordinary shard loaders, so a tensor-parallel rank takes
  its heads of each part, exactly as from separate tensors.
- Rope: ``longrope`` (``su`` in older configs), and ``partial_rotary_factor`` (Phi-4-mini
  rotates 3/4 of each head). Position ``p`` is rotated with the long factors when
  ``p >= original_max_position_embeddings``: transformers' model does the same decoding
  token by token over its cache, but its ``generate`` drops the cache once when the
  sequence first outgrows the original context and recomputes the earlier keys with the
  long factors too. A paged cache keeps those keys, so outputs past that point can
  differ slightly from ``generate``'s (prompts longer than the original context are
  prefilled short-then-long here, all-long there).
- ``sliding_window`` (when set) on every layer, as transformers' mask does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from engine.model_executor.layers.rotary import RotaryEmbedding, rotary_for_config
from engine.model_executor.models.interface import ModelInitContext
from engine.model_executor.models.llama import (
    DecoderOptions,
    LlamaForCausalLM,
    config_head_size,
)

# (infix of the fused checkpoint tensor, [(infix of each part, its rows), ...])
FusedSplit = tuple[str, Sequence[tuple[str, int]]]


def unfuse_checkpoint(weights: Iterable[tuple[str, Any]], splits: Sequence[FusedSplit]
                      ) -> Iterator[tuple[str, Any]]:
    """Cut checkpoint tensors that fuse several projections along the output rows into
    one tensor per projection, named as if the checkpoint held them separately (the
    model's stacked-parameter rules then load each into its shard)."""
    for name, tensor in weights:
        for fused, parts in splits:
            if fused not in name:
                continue
            suffix = name.rsplit(".", 1)[-1]
            if suffix not in ("weight", "bias"):
                raise ValueError(f"checkpoint tensor {name!r}: only unquantized fused "
                                 f"projections ({fused.strip('.')} weight / bias) are supported")
            total = sum(rows for _, rows in parts)
            if tensor.shape[0] != total:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, "
                                 f"the config implies {total}")
            offset = 0
            for part, rows in parts:
                yield name.replace(fused, part), tensor.narrow(0, offset, rows)
                offset += rows
            break
        else:
            yield name, tensor


def config_rotary(hf_config: Any, ctx: ModelInitContext, head_size: int, **kwargs: Any
                  ) -> RotaryEmbedding:
    return rotary_for_config(hf_config, head_size, dtype=ctx.dtype, device=ctx.device,
                             fused_ops=ctx.fused_ops, **kwargs)


def gate_up_split(hf_config: Any) -> FusedSplit:
    inter = hf_config.intermediate_size
    return ".mlp.gate_up_proj.", ((".mlp.gate_proj.", inter), (".mlp.up_proj.", inter))


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config: Any) -> DecoderOptions:
        window = getattr(hf_config, "sliding_window", None)
        return DecoderOptions(
            head_size=config_head_size(hf_config),
            sliding_windows=(window,) * hf_config.num_hidden_layers if window else (),
        )

    @staticmethod
    def make_rotary(hf_config: Any, ctx: ModelInitContext, opts: DecoderOptions
                    ) -> RotaryEmbedding:
        return config_rotary(hf_config, ctx, opts.head_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        c = self.config
        q = c.num_attention_heads * self.head_size
        kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * self.head_size
        qkv = (".self_attn.qkv_proj.", ((".self_attn.q_proj.", q), (".self_attn.k_proj.", kv),
                                        (".self_attn.v_proj.", kv)))
        return super().load_weights(unfuse_checkpoint(weights, (qkv, gate_up_split(c))))
