"""Engine configuration: pydantic models with vLLM-compatible names and V1 defaults.

Validation errors name the bad field and value (pydantic's ValidationError is a
ValueError). ``EngineArgs`` is the flat user-facing bag of options; ``EngineConfig`` is
the resolved, grouped result the engine runs with.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.core.dp_placement import check_placement
from engine.core.pooling_config import PoolerConfig

_STRICT = ConfigDict(extra="forbid", validate_assignment=True)

DEFAULT_CPU_KVCACHE_GIB = 4.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
CPU_KVCACHE_ENV = "ENGINE_CPU_KVCACHE_SPACE"  # GiB, like vLLM's VLLM_CPU_KVCACHE_SPACE

DType = Literal["auto", "float32", "float16", "bfloat16", "float", "half"]


class ModelConfig(BaseModel):
    model_config = _STRICT

    model: str
    tokenizer: str | None = None  # defaults to the model directory
    served_model_name: str | None = None
    dtype: DType = "auto"  # the weights' (and KV cache's); "auto": the checkpoint's torch_dtype
    # Whether dtype came from --dtype auto: the platform may then compute in a wider
    # activation dtype (Platform.activation_dtype), resolved by the executor.
    dtype_is_auto: bool = False
    activation_dtype: DType | None = None  # None: dtype
    max_model_len: int | None = Field(default=None, ge=1)  # None: from the HF config
    seed: int = 0
    revision: str | None = None
    trust_remote_code: bool = False  # accepted for vLLM compatibility; never needed
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none) or a
    # directory holding a generation_config.json (engine.core.sampling_defaults).
    generation_config: str = "auto"
    # Run every step eagerly: no forward graphs (CUDA graphs / CPU call tables).
    enforce_eager: bool = False
    # vLLM's --enable-sleep-mode: LLM.sleep / wake_up (and the server's /sleep routes)
    # may free the KV cache and the weights (engine.core.engine_core.EngineCore.sleep).
    enable_sleep_mode: bool = False
    # --enable-weight-updates: the server registers its weight-update routes
    # (engine.entrypoints.openai.rl_routes); LLM / AsyncLLM update weights regardless.
    enable_weight_updates: bool = False
    # --batch-invariant / $ENGINE_BATCH_INVARIANT: kernels reduce in one order per row
    # whatever the batch (engine.core.batch_invariance).
    batch_invariant: bool = False
    # vLLM's --quantization: None follows the checkpoint (engine.quantization).
    quantization: str | None = None
    # vLLM's --hf-overrides: keys set on the HF config before the architecture resolves
    # (e.g. Qwen3-Reranker's {"architectures": ["Qwen3ForSequenceClassification"],
    # "classifier_from_token": ["no", "yes"]}).
    hf_overrides: dict[str, Any] | None = None
    # vLLM's --model-impl: "auto" (the engine's class when registered, else the
    # Transformers backend), "engine" (registered classes only) or "transformers".
    model_impl: Literal["auto", "engine", "transformers"] = "auto"
    # "generate" or "pooling" (embed / classify / score / reward; see
    # engine.core.pooling_config), resolved from --runner / --convert.
    runner: Literal["generate", "pooling"] = "generate"
    pooler_config: PoolerConfig | None = None  # set exactly when runner == "pooling"
    # Vision-language models (engine.multimodal), vLLM's options: the most items of each
    # modality one prompt may hold (e.g. {"image": 2}; None: no limit), and where the
    # image URLs of chat messages may point: local files only under
    # allowed_local_media_path (None: none), http(s) only to allowed_media_domains (None:
    # any host), each fetch bounded by media_io_timeout seconds.
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    media_io_timeout: float = Field(default=10.0, gt=0)

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _check_mm_limits(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        for modality, limit in (value or {}).items():
            if modality not in ("image", "video"):
                raise ValueError(f"limit_mm_per_prompt names {modality!r}; modalities: "
                                 "image, video")
            if limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be >= 0, "
                                 f"got {limit}")
        return value

    @field_validator("allowed_local_media_path")
    @classmethod
    def _check_media_path(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isdir(value):
            raise ValueError(f"allowed_local_media_path {value!r} is not a directory")
        return value

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model


class CacheConfig(BaseModel):
    model_config = _STRICT

    block_size: int = Field(default=16, ge=1, le=1024)
    # The share of one device's memory the engine may use (weights, activations, KV
    # cache); None: 0.9 on GPUs (``gpu_utilization``). On the CPU platform an explicit
    # value sizes the KV cache from that share of the host's RAM.
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    # CPU: KV cache size in GiB (ENGINE_CPU_KVCACHE_SPACE; default 4 GiB).
    cpu_kvcache_space_gib: float | None = Field(default=None, gt=0.0)
    # vLLM's --kv-cache-memory: the KV cache's bytes per rank, on any platform (wins
    # over gpu_memory_utilization and the CPU's KV cache space).
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1)
    # --max-model-len auto / -1: max_model_len is the model's limit until the workers
    # measured the KV cache, then the largest length one request's KV fits in.
    max_model_len_auto: bool = False
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Literal["sha256"] = "sha256"
    # vLLM's --kv-cache-dtype: "auto" stores K/V in the model dtype; "fp8" (= "fp8_e4m3")
    # and "fp8_e5m2" in one byte per value with per-layer scales (twice the blocks of a
    # 16-bit cache in the same memory; engine.core.interfaces.attention).
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # One KV cache group even when layers attend differently (engine.core.kv_cache.groups):
    # sliding-window layers then keep every block (vLLM's flag).
    disable_hybrid_kv_cache_manager: bool = False

    @property
    def gpu_utilization(self) -> float:
        """``gpu_memory_utilization``, 0.9 when not given."""
        return DEFAULT_GPU_MEMORY_UTILIZATION if self.gpu_memory_utilization is None \
            else self.gpu_memory_utilization

    def cpu_kvcache_space_given(self) -> bool:
        """True when the CPU KV cache size was set (config or ENGINE_CPU_KVCACHE_SPACE)."""
        return self.cpu_kvcache_space_gib is not None or bool(os.environ.get(CPU_KVCACHE_ENV))

    def resolved_cpu_kvcache_gib(self) -> float:
        if self.cpu_kvcache_space_gib is not None:
            return self.cpu_kvcache_space_gib
        env = os.environ.get(CPU_KVCACHE_ENV)
        if env:
            try:
                value = float(env)
            except ValueError as exc:
                raise ValueError(f"{CPU_KVCACHE_ENV}={env!r} is not a number of GiB") from exc
            if value <= 0:
                raise ValueError(f"{CPU_KVCACHE_ENV}={env!r} must be > 0")
            return value
        return DEFAULT_CPU_KVCACHE_GIB


class SchedulerConfig(BaseModel):
    model_config = _STRICT

    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    max_model_len: int = Field(default=2048, ge=1)  # resolved from ModelConfig
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # A prefill may take at most this many tokens of one step (0: no limit beyond budget).
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    # vLLM's --async-scheduling: step N+1 is scheduled while step N runs (engine_core).
    async_scheduling: bool = False
    # vLLM's --disable-chunked-mm-input: a prompt chunk never ends inside an image (on
    # for models whose image tokens attend to each other both ways, e.g. Gemma 3).
    disable_chunked_mm_input: bool = False

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens one request may compute in one step."""
        threshold = self.long_prefill_token_threshold
        if self.enable_chunked_prefill and threshold:
            return min(self.max_num_batched_tokens, threshold)
        return self.max_num_batched_tokens

    @model_validator(mode="after")
    def _budget_fits_a_prompt(self) -> "SchedulerConfig":
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill disabled: "
                "long prompts could never be scheduled"
            )
        return self


