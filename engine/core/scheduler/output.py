"""What crosses the scheduler <-> executor boundary each step.

Diffs, not state (DESIGN lesson 3): a request the executor has never seen (or dropped
after preemption) arrives in full as :class:`NewRequestData`; afterwards only its new
block ids and progress travel in :class:`CachedRequestData`. The executor samples the
tokens itself, so generated tokens need not travel back down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.core.pooling_params import PoolingParams
from engine.core.sampling_params import SamplingParams
from engine.lora.request import LoRARequest
from engine.multimodal.inputs import MultiModalFeature


class PooledData(msgspec.Struct, array_like=True, gc=False):
    """One pooling request's result on the wire: float32 values in C order (the model
    runner packs them, the output processor unpacks them)."""

    data: bytes
    shape: list[int]


@dataclass
class NewRequestData:
    req_id: str
    # Prompt plus any tokens generated before a preemption (recompute resumes from here).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # the request's block table of each KV cache group
    num_computed_tokens: int
    eos_token_id: int | None = None  # the sampler masks it while output < min_tokens
    # A pooling request (runner "pooling"): what to pool, and the token type of every
    # prompt token (BERT pair encodings; None: all zeros).
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    # A model with state layers: the request's state slot in every state layer's cache
    # (engine.core.kv_cache.state_slots); None: the model has none.
    state_slot: int | None = None
    # The adapter the request runs under (None: the base model).
    lora_request: LoRARequest | None = None
    # Its images / videos (encoder inputs included); None: text only.
    mm_features: list[MultiModalFeature] | None = None


@dataclass
class CachedRequestData:
    """Per-step deltas for requests the executor already holds (parallel lists)."""

    req_ids: list[str] = field(default_factory=list)
    # Per request, the block ids appended to each KV cache group's table this step (a
    # windowed group's blocks that left the window stay in the executor's table unread).
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Tokens accepted since the executor last saw each request, for the ranks that do
    # not sample (earlier pipeline stages); empty lists unless the executor asks for them.
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's decision: ``num_scheduled_tokens`` is ``{req_id: tokens to compute}``."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Draft tokens to verify this step, per request (speculative decoding).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests the executor must forget before running this step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests whose next-token bitmask must be applied (structured outputs).
    structured_output_req_ids: list[str] = field(default_factory=list)
    # The KV connector's instructions for the worker side (its metadata_cls; None: no
    # connector).
    kv_connector_metadata: Any = None
    # Images / videos the worker encodes this step: per request, indices into its
    # mm_features; and encoder cache entries (identifiers) to drop before the step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_ids: list[str] = field(default_factory=list)
    # Speculative decoding: the most drafts each request may propose for the next step
    # (engine.core.scheduler.spec_governor: 0 while drafting does not pay); None: the proposer's K.
    max_draft_tokens: int | None = None
    # The governor settled on steps without drafts (not a probe): a proposer that keeps
    # its KV complete across such steps may let its oldest backlog go (EagleProposer.defer).
    drafts_settled_off: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @classmethod
    def empty(cls) -> SchedulerOutput:
        """A step that schedules nothing and changes no request (a lockstep data-parallel
        rank's dummy step)."""
        return cls([], CachedRequestData(), {}, 0)


@dataclass
class LogprobsLists:
    """Top-k logprobs of sampled (or prompt) tokens, one row per token.

    Row ``i``: ``token_ids[i][0]`` is the chosen token and ``logprobs[i][0]`` its logprob,
    followed by the top-k alternatives in descending order; ``ranks[i]`` is the chosen
    token's rank in the full distribution (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """What the executor sampled this step, in the executor's batch order."""

    req_ids: list[str]
    # Tokens accepted this step per request: [] for a prefill chunk that does not sample,
    # one token normally, several when speculative tokens were accepted.
    sampled_token_ids: list[list[int]]
    # Per request: logprobs of its sampled tokens (None when not requested).
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Per request: logprobs of the prompt tokens computed this step (chunk by chunk).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Per request (batch order): drafts proposed for the next step; None when the
    # engine does not speculate.
    spec_token_ids: list[list[int]] | None = None
    # MoE models: (token, choice) pairs each expert received this step, summed over the
    # reporting rank's MoE layers (under pipeline stages: the last stage's); None: dense.
    expert_load: list[int] | None = None
    # KV connector: what the worker side finished or failed since the previous step.
    kv_connector_output: KVConnectorOutput | None = None
    # Pooling runner: the result of every request whose prompt completed this step.
    pooler_output: dict[str, PooledData] = field(default_factory=dict)


@dataclass
class KVConnectorOutput:
    """Request ids whose asynchronous sends / receives completed, whose loads failed
    (recomputed), and the connector's cumulative counters."""

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    transfer_seconds: float = 0.0
    load_failures: int = 0
