"""Wire protocol between a front end and an engine-core process (ZeroMQ + msgpack).

Every message is two frames: a one-byte tag, then a msgspec-msgpack payload whose type
the tag names. Nothing is ever pickled.

Front end -> core (PUSH -> PULL):
    ADD      EngineCoreRequest
    ABORT    list[str] (request ids)
    UTILITY  UtilityCall (a named call such as get_stats; answered by UTILITY_RESULT)
Core -> front end (PUSH -> PULL):
    READY           ReadyInfo, once, after the model is loaded
    OUTPUTS         EngineCoreOutputs of one step
    UTILITY_RESULT  UtilityResult
    DEAD            EngineDeadInfo, the last message of a core that failed
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine.core.scheduler.stats import SpecDecodingStats

# Front end -> core.
ADD = b"A"
ABORT = b"X"
UTILITY = b"U"
# No payload: wakes a lockstep data-parallel core waiting for input, so it joins the
# ranks' next step agreement at once (engine.distributed.dp_lockstep).
WAKE = b"W"
# Core -> front end.
READY = b"R"
OUTPUTS = b"O"
UTILITY_RESULT = b"T"
DEAD = b"D"


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None  # "ExcType: message" when the call raised


class ReadyInfo(msgspec.Struct, array_like=True, gc=False):
    num_kv_blocks: int
    max_model_len: int
    pid: int


class EngineDeadInfo(msgspec.Struct, array_like=True, gc=False):
    error: str


class EngineCoreStats(msgspec.Struct, gc=False):
    """The core's load for metrics: gauges are current values; the ``*_total`` counters
    are cumulative since the core started (Prometheus counter semantics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks held by requests
    num_kv_blocks: int = 0
    prefix_cache_queries_total: int = 0  # tokens looked up
    prefix_cache_hits_total: int = 0  # tokens found computed
    prefix_cache_requests_total: int = 0
    num_preemptions_total: int = 0
    # Speculative decoding (every field defaults, so a peer without them still decodes).
    spec_decoding_enabled: bool = False  # the scheduler reported spec stats at least once
    spec_num_drafts_total: int = 0  # verifications that had drafts
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_num_accepted_tokens_per_pos_total: list[int] = msgspec.field(default_factory=list)
    # MoE models: (token, choice) pairs routed to each expert, and the expert-parallel
    # size the experts are spread over (consecutive experts per rank); empty: dense.
    moe_expert_tokens_total: list[int] = msgspec.field(default_factory=list)
    moe_expert_parallel_size: int = 1
    # Lockstep data parallelism (experts shared across ranks): the waves this rank stepped
    # in, and its dummy steps (nothing of its own scheduled while another rank had work).
    dp_lockstep_waves_total: int = 0
    dp_dummy_steps_total: int = 0
    # Prompt tokens the model computed, and prompt tokens whose KV a connector loaded.
    prompt_tokens_computed_total: int = 0
    kv_transfer_loaded_tokens_total: int = 0
    # The KV connector's counters (kv_transfer_enabled: a connector is configured).
    kv_transfer_enabled: bool = False
    kv_transfer_bytes_sent_total: int = 0
    kv_transfer_bytes_received_total: int = 0
    kv_transfer_blocks_sent_total: int = 0
    kv_transfer_blocks_received_total: int = 0
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_load_failures_total: int = 0
    kv_transfer_blocks_held: int = 0  # finished requests' blocks waiting for a consumer
    # The core's grammar compiles (engine.structured_output.stats.CompileStats.snapshot):
    # cumulative time histogram and cache hits / misses.
    structured_output: dict[str, Any] = msgspec.field(default_factory=dict)
    # LoRA (max_loras 0: off): requests per adapter name now, running and waiting.
    max_loras: int = 0
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)

    @classmethod
    def merge(cls, ranks: list[EngineCoreStats]) -> EngineCoreStats:
        """Several data-parallel ranks' stats as one engine's: counts and counters add
        up (per expert / per draft position / per adapter too), KV usage is the share of
        all ranks' blocks held, and the grammar-compile snapshot is the first rank's."""
        if len(ranks) == 1:
            return ranks[0]
        merged = cls()
        for stats in ranks:
            for name in stats.__struct_fields__:
                value, total = getattr(stats, name), getattr(merged, name)
                if isinstance(value, bool):
                    setattr(merged, name, total or value)
                elif isinstance(value, (int, float)) and name not in _NOT_ADDED:
                    setattr(merged, name, total + value)
                elif isinstance(value, list):
                    if len(total) < len(value):
                        total.extend([0] * (len(value) - len(total)))
                    for i, count in enumerate(value):
                        total[i] += count
            for name in ("running_lora_adapters", "waiting_lora_adapters"):
                total = getattr(merged, name)
                for adapter, count in getattr(stats, name).items():
                    total[adapter] = total.get(adapter, 0) + count
        blocks = merged.num_kv_blocks
        if blocks:
            merged.kv_cache_usage = sum(s.kv_cache_usage * s.num_kv_blocks for s in ranks) / blocks
        merged.moe_expert_parallel_size = ranks[0].moe_expert_parallel_size if ranks else 1
        merged.max_loras = ranks[0].max_loras if ranks else 0
        merged.structured_output = ranks[0].structured_output if ranks else {}
        return merged

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries_total:
            return 0.0
        return self.prefix_cache_hits_total / self.prefix_cache_queries_total

    def add_spec_interval(self, interval: SpecDecodingStats) -> None:
        """Fold one interval's speculative counts into the totals; the per-position list
        grows to the longest draft seen."""
        self.spec_decoding_enabled = True
        self.spec_num_drafts_total += interval.num_drafts
        self.spec_num_draft_tokens_total += interval.num_draft_tokens
        self.spec_num_accepted_tokens_total += interval.num_accepted_tokens
        per_pos = self.spec_num_accepted_tokens_per_pos_total
        extra = len(interval.num_accepted_tokens_per_pos) - len(per_pos)
        if extra > 0:
            per_pos.extend([0] * extra)
        for pos, accepted in enumerate(interval.num_accepted_tokens_per_pos):
            per_pos[pos] += accepted

    def add_expert_load(self, load: list[int]) -> None:
        totals = self.moe_expert_tokens_total
        if len(totals) < len(load):
            totals.extend([0] * (len(load) - len(totals)))
        for expert, count in enumerate(load):
            totals[expert] += count

    def moe_rank_tokens_total(self) -> list[int]:
        """The expert counts summed per expert-parallel rank (rank r owns the r-th
        consecutive run of experts)."""
        size = self.moe_expert_parallel_size
        totals = self.moe_expert_tokens_total
        if not totals or size <= 1 or len(totals) % size:
            return []
        per = len(totals) // size
        return [sum(totals[r * per : (r + 1) * per]) for r in range(size)]

    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """The cumulative speculative counts in the scheduler's shape (for its rates);
        None while speculative decoding is off."""
        if not self.spec_decoding_enabled:
            return None
        return SpecDecodingStats(
            num_drafts=self.spec_num_drafts_total,
            num_draft_tokens=self.spec_num_draft_tokens_total,
            num_accepted_tokens=self.spec_num_accepted_tokens_total,
            num_accepted_tokens_per_pos=list(self.spec_num_accepted_tokens_per_pos_total),
        )


# Fields EngineCoreStats.merge does not add up across ranks.
_NOT_ADDED = frozenset({"kv_cache_usage", "moe_expert_parallel_size", "max_loras"})

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
abort_decoder = msgspec.msgpack.Decoder(list[str])
utility_call_decoder = msgspec.msgpack.Decoder(UtilityCall)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
utility_result_decoder = msgspec.msgpack.Decoder(UtilityResult)
ready_decoder = msgspec.msgpack.Decoder(ReadyInfo)
dead_decoder = msgspec.msgpack.Decoder(EngineDeadInfo)


def describe_exception(exc: BaseException) -> str:
    """One line for the other side: the exception type and its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
