"""Scheduler load snapshot for metrics and logging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodingStats:
    """Speculative decoding since the previous ``make_stats()``: drafts verified, draft
    tokens proposed and accepted, and acceptances by draft position (0 = first draft)."""

    num_drafts: int = 0  # verification steps that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: ``num_accepted`` of its drafts were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the target's own token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SchedulerStats:
    """Queue lengths and KV usage now; prefix-cache and preemption counts since the
    previous ``Scheduler.make_stats()`` call."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks held by requests
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found computed
    num_preemptions: int
    prefix_cache_requests: int = 0
    spec: SpecDecodingStats | None = None  # None when speculative decoding is off
    # MoE: tokens routed to each expert since the previous make_stats (None: dense model).
    expert_load: list[int] | None = None
    # Prompt tokens run through the model, and prompt tokens whose KV a connector loaded,
    # since the previous make_stats.
    prompt_tokens_computed: int = 0
    external_tokens_loaded: int = 0
    # The KV connector's cumulative counters (KVConnectorOutput; None: no connector) and
    # finished requests whose blocks wait for a consumer to pull them.
    kv_transfer: Any = None
    num_held_for_send: int = 0
    # LoRA (max_loras 0: off): requests per adapter name, running and waiting.
    max_loras: int = 0
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
