"""What vision towers share: running non-causal attention over segments (one image, or
one window of an image) through the platform's attention backend.

A tower's :class:`~engine.model_executor.layers.attention.Attention` layers are built
with ``causal=False``; they read the segment layout from the forward context set here,
exactly as a BERT encoder's layers read the step's requests, so the platform's encoder
attention kernel (C on the CPU, Triton on GPUs) runs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from engine.core.interfaces import AttentionBatch
from engine.model_executor.forward_context import ForwardContext, set_forward_context


def segment_metadata(attn_backend, seq_lens: Sequence[int], device: torch.device):
    """The backend's metadata for ``len(seq_lens)`` independent segments laid end to end
    (each token attends to every token of its own segment only)."""
    lens = np.asarray(seq_lens, dtype=np.int32)
    if lens.ndim != 1 or not len(lens) or (lens <= 0).any():
        raise ValueError(f"segment lengths must be positive, got {list(seq_lens)}")
    starts = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=starts[1:])
    num_tokens = int(starts[-1])

    def upload(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if device.type == "cpu" else tensor.to(device)

    batch = AttentionBatch(
        num_reqs=len(lens),
        num_tokens=num_tokens,
        query_start_loc=upload(starts),
        seq_lens=upload(lens),
        # No KV cache is read; the tables only need the width a context this long has.
        block_tables=upload(np.zeros((len(lens), -(-int(lens.max()) // attn_backend.block_size)),
                                     dtype=np.int32)),
        slot_mapping=upload(np.full(num_tokens, -1, dtype=np.int64)),
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    return attn_backend.build_metadata(batch)


@contextmanager
def encoder_attention_context(
    attn_backend, seq_lens: Sequence[int], device: torch.device,
    layer_seq_lens: Sequence[Sequence[int]] | None = None,
) -> Iterator[ForwardContext]:
    """Run a tower's non-causal attention layers over these segments.

    ``layer_seq_lens``: per attention layer (by its ``layer_idx``), that layer's own
    segments (Qwen2.5-VL's windowed layers beside its full ones); None: all layers use
    ``seq_lens``."""
    metadata = segment_metadata(attn_backend, seq_lens, device)
    per_layer = None
    if layer_seq_lens is not None:
        built = {tuple(seq_lens): metadata}  # one metadata per distinct layout
        per_layer = []
        for lens in layer_seq_lens:
            key = tuple(lens)
            if key not in built:
                built[key] = segment_metadata(attn_backend, lens, device)
            per_layer.append(built[key])
    with set_forward_context(ForwardContext(metadata, [], layer_attn_metadata=per_layer)) as ctx:
        yield ctx



def patch_rows(pixels: torch.Tensor, channels: int, image_size: int, patch: int,
               tower: str) -> torch.Tensor:
    """``[N, C, S, S]`` pixels -> ``[N * patches, C * patch * patch]`` rows, row-major
    patches each flattened (channel, row, column) like a ViT's stride-``patch`` conv
    kernel, so the patch embedding runs as one GEMM."""
    n, c, h, w = pixels.shape
    if c != channels or h != image_size or w != image_size:
        raise ValueError(f"{tower} tower takes [N, {channels}, {image_size}, {image_size}] "
                         f"pixels, got {list(pixels.shape)}")
    g = image_size // patch
    return pixels.reshape(n, c, g, patch, g, patch).permute(0, 2, 4, 1, 3, 5).reshape(
        n * g * g, c * patch * patch)
