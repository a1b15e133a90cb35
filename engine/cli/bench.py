"""`engine bench ...`: reproducible performance measurements (table on stdout, --json FILE).

With ``--speculative-config`` the report names the resolved config, and throughput and
latency add the measured rounds' acceptance figures (``results.spec_decoding`` in JSON).

Subcommands (a click group, so serving benchmarks join as further subcommands):

* ``throughput``  every prompt submitted at once through the offline API
* ``latency``     one request: time to first token and ms per output token
* ``prefix``      time to first token with a shared prompt prefix, caching on vs off
* ``profile``     where one decode step's time goes, stage by stage
* ``serve``       a running OpenAI-compatible server under load: TTFT, TPOT, ITL, E2E

Defaults reproduce the reference workload (64 prompts of 128 random token ids, 128
greedy output tokens, EOS ignored); every engine option keeps the engine's own default.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import click

from engine.cli.options import engine_args_from_options, engine_options


def _workload_options(
    num_prompts: int, input_len: int, output_len: int, repeats: bool = True
) -> Callable:
    options = [
        click.option("--num-prompts", type=int, default=num_prompts, show_default=True),
        click.option("--input-len", type=int, default=input_len, show_default=True,
                     help="Prompt length in token ids."),
        click.option("--output-len", type=int, default=output_len, show_default=True,
                     help="Output tokens per request."),
        click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True),
        click.option("--warmup", type=int, default=1, show_default=True,
                     help="Unmeasured rounds first."),
        *([click.option("--repeats", type=int, default=1, show_default=True,
                        help="Measured rounds (the median is reported).")] if repeats else []),
        click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                     help="Also write the results to this JSON file."),
    ]

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return engine_options(func)

    return decorate


_prompt_option = click.option(
    "--prompt", "prompt_text", default=None,
    help="A text prompt for every request instead of random token ids (--input-len is then "
         "ignored): text a speculative proposer can predict, e.g. 'Repeat this paragraph'.",
)


@click.group("bench")
def bench_cmd() -> None:
    """Measure throughput, latency, prefix caching and the decode step profile."""


def _make_llm(engine_kwargs: dict[str, Any], **overrides: Any):
    from engine import LLM

    return LLM(**{**engine_args_from_options(engine_kwargs), **overrides})


def _workload(engine_kwargs: dict[str, Any], num_prompts: int, input_len: int,
              output_len: int, ignore_eos: bool, prompt_text: str | None = None):
    from engine.benchmarks.workload import Workload

    return Workload(
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        ignore_eos=ignore_eos,
        vocab_high=_vocab_high(engine_kwargs),
        prompt=prompt_text,
    )


def _vocab_high(engine_kwargs: dict[str, Any]) -> int:
    """The prompt-id bound for the model, read from its config (no engine needed)."""
    from engine.benchmarks.workload import vocab_high_for
    from engine.core.engine_args import EngineArgs
    from engine.model_executor.model_loader import load_model_files

    args = EngineArgs.from_kwargs(**engine_args_from_options(engine_kwargs))
    path, _ = args.resolved_model_path()
    return vocab_high_for(load_model_files(path).hf_config.vocab_size)


def _emit(mode: str, llm_info: dict[str, Any], settings: dict[str, Any],
          results: dict[str, Any], rows: list[tuple[str, str]], json_path: str | None,
          env: dict[str, Any] | None = None) -> None:
    from engine.benchmarks.report import environment, format_table, speculative_text, write_json

    env = environment() if env is None else env
    speculative = ("speculative decoding", speculative_text(llm_info.get("speculative_config")))
    rows = rows + _runtime_row(llm_info) + _kv_cache_row(llm_info) + [
        speculative,
        ("threads / load avg", f"{env['torch_threads']} / {env['load_avg_1m']}"),
        ("memory read", f"{env['memory_read_gb_s']} GB/s"),
    ]
    click.echo(format_table(rows, f"engine bench {mode}: {llm_info['model']}"))
    if json_path:
        write_json(json_path, {"mode": mode, **llm_info, "settings": settings,
                               "results": results, "environment": env})


def _llm_info(llm, load_s: float) -> dict[str, Any]:
    """The model, its dtypes and what the executor runs it with (platform, ISA level,
    kernels), read from the in-process engine core."""
    config = llm.llm_engine.config
    spec = config.speculative
    info: dict[str, Any] = {"model": config.model.model, "dtype": config.model.dtype,
                            "load_s": round(load_s, 2),
                            "speculative_config": spec.model_dump() if spec else None}
    core = getattr(llm.llm_engine.client, "core", None)
    if core is not None:
        info["runtime"] = core.executor.runtime_info()
        info["activation_dtype"] = info["runtime"]["activation_dtype"]
        kv = core.scheduler.kv_cache_manager
        info["kv_cache"] = {"num_blocks": kv.num_blocks, "groups": kv.group_usage(),
                            **{k: v for k, v in info["runtime"].get("kv_cache", {}).items()
                               if k != "groups"}}
    return info


def _kv_cache_row(llm_info: dict[str, Any]) -> list[tuple[str, str]]:
    """The KV cache groups, the most blocks each held during the run, and what a block
    costs against one group for every layer (the memory the hybrid manager saves)."""
    kv = llm_info.get("kv_cache")
    if not kv:
        return []
    groups = ", ".join(f"{g['kind']} peak {g['peak']}" for g in kv["groups"])
    text = f"{kv['num_blocks']} blocks; {groups} blocks held"
    if kv.get("one_group_block_bytes") and kv["block_bytes"] != kv["one_group_block_bytes"]:
        text += (f"; a block stores {kv['layers_per_block']} of {kv['num_layers']} layers "
                 f"({kv['block_bytes']} of {kv['one_group_block_bytes']} bytes: "
                 f"{1 - kv['block_bytes'] / kv['one_group_block_bytes']:.0%} saved per block)")
    return [("KV cache", text)]


def _runtime_row(llm_info: dict[str, Any]) -> list[tuple[str, str]]:
    runtime = llm_info.get("runtime")
    if not runtime:
        return []
    level = runtime.get("isa_level")
    if level and runtime.get("stream_prefetch"):
        level += f", stream prefetch {runtime['stream_prefetch']}"
    if level and runtime.get("amx_min_rows"):
        level += f", AMX from {runtime['amx_min_rows']} rows"
    where = f"{runtime['platform']}" + (f" ({level})" if level else "")
    cpu = runtime.get("cpu_model")
    weights = (f"{runtime['quantization']} quantized" if runtime.get("quantization")
               else runtime["weight_dtype"])
    rows = [("runs on", f"{where}{f' on {cpu}' if cpu else ''}: {weights} weights "
                        f"({runtime['weights_mib']} MiB), {runtime['activation_dtype']} "
                        f"activations, {runtime.get('kv_cache_dtype', '?')} KV cache")]
    parallel = runtime.get("parallel")
    if parallel:
        rows.append(("ranks", f"tp {parallel['tensor_parallel_size']} x pp "
                              f"{parallel['pipeline_parallel_size']} ({parallel['executor']}), "
                              f"weights per rank {parallel['weights_mib_per_rank']} MiB"))
    layers = runtime.get("layer_kernels") or {}
    kernels = ", ".join(f"{kind}: {kernel}" for kind, kernel in layers.items())
    return [*rows, ("GEMMs", kernels or "-")]


def _timed_llm(engine_kwargs: dict[str, Any]):
    start = time.perf_counter()
    llm = _make_llm(engine_kwargs)
    return llm, time.perf_counter() - start


def _fail(exc: Exception):
    raise click.ClickException(str(exc)) from exc


@bench_cmd.command("throughput")
@_workload_options(num_prompts=64, input_len=128, output_len=128)
@_prompt_option
@click.option("--structured-output", type=click.Choice(["none", "json"]), default="none",
              show_default=True, help="json: constrain every request to a JSON schema.")
def throughput_cmd(num_prompts: int, input_len: int, output_len: int, ignore_eos: bool,
                   warmup: int, repeats: int, json_path: str | None, structured_output: str,
                   prompt_text: str | None, **engine_kwargs) -> None:
    """Offline throughput: every prompt submitted at once, output tokens per second."""
    from engine.benchmarks.offline import run_throughput
    from engine.benchmarks.report import runs_text, spec_decoding_rows

    try:
        llm, load_s = _timed_llm(engine_kwargs)
        workload = _workload(engine_kwargs, num_prompts, input_len, output_len, ignore_eos,
                             prompt_text)
        if structured_output != "none":
            workload = dataclasses.replace(workload, structured_output=structured_output)
        result = run_throughput(llm, workload, warmup=warmup, repeats=repeats).to_json()
    except (ValueError, FileNotFoundError) as exc:
        _fail(exc)
    _emit("throughput", _llm_info(llm, load_s), _settings(workload, warmup, repeats), result, [
        ("requests x (in, out)", f"{num_prompts} x ({input_len}, {output_len})"),
        ("structured output", structured_output),
        ("output tokens/s", runs_text(result["output_tok_s"], "tok/s")),
        ("total tokens/s", f"{result['total_tok_s']} tok/s"),
        ("wall", runs_text(result["elapsed_s"], "s")),
        ("engine load", f"{load_s:.2f} s"),
        *spec_decoding_rows(result.get("spec_decoding")),
    ], json_path)


@bench_cmd.command("latency")
@_workload_options(num_prompts=1, input_len=128, output_len=128)
@_prompt_option
def latency_cmd(num_prompts: int, input_len: int, output_len: int, ignore_eos: bool,
                warmup: int, repeats: int, json_path: str | None, prompt_text: str | None,
                **engine_kwargs) -> None:
    """Single-stream latency: TTFT and decode ms per output token of one request."""
    from engine.benchmarks.offline import run_latency
    from engine.benchmarks.report import runs_text, spec_decoding_rows

    if num_prompts != 1:
        raise click.BadParameter("latency runs one request at a time", param_hint="--num-prompts")
    try:
        llm, load_s = _timed_llm(engine_kwargs)
        workload = _workload(engine_kwargs, 1, input_len, output_len, ignore_eos, prompt_text)
        result = run_latency(llm, workload, warmup=warmup, repeats=repeats).to_json()
    except (ValueError, FileNotFoundError) as exc:
        _fail(exc)
    _emit("latency", _llm_info(llm, load_s), _settings(workload, warmup, repeats), result, [
        ("prompt / output tokens",
         f"{'text' if prompt_text else input_len} / {output_len}"),
        ("time to first token", runs_text(result["ttft_ms"], "ms")),
        ("decode", runs_text(result["decode_ms_per_token"], "ms/token")),
        ("end to end", runs_text(result["e2e_s"], "s")),
        *spec_decoding_rows(result.get("spec_decoding")),
    ], json_path)


@bench_cmd.command("prefix")
@_workload_options(num_prompts=1, input_len=1024, output_len=1)
@click.option("--prefix-len", type=int, default=960, show_default=True,
              help="Leading tokens the measured prompt shares with the earlier one.")
@click.option("--working-set", type=click.IntRange(min=0), default=0, show_default=True,
              help="Other prompts of --input-len run between the two: with a KV cache "
                   "smaller than them the prefix is evicted before the revisit (compare "
                   "with and without --kv-offloading-size).")
def prefix_cmd(num_prompts: int, input_len: int, output_len: int, ignore_eos: bool,
               warmup: int, repeats: int, json_path: str | None, prefix_len: int,
               working_set: int, **engine_kwargs) -> None:
    """Prefix caching: TTFT of a prompt sharing --prefix-len tokens, caching on vs off."""
    from engine.benchmarks.offline import run_prefix
    from engine.benchmarks.report import runs_text

    engine_kwargs.pop("enable_prefix_caching", None)  # the benchmark sets it both ways
    info: dict[str, Any] = {}

    def make_llm(caching: bool):
        start = time.perf_counter()
        # The offloading tier keeps prefix-cache blocks: the caching-off run has neither.
        kwargs = engine_kwargs if caching else {**engine_kwargs, "kv_offloading_size": None}
        llm = _make_llm(kwargs, enable_prefix_caching=caching)
        info.setdefault("llm", _llm_info(llm, time.perf_counter() - start))
        return llm

    try:
        result = run_prefix(
            make_llm, input_len=input_len, prefix_len=prefix_len,
            vocab_high=_vocab_high(engine_kwargs), warmup=warmup, repeats=repeats,
            working_set=working_set,
        ).to_json()
    except (ValueError, FileNotFoundError) as exc:
        _fail(exc)
    _emit("prefix", info["llm"], {"input_len": input_len, "prefix_len": prefix_len,
                           "warmup": warmup, "repeats": repeats,
                           "working_set": working_set}, result, [
        ("prompt / shared prefix", f"{input_len} / {prefix_len} tokens"),
        ("prompts between the two", str(working_set)),
        ("TTFT, caching on", runs_text(result["ttft_cached_ms"], "ms")),
        ("TTFT, caching off", runs_text(result["ttft_uncached_ms"], "ms")),
        ("speedup", f"{result['speedup']}x ({result['num_cached_tokens']} tokens cached)"),
    ], json_path)


@bench_cmd.command("profile")
@_workload_options(num_prompts=64, input_len=128, output_len=32, repeats=False)
@_prompt_option
@click.option("--steps", type=int, default=10, show_default=True,
              help="Decode steps to profile (the median per stage is reported).")
def profile_cmd(num_prompts: int, input_len: int, output_len: int, ignore_eos: bool,
                warmup: int, json_path: str | None, steps: int, prompt_text: str | None,
                **engine_kwargs) -> None:
    """Per-stage time of one decode step with --num-prompts requests running."""
    from engine.benchmarks.offline import run_throughput
    from engine.benchmarks.report import environment
    from engine.benchmarks.step_profile import STAGES, profile_decode_step

    try:
        llm, load_s = _timed_llm(engine_kwargs)
        workload = _workload(engine_kwargs, num_prompts, input_len, output_len, ignore_eos,
                             prompt_text)
        if warmup:
            run_throughput(llm, workload, warmup=0, repeats=warmup)
        env = environment()  # one bandwidth figure for the floor and the report
        result = profile_decode_step(llm, workload, num_steps=steps,
                                     read_gb_s=env["memory_read_gb_s"]).to_json()
    except (ValueError, FileNotFoundError) as exc:
        _fail(exc)
    step_ms = result["step_ms"]
    where = f"at {num_prompts} running requests, context ~{result['context_len']}"
    rows = [("decode step", f"{step_ms} ms {where}")]
    for stage in (*STAGES, "unaccounted"):
        ms = result["stage_ms"][stage]
        rows.append((f"  {stage}", f"{ms:8.3f} ms  {100 * ms / step_ms:5.1f}%"))
    rows.append(("schedule + prepare + sample", f"{100 * result['overhead_share']:.1f}% of the step"))
    floor = result.get("floor")
    if floor is not None:
        rows.append(("memory floor", (
            f"{floor['floor_ms']:.3f} ms: {floor['weight_bytes'] / 2**20:.1f} MiB of weights + "
            f"{floor['kv_bytes'] / 2**20:.1f} MiB of KV cache at {floor['read_gb_s']} GB/s; "
            f"the step takes {result['floor_ratio']:.2f}x")))
    _emit("profile", _llm_info(llm, load_s), _settings(workload, warmup, steps), result, rows,
          json_path, env)


def _settings(workload, warmup: int, repeats: int) -> dict[str, Any]:
    return {
        "num_prompts": workload.num_prompts,
        "input_len": workload.input_len,
        "output_len": workload.output_len,
        "ignore_eos": workload.ignore_eos,
        "warmup": warmup,
        "repeats": repeats,
    }


@bench_cmd.command("serve")
@click.option("--base-url", required=True,
              help="The OpenAI-compatible server, e.g. http://127.0.0.1:8000.")
@click.option("--model", default=None,
              help="Served model name  [default: the first one GET /v1/models lists]")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions",
              show_default=True, help="completions sends token ids; chat sends text.")
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--input-len", type=int, default=128, show_default=True,
              help="Prompt length in token ids.")
@click.option("--output-len", type=int, default=128, show_default=True,
              help="Output tokens per request (max_tokens).")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Sampling temperature of every request (0: greedy).")
@click.option("--request-rate", default="inf", show_default=True,
              help="Requests/s with Poisson arrivals (inf: all at once); a comma list sweeps.")
@click.option("--max-concurrency", default=None,
              help="Most requests in flight; a comma list sweeps  [default: no cap]")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the prompt draw (point i of a sweep: seed + i) and the arrival "
                   "times; give each run against one server its own seed (its prefix cache "
                   "keeps earlier prompts).")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=None,
              help="Local model/tokenizer dir: sets the id bound and decodes chat prompts.")
@click.option("--vocab-high", type=int, default=None,
              help="Exclusive bound of the prompt ids  [default: from --tokenizer, else 1000, "
                   "below every real vocabulary size]")
@click.option("--api-key", envvar=["ENGINE_API_KEY", "OPENAI_API_KEY"], default=None,
              help="Bearer key  [default: $ENGINE_API_KEY or $OPENAI_API_KEY]")
@click.option("--timeout", "timeout_s", type=float, default=3600.0, show_default=True,
              help="Seconds one request may take before it counts as failed.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write every sweep point to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of throughput and latency over the sweep (needs matplotlib).")
def serve_cmd(base_url: str, model: str | None, endpoint: str, num_prompts: int,
              input_len: int, output_len: int, ignore_eos: bool, temperature: float,
              request_rate: str,
              max_concurrency: str | None, seed: int, tokenizer: str | None,
              vocab_high: int | None, api_key: str | None, timeout_s: float,
              json_path: str | None, plot_path: str | None) -> None:
    """Serving benchmark: stream requests to a running server, TTFT / TPOT / ITL / E2E.

    Each request rate x max concurrency pair is one sweep point, run in turn against the
    same server. Failed requests are counted and their first errors kept; the exit status
    is 0 unless every request of the run failed (then 1, after the JSON is written).
    """
    from engine.benchmarks.report import environment, format_table, write_json
    from engine.benchmarks.serve import (
        ServerError,
        ServeSettings,
        parse_concurrencies,
        parse_rates,
        point_rows,
        run_serve_benchmark,
        serve_report,
    )
    from engine.benchmarks.serve_prompts import DEFAULT_VOCAB_HIGH, PromptSpec, load_vocab_high

    try:
        rates = parse_rates(request_rate)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--request-rate") from exc
    try:
        caps = parse_concurrencies(max_concurrency)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-concurrency") from exc
    if plot_path:
        from engine.benchmarks.serve_plot import plot_sweep, require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            _fail(exc)
    try:
        if vocab_high is None:
            vocab_high = load_vocab_high(tokenizer) if tokenizer else DEFAULT_VOCAB_HIGH
        spec = PromptSpec(endpoint=endpoint, num_prompts=num_prompts, input_len=input_len,
                          output_len=output_len, ignore_eos=ignore_eos, seed=seed,
                          vocab_high=vocab_high, temperature=temperature)
        spec.workload()  # validates the sizes before the server is contacted
        settings = ServeSettings(base_url=base_url, spec=spec, rates=tuple(rates),
                                 concurrencies=tuple(caps), model=model, api_key=api_key,
                                 tokenizer=tokenizer, timeout_s=timeout_s)
    except ValueError as exc:
        _fail(exc)

    def show(served_model: str, point) -> None:
        title = f"engine bench serve: {served_model} ({endpoint}), {point.point.label()}"
        click.echo(format_table(point_rows(point), title) + "\n")

    try:
        result = run_serve_benchmark(settings, on_point=show)
    except (ServerError, ValueError) as exc:
        _fail(exc)
    if json_path:
        write_json(json_path, serve_report(settings, result, environment()))
    if plot_path:
        plot_sweep(result.points, plot_path, f"engine bench serve: {result.model} ({endpoint}, "
                   f"{num_prompts} x ({input_len}, {output_len}))")
    if result.all_failed:
        first = next((e for p in result.points for e in p.metrics["errors"]), "no error text")
        raise click.ClickException(f"every request failed; the first error: {first}")
