"""Gemma 3 (vision-language) through ``engine.LLM`` against transformers' greedy output.

Reference: transformers ``generate`` on one prompt at a time, float32, with the inputs its
saved Gemma3Processor makes (PIL image processor) -- ``token_type_ids`` included, so
transformers lets an image's tokens attend to each other both ways, as the engine does
(``bidirectional_mm_attention``). A divergence is accepted only at a verified near-tie
of transformers' top-2 logprobs.

One engine, with a small token budget (chunked prefill cuts prompts across steps, never
inside an image) and prefix caching on. The tiny model's sliding layers see 8 tokens,
so windows cut across the image sequences.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest

from engine import SamplingParams
from tests.helpers.hf_reference import cpu_llm
from tests.helpers.vlm_gemma3 import BOI, build_gemma3, hf_inputs, hf_processor, random_image
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


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("gemma3_vlm_e2e")
    # Untied head and seed 1: a tiny random model whose greedy output follows its input
    # (with the released models' tied head it repeats the last prompt token) and depends
    # on the image.
    reference = build_gemma3(path, seed=1, tie_word_embeddings=False)
    llm = cpu_llm(path, max_model_len=256, max_num_batched_tokens=BUDGET, block_size=BUDGET,
                  enable_chunked_prefill=True, enable_prefix_caching=True)
    return {"path": path, "hf": reference, "llm": llm,
            "image_id": reference.config.image_token_id}


def run(setup: dict[str, Any], requests: list[dict[str, Any]]) -> list[list[int]]:
    return generated_ids(setup["llm"], requests, GREEDY)


def check(setup: dict[str, Any], prompt: str, got: list[int], images: list | None = None
          ) -> list[int]:
    inputs = hf_inputs(setup["path"], prompt, images)
    return check_greedy(setup["hf"], inputs, got, MAX_TOKENS)


def test_one_image(setup) -> None:
    image = random_image(60, 40, 0)
    prompt = f"describe {BOI} now"
    [got] = run(setup, [mm_request(prompt, [image])])
    check(setup, prompt, got, [image])


def test_two_images(setup) -> None:
    images = [random_image(60, 40, 1), random_image(24, 64, 2)]
    prompt = f"first {BOI} second {BOI} compare"
    [got] = run(setup, [mm_request(prompt, images)])
    check(setup, prompt, got, images)


def test_batched_with_text_only_requests(setup) -> None:
    """Image prompts share steps with text-only ones; each equals its reference alone."""
    images = [random_image(50, 50, 3), random_image(64, 24, 4)]
    prompts = [f"a {BOI} b", "just some text here", f"c {BOI} d", "more words"]
    got = run(setup, [mm_request(prompts[0], [images[0]]), mm_request(prompts[1]),
                      mm_request(prompts[2], [images[1]]), mm_request(prompts[3])])
    check(setup, prompts[0], got[0], [images[0]])
    check(setup, prompts[1], got[1])
    check(setup, prompts[2], got[2], [images[1]])
    check(setup, prompts[3], got[3])


def test_chunk_boundary_inside_an_image_is_moved(setup) -> None:
    """With this prefix a budget-sized chunk would end inside the image's tokens; the
    engine keeps the image whole in one step (its tokens attend to each other both
    ways), and the output still equals the reference."""
    image = random_image(56, 48, 5)
    words = ["a", "long", "prefix", "of", "some", "words", "before", "it", "comes"]
    for n in range(1, len(words) + 1):
        prompt = f"{' '.join(words[:n])} {BOI} and then"
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
    prompt = f"{BOI} the same image again and again, then once more the same"
    first = setup["llm"].generate([mm_request(prompt, [image])], GREEDY)[0]
    second = setup["llm"].generate([mm_request(prompt, [image])], GREEDY)[0]
    assert second.num_cached_tokens >= BUDGET
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    check(setup, prompt, list(second.outputs[0].token_ids), [image])


def test_a_different_image_gives_the_references_different_output(setup) -> None:
    """Same text, another image: the prefix cache must not serve the first image's
    blocks, and the output follows the reference for the new image."""
    prompt = f"{BOI} tell me about it"
    images = [random_image(60, 60, 7), random_image(60, 60, 8)]
    got = [run(setup, [mm_request(prompt, [image])])[0] for image in images]
    wants = [check(setup, prompt, g, [image]) for g, image in zip(got, images)]
    assert wants[0] != wants[1]  # the images matter to the reference
    assert got[0] != got[1]


def test_chat_with_image_parts(setup) -> None:
    """``LLM.chat`` with an OpenAI ``image_url`` part (base64 PNG) and an ``image_pil``
    part; the tiny template takes string content, so the image's ``<start_of_image>``
    goes on its own line before the text. Reference: transformers on that text."""
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
        [{"role": "user", "content": f"{BOI}\nwhat is this"}], tokenize=False,
        add_generation_prompt=True)
    inputs = dict(processor(text=[text], images=[[image]], return_tensors="pt",
                            add_special_tokens=False))
    want = hf_greedy(setup["hf"], inputs, MAX_TOKENS)
    for out in outs:
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert_greedy_equivalent(setup["hf"], inputs, list(out.outputs[0].token_ids), want)
