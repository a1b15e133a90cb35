"""A request as the engine core tracks it: tokens, progress, status.

One rule drives scheduling (DESIGN lesson 1): a request has ``num_computed_tokens`` and
a target ``num_tokens_with_spec``; each step the scheduler lets the first catch up with
the second as far as the budget allows. Prompt tokens, generated tokens, prefix-cache
hits and speculative tokens all move the same two counters.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.core.pooling_params import PoolingParams
from engine.core.sampling_params import SamplingParams
from engine.lora.request import LoRARequest
from engine.multimodal.inputs import MultiModalFeature


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # structured output: grammar still compiling
    WAITING_FOR_REMOTE_KV = 2  # disaggregated prefill: KV still arriving
    RUNNING = 3
    PREEMPTED = 4
    # Finished states: everything at or above FINISHED_STOPPED.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_IGNORED = 8  # never scheduled: could not fit at all

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> "FinishReason | None":
        return _FINISH_REASONS.get(self)


class FinishReason(enum.IntEnum):
    """Why a request ended; ``str()`` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


@dataclass(eq=False)
class Request:
    """Core-side state of one sequence (one of the ``n`` samples of a user request)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = served first (vLLM convention)
    # Extra keys folded into every block hash (cache salt, LoRA name, media hashes...).
    cache_salt: str | None = None
    max_tokens: int = 16  # resolved by the processor (max_model_len aware)
    # Pooling requests: what to pool and the prompt's token types (see EngineCoreRequest).
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base)
    # Its images / videos (by prompt offset): their embeddings replace prompt tokens
    # [offset, offset + length); the scheduler has each encoded when its tokens run.
    mm_features: list[MultiModalFeature] = field(default_factory=list)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens that steps in flight will sample (scheduled, not yet known).
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Prefix-cache hashes of the full blocks of all_token_ids, extended incrementally
    # by the KV cache manager (engine.core.kv_cache.hashing); kept across preemption.
    block_hashes: list[bytes] = field(default_factory=list)
    # KV connector: prompt tokens whose KV comes from outside (being loaded, or loaded),
    # the locally cached ones before them, and the kv_transfer_params to return.
    num_external_tokens: int = 0
    num_local_hit_tokens: int = 0
    kv_transfer_params_out: dict | None = None
    hold_blocks: bool | None = None  # set when it finishes: a consumer pulls its blocks

    @property
    def kv_transfer_params(self) -> dict | None:
        """The client's ``kv_transfer_params`` (vLLM keeps them in the sampling params'
        ``extra_args``)."""
        extra = self.sampling_params.extra_args
        params = extra.get("kv_transfer_params") if extra else None
        return params if isinstance(params, dict) else None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
