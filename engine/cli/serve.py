"""`engine serve [MODEL]`: the OpenAI-compatible HTTP server (vLLM's flag names)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import click

from engine.cli.options import engine_args_from_options, engine_options
from engine.structured_output.reasoning import reasoning_parser_names
from engine.structured_output.tool_calls import tool_parser_names


def _check_tool_call_parser(value: str) -> str:
    """Any parser a plugin registers (the built-ins included); the error lists them."""
    names = tool_parser_names()
    if value not in names:
        raise click.BadParameter(f"{value!r} is not a registered tool-call parser; "
                                 f"registered: {', '.join(names)}")
    return value


class _LoRAModulesOption(click.Option):
    """``--lora-modules`` as vLLM's ``nargs='+'``: one flag takes every following
    argument up to the next option (``--lora-modules a=/p b=/q``); the flag may also be
    repeated. Values are collected in order (``multiple``)."""

    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = parser._long_opt.get(name) or parser._short_opt.get(name)
            if option is None:
                continue
            process = option.process

            def greedy(value: Any, state: Any, process: Any = process) -> None:
                process(value, state)
                while state.rargs and not state.rargs[0].startswith("-"):
                    process(state.rargs.pop(0), state)

            option.process = greedy


def _lora_settings(lora_modules: tuple[str, ...], allow_runtime_lora_updating: bool,
                   engine_kwargs: dict[str, Any]) -> tuple[list[Any], bool]:
    """The parsed ``--lora-modules`` and whether runtime updating is on (the flag or
    vLLM's environment variable); usage errors for what cannot work."""
    from engine.entrypoints.openai.serving_lora import (
        parse_lora_modules,
        runtime_updating_from_env,
    )

    try:
        modules = parse_lora_modules(lora_modules)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (give MODEL before --lora-modules: the option "
                                 "takes every argument that follows it)",
                                 param_hint="'--lora-modules'") from exc
    enabled = bool(engine_kwargs.get("enable_lora"))
    if modules and not enabled:
        raise click.UsageError("--lora-modules needs --enable-lora")
    if allow_runtime_lora_updating and not enabled:
        raise click.UsageError("--allow-runtime-lora-updating needs --enable-lora")
    return modules, allow_runtime_lora_updating or runtime_updating_from_env()


@click.command("serve")
@click.argument("model_arg", metavar="[MODEL]", required=False)
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="ENGINE_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize.")
@click.option("--served-model-name", default=None,
              help="The model name clients send and see (default: MODEL, or engine-demo).")
@click.option("--max-request-body-bytes", type=click.IntRange(min=1), default=8 * 1024 * 1024,
              show_default=True, help="Larger request bodies get a 413.")
@click.option("--max-request-json-depth", type=click.IntRange(min=1), default=64,
              show_default=True, help="Request bodies nested deeper get a 400.")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=None,
              help="Reject requests asking for more max_tokens (default: no limit beyond "
                   "max_model_len).")
@click.option("--max-logprobs", type=click.IntRange(min=0), default=20, show_default=True,
              help="Largest logprobs / top_logprobs / prompt_logprobs a request may ask for.")
@click.option("--tool-call-parser", default="hermes", show_default=True,
              callback=lambda ctx, param, value: _check_tool_call_parser(value),
              help="How tool calls are read from model text (tool_choice 'auto'): hermes, "
                   "llama3_json, mistral, pythonic, qwen3_coder, granite, deepseek_v3, openai, "
                   "or a name a plugin registers.")
@click.option("--reasoning-parser", type=click.Choice(reasoning_parser_names()), default=None,
              help="Split a reasoning model's chat output into reasoning_content and "
                   "content; structured outputs and tool calls then apply to the content.")
@click.option("--timeout-graceful-shutdown", type=click.IntRange(min=0), default=10,
              show_default=True,
              help="Seconds in-flight requests may keep running after SIGTERM / SIGINT.")
@click.option("--restart-engine-core", type=click.IntRange(min=0), default=0, show_default=True,
              help="When the engine-core process dies, start a fresh one up to N times "
                   "(in-flight requests get errors; new ones are served again). After that "
                   "(or with 0) the server exits with code 1, as vLLM's does.")
@click.option("--keep-alive-on-engine-death", is_flag=True,
              envvar="ENGINE_KEEP_ALIVE_ON_ENGINE_DEATH", show_envvar=True,
              help="Once the engine core is dead for good, keep the server up answering "
                   "503 instead of exiting.")
@click.option("--max-num-waiting", type=click.IntRange(min=0), default=None,
              help="At most max_num_seqs + N generation requests are admitted at once; "
                   "more get a 429 with Retry-After (default: no limit).")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds a generation request may take before its work is aborted and it "
                   "gets a 408; a request's x-request-timeout header overrides it (default: "
                   "none).")
@click.option("--max-stored-responses", type=click.IntRange(min=0), default=1000,
              show_default=True,
              help="/v1/responses: how many stored responses (store: true, the default) are "
                   "kept in memory for previous_response_id and GET /v1/responses/{id}; the "
                   "least recently used is dropped first (0: none are kept).")
