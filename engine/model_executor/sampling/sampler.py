"""The sampler: logits of the sampling rows -> one token per row (+ logprobs).

Pipeline, in order, each stage skipped when no row of the batch uses it:

1. Logprobs of the raw model distribution (``log_softmax`` of the unmodified logits),
   only when some row asks for logprobs; reported for the token finally chosen.
2. Logits processors, all setting masked tokens to ``-inf``: ``allowed_token_ids``
   (whitelist); ``bad_words`` (single-token words always, a multi-token word's last token
   when the history ends with the word's other tokens); ``logit_bias`` (added);
   ``min_tokens`` (EOS and ``stop_token_ids`` banned while the output is shorter); then
   the optional structured-output bitmask (packed int32, bit set = allowed).
3. Penalties: repetition (prompt + output tokens), frequency and presence (output).
4. Greedy rows take the argmax of the logits processed so far. Random rows are divided
   by their temperature (greedy rows hold 1.0, so temperature 0 never divides by zero).
5. min-p, 6. top-k, 7. top-p (top-p renormalized over the top-k set); both found among
   ``torch.topk`` candidates, with one shared sort only for rows whose nucleus is wider.
8. Sampling: by inverse CDF where the platform has a kernel for it (``FusedOps.categorical``:
   one uniform ``u`` per row, the first token whose running probability passes ``u``),
   else by exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` draws a token
   with probability ``probs`` (the Gumbel-max trick in linear space; one random number
   per vocabulary entry, cheap on GPUs, ~22 ns each in torch on a CPU). Seeded rows draw
   their randomness from their request's own generator, keyed by (seed, output position)
   when the metadata is built, so a seed reproduces its tokens whatever else is in the
   batch, whatever row holds it, and across preemption; unseeded rows share one draw
   from the device's default generator.

``logits`` (float32, as the runner should produce them) are modified in place; other
floating dtypes are upcast to a float32 copy first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.interfaces import FusedOps
from engine.model_executor.sampling import row_softmax
from engine.model_executor.sampling.logits_processors import (
    apply_allowed_token_ids,
    apply_banned_tokens,
    apply_logit_bias,
    apply_token_bitmask,
)
from engine.model_executor.sampling.logprobs import LogprobsTensors, gather_logprobs
from engine.model_executor.sampling.metadata import SamplingMetadata
from engine.model_executor.sampling.penalties import apply_batch_penalties
from engine.model_executor.sampling.topk_topp import apply_min_p, apply_top_k_top_p

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


# FusedOps.categorical: (probs [N, V], float64 uniforms [N]) -> int64 [N], or None.
Categorical = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    """Stateless: everything per-request arrives in :class:`SamplingMetadata`.

    ``fused_ops``: the platform's kernels; their row-wise argmax replaces torch's."""

    def __init__(self, fused_ops: FusedOps | None = None) -> None:
        self.argmax = fused_ops.argmax if fused_ops is not None else torch_argmax
        self.categorical = fused_ops.categorical if fused_ops is not None else None

    def draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One token per row of ``probs`` (see :func:`draw_tokens`); overwrites ``probs``."""
        return draw_tokens(probs, generators, self.argmax, self.categorical)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        logits, raw_logprobs = process_logits(logits, metadata, token_bitmask)
        sampled = sample(logits, metadata, self.argmax, self.categorical)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
            logprobs.num_logprobs = metadata.num_logprobs
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def process_logits(
    logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stages 1-3: the raw logprobs (when some row asks), then processors and penalties
    in place. Returns the float32 logits and the raw logprobs (or None)."""
    logits = _as_float32_logits(logits, metadata)
    raw_logprobs = None
    if metadata.max_num_logprobs is not None:
        raw_logprobs = row_softmax.log_softmax(logits)
    apply_logits_processors(logits, metadata, token_bitmask)
    if metadata.penalties is not None:
        apply_batch_penalties(logits, metadata.penalties)
    return logits, raw_logprobs


def apply_logits_processors(
    logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None
) -> None:
    """Stage 2: whitelists, bans, biases and the grammar bitmask, in place."""
    if metadata.allowed_token_ids is not None:
        apply_allowed_token_ids(logits, metadata.allowed_token_ids)
    if metadata.bad_words is not None:
        apply_banned_tokens(logits, metadata.bad_words)
    if metadata.logit_bias is not None:
        apply_logit_bias(logits, metadata.logit_bias)
    if metadata.min_tokens is not None:
        apply_banned_tokens(logits, metadata.min_tokens)
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask)


def sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
    categorical: Categorical | None = None,
) -> torch.Tensor:
    """Stages 4-8 on processed logits: greedy argmax or a random draw per row."""
    greedy = None
    if not metadata.all_random:
        greedy = argmax(logits)
        if metadata.all_greedy:
            return greedy
    if metadata.temperature is not None:
        logits.div_(metadata.temperature.unsqueeze(1))
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
    probs = row_softmax.softmax(logits)
    drawn = draw_tokens(probs, metadata.generators, argmax, categorical)
    if greedy is None:
        return drawn
    return torch.where(metadata.greedy_mask, greedy, drawn)


def draw_tokens(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
    categorical: Categorical | None = None,
) -> torch.Tensor:
    """One token per row of ``probs`` ``[N, V]``: the platform's inverse-CDF kernel
    (``FusedOps.categorical``, one uniform per row) where it has one, else the exponential
    race. Rows in ``generators`` take their randomness from their own generator. May
    overwrite ``probs``."""
    if categorical is not None:
        drawn = categorical(probs, row_uniforms(probs.shape[0], generators, probs.device))
        if drawn is not None:
            return drawn
    return exponential_race(probs, generators, argmax)


def row_uniforms(num_rows: int, generators: dict[int, torch.Generator],
                 device: torch.device) -> torch.Tensor:
    """float64 ``[num_rows]`` uniforms in [0, 1): rows in ``generators`` from their own
    generator (one draw each), the others from the shared one."""
    u = torch.rand(num_rows, dtype=torch.float64, device=device)
    for row, generator in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)[0]
    return u


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
) -> torch.Tensor:
    """Draw one token per row from ``probs`` ``[N, V]`` as ``argmax(probs / q)``.

    Rows listed in ``generators`` take ``q`` from their own generator (one ``[V]`` draw
    each); the rest share one batch draw. Overwrites ``probs``.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    q.clamp_min_(_TINY)  # q == 0 would turn a masked token's 0/0 into a winning NaN
    return argmax(probs.div_(q))


def _as_float32_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Validate the shape; half-precision logits are upcast (a copy) before sampling."""
    expected = (metadata.num_rows, metadata.vocab_size)
    if logits.dim() != 2 or tuple(logits.shape) != expected:
        raise ValueError(f"logits must have shape {list(expected)}, got {list(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    return logits if logits.dtype == torch.float32 else logits.to(torch.float32)
