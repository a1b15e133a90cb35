#!/usr/bin/env python3
"""Image prompts through this engine and through transformers, side by side.

The model is a random-weight LLaVA-1.5 of a small real shape (a CLIP ViT-B/16 tower at
224 px: 12 layers, 768 wide, 196 patches per image; a 512-wide, 8-layer Llama), saved
with its processor, unless ``--model`` names a LLaVA directory. The workload: ``--num``
prompts, each one distinct random image (``--image-size`` px, resized by the processor)
and a short question, ``--max-tokens`` greedy tokens (EOS ignored). Both sides run in this
process with the same threads (``--threads``, default the usable cores):

* engine: ``LLM(model, dtype=--dtype)``, all prompts submitted at once (the scheduler
  encodes each image in the step that reaches it, within the encoder budget);
* transformers: ``generate`` one prompt at a time (LLaVA's processor pads a batch, and
  a padded batch changes the greedy tokens), ``min_new_tokens = max_new_tokens``.

Each side gets one warm-up run, then ``--repeats`` measured runs alternating engine /
transformers; figures are medians in prompts per second and the ratio between them, with
how many prompts' tokens agreed (the check that both computed the same thing).

    python ci/bench_vlm.py                       # float32, 16 prompts of 24 tokens
    python ci/bench_vlm.py --num 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build_model(out: Path) -> Path:
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from tests.helpers.hf_models import build_tokenizer

    tokenizer = build_tokenizer(out, vocab_size=2048)
    tokenizer.add_special_tokens({"additional_special_tokens":
                                  ["<|im_start|>", "<|im_end|>", "<image>"]})
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 224},
                                             crop_size={"height": 224, "width": 224})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=16,
                   vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(out)
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, image_size=224, patch_size=16)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=512,
                intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8, max_position_embeddings=2048,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--num", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--image-size", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both sides (default: the usable cores)")
    args = parser.parse_args()

    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from engine import LLM, SamplingParams
    from engine.plugins.cpu.threads import usable_core_count

    threads = args.threads or usable_core_count()
    torch.set_num_threads(threads)
    model_dir = args.model or build_model(Path(tempfile.mkdtemp(prefix="bench-vlm-")))
    prompts = [f"question {i}: what is in <image> here?" for i in range(args.num)]

    def fresh_images(seed: int) -> list:
        """New images each round: the engine's prefix and encoder caches must not
        remember an earlier round's (the workload is unseen images)."""
        rng = np.random.default_rng(seed)
        return [Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3),
                                             dtype=np.uint8)) for _ in range(args.num)]

    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=1024, num_threads=threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    processor = AutoProcessor.from_pretrained(model_dir)
    hf_dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=hf_dtype).eval()

    def run_engine(images: list) -> list[list[int]]:
        requests = [{"prompt": p, "multi_modal_data": {"image": img}}
                    for p, img in zip(prompts, images)]
        outs = llm.generate(requests, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    @torch.inference_mode()
    def run_hf(images: list) -> list[list[int]]:
        tokens = []
        for prompt, image in zip(prompts, images):
            enc = processor(text=[prompt], images=[image], return_tensors="pt")
            enc["pixel_values"] = enc["pixel_values"].to(hf_dtype)
            out = hf.generate(**enc, max_new_tokens=args.max_tokens,
                              min_new_tokens=args.max_tokens, do_sample=False,
                              pad_token_id=hf.config.text_config.pad_token_id)
            tokens.append(out[0, enc["input_ids"].shape[1]:].tolist())
        return tokens

    def timed(fn, images: list) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        result = fn(images)
        return args.num / (time.perf_counter() - start), result

    warm = fresh_images(0)
    run_engine(warm), run_hf(warm)  # warm-up
    engine_rates, hf_rates = [], []
    agree = 0
    for round_ in range(1, args.repeats + 1):
        images = fresh_images(round_)
        rate, got = timed(run_engine, images)
        engine_rates.append(rate)
        rate, want = timed(run_hf, images)
        hf_rates.append(rate)
        agree = sum(g == w for g, w in zip(got, want))
    engine_rate, hf_rate = statistics.median(engine_rates), statistics.median(hf_rates)
    print(json.dumps({
        "prompts": args.num, "max_tokens": args.max_tokens, "dtype": args.dtype,
        "threads": threads, "load_avg": os.getloadavg()[0],
        "engine_prompts_per_s": round(engine_rate, 3), "hf_prompts_per_s": round(hf_rate, 3),
        "ratio": round(engine_rate / hf_rate, 2), "greedy_tokens_agree": f"{agree}/{args.num}",
    }, indent=1))


if __name__ == "__main__":
    main()
