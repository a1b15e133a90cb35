"""`engine generate PROMPT...`: complete prompts from the command line."""

from __future__ import annotations

import json
import sys
import time

import click

from engine.cli.options import engine_options, engine_args_from_options


@click.command("generate")
@click.argument("prompts", nargs=-1, required=True)
@engine_options
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 means greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables.")
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", "sample_seed", type=int, default=None, help="Per-request sampling seed.")
@click.option("--n", type=int, default=1, show_default=True, help="Samples per prompt.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def generate_cmd(prompts: tuple[str, ...], max_tokens: int, temperature: float, top_p: float,
                 top_k: int, min_p: float, repetition_penalty: float, sample_seed: int | None,
                 n: int, stop: tuple[str, ...], ignore_eos: bool, as_json: bool,
                 **engine_kwargs) -> None:
    """Generate completions for PROMPTS (the demo model when no --model is given)."""
    from engine import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, repetition_penalty=repetition_penalty, seed=sample_seed, n=n,
            stop=list(stop) or None, ignore_eos=ignore_eos,
        )
        start = time.perf_counter()
        llm = LLM(**engine_args_from_options(engine_kwargs))
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc

    if as_json:
        records = [
            {
                "prompt": out.prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "outputs": [
                    {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                     "finish_reason": c.finish_reason}
                    for c in out.outputs
                ],
            }
            for out in outputs
        ]
        json.dump({"model": llm.engine_args.resolved_model_path()[1], "results": records,
                   "elapsed_s": round(elapsed, 3)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    for out in outputs:
        for c in out.outputs:
            click.echo(f"{out.prompt}{c.text}")
            if len(out.outputs) > 1 or len(outputs) > 1:
                click.echo("---")