class ParallelConfig(BaseModel):
    model_config = _STRICT

    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    enable_expert_parallel: bool = False
    # vLLM's names: "mp" (local worker processes), "ray" (a Ray cluster), "uni" (one rank
    # in process); None picks uni for one rank and mp otherwise.
    distributed_executor_backend: Literal["mp", "ray", "uni"] | None = None
    # Data parallelism (engine.core.dp_client): data_parallel_size engine cores, each a
    # whole replica (its own scheduler, KV cache and TP x PP workers) behind one front
    # end; ranks may run on other nodes ("mp" with --headless nodes, or placed by "ray").
    data_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size_local: int | None = Field(default=None, ge=1)  # None: all local
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    data_parallel_rank: int = Field(default=0, ge=0)  # this core's rank (set per core)
    # Multi-node (engine.core.dp_handshake): the head's address and the port where it
    # takes the other nodes' registrations (0: pick a free one; head only), and the first
    # global rank this node runs (its local ranks are start_rank .. + size_local - 1).
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = Field(default=0, ge=0, le=65535)
    data_parallel_start_rank: int = Field(default=0, ge=0)
    # A dead rank: "exit" fails the whole engine (the server exits, as vLLM's does);
    # "continue" fails only that rank's requests and routes new ones to the others.
    data_parallel_on_rank_failure: Literal["exit", "continue"] = "exit"
    # Where DP rank 0's engine core hosts the ranks' rendezvous store (the lockstep sync
    # group and the expert-parallel world of an MoE model; engine.distributed.dp_lockstep).
    # Port 0: the front end picks a free one when it starts the ranks.
    data_parallel_master_ip: str = "127.0.0.1"
    data_parallel_master_port: int = Field(default=0, ge=0, le=65535)

    @property
    def world_size(self) -> int:
        """Ranks of one replica (one engine core's workers)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def dp_lockstep(self) -> bool:
        """MoE expert parallelism across data-parallel ranks (EP = DP x TP): every rank
        steps together, a rank with no work running a dummy forward, so the experts'
        all-to-all stays matched."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel

    @model_validator(mode="after")
    def _check_data_parallel(self) -> "ParallelConfig":
        size = self.data_parallel_size
        check_placement(size, self.data_parallel_size_local, self.data_parallel_start_rank,
                        self.data_parallel_address, self.data_parallel_backend)
        if self.data_parallel_rank >= size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is outside "
                             f"data_parallel_size {size}")
        if self.dp_lockstep:
            if self.data_parallel_backend == "ray":
                raise ValueError(
                    "data parallelism with expert parallelism under data_parallel_backend "
                    "'ray' is not supported: rank 0 (the ranks' rendezvous) may land on "
                    "any node; start the ranks per node (--headless) instead")
            if self.pipeline_parallel_size > 1:
                raise ValueError(
                    "data parallelism with expert parallelism runs its ranks in lockstep, "
                    "one forward per step; with pipeline_parallel_size > 1 the stages' "
                    "micro-batches would have to stay matched across ranks too, which is "
                    "not built: use tensor parallelism inside each rank")
            if self.data_parallel_on_rank_failure == "continue":
                raise ValueError(
                    "data_parallel_on_rank_failure='continue' cannot hold with expert "
                    "parallelism across data-parallel ranks: a dead rank takes its experts "
                    "with it, so every rank stops (use 'exit')")
        return self

    def node_share(self, rank: int) -> tuple[int, int]:
        """(local rank, local world size) of worker ``rank`` of this core among every
        worker on the machine: the data-parallel ranks' workers take consecutive slots,
        so two replicas never pick the same device or the same CPUs."""
        size_local = self.data_parallel_size_local or self.data_parallel_size
        local_dp_rank = (self.data_parallel_rank - self.data_parallel_start_rank) % size_local
        return local_dp_rank * self.world_size + rank, size_local * self.world_size


