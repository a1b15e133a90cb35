"""`engine chat`: an interactive terminal chat through the model's chat template."""

from __future__ import annotations

import click

from engine.cli.options import engine_args_from_options, engine_options

_HELP = "Type a message and press Enter. Commands: /reset clears the history, /exit quits."


@click.command("chat")
@engine_options
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.7, show_default=True)
@click.option("--top-p", type=float, default=0.95, show_default=True)
@click.option("--seed", "sample_seed", type=int, default=None)
def chat_cmd(system: str | None, max_tokens: int, temperature: float, top_p: float,
             sample_seed: int | None, **engine_kwargs) -> None:
    """Chat with a model (the demo model when no --model is given), streaming replies."""
    from engine import LLM, SamplingParams
    from engine.core.sampling_params import RequestOutputKind

    try:
        llm = LLM(**engine_args_from_options(engine_kwargs))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=sample_seed, output_kind=RequestOutputKind.DELTA)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    engine = llm.llm_engine
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    click.echo(_HELP)
    while True:
        try:
            line = click.prompt("you", prompt_suffix="> ", default="", show_default=False)
        except (EOFError, click.Abort):
            click.echo()
            return
        text = line.strip()
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history = history[:1] if system else []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        try:
            prompt = engine.processor.apply_chat_template(history, add_generation_prompt=True)
            request_id = engine.next_request_id()
            engine.add_request(request_id, prompt, params, add_special_tokens=False)
        except ValueError as exc:
            history.pop()
            click.echo(f"error: {exc}", err=True)
            continue
        reply = []
        click.echo("assistant> ", nl=False)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    delta = output.outputs[0].text
                    reply.append(delta)
                    click.echo(delta, nl=False)
        except KeyboardInterrupt:
            engine.abort_request([request_id])
        click.echo()
        history.append({"role": "assistant", "content": "".join(reply)})
