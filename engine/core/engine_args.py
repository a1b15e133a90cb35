"""EngineArgs: the flat, vLLM-compatible bag of options shared by the API and the CLI.

``create_engine_config()`` resolves it against the model directory (dtype "auto",
max_model_len from the HF config, the demo model when no model is given) into the
grouped :class:`EngineConfig` the engine runs with.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.batch_invariance import env_requests_batch_invariance
from engine.core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from engine.core.dp_placement import DEFAULT_RPC_PORT, check_placement

ATTENTION_BACKEND_ENV = "ENGINE_ATTENTION_BACKEND"
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]

logger = logging.getLogger(__name__)

# The step's token budget when --max-num-batched-tokens is not given, by what runs the
# engine (vLLM's UsageContext and its CPU defaults): offline, a burst of prompts fills
# big steps; behind an API server a smaller budget lets the first prompts of a burst
# stream tokens while the rest prefill (the same throughput, measured on 2 cores, and
# ~0.6x the mean time to first token of a one-step prefill of 64 x 128 tokens).
DEFAULT_TOKEN_BUDGETS = {"llm": 8192, "api_server": 2048}


def check_usage_context(value: str) -> str:
    if value not in DEFAULT_TOKEN_BUDGETS:
        raise ValueError(f"usage_context {value!r}: expected one of "
                         f"{', '.join(DEFAULT_TOKEN_BUDGETS)}")
    return value


def resolve_model_source(model: str) -> str:
    """A local model directory for ``model``: the path itself, or a hub snapshot.

    A name like ``org/model`` that is not a local path is fetched (safetensors, configs,
    tokenizer files only) through huggingface_hub when online or already cached.
    """
    if Path(model).expanduser().exists() or not _HUB_REPO_ID.match(model):
        return str(Path(model).expanduser())
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=_HUB_FILES)
    except Exception as exc:  # noqa: BLE001 - any hub failure is the same user error
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(exc).__name__}: {exc})"
        ) from exc


_MEMORY_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                 "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_max_model_len(value: Any) -> tuple[int | None, bool]:
    """(the requested length or None, whether it is "auto"): ``"auto"`` and -1 (as int or
    string) ask for the largest length the KV cache fits."""
    if value is None:
        return None, False
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "-1"):
            return None, True
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"max_model_len must be a number of tokens, 'auto' or -1, not "
                             f"{value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_model_len must be a number of tokens, 'auto' or -1, not "
                        f"{value!r}")
    if value == -1:
        return None, True
    return value, False


def parse_memory_bytes(value: Any, name: str) -> int | None:
    """Bytes from an int or a string with an optional unit (``4GiB``, ``512M``, ``1e9``)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT][iI]?)?[bB]?\s*", value)
        if match:
            try:
                number = float(match.group(1))
            except ValueError:
                number = None
            if number is not None:
                return int(number * _MEMORY_UNITS[(match.group(2) or "").lower()])
    raise ValueError(f"{name} must be a number of bytes (e.g. 4294967296, 4GiB, 512M), not "
                     f"{value!r}")


