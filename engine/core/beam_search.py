"""Beam search as vLLM defines it: one bookkeeping class, driven by the offline ``LLM`` and
by ``AsyncLLM`` alike.

Each round, every live beam is submitted to the engine as a prompt (the beam's full
token ids: prompt + generated so far) asking for ONE token with ``logprobs = 2 *
beam_width`` (transformers' choice of candidates per step). Beams of one prompt share
everything but their last few tokens, so the engine's prefix cache serves their common
full blocks: nothing is copied, and only the uncached tail of each beam is computed.

Each beam's reported tokens become candidates scored by cumulative logprob. A candidate
ending in EOS (the tokenizer's EOS or the generation config's extra EOS ids; unless
``ignore_eos``) moves to the finished set; the best ``beam_width`` of the others stay live.
The search stops after ``max_tokens`` rounds or when no beam is live (a beam reaching
max_model_len finishes with reason "length"). The answer is the best ``beam_width`` of
finished + live beams by :func:`get_beam_search_score`.

Scoring (vLLM's ``get_beam_search_score``, verified against vLLM's ``beam_search.py``):
``cum_logprob / (seq_len ** length_penalty)`` where ``seq_len = len(tokens)`` counts the
PROMPT tokens and the generated tokens, minus one if the last token is EOS. (transformers'
beam scorer, 5.x, divides by the number of generated tokens INCLUDING the EOS instead; the
two agree whenever all candidates have the same length, e.g. ``ignore_eos`` with a fixed
``max_tokens``, where both rank by cumulative logprob.) Within a round all live beams of
a prompt have the same length, so pruning is by cumulative logprob (as in vLLM, a live
beam ending in EOS under ``ignore_eos`` still counts one token less).

Logprobs are the model's raw log-softmax (the engine reports them before temperature);
``temperature > 0`` only makes each round's sampled token (an extra candidate when it is
outside the top 2 * beam_width) random, as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.core.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``; every bad value raises a ValueError naming it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")

    def round_params(self) -> SamplingParams:
        """What each beam asks of the engine per round: one token, 2 * beam_width logprobs."""
        return SamplingParams(
            n=1, max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
            ignore_eos=self.ignore_eos, detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One beam. ``tokens`` include the prompt (as in vLLM); ``logprobs`` has one entry
    per generated token (the reported candidates of that round); ``text`` is filled when
    returned: the decoded prompt + generated tokens (special tokens skipped; a final EOS
    left out unless ``include_stop_str_in_output``)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # the EOS id that finished it
    num_prompt_tokens: int = field(default=0, repr=False)

    @property
    def generated_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float,
                          eos_token_ids: int | set[int] | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: ``cumulative_logprob / seq_len ** length_penalty``, ``seq_len`` the
    number of tokens INCLUDING the prompt, minus one when the last one is EOS."""
    eos = eos_token_ids if isinstance(eos_token_ids, (set, frozenset)) else {eos_token_ids}
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos:
        seq_len -= 1
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


class BeamSearchInstance:
    """The search state of one prompt: submit :attr:`beams`, feed each one's position
    logprobs to :meth:`advance`, until :attr:`done`; then :meth:`finish`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: set[int], max_model_len: int) -> None:
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self._score_eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.beams: list[BeamSearchSequence] = [
            BeamSearchSequence(list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.rounds = 0
        self._retire_full_beams()

    def score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self._score_eos,
                                     self.params.length_penalty)

    @property
    def done(self) -> bool:
        return not self.beams or self.rounds >= self.params.max_tokens

    def advance(self, results: list[PositionLogprobs | None]) -> None:
        """One round: ``results[i]`` is the logprobs of beam ``i``'s one new position
        (None: the request produced nothing, e.g. aborted; that beam is dropped)."""
        if len(results) != len(self.beams):
            raise ValueError(f"{len(results)} results for {len(self.beams)} beams")
        candidates: list[BeamSearchSequence] = []
        for beam, position in zip(self.beams, results):
            if not position:
                continue
            for token_id, logprob in position.items():
                new = BeamSearchSequence(
                    beam.tokens + [token_id], beam.logprobs + [position],
                    beam.cum_logprob + logprob.logprob, num_prompt_tokens=self.num_prompt_tokens)
                if token_id in self.eos_token_ids:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self.score, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.rounds += 1
        self._retire_full_beams()

    def _retire_full_beams(self) -> None:
        """A beam that fills max_model_len cannot be submitted again: it is finished."""
        full = [b for b in self.beams if len(b.tokens) >= self.max_model_len]
        for beam in full:
            beam.finish_reason = "length"
        self.completed.extend(full)
        self.beams = [b for b in self.beams if len(b.tokens) < self.max_model_len]

    def finish(self, tokenizer: Any) -> BeamSearchOutput:
        """The best ``beam_width`` of finished + live beams, best first, with text."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, key=self.score, reverse=True)
        best = ranked[: self.params.beam_width]
        for beam in best:
            beam.text = self._decode(tokenizer, beam.tokens, beam)
        return BeamSearchOutput(best)

    def _decode(self, tokenizer: Any, tokens: list[int], beam: BeamSearchSequence) -> str:
        if tokenizer is None:
            return ""
        if (beam.finish_reason == "stop" and not self.params.include_stop_str_in_output
                and tokens and tokens[-1] == beam.stop_reason):
            tokens = tokens[:-1]
        return tokenizer.decode(tokens, skip_special_tokens=True)

    def request_output(self, request_id: str, prompt_text: str | None, tokenizer: Any
                       ) -> RequestOutput:
        """The result as one finished ``RequestOutput`` with ``beam_width`` completions
        (best first; text and token ids are the generated part only), as vLLM's
        ``AsyncLLM.beam_search`` yields it."""
        output = self.finish(tokenizer)
        completions = []
        for i, beam in enumerate(output.sequences):
            generated = beam.generated_tokens
            completions.append(CompletionOutput(
                index=i, text=self._decode(tokenizer, generated, beam), token_ids=generated,
                cumulative_logprob=beam.cum_logprob, logprobs=beam.logprobs,
                finish_reason=beam.finish_reason, stop_reason=beam.stop_reason))
        prompt_ids = output.sequences[0].tokens[: self.num_prompt_tokens] if output.sequences \
            else []
        return RequestOutput(request_id=request_id, prompt=prompt_text,
                             prompt_token_ids=prompt_ids, prompt_logprobs=None,
                             outputs=completions, finished=True)


def eos_ids_of(processor: Any) -> set[int]:
    """The EOS ids a beam finishes on: the tokenizer's plus the generation config's."""
    ids = set(getattr(processor, "extra_eos_token_ids", ()) or ())
    if processor.eos_token_id is not None:
        ids.add(processor.eos_token_id)
    return ids
