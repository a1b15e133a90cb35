"""LazyTensor: narrowing composes on the file's index without reading, reads return
exactly the selected part, and split_part refuses uneven cuts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.model_executor.lazy_tensor import LazyTensor, materialize, split_part
from engine.model_executor.weight_utils import safetensors_weights_iterator


class RecordingHandle:
    """A stand-in for safetensors' slice handle: answers ``[slice, ...]`` from a tensor
    and records every index it was asked for (to see what was actually read)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.reads: list[tuple] = []

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index].clone()


FULL = torch.arange(6 * 8, dtype=torch.float64).reshape(6, 8)


def lazy(tensor: torch.Tensor = FULL) -> tuple[LazyTensor, RecordingHandle]:
    handle = RecordingHandle(tensor)
    return LazyTensor(handle, tuple(tensor.shape)), handle


def test_narrow_composes_without_reading():
    t, handle = lazy()
    part = t.narrow(0, 1, 4).narrow(1, 2, 5).narrow(0, 2, 2).narrow(-1, 1, 3)
    assert handle.reads == []  # narrowing never touches the file
    assert part.shape == torch.Size([2, 3])
    assert part.dim() == 2
    got = materialize(part)
    torch.testing.assert_close(got, FULL[3:5, 3:6], rtol=0, atol=0)
    assert handle.reads == [(slice(3, 5), slice(3, 6))]  # one read, of that part only


def test_narrow_out_of_bounds_raises():
    t, _ = lazy()
    with pytest.raises(ValueError, match="outside shape"):
        t.narrow(0, 4, 3)  # rows 4..6 of 6
    with pytest.raises(ValueError, match="outside shape"):
        t.narrow(1, -1, 2)
    with pytest.raises(ValueError, match="outside shape"):
        t.narrow(0, 0, -1)
    inner = t.narrow(1, 2, 4)  # bounds are the narrowed view's, not the file's
    with pytest.raises(ValueError, match="outside shape"):
        inner.narrow(1, 1, 4)
    inner.narrow(1, 0, 4)  # exactly the view: allowed


def test_zero_length_narrow_reads_empty():
    t, _ = lazy()
    got = materialize(t.narrow(0, 6, 0))
    assert got.shape == (0, 8)


def test_split_part_reads_each_part():
    t, handle = lazy()
    for part in range(2):
        got = materialize(split_part(t, 1, part, 2))
        torch.testing.assert_close(got, FULL[:, part * 4:(part + 1) * 4], rtol=0, atol=0)
    assert handle.reads == [(slice(0, 6), slice(0, 4)), (slice(0, 6), slice(4, 8))]
    # plain tensors go through the same function
    torch.testing.assert_close(split_part(FULL, 0, 2, 3), FULL[4:6], rtol=0, atol=0)


def test_split_part_non_divisible_raises():
    t, _ = lazy()
    with pytest.raises(ValueError, match="cannot be cut into 4 equal parts along dim 0"):
        split_part(t, 0, 0, 4)  # 6 rows
    with pytest.raises(ValueError, match="equal parts"):
        split_part(FULL, 1, 0, 3)  # 8 columns, plain tensor


def test_materialize_passes_plain_tensors_through():
    assert materialize(FULL) is FULL


def test_safetensors_lazy_iterator_reads_slices(tmp_path):
    tensors = {
        "a": torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
        "b": torch.arange(10, dtype=torch.int32),
        "s": torch.tensor(2.5),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    lazy_items = dict(safetensors_weights_iterator([path], lazy=True))
    eager_items = dict(safetensors_weights_iterator([path], lazy=False))
    assert set(lazy_items) == set(eager_items) == set(tensors)
    for name, ref in tensors.items():
        assert isinstance(lazy_items[name], LazyTensor)
        assert lazy_items[name].shape == ref.shape
        assert torch.equal(materialize(lazy_items[name]), ref)
        assert torch.equal(eager_items[name], ref)
    # read after the file's context closed (the iterator is exhausted)
    a = lazy_items["a"]
    assert torch.equal(materialize(a.narrow(0, 1, 2).narrow(1, 3, 3)), tensors["a"][1:3, 3:6])
    assert torch.equal(materialize(split_part(lazy_items["b"], 0, 1, 2)), tensors["b"][5:])
