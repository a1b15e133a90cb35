"""Engine options shared by every command that builds an engine (vLLM's flag names)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from engine.core.dp_placement import DEFAULT_RPC_PORT


def _max_model_len_option(ctx: click.Context | None, param: click.Parameter | None,
                          value: str | None) -> int | str | None:
    """``--max-model-len N|auto|-1``: an int, or "auto"."""
    from engine.core.engine_args import parse_max_model_len

    try:
        length, auto = parse_max_model_len(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return "auto" if auto else length


def _kv_cache_memory_option(ctx: click.Context | None, param: click.Parameter | None,
                            value: str | None) -> int | None:
    """``--kv-cache-memory BYTES`` (with an optional unit: 4GiB, 512M)."""
    from engine.core.engine_args import parse_memory_bytes

    try:
        return parse_memory_bytes(value, "--kv-cache-memory")
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def parse_speculative_config(
    ctx: click.Context | None, param: click.Parameter | None, value: str | None
) -> dict[str, Any] | None:
    """``--speculative-config`` text -> the dict EngineArgs takes; a typo is a usage error
    now, not a stack trace after the model has loaded."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}): {value!r}", ctx, param) from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(
            f"must be a JSON object such as '{{\"method\": \"ngram\", "
            f"\"num_speculative_tokens\": 3}}', got {type(parsed).__name__}: {value!r}",
            ctx, param,
        )
    return parsed


def _checked_json_config(config_cls_name: str) -> Callable[..., dict[str, Any] | None]:
    """A click callback: the option's JSON text -> the dict EngineArgs takes, checked by
    ``engine.core.config.<config_cls_name>.from_value`` now (a usage error, not a stack
    trace after the model has loaded)."""

    def parse(ctx: click.Context | None, param: click.Parameter | None, value: str | None
              ) -> dict[str, Any] | None:
        if value is None:
            return None
        from engine.core import config

        try:
            parsed = json.loads(value)
            getattr(config, config_cls_name).from_value(parsed)
        except ValueError as exc:
            raise click.BadParameter(f"{exc}: {value!r}", ctx, param) from None
        return parsed

    return parse


