"""Content hashes of processed items: the encoder cache's key and the prefix cache's
extra key, so the same text with another image never shares KV, and the same image in a
new request does (whatever its file name or URL was)."""

from __future__ import annotations

import hashlib
from typing import Any


def hash_item(modality: str, tensors: dict[str, Any]) -> str:
    """blake2b-128 over the modality and every tensor's name, dtype, shape and bytes."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    h.update(modality.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()
