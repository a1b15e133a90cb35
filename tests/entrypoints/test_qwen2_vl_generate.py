"""Qwen2-VL / Qwen2.5-VL through ``engine.LLM`` against transformers' greedy output.

Reference: transformers ``generate`` on one prompt at a time, float32, with the inputs
its Qwen2VLProcessor would make (the PIL image processor and the placeholder expanded
by hand: the processor class itself needs torchvision). Videos: transformers' video
processor needs torchvision too, so the reference takes the engine processor's video
tensors (checked against the image pipeline in
tests/model_executor/models/test_qwen2_vl.py). A divergence is accepted only at a
verified near-tie of transformers' top-2 logprobs.

One engine per model, with a small token budget (chunked prefill cuts prompts, images
included, across steps) and prefix caching on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import SamplingParams
from tests.helpers.hf_reference import cpu_llm
from tests.helpers.vlm_qwen2vl import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    build_qwen2_vl,
    hf_inputs,
    random_image,
)
from tests.helpers.vlm_reference import (
    check_greedy,
    generated_ids,
)

MAX_TOKENS = 8
# min_tokens: the EOS logit masked until then, as transformers' min_new_tokens does.
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module", params=["2", "2.5"])
def setup(request, tmp_path_factory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp(f"qwen{request.param}vl_e2e")
    # Seed 3 for Qwen2.5-VL: a tiny random model whose greedy output depends on the image
    # more than seed 0's does.
    reference = build_qwen2_vl(path, version=request.param,
                               seed=3 if request.param == "2.5" else 0)
    llm = cpu_llm(path, max_model_len=256, max_num_batched_tokens=16, block_size=16,
                  enable_prefix_caching=True)
    return {"path": path, "hf": reference, "llm": llm, "version": request.param}






def frames(n: int, width: int, height: int, seed: int) -> list:
    return [random_image(width, height, seed + i) for i in range(n)]


def run(setup: dict[str, Any], requests: list[dict[str, Any]]) -> list[list[int]]:
    return generated_ids(setup["llm"], requests, GREEDY)


def check(setup: dict[str, Any], prompt: str, got: list[int], images: list | None = None,
          video: dict[str, torch.Tensor] | None = None) -> list[int]:
    inputs = hf_inputs(setup["path"], prompt, images, video)
    return check_greedy(setup["hf"], inputs, got, MAX_TOKENS)


def video_tensors(setup: dict[str, Any], video: list) -> dict[str, torch.Tensor]:
    """The engine processor's tensors of one video (the reference's video inputs)."""
    import transformers

    from engine.multimodal.processing import processor_for

    config = transformers.AutoConfig.from_pretrained(setup["path"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(setup["path"])
    processor = processor_for(setup["path"], config, tokenizer)
    return processor.process("video", [video])[0].tensors


def test_one_image(setup) -> None:
    image = random_image(60, 40, 0)
    prompt = f"describe {IMAGE_PLACEHOLDER} now"
    [got] = run(setup, [{"prompt": prompt, "multi_modal_data": {"image": [image]}}])
    check(setup, prompt, got, [image])


def test_two_images_of_different_sizes(setup) -> None:
    images = [random_image(60, 40, 1), random_image(40, 90, 2)]
    prompt = f"first {IMAGE_PLACEHOLDER} second {IMAGE_PLACEHOLDER} compare"
    [got] = run(setup, [{"prompt": prompt, "multi_modal_data": {"image": images}}])
    check(setup, prompt, got, images)


def test_video(setup) -> None:
    video = frames(5, 84, 56, 10)
    prompt = f"watch {VIDEO_PLACEHOLDER} what happens"
    [got] = run(setup, [{"prompt": prompt, "multi_modal_data": {"video": [video]}}])
    check(setup, prompt, got, video=video_tensors(setup, video))


def test_batched_with_text_only_requests(setup) -> None:
    """Image prompts (whose positions are M-RoPE's) share steps with text-only ones
    (plain positions); each equals its reference alone."""
    images = [random_image(50, 50, 3), random_image(70, 30, 4)]
    prompts = [f"a {IMAGE_PLACEHOLDER} b", "just some text here", f"c {IMAGE_PLACEHOLDER} d",
               "more words"]
    requests = [{"prompt": prompts[0], "multi_modal_data": {"image": [images[0]]}},
                {"prompt": prompts[1]},
                {"prompt": prompts[2], "multi_modal_data": {"image": [images[1]]}},
                {"prompt": prompts[3]}]
    got = run(setup, requests)
    check(setup, prompts[0], got[0], [images[0]])
    check(setup, prompts[1], got[1])
    check(setup, prompts[2], got[2], [images[1]])
    check(setup, prompts[3], got[3])


def test_chunked_prefill_across_an_image(setup) -> None:
    """A 16-token budget cuts this prompt's 16-token image over two steps."""
    image = random_image(120, 100, 5)
    prompt = f"a long prefix of words {IMAGE_PLACEHOLDER} and then"
    inputs = hf_inputs(setup["path"], prompt, [image])
    ids = inputs["input_ids"][0].tolist()
    pads = [i for i, t in enumerate(ids) if inputs["mm_token_type_ids"][0, i]]
    assert pads[0] // 16 != pads[-1] // 16  # the image straddles a chunk boundary
    [got] = run(setup, [{"prompt": prompt, "multi_modal_data": {"image": [image]}}])
    check(setup, prompt, got, [image])


def test_prefix_cache_hit_keeps_the_output(setup) -> None:
    image = random_image(90, 60, 6)
    prompt = f"{IMAGE_PLACEHOLDER} the same image again and again, then"
    request = {"prompt": prompt, "multi_modal_data": {"image": [image]}}
    first = setup["llm"].generate([request], GREEDY)[0]
    second = setup["llm"].generate([request], GREEDY)[0]
    assert second.num_cached_tokens >= 16
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    check(setup, prompt, list(second.outputs[0].token_ids), [image])


def test_a_different_image_gives_the_references_different_output(setup) -> None:
    """Same text, other images of the same size: the prefix cache must not serve an
    earlier image's blocks; each output follows the reference for its own image, and
    the references differ (the images matter)."""
    from PIL import Image

    prompt = f"{IMAGE_PLACEHOLDER} tell me about it"
    images = [Image.new("RGB", (60, 60), (0, 0, 0)), Image.new("RGB", (60, 60), (255, 255, 255)),
              random_image(60, 60, 7), random_image(60, 60, 8)]
    got = [run(setup, [{"prompt": prompt, "multi_modal_data": {"image": [image]}}])[0]
           for image in images]
    wants = [check(setup, prompt, g, [image]) for g, image in zip(got, images)]
    assert len({tuple(w) for w in wants}) > 1
    assert len({tuple(g) for g in got}) > 1
