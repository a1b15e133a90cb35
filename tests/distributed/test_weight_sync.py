"""The packed layout of trainer broadcasts: buckets both sides compute alike."""

from __future__ import annotations

import torch

from engine.distributed.weight_sync import PACKED_ALIGN, packed_buckets, tensor_bytes


def test_packed_buckets_hold_every_tensor_once_aligned_and_bounded():
    specs = [("a", torch.bfloat16, (3, 5)), ("b", torch.float32, (7,)), ("c", torch.int8, ()),
             ("d", torch.float32, (100,)), ("e", torch.float16, (2, 2))]
    buckets = packed_buckets(specs, bucket_bytes=256)
    placed = [index for _, entries in buckets for index, _ in entries]
    assert placed == list(range(len(specs)))  # in order, each once
    for total, entries in buckets:
        ends = []
        for index, offset in entries:
            assert offset % PACKED_ALIGN == 0  # any dtype views its bytes in place
            ends.append(offset + tensor_bytes(*specs[index][1:]))
        assert max(ends) <= total
        assert total <= 256 or len(entries) == 1  # only a lone big tensor exceeds a bucket
    assert len(buckets) == 3  # a, b, c | d (400 bytes, alone) | e


def test_packed_views_read_back_the_tensors():
    tensors = [("x", torch.randn(3, 4).to(torch.bfloat16)), ("y", torch.arange(5.0)),
               ("z", torch.tensor(7, dtype=torch.int64))]
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    ((total, entries),) = packed_buckets(specs)
    flat = torch.zeros(total, dtype=torch.uint8)
    for index, offset in entries:  # what the trainer side writes
        data = tensors[index][1].reshape(-1).view(torch.uint8)
        flat[offset : offset + data.numel()] = data
    for index, offset in entries:  # what a receiving rank views
        name, dtype, shape = specs[index]
        view = flat[offset : offset + tensor_bytes(dtype, shape)].view(dtype).view(shape)
        assert torch.equal(view, tensors[index][1]), name
