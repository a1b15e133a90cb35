"""Token sampling: persistent per-row state, per-step metadata and the sampler pipeline.

The model runner keeps one :class:`SamplingState` for its persistent batch, calls
``build_metadata(rows)`` for the rows that sample each step, runs :class:`Sampler` on
their logits, and feeds the sampled tokens back with ``append_tokens``.
"""

from engine.model_executor.sampling.logits_processors import (
    apply_token_bitmask,
    unpack_token_bitmask,
)
from engine.model_executor.sampling.logprobs import (
    BatchLogprobsLists,
    LogprobsTensors,
    compute_prompt_logprobs,
    gather_logprobs,
)
from engine.model_executor.sampling.metadata import SamplingMetadata
from engine.model_executor.sampling.penalties import apply_penalties
from engine.model_executor.sampling.sampler import Sampler, SamplerOutput
from engine.model_executor.sampling.state import SamplingState

__all__ = [
    "BatchLogprobsLists",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "apply_penalties",
    "apply_token_bitmask",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "unpack_token_bitmask",
]