@dataclass
class EngineArgs:
    """Every engine option, with vLLM's names and V1 defaults."""

    model: str | None = None  # None: the embedded demo model
    # What runs the engine (vLLM's UsageContext): "llm" (offline) or "api_server"; picks
    # the defaults that depend on it (DEFAULT_TOKEN_BUDGETS).
    usage_context: str = "llm"
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    # None: the model's limit; "auto" / -1: the largest length the KV cache fits.
    max_model_len: int | str | None = None
    seed: int = 0
    device: str = "auto"
    attention_backend: str | None = None
    num_threads: int | None = None
    block_size: int = 16
    # None: 0.9 on GPUs; on the CPU an explicit value sizes the KV from that share of RAM.
    gpu_memory_utilization: float | None = None
    cpu_kvcache_space_gib: float | None = None
    # vLLM's --kv-cache-memory: the KV cache's bytes per rank on any platform.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's: one KV cache group even for hybrid (sliding-window / chunked) models.
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_dtype: str = "auto"  # vLLM's: auto (the model dtype), fp8, fp8_e4m3, fp8_e5m2
    max_num_seqs: int = 256
    # None: the usage context's default (below), raised to max_model_len without chunking.
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # vLLM's: schedule step N+1 while step N runs (the scheduler counts N's tokens as
    # placeholders); refused with speculative decoding and pipeline parallelism.
    async_scheduling: bool = False
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "mp", "ray", "uni"; None: by world size
    enable_expert_parallel: bool = False  # MoE experts placed whole across the TP ranks
    # vLLM's data-parallel options (engine.core.dp_client): this many engine cores, each
    # a whole replica, behind one front end; all local, started as processes ("mp").
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # None: data_parallel_size (all local)
    data_parallel_backend: str = "mp"  # "mp" (processes per node) or "ray" (Ray places them)
    # Multi-node (engine.core.dp_placement): the head's address and registration port,
    # this node's first rank, and --headless (a node with ranks and no API server).
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = DEFAULT_RPC_PORT
    data_parallel_start_rank: int = 0
    headless: bool = False
    # A dead rank: "exit" (vLLM's behaviour: the engine fails, the server exits) or
    # "continue" (its requests fail; the other ranks keep serving).
    data_parallel_on_rank_failure: str = "exit"
    trust_remote_code: bool = False
    generation_config: str = "auto"  # "auto", "vllm" or a directory (sampling defaults)
    enforce_eager: bool = False  # no forward graphs for decode steps
    enable_sleep_mode: bool = False  # LLM.sleep / wake_up may free the KV cache and weights
    enable_weight_updates: bool = False  # the server's weight-update routes (LLM: always)
    # Bitwise-equal outputs whatever the batch (or $ENGINE_BATCH_INVARIANT=1).
    batch_invariant: bool = False
    quantization: str | None = None  # None: the checkpoint's; vLLM's names
    # vLLM's --speculative-config: a dict or its JSON text (engine.spec_decode.config).
    speculative_config: dict[str, Any] | str | None = None
    # vLLM's --structured-outputs-config: a dict or its JSON text ({"backend": ...,
    # "disable_any_whitespace": ..., "disable_fallback": ..., "strict": ...}).
    structured_outputs_config: dict[str, Any] | str | None = None
    # vLLM's --reasoning-parser (engine.structured_output.reasoning): structured outputs
    # constrain only what follows the reasoning.
    reasoning_parser: str | None = None
    # vLLM's --kv-transfer-config: a dict or its JSON text ({"kv_connector": ...,
    # "kv_role": ..., "kv_connector_extra_config": {...}}).
    kv_transfer_config: dict[str, Any] | str | None = None
    # vLLM's --kv-offloading-size: GiB of host memory for a second KV tier (the
    # OffloadingConnector; next to a kv_transfer_config, both through a MultiConnector).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # vLLM's --runner (auto | generate | pooling) and --convert (auto | embed | classify |
    # reward): serve an embedder / classifier (engine.core.pooling_config).
    runner: str = "auto"
    convert: str = "auto"
    # vLLM's --hf-overrides: a dict or its JSON text, set on the HF config.
    hf_overrides: dict[str, Any] | str | None = None
    # vLLM's --model-impl: "auto" (the engine's class when the architecture is
    # registered, else the Transformers backend), "engine" or "transformers".
    model_impl: str = "auto"
    # vLLM's LoRA options (engine.lora): serve PEFT adapters over the base model.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's multimodal options (engine.multimodal): items per prompt by modality (a dict
    # or its JSON text, e.g. '{"image": 2}'); where chat image URLs may point (local files
    # under allowed_local_media_path; http(s) hosts in allowed_media_domains, any when
    # None); seconds a media fetch may take.
    limit_mm_per_prompt: dict[str, int] | str | None = None
    # Never end a prompt chunk inside an image (always on for Gemma 3, whose image tokens
    # attend to each other both ways).
    disable_chunked_mm_input: bool = False
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    media_io_timeout: float = 10.0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def resolved_model_path(self) -> tuple[str, str]:
        """(model directory, served name)."""
        if self.model is None:
            from engine.assets import DEMO_MODEL_NAME, demo_model_path

            return demo_model_path(), self.served_model_name or DEMO_MODEL_NAME
        return resolve_model_source(self.model), self.served_model_name or self.model

    def create_engine_config(self) -> EngineConfig:
        from engine.core.sampling_defaults import load_sampling_defaults
        from engine.model_executor.model_loader import (
            get_max_model_len,
            load_model_files,
            resolve_dtype,
        )

        path, served_name = self.resolved_model_path()
        hf_overrides = _json_dict(self.hf_overrides, "hf_overrides")
        files = load_model_files(path, hf_overrides=hf_overrides, model_impl=self.model_impl)
        load_sampling_defaults(path, self.generation_config)  # a bad value fails here
        dtype = resolve_dtype(files.hf_config, self.dtype)
        from engine.quantization import resolve_quantization

        resolve_quantization(files.hf_config, self.quantization)  # a bad one fails here
        runner, pooler = resolve_runner(self.runner, self.convert, files, hf_overrides)
        requested_len, auto_len = parse_max_model_len(self.max_model_len)
        if requested_len is None and pooler is not None and pooler.max_seq_length:
            # sentence-transformers' max_seq_length, within what the model allows
            requested_len = min(pooler.max_seq_length,
                                get_max_model_len(files.hf_config, None))
        max_model_len = get_max_model_len(files.hf_config, requested_len)
        chunked_prefill, prefix_caching = self.enable_chunked_prefill, self.enable_prefix_caching
        if pooler is not None:
            self._check_pooling_options()
            # A pooling prompt runs whole in one step and keeps no KV afterwards.
            chunked_prefill = prefix_caching = False
        speculative = None
        if self.speculative_config is not None:
            from engine.spec_decode.config import resolve_speculative_config

            # Every bad draft (vocabulary, size, method) fails here, before a model loads.
            speculative = resolve_speculative_config(
                self.speculative_config, files, is_demo_target=self.model is None
            )
        # A bad structured-outputs config fails here, before a model loads.
        structured_outputs = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        structured_outputs = _resolve_reasoning(structured_outputs, self.reasoning_parser,
                                                self.tokenizer or path)
        kv_transfer = KVTransferConfig.with_offloading(
            KVTransferConfig.from_value(self.kv_transfer_config), self.kv_offloading_size,
            self.kv_offloading_backend)
        if kv_transfer is not None:
            from engine.kv_transfer.factory import connector_classes

            known = connector_classes()
            if kv_transfer.kv_connector not in known:
                raise ValueError(f"unknown KV connector {kv_transfer.kv_connector!r}; "
                                 f"installed: {', '.join(sorted(known))}")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_TOKEN_BUDGETS[check_usage_context(self.usage_context)]
            budget = budget if chunked_prefill else max(budget, max_model_len)
        elif pooler is not None:
            budget = max(budget, max_model_len)
        return EngineConfig(
            model=ModelConfig(
                model=path,
                tokenizer=self.tokenizer,
                served_model_name=served_name,
                dtype=str(dtype).removeprefix("torch."),
                dtype_is_auto=self.dtype == "auto",
                max_model_len=max_model_len,
                seed=self.seed,
                trust_remote_code=self.trust_remote_code,
                generation_config=self.generation_config,
                enforce_eager=self.enforce_eager,
                enable_sleep_mode=self.enable_sleep_mode,
                enable_weight_updates=self.enable_weight_updates,
                batch_invariant=self.batch_invariant or env_requests_batch_invariance(),
                quantization=self.quantization,
                hf_overrides=hf_overrides,
                model_impl=self.model_impl,
                runner=runner,
                pooler_config=pooler,
                limit_mm_per_prompt=_json_dict(self.limit_mm_per_prompt,
                                               "limit_mm_per_prompt"),
                allowed_local_media_path=self.allowed_local_media_path,
                allowed_media_domains=(list(self.allowed_media_domains)
                                       if self.allowed_media_domains is not None else None),
                media_io_timeout=self.media_io_timeout,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cpu_kvcache_space_gib=self.cpu_kvcache_space_gib,
                kv_cache_memory_bytes=parse_memory_bytes(self.kv_cache_memory_bytes,
                                                         "kv_cache_memory_bytes"),
                max_model_len_auto=auto_len,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                policy=self.scheduling_policy,
                enable_chunked_prefill=chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                async_scheduling=self._async_scheduling(speculative),
                disable_chunked_mm_input=self.disable_chunked_mm_input or bool(
                    getattr(files.model_cls, "bidirectional_mm_attention", False)),
            ),
            parallel=self._parallel_config(kv_transfer is not None, speculative),
            device=DeviceConfig(
                device=self.device,
                attention_backend=self.attention_backend or os.environ.get(ATTENTION_BACKEND_ENV),
                num_threads=self.num_threads,
            ),
            speculative=speculative,
            structured_outputs=structured_outputs,
            kv_transfer=kv_transfer,
            lora=self._lora_config(pooler is not None),
        )

    def _parallel_config(self, kv_connector: bool, speculative: Any = None) -> ParallelConfig:
        """The parallel layout; data-parallel settings that are not built are refused by
        name here, before a model loads."""
        self._check_data_parallel(kv_connector, speculative)
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            enable_expert_parallel=self.enable_expert_parallel,
            data_parallel_size=self.data_parallel_size,
            data_parallel_size_local=self.data_parallel_size_local,
            data_parallel_backend=self.data_parallel_backend,
            data_parallel_on_rank_failure=self.data_parallel_on_rank_failure,
            data_parallel_address=self.data_parallel_address,
            data_parallel_rpc_port=self.data_parallel_rpc_port,
            data_parallel_start_rank=self.data_parallel_start_rank,
        )

    def _check_data_parallel(self, kv_connector: bool, speculative: Any = None) -> None:
        size = self.data_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, not {size!r}")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', not "
                             f"{self.data_parallel_backend!r}")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ValueError(f"data_parallel_rpc_port must be a port (1..65535), not "
                             f"{self.data_parallel_rpc_port!r}")
        check_placement(size, self.data_parallel_size_local, self.data_parallel_start_rank,
                        self.data_parallel_address, self.data_parallel_backend,
                        self.headless)
        if self.data_parallel_on_rank_failure not in ("exit", "continue"):
            raise ValueError("data_parallel_on_rank_failure must be 'exit' or 'continue', "
                             f"not {self.data_parallel_on_rank_failure!r}")
        if size == 1:
            return
        if self.enable_expert_parallel:
            self._check_dp_lockstep(speculative)
        if kv_connector:
            raise ValueError("data_parallel_size > 1 with a KV connector (kv_transfer_config "
                             "/ kv_offloading_size) is not supported yet: each rank would "
                             "need its own connector endpoints")

    def _check_dp_lockstep(self, speculative: Any) -> None:
        """Expert parallelism across data-parallel ranks runs exactly one forward per
        rank per step; what would run a different number on some ranks is refused."""
        if self.async_scheduling:
            raise ValueError("async_scheduling with data parallelism and expert parallelism "
                             "is not supported: the ranks step in lockstep, one step at a "
                             "time")
        method = None if speculative is None else speculative.method
        if method not in (None, "ngram"):
            raise ValueError(f"speculative decoding with a {method!r} proposer and data "
                             "parallelism with expert parallelism is not supported: the "
                             "proposer's forwards would not stay matched across the ranks "
                             "(n-gram speculation is)")

    def _async_scheduling(self, speculative: Any) -> bool:
        """Whether steps overlap; what cannot overlap is refused by name."""
        if not self.async_scheduling:
            return False
        if speculative is not None:
            raise ValueError("async_scheduling with speculative decoding is not supported: "
                             "step N+1's drafts are proposed from step N's output")
        if self.pipeline_parallel_size > 1:
            raise ValueError("async_scheduling with pipeline parallelism is not supported: "
                             "the stages already overlap their micro-batches")
        return True

    def _lora_config(self, pooling: bool) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if pooling:
            raise ValueError("enable_lora: LoRA adapters are served for generating models "
                             "only (this model runs as a pooling model)")
        if self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora: LoRA with pipeline parallelism is not supported "
                             "(tensor parallelism is)")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)

    def _check_pooling_options(self) -> None:
        """What a pooling engine cannot do, refused before a model loads."""
        refused = {
            "speculative_config": self.speculative_config is not None,
            "kv_transfer_config": self.kv_transfer_config is not None,
            "kv_offloading_size": self.kv_offloading_size is not None,
            "pipeline_parallel_size > 1": self.pipeline_parallel_size > 1,
        }
        bad = [name for name, set_ in refused.items() if set_]
        if bad:
            raise ValueError(f"--runner pooling cannot be combined with {', '.join(bad)}")