class DeviceConfig(BaseModel):
    model_config = _STRICT

    device: str = "auto"  # "auto" or a platform name
    attention_backend: str | None = None  # None: the platform's preferred backend
    num_threads: int | None = Field(default=None, ge=1)  # host threads (CPU platform)


SpecMethod = Literal["ngram", "draft_model", "eagle"]
SPEC_METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle")
# vLLM's other methods, refused by name with this reason.
_UNSUPPORTED_SPEC_METHODS = {
    "eagle3": "EAGLE-3 heads read several target layers' hidden states",
    "medusa": "Medusa heads are not implemented",
    "mlp_speculator": "MLP speculators are not implemented",
    "deepseek_mtp": "multi-token-prediction layers arrive with DeepSeek-V3",
    "mtp": "multi-token-prediction layers arrive with DeepSeek-V3",
}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given


SPEC_ADAPTIVE_ENV = "ENGINE_SPEC_ADAPTIVE"


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${name}={value!r}: expected 1 or 0")


class SpeculativeConfig(BaseModel):
    """vLLM's ``--speculative-config`` JSON: which proposer drafts how many tokens.

    ``method`` may be omitted when ``model`` names a draft (vLLM infers ``draft_model``,
    or ``eagle`` for an EAGLE head; the engine args resolve it from the draft's config).
    ``model`` is resolved to a directory by the engine args (the shipped demo-draft /
    demo-eagle when the target is the demo model and no model is given)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    # vLLM spells the draft's parallel size; only 1 exists here.
    draft_tensor_parallel_size: int | None = Field(default=None, ge=1, le=1)
    # vLLM's: steps of this many requests or more do not draft (None: any batch size).
    disable_by_batch_size: int | None = Field(default=None, ge=1)
    # Draft only while it measures faster than not drafting, per batch size
    # (engine.core.scheduler.spec_governor); False: every step drafts. Default from
    # $ENGINE_SPEC_ADAPTIVE (1; 0 pins drafting on, e.g. for tests that count drafts).
    adaptive: bool = Field(default_factory=lambda: _env_flag(SPEC_ADAPTIVE_ENV, True))

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if self.method == "[ngram]" or (self.method is None and self.model in ("ngram", "[ngram]")):
            object.__setattr__(self, "method", "ngram")
            object.__setattr__(self, "model", None)
        if self.method in _UNSUPPORTED_SPEC_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported "
                f"({_UNSUPPORTED_SPEC_METHODS[self.method]}); use one of {', '.join(SPEC_METHODS)}"
            )
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; use one of {', '.join(SPEC_METHODS)}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise ValueError(
                    f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})"
                )
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only")
        return self

    @property
    def uses_draft_kv(self) -> bool:
        """Whether the proposer is a model with its own KV cache (it writes ahead)."""
        return self.method in ("draft_model", "eagle")


class StructuredOutputsConfig(BaseModel):
    """vLLM's ``--structured-outputs-config`` JSON: engine-wide defaults for every
    constrained request (a request's own ``backend`` / ``disable_any_whitespace`` /
    ``strict`` win). ``strict`` is this engine's: refuse a JSON schema the backends cannot
    enforce in full instead of relaxing the unsupported keywords."""

    model_config = _STRICT

    backend: Literal["auto", "xgrammar", "llguidance"] = "auto"
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    strict: bool = False
    # vLLM's: with a reasoning parser the grammar constrains only the tokens after the
    # reasoning ends (enable_in_reasoning: from the first token, reasoning included).
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False
    # Resolved by the front end from the parser and the tokenizer (EngineArgs): the core
    # sees reasoning end at this token (None: the end marker is not one token).
    reasoning_start_token_id: int | None = None
    reasoning_end_token_id: int | None = None

    @field_validator("backend", mode="before")
    @classmethod
    def _guidance_alias(cls, value: object) -> object:
        return "llguidance" if value == "guidance" else value  # vLLM's name

    @classmethod
    def from_value(cls, value: StructuredOutputsConfig | dict | str | None
                   ) -> StructuredOutputsConfig:
        """From a dict, its JSON text, or None (the defaults); ValueError naming the
        problem."""
        import json

        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"structured_outputs_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(  # noqa: TRY004 - a bad option value, like every config error
                "structured_outputs_config must be a JSON object such as "
                f"'{{\"backend\": \"xgrammar\"}}', got {type(value).__name__}")
        from pydantic import ValidationError

        try:
            return cls(**value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']} (got {e['input']!r})"
                for e in exc.errors())
            raise ValueError(f"invalid structured_outputs_config: {problems}") from None


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


class KVTransferConfig(BaseModel):
    """vLLM's ``--kv-transfer-config`` JSON: which KV connector moves KV in or out."""

    model_config = _STRICT

    kv_connector: str
    kv_role: KVRole = "kv_both"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # This instance's id in transfers (generated when absent; shared by every rank).
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    # Where a producer's side channel listens (rank r: kv_port + r); consumers learn it
    # from the kv_transfer_params the producer returns.
    kv_ip: str = "127.0.0.1"
    kv_port: int = Field(default=14579, ge=1, le=65535 - 64)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_value(cls, value: Any) -> KVTransferConfig | None:
        """A dict, its JSON text, or None; a clear ValueError for anything malformed."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object, got "  # noqa: TRY004
                             f"{type(value).__name__}")
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                                 for e in exc.errors())
            raise ValueError(f"invalid kv_transfer_config: {problems}") from None

    @classmethod
    def with_offloading(cls, base: KVTransferConfig | None, size_gib: float | None,
                        backend: str = "native") -> KVTransferConfig | None:
        """vLLM's ``--kv-offloading-size GiB``: the ``OffloadingConnector`` (a host-memory
        KV tier), alone or, next to a configured connector, after it in a
        ``MultiConnector`` (loads from the first that has the tokens, saves to all)."""
        if size_gib is None:
            return base
        if not size_gib > 0:
            raise ValueError(f"kv_offloading_size={size_gib}: must be > 0 GiB")
        if backend != "native":
            raise ValueError(f"kv_offloading_backend={backend!r}: only 'native' is built in")
        offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"kv_offloading_size": float(size_gib)}}
        if base is None:
            return cls.model_validate(offload)
        if base.kv_connector == "OffloadingConnector":
            raise ValueError("kv_offloading_size and a kv_transfer_config naming the "
                             "OffloadingConnector: give the tier's size once")
        shared = {"kv_role": base.kv_role, "engine_id": base.engine_id, "kv_ip": base.kv_ip,
                  "kv_port": base.kv_port}
        if base.kv_connector == "MultiConnector":
            children = list(base.kv_connector_extra_config.get("connectors") or [])
        else:
            children = [base.model_dump(include={"kv_connector", "kv_role",
                                                 "kv_connector_extra_config"})]
        extra = {**base.kv_connector_extra_config, "connectors": [*children, offload]}
        return cls.model_validate({"kv_connector": "MultiConnector", **shared,
                                   "kv_connector_extra_config": extra})


class LoRAConfig(BaseModel):
    """vLLM's LoRA options: how many adapters a step may mix, how big they may be."""

    model_config = _STRICT

    # Distinct adapters one step may run (the device slots each LoRA layer holds).
    max_loras: int = Field(default=1, ge=1)
    # The largest rank an adapter may have; every slot is this wide.
    max_lora_rank: int = Field(default=16, ge=1, le=512)
    # Adapters kept loaded in host memory (an LRU cache); None: max_loras.
    max_cpu_loras: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _cpu_cache_holds_the_slots(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        return self

    @property
    def host_cache_size(self) -> int:
        return self.max_cpu_loras or self.max_loras


class EngineConfig(BaseModel):
    """The resolved configuration the engine runs with."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None = None
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    kv_transfer: KVTransferConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA disabled
