"""LLaVA-1.5 / LLaVA-NeXT through ``engine.LLM`` against transformers' greedy output.

Reference: transformers ``generate`` on one prompt at a time, float32, with the inputs
its saved LlavaProcessor / LlavaNextProcessor makes (PIL image processor). A divergence
is accepted only at a verified near-tie of transformers' top-2 logprobs.

One engine per model, with a small token budget (chunked prefill cuts prompts, images
included, across steps) and prefix caching on.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest

from engine import SamplingParams
from tests.helpers.hf_reference import cpu_llm
from tests.helpers.vlm_llava import (
    IMAGE_TOKEN,
    LLAVA_HF_CHAT_TEMPLATE,
    build_llava,
    hf_inputs,
    hf_processor,
    random_image,
)
from tests.helpers.vlm_reference import (
    assert_greedy_equivalent,
    check_greedy,
    generated_ids,
    hf_greedy,
    mm_request,
)

MAX_TOKENS = 8
BUDGET = 16  # max_num_batched_tokens (and the block size)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llava", "next"])
def setup(request, tmp_path_factory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp(f"{request.param}_e2e")
    reference = build_llava(path, next=request.param == "next")
    llm = cpu_llm(path, max_model_len=256, max_num_batched_tokens=BUDGET, block_size=BUDGET,
                  enable_chunked_prefill=True, enable_prefix_caching=True)
    return {"path": path, "hf": reference, "llm": llm, "kind": request.param,
            "image_id": reference.config.image_token_id}


def run(setup: dict[str, Any], requests: list[dict[str, Any]]) -> list[list[int]]:
    return generated_ids(setup["llm"], requests, GREEDY)


def check(setup: dict[str, Any], prompt: str, got: list[int], images: list | None = None
          ) -> list[int]:
    inputs = hf_inputs(setup["path"], prompt, images)
    return check_greedy(setup["hf"], inputs, got, MAX_TOKENS)


def test_one_image(setup) -> None:
    image = random_image(60, 40, 0)
    prompt = f"describe {IMAGE_TOKEN} now"
    [got] = run(setup, [mm_request(prompt, [image])])
    check(setup, prompt, got, [image])


def test_two_images_of_different_sizes(setup) -> None:
    images = [random_image(60, 40, 1), random_image(24, 64, 2)]
    prompt = f"first {IMAGE_TOKEN} second {IMAGE_TOKEN} compare"
    [got] = run(setup, [mm_request(prompt, images)])
    check(setup, prompt, got, images)


def test_batched_with_text_only_requests(setup) -> None:
    """Image prompts share steps with text-only ones; each equals its reference alone."""
    images = [random_image(50, 50, 3), random_image(64, 24, 4)]
    prompts = [f"a {IMAGE_TOKEN} b", "just some text here", f"c {IMAGE_TOKEN} d", "more words"]
    got = run(setup, [mm_request(prompts[0], [images[0]]), mm_request(prompts[1]),
                      mm_request(prompts[2], [images[1]]), mm_request(prompts[3])])
    check(setup, prompts[0], got[0], [images[0]])
    check(setup, prompts[1], got[1])
    check(setup, prompts[2], got[2], [images[1]])
    check(setup, prompts[3], got[3])


def test_chunked_prefill_across_an_image(setup) -> None:
    """The token budget cuts this prompt's image tokens over two steps (the prefix is
    the shortest one of these that puts the image across a chunk boundary)."""
    image = random_image(56, 48, 5)
    words = ["a", "long", "prefix", "of", "some", "words", "before", "it"]
    for n in range(1, len(words) + 1):
        prompt = f"{' '.join(words[:n])} {IMAGE_TOKEN} and then"
        ids = hf_inputs(setup["path"], prompt, [image])["input_ids"][0].tolist()
        where = [i for i, t in enumerate(ids) if t == setup["image_id"]]
        if where[0] // BUDGET != where[-1] // BUDGET:
            break
    else:
        pytest.fail("no prefix puts the image across a chunk boundary")
    [got] = run(setup, [mm_request(prompt, [image])])
    check(setup, prompt, got, [image])


def test_prefix_cache_hit_keeps_the_output(setup) -> None:
    image = random_image(45, 60, 6)
    prompt = f"{IMAGE_TOKEN} the same image again and again, then once more the same"
    first = setup["llm"].generate([mm_request(prompt, [image])], GREEDY)[0]
    second = setup["llm"].generate([mm_request(prompt, [image])], GREEDY)[0]
    assert second.num_cached_tokens >= BUDGET
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    check(setup, prompt, list(second.outputs[0].token_ids), [image])


def test_a_different_image_gives_the_references_different_output(setup) -> None:
    """Same text, another image of the same size: the prefix cache must not serve the
    first image's blocks, and the output follows the reference for the new image."""
    prompt = f"{IMAGE_TOKEN} tell me about it"
    images = [random_image(60, 60, 7), random_image(60, 60, 8)]
    got = [run(setup, [mm_request(prompt, [image])])[0] for image in images]
    wants = [check(setup, prompt, g, [image]) for g, image in zip(got, images)]
    assert wants[0] != wants[1]  # the images matter to the reference
    assert got[0] != got[1]