@click.option("--lora-modules", "lora_modules", cls=_LoRAModulesOption, multiple=True,
              metavar="NAME=PATH|JSON ...",
              help="LoRA adapters served under their own model names (needs --enable-lora): "
                   "name=path, or JSON '{\"name\": ..., \"path\": ..., "
                   "\"base_model_name\": ...}'; several after one flag and/or the flag "
                   "repeated, as vLLM's.")
@click.option("--allow-runtime-lora-updating", is_flag=True,
              help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on "
                   "with VLLM_ALLOW_RUNTIME_LORA_UPDATING or "
                   "ENGINE_ALLOW_RUNTIME_LORA_UPDATING set to 1 / true).")
@click.option("--api-server-count", type=click.IntRange(min=1), default=1, show_default=True,
              help="API server processes sharing the port (and every engine core), so "
                   "tokenization, detokenization and HTTP use K processes; 1: one process "
                   "serves (and owns the cores).")
@click.option("--api-server-on-failure", type=click.Choice(["exit", "continue"]),
              default="exit", show_default=True,
              help="With --api-server-count > 1, when an API server process dies: 'exit' "
                   "stops the whole server (non-zero exit code, as vLLM); 'continue' lets "
                   "the others serve on (the cores abort the dead one's requests).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@click.option("--disable-uvicorn-access-log", is_flag=True, help="No per-request log lines.")
def serve_cmd(model_arg: str | None, host: str, port: int, api_key: str | None,
              served_model_name: str | None, max_request_body_bytes: int,
              max_request_json_depth: int,
              max_tokens_limit: int | None, max_logprobs: int, tool_call_parser: str,
              reasoning_parser: str | None,
              timeout_graceful_shutdown: int, restart_engine_core: int,
              keep_alive_on_engine_death: bool, max_num_waiting: int | None,
              request_timeout: float | None, max_stored_responses: int,
              lora_modules: tuple[str, ...], allow_runtime_lora_updating: bool,
              api_server_count: int, api_server_on_failure: str,
              log_level: str, disable_uvicorn_access_log: bool, **engine_kwargs) -> None:
    """Serve MODEL (a Hugging Face model directory; the demo model when omitted) over an
    OpenAI-compatible HTTP API."""
    from engine.core.engine_args import EngineArgs
    from engine.core.errors import EngineStartupError
    from engine.entrypoints.async_llm import AsyncLLM
    from engine.entrypoints.openai import ServerSettings, run_server

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_option = engine_kwargs.get("model")
    if model_arg and model_option and model_arg != model_option:
        raise click.UsageError(f"MODEL {model_arg!r} and --model {model_option!r} differ; "
                               "give one of them")
    engine_kwargs["model"] = model_arg or model_option
    if engine_kwargs.get("headless"):
        _serve_headless(engine_kwargs, api_server_count)
        return
    _check_multi_node(engine_kwargs, api_server_count, restart_engine_core)
    modules, runtime_lora = _lora_settings(lora_modules, allow_runtime_lora_updating,
                                           engine_kwargs)
    if api_server_count > 1:
        if modules:
            raise click.UsageError("--lora-modules with --api-server-count > 1 is not "
                                   "supported yet (load adapters at runtime instead)")
        if restart_engine_core:
            raise click.UsageError("--restart-engine-core with --api-server-count > 1 is not "
                                   "supported: the cores belong to the launcher")
    try:
        args = EngineArgs.from_kwargs(**engine_args_from_options(engine_kwargs),
                                      served_model_name=served_model_name,
                                      reasoning_parser=reasoning_parser,
                                      usage_context="api_server")
        if api_server_count > 1:
            config = args.create_engine_config()
        else:
            engine = AsyncLLM.from_engine_args(args)
    except (ValueError, FileNotFoundError, EngineStartupError) as exc:
        raise click.ClickException(str(exc)) from exc
    if api_server_count > 1:
        _serve_group(config, api_server_count, api_server_on_failure,
                     log_level=log_level, access_log=not disable_uvicorn_access_log,
                     timeout_graceful_shutdown=timeout_graceful_shutdown,
                     settings=ServerSettings(
                         served_model_name=(served_model_name or config.model.served_model_name
                                            or config.model.model),
                         api_key=api_key or None,
                         max_request_body_bytes=max_request_body_bytes,
                         max_tokens_limit=max_tokens_limit,
                         max_request_json_depth=max_request_json_depth,
                         max_logprobs=max_logprobs, tool_call_parser=tool_call_parser,
                         reasoning_parser=(reasoning_parser
                                           or config.structured_outputs.reasoning_parser),
                         host=host, port=port, restart_engine_core=0,
                         exit_on_engine_death=not keep_alive_on_engine_death,
                         max_num_waiting=max_num_waiting, request_timeout=request_timeout,
                         max_stored_responses=max_stored_responses,
                         allow_runtime_lora_updating=runtime_lora))
        return
    loras = _load_lora_modules(engine, modules, served_model_name)
    settings = ServerSettings(
        served_model_name=engine.model_name, api_key=api_key or None,
        max_request_body_bytes=max_request_body_bytes, max_tokens_limit=max_tokens_limit,
        max_request_json_depth=max_request_json_depth,
        max_logprobs=max_logprobs, tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser or engine.config.structured_outputs.reasoning_parser,
        host=host, port=port,
        restart_engine_core=restart_engine_core,
        exit_on_engine_death=not keep_alive_on_engine_death,
        max_num_waiting=max_num_waiting, request_timeout=request_timeout,
        max_stored_responses=max_stored_responses,
        lora_modules=loras, allow_runtime_lora_updating=runtime_lora,
    )
    try:
        exit_code = run_server(engine, settings, log_level=log_level,
                               access_log=not disable_uvicorn_access_log,
                               timeout_graceful_shutdown=timeout_graceful_shutdown)
    finally:
        engine.shutdown()
    if exit_code:
        logging.getLogger("engine.server").error("Exiting with code %d (the engine core died)",
                                                 exit_code)
        raise SystemExit(exit_code)


def _check_multi_node(engine_kwargs: dict[str, Any], api_server_count: int,
                      restart_engine_core: int) -> None:
    """A head with ranks on other nodes: what its server cannot combine with yet."""
    size = engine_kwargs.get("data_parallel_size") or 1
    size_local = engine_kwargs.get("data_parallel_size_local")
    ray = engine_kwargs.get("data_parallel_backend") == "ray"
    if size == 1 or not (ray or (size_local is not None and size_local < size)):
        return
    if api_server_count > 1:
        raise click.UsageError("--api-server-count > 1 with data-parallel ranks on other "
                               "nodes is not supported yet (its launcher starts every rank "
                               "locally)")
    if restart_engine_core and not ray:
        raise click.UsageError("--restart-engine-core with --headless nodes is not "
                               "supported: the nodes stop when the head's ranks go")


def _serve_headless(engine_kwargs: dict[str, Any], api_server_count: int) -> None:
    """``--headless``: this node's data-parallel ranks for the head at
    --data-parallel-address (no API server; the head sends the engine config)."""
    from engine.core.dp_headless import run_node
    from engine.core.dp_placement import check_placement
    from engine.core.errors import EngineStartupError

    if api_server_count > 1:
        raise click.UsageError("--headless runs no API server: drop --api-server-count")
    size = engine_kwargs.get("data_parallel_size") or 1
    size_local = engine_kwargs.get("data_parallel_size_local")
    start_rank = engine_kwargs.get("data_parallel_start_rank") or 0
    try:
        check_placement(size, size_local, start_rank,
                        engine_kwargs.get("data_parallel_address"),
                        engine_kwargs.get("data_parallel_backend") or "mp", headless=True)
        exit_code = run_node(engine_kwargs["data_parallel_address"],
                             engine_kwargs["data_parallel_rpc_port"], size, start_rank,
                             size_local)
    except (ValueError, EngineStartupError) as exc:
        raise click.ClickException(str(exc)) from exc
    if exit_code:
        raise SystemExit(exit_code)


def _serve_group(config: Any, count: int, on_failure: str, *, settings: Any, log_level: str,
                 access_log: bool, timeout_graceful_shutdown: int) -> None:
    """``--api-server-count K`` (K > 1): the launcher of K API server processes."""
    from engine.entrypoints.openai.api_server_group import run_api_server_group

    try:
        exit_code = run_api_server_group(config, settings, count, on_failure=on_failure,
                                         log_level=log_level, access_log=access_log,
                                         timeout_graceful_shutdown=timeout_graceful_shutdown)
    except OSError as exc:  # e.g. the port is taken
        raise click.ClickException(f"cannot serve on {settings.host}:{settings.port}: {exc}"
                                   ) from exc
    if exit_code:
        logging.getLogger("engine.server").error("Exiting with code %d", exit_code)
        raise SystemExit(exit_code)


def _load_lora_modules(engine: Any, modules: list[Any], served_model_name: str | None
                       ) -> list[Any]:
    """Give each ``--lora-modules`` adapter its id and load it into the engine before the
    server listens; a bad adapter stops the startup with the engine's reason."""
    from engine.entrypoints.openai.serving_lora import load_lora_modules, lora_requests_for

    if not modules:
        return []
    base_name = served_model_name or engine.model_name
    if any(module.name == base_name for module in modules):
        engine.shutdown()
        raise click.BadParameter(f"an adapter may not be named {base_name!r}: that is the "
                                 "base model's served name", param_hint="'--lora-modules'")
    requests = lora_requests_for(modules, base_model_name=base_name)
    try:
        asyncio.run(load_lora_modules(engine, requests))
    except Exception as exc:
        engine.shutdown()
        if isinstance(exc, (ValueError, FileNotFoundError)):
            raise click.ClickException(f"--lora-modules: {exc}") from exc
        raise
    return requests