def parse_limit_mm_per_prompt(ctx: click.Context | None, param: click.Parameter | None,
                              value: str | None) -> dict[str, int] | None:
    """``--limit-mm-per-prompt '{"image": 2, "video": 1}'`` -> the dict EngineArgs takes."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}): {value!r}", ctx, param) from None
    if not isinstance(parsed, dict) or not all(
            key in ("image", "video") and isinstance(n, int) and not isinstance(n, bool)
            and n >= 0 for key, n in parsed.items()):
        raise click.BadParameter("must be a JSON object of modality (image, video) -> "
                                 f"count >= 0, e.g. '{{\"image\": 2}}'; got {value!r}",
                                 ctx, param)
    return parsed


def _domains_option(ctx: click.Context | None, param: click.Parameter | None,
                    value: tuple[str, ...]) -> list[str] | None:
    """``--allowed-media-domains a.com b.org`` (or comma separated) -> a list, or None
    when not given (any domain)."""
    domains = [d.strip() for item in value for d in item.split(",") if d.strip()]
    return domains or None


class GreedyMultipleOption(click.Option):
    """A ``multiple`` option that, like argparse's ``nargs='+'``, takes every following
    argument up to the next option (``--allowed-media-domains a.com b.org``)."""

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


parse_structured_outputs_config = _checked_json_config("StructuredOutputsConfig")
parse_kv_transfer_config = _checked_json_config("KVTransferConfig")


_ENGINE_OPTIONS: list[Callable[[Callable], Callable]] = [
    click.option("--model", default=None, help="HF model directory (default: the demo model)."),
    click.option("--tokenizer", default=None, help="Tokenizer directory (default: the model's)."),
    click.option("--device", default="auto", show_default=True,
                 help="Platform name (see `engine plugins`) or auto."),
    click.option("--dtype", default="auto", show_default=True,
                 type=click.Choice(["auto", "float32", "bfloat16", "float16", "float", "half"])),
    click.option("--max-model-len", default=None, callback=_max_model_len_option,
                 help="Tokens per request (prompt and output): N, or auto / -1 for the "
                      "largest length the KV cache fits (default: the model's limit)."),
    click.option("--max-num-seqs", type=int, default=256, show_default=True),
    click.option("--max-num-batched-tokens", type=int, default=None),
    click.option("--block-size", type=int, default=16, show_default=True),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True,
                 show_default=True),
    click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=True,
                 show_default=True),
    click.option("--disable-hybrid-kv-cache-manager", is_flag=True, default=False,
                 help="One KV cache group for every layer: sliding-window and chunked-local "
                      "layers then keep every block instead of only their window."),
    click.option("--kv-cache-space", "cpu_kvcache_space_gib", type=float, default=None,
                 help="CPU KV cache size in GiB (env ENGINE_CPU_KVCACHE_SPACE; default 4)."),
    click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
                 default="auto", show_default=True,
                 help="What the KV cache stores: auto (the model dtype) or fp8 (= fp8_e4m3) / "
                      "fp8_e5m2, one byte per value with the checkpoint's per-layer "
                      "k_scale / v_scale (else 1.0): twice the blocks in the same memory."),
    click.option("--gpu-memory-utilization", type=click.FloatRange(0.0, 1.0, min_open=True),
                 default=None,
                 help="Share of the device's memory for weights, activations and KV cache "
                      "(default 0.9 on GPUs; on the CPU, when given, the KV cache takes "
                      "this share of RAM less weights and profiled activations)."),
    click.option("--kv-cache-memory", "kv_cache_memory_bytes", default=None,
                 callback=_kv_cache_memory_option,
                 help="KV cache size per rank in bytes, on any platform (e.g. 4GiB, "
                      "512MiB, 1000000000); wins over --gpu-memory-utilization and "
                      "--kv-cache-space."),
    click.option("--attention-backend", default=None,
                 help="Attention backend name (env ENGINE_ATTENTION_BACKEND)."),
    click.option("--num-threads", type=int, default=None, help="Host threads (CPU)."),
    click.option("--engine-seed", "seed", type=int, default=0, show_default=True,
                 help="Seed of the engine's global RNGs."),
    click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default="fcfs",
                 show_default=True),
    click.option("--tensor-parallel-size", "-tp", "tensor_parallel_size", type=click.IntRange(1),
                 default=1, show_default=True,
                 help="Ranks each layer's heads and matrices are split over."),
    click.option("--pipeline-parallel-size", "-pp", "pipeline_parallel_size",
                 type=click.IntRange(1), default=1, show_default=True,
                 help="Pipeline stages the layers are split into."),
    click.option("--distributed-executor-backend", type=click.Choice(["mp", "ray", "uni"]),
                 default=None,
                 help="How ranks run: mp (local processes; the default for more than one "
                      "rank), ray (actors on a Ray cluster: RAY_ADDRESS or `ray start`), "
                      "uni (one rank, in process)."),
    click.option("--data-parallel-size", "-dp", "data_parallel_size", type=click.IntRange(1),
                 default=1, show_default=True,
                 help="Engine cores, each a whole replica (its own scheduler, KV cache and "
                      "TP x PP ranks), behind one front end that routes each request to a "
                      "core by load and shared prompt prefix."),
    click.option("--data-parallel-size-local", "data_parallel_size_local",
                 type=click.IntRange(1), default=None,
                 help="Data-parallel ranks on this node (default: all of them); fewer "
                      "on the head means the rest come from --headless nodes."),
    click.option("--data-parallel-backend", "data_parallel_backend",
                 type=click.Choice(["mp", "ray"]), default="mp", show_default=True,
                 help="How data-parallel ranks start: mp (processes on each node: this "
                      "head, and --headless nodes) or ray (Ray places one core per rank "
                      "on the cluster at RAY_ADDRESS / `ray start`)."),
    click.option("--data-parallel-address", "data_parallel_address", default=None,
                 help="Multi-node: the head node's address, reachable from every node."),
    click.option("--data-parallel-rpc-port", "data_parallel_rpc_port",
                 type=click.IntRange(1, 65535), default=DEFAULT_RPC_PORT, show_default=True,
                 help="Multi-node: the head's port where other nodes register."),
    click.option("--data-parallel-start-rank", "data_parallel_start_rank",
                 type=click.IntRange(0), default=0, show_default=True,
                 help="A --headless node's first data-parallel rank."),
    click.option("--headless", "headless", is_flag=True, default=False,
                 help="Run this node's data-parallel ranks for a head node elsewhere (no "
                      "API server); needs --data-parallel-address."),
    click.option("--data-parallel-on-rank-failure", "data_parallel_on_rank_failure",
                 type=click.Choice(["exit", "continue"]), default="exit", show_default=True,
                 help="When one data-parallel rank dies: exit (the engine fails and the "
                      "server exits, as vLLM's) or continue (that rank's in-flight requests "
                      "fail; the other ranks keep serving new ones)."),
    click.option("--enable-expert-parallel", is_flag=True, default=False,
                 help="MoE models: place whole experts across the tensor-parallel ranks "
                      "(tokens go to their experts' ranks by all-to-all) instead of "
                      "splitting every expert."),
    click.option("--kv-transfer-config", "kv_transfer_config", default=None,
                 callback=parse_kv_transfer_config, metavar="JSON",
                 help="A KV connector as a JSON object (vLLM's), e.g. '{\"kv_connector\": "
                      "\"NixlConnector\", \"kv_role\": \"kv_producer\"}' or "
                      "'{\"kv_connector\": \"SharedStorageConnector\", \"kv_role\": "
                      "\"kv_both\", \"kv_connector_extra_config\": "
                      "{\"shared_storage_path\": DIR}}'."),
    click.option("--kv-offloading-size", "kv_offloading_size", type=float, default=None,
                 metavar="GiB",
                 help="A second KV tier of this many GiB of host memory (vLLM's "
                      "OffloadingConnector): prefix blocks evicted from the KV cache are "
                      "kept there and loaded back on a later hit instead of recomputed; "
                      "with --kv-transfer-config both run (a MultiConnector)."),
    click.option("--kv-offloading-backend", "kv_offloading_backend",
                 type=click.Choice(["native"]), default="native",
                 help="The KV offloading tier's implementation (vLLM's flag; 'native': "
                      "the engine's OffloadingConnector)."),
    click.option("--enforce-eager", is_flag=True, default=False,
                 help="Run every step eagerly (no forward graphs for decode steps)."),
    click.option("--enable-sleep-mode", is_flag=True, default=False,
                 help="Allow sleep / wake_up (POST /sleep, /wake_up): free the KV cache "
                      "(level 1) and the weights (level 2) between RL training phases."),
    click.option("--enable-weight-updates", is_flag=True, default=False,
                 help="Serve POST /update_weights, /init_weight_update_group and "
                      "/update_weights_from_distributed: load new weights from a directory "
                      "or a trainer's broadcast (RL training loops)."),
    click.option("--batch-invariant", is_flag=True, default=False,
                 help="Batch-invariant kernels: a request's tokens and logprobs are bitwise "
                      "equal alone or in any batch, chunked or speculated (RL rollouts); "
                      "also $ENGINE_BATCH_INVARIANT=1."),
    click.option("--quantization", "-q", default=None,
                 help="Quantization method (vLLM's names: compressed-tensors, gptq, awq, fp8, "
                      "gptq_marlin, ...); default: the checkpoint's. fp8 of an unquantized "
                      "checkpoint quantizes it at load."),
    click.option("--generation-config", default="auto", show_default=True,
                 help="Sampling defaults: 'auto' (the model's generation_config.json), "
                      "'vllm' (none) or a directory holding a generation_config.json."),
    click.option("--speculative-config", "speculative_config", default=None,
                 callback=parse_speculative_config, metavar="JSON",
                 help="Speculative decoding as a JSON object (vLLM's), e.g. "
                      "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' or "
                      "'{\"model\": DRAFT_DIR, \"num_speculative_tokens\": 4}'; default: off."),
    click.option("--structured-outputs-config", "structured_outputs_config", default=None,
                 callback=parse_structured_outputs_config, metavar="JSON",
                 help="Structured-output defaults for every request as a JSON object "
                      "(vLLM's), e.g. '{\"backend\": \"xgrammar\", "
                      "\"disable_any_whitespace\": true}'; keys: backend (auto, xgrammar, "
                      "llguidance), disable_any_whitespace, disable_fallback, strict (refuse "
                      "JSON schemas that cannot be enforced in full)."),
    click.option("--runner", type=click.Choice(["auto", "generate", "pooling"]), default="auto",
                 show_default=True,
                 help="generate, or pooling (embeddings, classification, scoring, reward: "
                      "/v1/embeddings, /classify, /score, /rerank, /pooling); auto: pooling "
                      "for encoders, sequence classifiers and sentence-transformers models."),
    click.option("--convert", type=click.Choice(["auto", "none", "embed", "classify", "reward"]),
                 default="auto", show_default=True,
                 help="What a pooling runner computes; auto: from the architecture "
                      "(*ForSequenceClassification: classify, else embed)."),
    click.option("--hf-overrides", "hf_overrides", default=None, metavar="JSON",
                 help="Keys set on the model's HF config, as a JSON object (vLLM's), e.g. "
                      "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                      "\"classifier_from_token\": [\"no\", \"yes\"]}' for Qwen3-Reranker."),
    click.option("--disable-chunked-mm-input", "disable_chunked_mm_input", is_flag=True,
                 default=False,
                 help="Never end a prompt chunk inside an image (always on for models whose "
                      "image tokens attend to each other both ways, e.g. Gemma 3)."),
    click.option("--async-scheduling", "async_scheduling", is_flag=True, default=False,
                 help="Schedule the next step while the current one runs (the host's "
                      "scheduling hides behind the model's compute)."),
    click.option("--enable-lora", "enable_lora", is_flag=True, default=False,
                 help="Serve PEFT LoRA adapters over the base model (per request: the "
                      "offline API's lora_request, the server's --lora-modules names)."),
    click.option("--max-loras", "max_loras", type=click.IntRange(min=1), default=1,
                 show_default=True, help="Distinct adapters one step may run."),
    click.option("--max-lora-rank", "max_lora_rank", type=click.IntRange(1, 512), default=16,
                 show_default=True, help="The largest adapter rank accepted."),
    click.option("--max-cpu-loras", "max_cpu_loras", type=click.IntRange(min=1),
                 default=None, help="Adapters kept in host memory (LRU; default: "
                                    "--max-loras)."),
    click.option("--model-impl", "model_impl",
                 type=click.Choice(["auto", "engine", "transformers"]), default="auto",
                 show_default=True,
                 help="Which implementation runs the model: engine (the built-in classes), "
                      "transformers (the Transformers modeling backend: any transformers "
                      "decoder on the engine's paged attention), auto (engine when the "
                      "architecture is built in, else transformers)."),
    click.option("--limit-mm-per-prompt", "limit_mm_per_prompt", default=None,
                 callback=parse_limit_mm_per_prompt, metavar="JSON",
                 help="Vision-language models: the most images / videos one prompt may "
                      "hold, e.g. '{\"image\": 2, \"video\": 1}' (default: no limit)."),
    click.option("--allowed-local-media-path", "allowed_local_media_path", default=None,
                 type=click.Path(exists=True, file_okay=False, resolve_path=True),
                 help="Chat messages may name images as file:// URLs under this directory "
                      "(default: no local files)."),
    click.option("--allowed-media-domains", "allowed_media_domains", multiple=True,
                 cls=GreedyMultipleOption, callback=_domains_option,
                 metavar="DOMAIN ...",
                 help="Fetch http(s) image URLs only from these host names (default: any "
                      "host; set this on a server untrusted clients reach)."),
    click.option("--media-io-timeout", "media_io_timeout",
                 type=click.FloatRange(min=0, min_open=True), default=10.0,
                 show_default=True, help="Seconds fetching one image URL may take."),
]

ENGINE_OPTION_NAMES = (
    "model", "tokenizer", "device", "dtype", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "block_size", "enable_prefix_caching", "enable_chunked_prefill",
    "disable_hybrid_kv_cache_manager",
    "cpu_kvcache_space_gib", "kv_cache_memory_bytes", "kv_cache_dtype", "gpu_memory_utilization", "attention_backend", "num_threads",
    "seed", "scheduling_policy", "generation_config", "enforce_eager", "enable_sleep_mode",
    "enable_weight_updates",
    "batch_invariant", "quantization",
    "speculative_config", "structured_outputs_config", "tensor_parallel_size",
    "pipeline_parallel_size", "distributed_executor_backend", "enable_expert_parallel",
    "data_parallel_size", "data_parallel_size_local", "data_parallel_backend",
    "data_parallel_on_rank_failure", "data_parallel_address", "data_parallel_rpc_port",
    "data_parallel_start_rank", "headless",
    "kv_transfer_config", "kv_offloading_size", "kv_offloading_backend", "runner", "convert", "hf_overrides", "model_impl",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "async_scheduling",
    "limit_mm_per_prompt", "allowed_local_media_path", "allowed_media_domains",
    "media_io_timeout", "disable_chunked_mm_input",
)


def engine_options(func: Callable) -> Callable:
    """Decorate a click command with every engine option."""
    for option in reversed(_ENGINE_OPTIONS):
        func = option(func)
    return func


def engine_args_from_options(options: dict[str, Any]) -> dict[str, Any]:
    """The EngineArgs keywords among a command's parsed options."""
    return {name: options[name] for name in ENGINE_OPTION_NAMES if name in options}
