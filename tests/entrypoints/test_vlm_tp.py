"""Vision-language models with tensor parallelism (two ranks, real worker processes):
greedy float32 tokens and their logprobs equal transformers' (near-ties tolerated), as
with one rank.

Each rank runs the whole vision tower with its share of the heads and MLP channels
(QKV / column-parallel in, row-parallel out with the all-reduce), the projector / patch
merger likewise, and merges the image rows into the vocab-parallel embedding's output;
the images reach the ranks inside the step message (engine/model_executor/step_codec.py).
An image prompt is batched with a text-only one under a 16-token budget, so the image
is cut across prefill chunks while the other request prefills / decodes beside it.

LLaVA-NeXT: every anyres tile through the sharded CLIP tower and projector, then the
packed grid with ``image_newline``. Qwen2-VL: the tower's 2D RoPE on each rank's heads,
the patch merger, and M-RoPE positions in the language model (prompt ``[3, T]``, decode
``p + delta``). Qwen2.5-VL (slow): its gated MLP and windowed attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, cpu_llm, sampled_logprobs

TP = 2
MAX_TOKENS = 8
BUDGET = 16  # max_num_batched_tokens (and the block size)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0, logprobs=0)
TEXT_PROMPT = "just some text here, then a few more words"


def _llava(path) -> dict[str, Any]:
    from tests.helpers.vlm_llava import IMAGE_TOKEN, build_llava, hf_inputs, random_image

    return {"hf": build_llava(path, next=True), "hf_inputs": hf_inputs,
            # The base tile and a 1x2 grid (pinpoint 56x112): 16 + 4 * (8 + 1) rows.
            "image": random_image(100, 48, 0),
            "prompt": f"describe this {IMAGE_TOKEN} in a few words"}


def _qwen2_vl(version: str):
    def build(path) -> dict[str, Any]:
        from tests.helpers.vlm_qwen2vl import (
            IMAGE_PLACEHOLDER,
            build_qwen2_vl,
            hf_inputs,
            random_image,
        )

        # Seed 3 for Qwen2.5-VL, as the one-rank tests (its output depends on the image).
        return {"hf": build_qwen2_vl(path, version=version, seed=3 if version == "2.5" else 0),
                "hf_inputs": hf_inputs,
                # 16 merged image tokens that straddle the first chunk boundary.
                "image": random_image(120, 100, 5),
                "prompt": f"a long prefix of words {IMAGE_PLACEHOLDER} and then"}

    return build


MODELS = {"llava-next": _llava, "qwen2-vl": _qwen2_vl("2"), "qwen2.5-vl": _qwen2_vl("2.5")}


@pytest.fixture(scope="module", params=[
    "llava-next",
    "qwen2-vl",
    pytest.param("qwen2.5-vl", marks=pytest.mark.slow),
])
def setup(request, tmp_path_factory) -> Any:
    path = tmp_path_factory.mktemp(request.param.replace(".", "") + "_tp")
    model = MODELS[request.param](path)
    llm = cpu_llm(path, max_model_len=256, max_num_batched_tokens=BUDGET, block_size=BUDGET,
                  enable_chunked_prefill=True, tensor_parallel_size=TP)
    try:
        yield {"path": path, "llm": llm, **model}
    finally:
        llm.shutdown()


@torch.inference_mode()
def _check(setup: dict[str, Any], prompt: str, got: Any, images: list | None) -> None:
    """Tokens equal transformers' greedy ones (up to a verified near-tie) and so do the
    sampled tokens' logprobs: a tower that is wrong only a little under TP shows there
    even where it leaves this tiny model's argmax alone."""
    model = setup["hf"]
    inputs = setup["hf_inputs"](setup["path"], prompt, images)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, pad_token_id=model.config.text_config.pad_token_id,
                         output_logits=True, return_dict_in_generate=True)
    want = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    ref = torch.stack([step[0] for step in out.logits]).double().log_softmax(-1)
    assert_matches_reference(list(got.token_ids), sampled_logprobs(got), want, ref)


def test_image_prompt_batched_with_text_matches_transformers(setup) -> None:
    image, prompt = setup["image"], setup["prompt"]
    ids = setup["hf_inputs"](setup["path"], prompt, [image])["input_ids"][0]
    image_id = setup["hf"].config.image_token_id
    where = (ids == image_id).nonzero().flatten().tolist()
    assert where[0] // BUDGET != where[-1] // BUDGET  # the image straddles a chunk boundary
    outputs = setup["llm"].generate(
        [{"prompt": prompt, "multi_modal_data": {"image": [image]}}, {"prompt": TEXT_PROMPT}],
        GREEDY, use_tqdm=False)
    got = [o.outputs[0] for o in outputs]
    _check(setup, prompt, got[0], [image])
    _check(setup, TEXT_PROMPT, got[1], None)