def _resolve_reasoning(config: StructuredOutputsConfig, parser_name: str | None,
                       tokenizer_path: str) -> StructuredOutputsConfig:
    """The structured-outputs config with the reasoning parser's start / end token ids
    (read from the tokenizer here, in the front end, so the core needs no parser)."""
    name = parser_name or config.reasoning_parser
    if name is None:
        return config
    from engine.core.tokenizer import load_tokenizer
    from engine.structured_output.reasoning import get_reasoning_parser

    get_reasoning_parser(name)  # an unknown name: ValueError listing the names
    parser = get_reasoning_parser(name, load_tokenizer(tokenizer_path))
    if parser.end_token_id is None and not config.enable_in_reasoning:
        logger.warning("reasoning parser %s: the end of reasoning is not one token of this "
                       "tokenizer, so structured outputs constrain the reasoning too", name)
    return config.model_copy(update={
        "reasoning_parser": name,
        "reasoning_start_token_id": parser.start_token_id,
        "reasoning_end_token_id": parser.end_token_id,
    })


def resolve_runner(runner: str, convert: str, files: Any,
                   hf_overrides: dict[str, Any] | None) -> tuple[str, Any]:
    """(``generate`` | ``pooling``, the PoolerConfig of a pooling runner or None)."""
    from engine.core.pooling_config import default_runner, resolve_pooler_config

    if runner not in ("auto", "generate", "pooling"):
        raise ValueError(f"runner must be auto, generate or pooling, not {runner!r}")
    if convert not in ("auto", "none", "embed", "classify", "reward"):
        raise ValueError(f"convert must be auto, none, embed, classify or reward, not {convert!r}")
    if runner == "auto":
        runner = "pooling" if convert in ("embed", "classify", "reward") else default_runner(
            getattr(files.model_cls, "is_pooling_model", False), files.path)
    if runner == "generate":
        if getattr(files.model_cls, "is_pooling_model", False):
            raise ValueError(f"{files.architecture} is a pooling model: it cannot generate "
                             "(use --runner pooling)")
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} needs --runner pooling")
        return runner, None
    return runner, resolve_pooler_config(files.path, files.architecture,
                                         "auto" if convert == "none" else convert,
                                         hf_overrides)


def _json_dict(value: dict[str, Any] | str | None, name: str) -> dict[str, Any] | None:
    """A dict option given as a dict or as its JSON text (the command line's form)."""
    if value is None or isinstance(value, dict):
        return value
    import json

    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name} must be a JSON object: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object, not {type(parsed).__name__}")
    return parsed
