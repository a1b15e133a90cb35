"""The per-step message to the worker ranks: the scheduler's diff, msgpack-encoded once.

``SchedulerOutput`` and its parts are plain dataclasses (ints, strings, lists, sampling
params), so msgspec encodes them as they are; the grammar bitmask (int32 ``[rows,
words]``) travels as raw bytes beside them. Nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

from engine.core.scheduler.output import ModelRunnerOutput, SchedulerOutput

_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
_shape_decoder = msgspec.msgpack.Decoder(list[int])
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode_step(so: SchedulerOutput, bitmask: torch.Tensor | None) -> list[bytes]:
    """The frames after the tag: the diff, the bitmask's shape ([] for none), its bytes."""
    if bitmask is None:
        return [_encoder.encode(so), _encoder.encode([]), b""]
    array = bitmask.to(torch.int32).cpu().contiguous().numpy()
    return [_encoder.encode(so), _encoder.encode(list(array.shape)), array.tobytes()]


def decode_step(frames: list[Any]) -> tuple[SchedulerOutput, torch.Tensor | None]:
    buffers = [getattr(f, "buffer", f) for f in frames]
    so = _step_decoder.decode(buffers[0])
    shape = _shape_decoder.decode(buffers[1])
    if not shape:
        return so, None
    array = np.frombuffer(buffers[2], dtype=np.int32).reshape(shape).copy()
    return so, torch.from_numpy(array)


def decode_output(buffer: Any) -> ModelRunnerOutput:
    return _output_decoder.decode(buffer)
