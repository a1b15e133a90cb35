"""Multi-LoRA throughput: requests spread over several adapters vs the same requests on
the base model, one engine, one run (issue 34's figure).

The base is the embedded demo model (a 7-layer Llama, bf16); the adapters are PEFT
LoRAs of rank ``--rank`` on every projection (q, k, v, o, gate, up, down) with random
A and B, made here with peft. Each round runs the same prompts three ways in one
engine started with ``enable_lora`` (``--max-loras`` slots):

- ``base``: no adapter;
- ``lora``: request ``i`` under adapter ``i % --adapters``;
- ``lora1``: every request under one adapter (the kernels' cost without slot mixing).

The rounds alternate and the best of ``--repeat`` is kept for each. The LoRA share of
a step is ``1 - base / lora`` of the times. Also an engine without ``enable_lora``
runs the base once, to show what enabling LoRA costs requests that use none.

    python ci/bench_lora.py --requests 64 --adapters 8 --max-loras 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def make_adapters(base_dir: str, out: Path, count: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = []
    for i in range(count):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        model = get_peft_model(base, config)
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        path = out / f"adapter{i}"
        model.save_pretrained(path)
        dirs.append(path)
    return dirs


def timed(llm, prompts, params, loras) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from engine import LLM, LoRARequest, SamplingParams
    from engine.assets import demo_model_path
    from engine.plugins.cpu.kernel_build import cpu_model_name, select_level

    base_dir = demo_model_path()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 4000, (args.prompt_len,),
                                                  generator=gen).tolist()}
               for _ in range(args.requests)]
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_adapters(base_dir, Path(tmp), args.adapters, args.rank)
        loras = [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
        mixed = [loras[i % len(loras)] for i in range(args.requests)]
        one = [loras[0]] * args.requests
        llm = LLM(dtype=args.dtype, enable_lora=True, max_loras=args.max_loras,
                  max_lora_rank=args.rank, enable_prefix_caching=False)
        for lora in loras:
            llm.add_lora(lora)
        timed(llm, prompts[:8], params, mixed[:8])  # warm-up: graphs, slots
        best = {"base": float("inf"), "lora": float("inf"), "lora1": float("inf")}
        tokens = 0
        for _ in range(args.repeat):
            for name, request in (("base", None), ("lora", mixed), ("lora1", one)):
                seconds, tokens = timed(llm, prompts, params, request)
                best[name] = min(best[name], seconds)
        llm.shutdown()
        del llm
        plain = LLM(dtype=args.dtype, enable_prefix_caching=False)
        timed(plain, prompts[:8], params, None)
        best["no_lora_engine"] = min(timed(plain, prompts, params, None)[0]
                                     for _ in range(args.repeat))
        plain.shutdown()
    for name, seconds in best.items():
        results[f"{name}_tok_s"] = round(tokens / seconds, 1)
    results["lora_vs_base"] = round(best["base"] / best["lora"], 3)
    results["lora1_vs_base"] = round(best["base"] / best["lora1"], 3)
    results["lora_share_of_step"] = round(1 - best["base"] / best["lora"], 3)
    results["enable_lora_cost_on_base"] = round(best["no_lora_engine"] / best["base"], 3)
    print(json.dumps({"cpu": cpu_model_name(), "isa": select_level().name, "requests": args.requests,
                      "adapters": args.adapters, "max_loras": args.max_loras,
                      "rank": args.rank, **results}, indent=1))


if __name__ == "__main__":
    main()
