"""What one image or video of a prompt becomes on its way to the engine core.

The front end runs the model's processor (resize, normalise, patching) and records, per
item, the encoder's input tensors, a content hash of them and where its embeddings go in
the prompt: ``length`` consecutive placeholder tokens from ``offset``. The engine core
sees only these structs (msgspec, tensors as raw bytes); the scheduler reads the offsets,
lengths and hashes, the model runner decodes the tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch


class PackedTensor(msgspec.Struct, array_like=True, gc=False):
    """A tensor as C-order bytes plus its dtype name and shape (no pickle on the wire)."""

    data: bytes
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "int64"
    shape: list[int]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PackedTensor:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8) if t.dtype == torch.bfloat16 else t
        return cls(raw.numpy().tobytes(), str(t.dtype).removeprefix("torch."), list(t.shape))

    def tensor(self) -> torch.Tensor:
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"packed tensor has unknown dtype {self.dtype!r}")
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return flat.view(dtype).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One image (or video) of a prompt, processed."""

    modality: str  # "image" | "video"
    # Content hash of the processed tensors (hex): the encoder cache's key, and what the
    # prefix cache folds into the hash of every block the item's tokens fall in.
    identifier: str
    offset: int  # index in the prompt of the first token its embeddings replace
    length: int  # how many consecutive prompt tokens they replace
    # The model's encoder inputs for this item alone (e.g. pixel_values, image_grid_thw).
    data: dict[str, PackedTensor] = {}

    @property
    def end(self) -> int:
        return self.offset + self.length

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: packed.tensor() for name, packed in self.data.items()}
