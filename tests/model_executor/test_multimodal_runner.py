"""The worker's multimodal step without a real model: encoder outputs are cached by
content and merged at exactly the tokens of a chunk that covers them; M-RoPE positions
come from the prompt's table inside it and are ``p + delta`` past it (1-D when no
prompt token of an image request runs, so decode steps keep their graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model_executor.input_batch import InputBatch
from engine.model_executor.multimodal_runner import MultiModalRunner
from engine.multimodal.inputs import MultiModalFeature, PackedTensor

HIDDEN = 4


class FakeVLM(torch.nn.Module):
    """Text rows are the token id; an image's rows are its ``value`` tensor plus the
    row index; M-RoPE table: text positions, images on a 3-axis grid."""

    supports_multimodal = True
    uses_mrope = True

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[str] = []

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids[:, None].float().repeat(1, HIDDEN)

    def embed_multimodal(self, modality, items):
        out = []
        for item in items:
            n = int(item["n"])
            self.encoded.append(float(item["value"]))
            out.append(item["value"] + torch.arange(n, dtype=torch.float32)[:, None].repeat(1, HIDDEN))
        return out

    def mrope_positions(self, prompt_token_ids, features):
        p = len(prompt_token_ids)
        table = np.tile(np.arange(p), (3, 1))
        table[1] += 100  # distinguishable axes
        table[2] += 200
        return table, 7


def feature(ident: str, offset: int, length: int, value: float) -> MultiModalFeature:
    return MultiModalFeature("image", ident, offset, length, {
        "value": PackedTensor.of(torch.tensor(value)), "n": PackedTensor.of(torch.tensor(length))})


def step_of(batch: InputBatch, rows, computed, scheduled):
    for row, c in zip(rows, computed):
        batch.num_computed_tokens[row] = c
    return batch.prepare_step(np.asarray(rows, dtype=np.int64), np.asarray(scheduled))


@pytest.fixture
def setup():
    model = FakeVLM()
    runner = MultiModalRunner(model, torch.device("cpu"))
    batch = InputBatch(4, 64, 4)
    prompt_a = list(range(1, 13))  # image at [3, 9)
    batch.add("a", prompt_a, [], ([0, 1, 2, 3],), 0)
    runner.add_request("a", [feature("cat", 3, 6, 1000.0)], prompt_a)
    prompt_t = list(range(50, 56))  # text only
    batch.add("t", prompt_t, [], ([4, 5],), 0)
    runner.add_request("t", None, prompt_t)
    return model, runner, batch


def test_chunk_takes_the_rows_of_its_part_of_the_image(setup):
    model, runner, batch = setup
    runner.encode({"a": [0]})
    step = step_of(batch, [0, 1], [0, 0], [5, 6])  # a: tokens 0..4 (image rows 0, 1)
    ids = torch.from_numpy(step.input_ids)
    embeds = runner.inputs_embeds(["a", "t"], step, ids)
    want = ids[:, None].float().repeat(1, HIDDEN)
    want[3] = 1000.0
    want[4] = 1001.0
    torch.testing.assert_close(embeds, want)
    step = step_of(batch, [0], [5], [7])  # the rest of the image from the cache
    embeds = runner.inputs_embeds(["a"], step, torch.from_numpy(step.input_ids))
    torch.testing.assert_close(embeds[:4, 0], torch.tensor([1002.0, 1003.0, 1004.0, 1005.0]))
    assert model.encoded == [1000.0]
    runner.free(["cat"])
    with pytest.raises(RuntimeError, match="not cached"):
        runner.inputs_embeds(["a"], step_of(batch, [0], [0], [5]),
                             torch.zeros(5, dtype=torch.int64))


def test_mrope_positions_inside_and_after_the_prompt(setup):
    _, runner, batch = setup
    step = step_of(batch, [0, 1], [10, 2], [4, 2])  # a: positions 10..13 (prompt is 12)
    pos = runner.positions(["a", "t"], step)
    assert pos.shape == (3, 6)
    np.testing.assert_array_equal(pos[:, :4], [[10, 11, 19, 20], [110, 111, 19, 20],
                                               [210, 211, 19, 20]])
    np.testing.assert_array_equal(pos[:, 4:], [[2, 3]] * 3)  # text-only: unchanged
    decode = step_of(batch, [0, 1], [12, 6], [1, 1])
    np.testing.assert_array_equal(runner.positions(["a", "t"], decode), [19, 6])


def test_key_ends_for_bidirectional_images(setup):
    model, runner, batch = setup
    step = step_of(batch, [0, 1], [0, 0], [10, 6])
    assert runner.key_ends(["a", "t"], step) is None  # FakeVLM attends causally
    runner.bidirectional = True
    ends = runner.key_ends(["a", "t"], step)
    want = np.concatenate([np.arange(1, 11), np.arange(1, 7)])
    want[3:9] = 9  # a's image [3, 9): its tokens see the whole image
    np.testing.assert_array_equal(ends, want)
    assert runner.key_ends(["t"], step_of(batch, [1], [0], [6])) is None
    with pytest.raises(RuntimeError, match="inside an image"):
        runner.key_ends(["a"], step_of(batch, [0], [0], [5]))