def test_chat_with_image_parts(setup) -> None:
    """``LLM.chat`` takes an OpenAI ``image_url`` part (a base64 PNG data URL) and an
    ``image_pil`` part; the tiny model's template takes string content, so the image's
    placeholder goes on its own line before the text (vLLM's rule). Reference:
    transformers on that rendered text."""
    image = random_image(48, 40, 9)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    by_url = [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url}}]}]
    by_pil = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": image}, {"type": "text", "text": "what is this"}]}]
    outs = setup["llm"].chat([by_url, by_pil], GREEDY, use_tqdm=False)
    processor = hf_processor(setup["path"])
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{IMAGE_TOKEN}\nwhat is this"}], tokenize=False,
        add_generation_prompt=True)
    inputs = dict(processor(text=[text], images=[image], return_tensors="pt",
                            add_special_tokens=False))
    want = hf_greedy(setup["hf"], inputs, MAX_TOKENS)
    for out in outs:
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert_greedy_equivalent(setup["hf"], inputs, list(out.outputs[0].token_ids), want)


@pytest.mark.parametrize("setup", ["llava"], indirect=True)  # one model suffices
def test_async_scheduling_gives_the_same_tokens(setup) -> None:
    """Image chunks scheduled one step ahead (--async-scheduling) encode and merge the
    same rows: tokens equal the serial engine's."""
    requests = [mm_request(f"a {IMAGE_TOKEN} b {i}", [random_image(40 + 3 * i, 30, 20 + i)])
                for i in range(3)] + [mm_request("text only here")]
    serial = run(setup, requests)
    llm = cpu_llm(setup["path"], max_model_len=256, max_num_batched_tokens=BUDGET,
                  block_size=BUDGET, enable_chunked_prefill=True, async_scheduling=True)
    try:
        outs = llm.generate(requests, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == serial


@pytest.mark.parametrize("setup", ["llava"], indirect=True)  # one model suffices
def test_preempted_image_requests_give_the_same_tokens(setup) -> None:
    """A KV cache too small for the batch preempts image requests (recomputed later:
    their images encoded again or taken from the encoder cache); tokens are unchanged."""
    requests = [mm_request(f"a {IMAGE_TOKEN} b {i} more words here",
                        [random_image(40 + i, 30, 30 + i)]) for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs = {}
    for blocks in (None, 17):
        llm = cpu_llm(setup["path"], max_model_len=64, block_size=4,
                      num_gpu_blocks_override=blocks, enable_prefix_caching=False)
        try:
            result = llm.generate(requests, params, use_tqdm=False)
            outs[blocks] = [list(o.outputs[0].token_ids) for o in result]
            preemptions = llm.llm_engine.client.core.scheduler.num_preemptions_total
        finally:
            llm.shutdown()
        assert (preemptions > 0) == (blocks is not None)
    assert outs[17] == outs[None]


@pytest.mark.parametrize("setup", ["llava"], indirect=True)  # one model suffices
def test_chat_with_llava_hf_template_takes_typed_parts(setup) -> None:
    """llava-hf's own chat template loops over typed content parts (and uses
    transformers' {% generation %} tag): the image part reaches it as {"type": "image"}
    and the template writes the placeholder; tokens equal transformers' on that text."""
    image = random_image(44, 36, 41)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "what is this"}]}]
    [out] = setup["llm"].chat(messages, GREEDY, chat_template=LLAVA_HF_CHAT_TEMPLATE,
                              use_tqdm=False)
    text = f"USER: {IMAGE_TOKEN}\nwhat is this ASSISTANT:"
    processor = hf_processor(setup["path"])
    inputs = dict(processor(text=[text], images=[image], return_tensors="pt",
                            add_special_tokens=False))
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert_greedy_equivalent(setup["hf"], inputs, list(out.outputs[0].token_ids),
                             hf_greedy(setup["hf"], inputs, MAX_TOKENS))
