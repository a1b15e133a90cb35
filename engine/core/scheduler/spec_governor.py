"""Speculate only while it pays: per batch size, the measured rates with and without drafts.

Speculative decoding pays when the tokens a step gains (its accepted drafts) outweigh
what drafting and verifying cost. Both sides move at run time: acceptance follows the
text (an n-gram proposer finds nothing in free prose, everything in a copied passage),
the costs follow the batch size (a verification row is nearly free at batch 1 and a
whole extra row of compute at batch 64). So the scheduler asks a
:class:`SpeculationGovernor` before every step whether the coming steps draft, and tells
it afterwards what each step took.

The governor keeps, per batch-size bucket (1, 2-3, 4-7, ...), the decode tokens each
request gains per second in each mode (the median of its last ``probe_steps``
decode-only steps; the first step after a switch is skipped: it still verifies or lacks
the previous mode's drafts; a drafting step that verified no drafts ran at plain speed
and is skipped too). It starts drafting, and once it has measured both modes it
keeps the faster one (by a margin, so noise does not flip it; at the first comparison
drafting must win by the margin: a tie is no reason to pay for a proposer) and tries the
other again now and then: after ``explore_every`` steps, twice as long each time the
choice held, up to ``max_explore_every``; while it drafts, its own recent steps are held
against the last plain measurement, so drafting whose acceptance collapses stops at once.
A decision is a step's draft budget: the proposer's K, or 0 (a draft model then catches
up at its next proposal and an EAGLE head defers its pass, so their KV caches stay
complete -- except while plain steps are the settled choice,
:meth:`SpeculationGovernor.plain_settled`: an EAGLE backlog at its limit is then let go
rather than caught up for drafts that may never come).

vLLM's static rule is here too: with ``disable_by_batch_size`` the steps of that many
requests or more never draft.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

logger = logging.getLogger(__name__)


class Mode(Enum):
    DRAFT = "draft"
    PLAIN = "plain"

    @property
    def other(self) -> Mode:
        return Mode.PLAIN if self is Mode.DRAFT else Mode.DRAFT


@dataclass
class _Rate:
    """A mode's per-request decode rate (tokens per second): the median of its last
    ``window`` steps. A median, not an average: one step in a probe can cost several
    ordinary ones (a proposer catching up its KV, the first graph of a shape), and a
    six-step probe averaged over it chose the wrong mode."""

    window: int = 6
    recent: deque[float] = field(default_factory=deque)
    samples: int = 0

    def add(self, rate: float) -> None:
        self.recent.append(rate)
        if len(self.recent) > self.window:
            self.recent.popleft()
        self.samples += 1

    @property
    def value(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0


@dataclass
class _Bucket:
    """What one batch-size bucket has measured and chosen."""

    explore_every: int
    window: int  # steps per rate median (the settings' probe_steps)
    sizes: str = ""  # the batch sizes it holds, for the log
    mode: Mode = Mode.DRAFT
    rates: dict[Mode, _Rate] = field(init=False)
    steps_in_mode: int = 0  # decode steps since the mode last changed
    samples_in_mode: int = 0  # of them, rate samples (drafting steps that verified drafts)
    choice: Mode | None = None  # the mode the comparison picked (None: not yet compared)
    explored: bool = False  # this run of the other mode is an exploration

    def __post_init__(self) -> None:
        self.rates = {m: _Rate(self.window) for m in Mode}


@dataclass
class GovernorSettings:
    warmup_steps: int = 24  # decode steps drafting before the first comparison
    probe_steps: int = 6  # decode steps of the other mode per measurement
    explore_every: int = 64  # steps of the chosen mode before trying the other again
    max_explore_every: int = 1024
    margin: float = 0.03  # the other mode must be this much faster to take over


class SpeculationGovernor:
    """Draft or not, per step (the module docstring)."""

    def __init__(self, num_speculative_tokens: int, *, adaptive: bool = True,
                 disable_by_batch_size: int | None = None,
                 settings: GovernorSettings | None = None) -> None:
        self.k = num_speculative_tokens
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.settings = settings or GovernorSettings()
        self._buckets: dict[int, _Bucket] = {}
        self.switches = 0  # mode changes (stats, tests)

    def _bucket(self, batch_size: int) -> _Bucket:
        key = max(1, batch_size).bit_length()
        bucket = self._buckets.get(key)
        if bucket is None:
            low = 1 << (key - 1)
            bucket = self._buckets[key] = _Bucket(
                self.settings.explore_every, self.settings.probe_steps,
                f"{low}-{2 * low - 1}" if low > 1 else "1")
        return bucket

    def draft_budget(self, batch_size: int) -> int:
        """Drafts each request of a step of ``batch_size`` decoding requests may
        propose for the next step: K, or 0."""
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return 0
        if not self.adaptive or batch_size < 1:
            return self.k
        return self.k if self._bucket(batch_size).mode is Mode.DRAFT else 0

    def plain_settled(self, batch_size: int) -> bool:
        """Whether steps of ``batch_size`` run without drafts by the comparison's choice
        (not a probe): a proposer that keeps its KV complete across plain steps (an EAGLE
        head's deferred pass) may then let the oldest positions go instead of paying a
        catch-up pass that may never be used."""
        if not self.adaptive or batch_size < 1 or (
                self.disable_by_batch_size is not None
                and batch_size >= self.disable_by_batch_size):
            return False
        bucket = self._bucket(batch_size)
        return bucket.choice is Mode.PLAIN and bucket.mode is Mode.PLAIN and not bucket.explored

    def observe(self, batch_size: int, drafted: bool, seconds: float, tokens: int, *,
                verified: bool = True) -> None:
        """A decode-only step of ``batch_size`` requests, run with a draft budget
        (``drafted``) or without, took ``seconds`` and emitted ``tokens`` in all;
        ``verified``: it verified drafts. A drafting step that verified none (an n-gram
        proposer found no match) ran at plain speed and says nothing about whether drafts
        pay: it is not a sample."""
        if not self.adaptive or batch_size < 1 or seconds <= 0:
            return
        bucket = self._bucket(batch_size)
        mode = Mode.DRAFT if drafted else Mode.PLAIN
        if mode is not bucket.mode:
            return  # a step decided before the last switch
        bucket.steps_in_mode += 1
        # the first step after a switch still carries the last mode's drafts (or lacks them)
        if bucket.steps_in_mode > 1 and (verified or mode is Mode.PLAIN):
            bucket.rates[mode].add(tokens / batch_size / seconds)
            bucket.samples_in_mode += 1
        self._next_mode(bucket)

    def _next_mode(self, bucket: _Bucket) -> None:
        s = self.settings
        measured = bucket.rates[bucket.mode].samples
        if bucket.choice is None:  # warming up: drafting, then one probe without
            if bucket.mode is Mode.DRAFT and measured >= s.warmup_steps:
                self._switch(bucket, Mode.PLAIN, explored=True)
            elif bucket.mode is Mode.PLAIN and measured >= s.probe_steps:
                self._choose(bucket)
            return
        if bucket.explored:
            if bucket.samples_in_mode >= s.probe_steps:
                self._choose(bucket)
            elif bucket.steps_in_mode > 4 * s.probe_steps:  # drafts found nothing to verify
                self._switch(bucket, bucket.choice, explored=False)
        elif bucket.steps_in_mode >= bucket.explore_every:
            self._switch(bucket, bucket.mode.other, explored=True)
        elif (bucket.mode is Mode.DRAFT and bucket.samples_in_mode >= s.probe_steps
              and self._clearly_faster(bucket, Mode.PLAIN)):
            # Drafting's own steps show it losing (acceptance collapsed: the text stopped
            # repeating): back to plain steps now, not at the next exploration.
            self._choose(bucket)

    def _choose(self, bucket: _Bucket) -> None:
        """Keep the faster mode: the incumbent unless the other is faster by the margin.
        The first comparison has no incumbent: drafting must then beat the plain steps by
        the margin (a tie is no reason to pay for a proposer, and speculation that does
        not clearly pay must not cost)."""
        rates = bucket.rates
        incumbent = bucket.choice or Mode.PLAIN
        challenger = incumbent.other
        choice = challenger if self._clearly_faster(bucket, challenger) else incumbent
        if choice is not incumbent or bucket.choice is None:
            logger.info("speculative decoding %s at batch sizes %s: %.1f tokens/s per request "
                        "drafting, %.1f without", "on" if choice is Mode.DRAFT else "off",
                        bucket.sizes, rates[Mode.DRAFT].value, rates[Mode.PLAIN].value)
        if choice is bucket.choice:  # confirmed: look again less often, if it was clear
            # (a near tie -- an n-gram proposer finding nothing drafts at plain speed --
            # keeps looking as often: the text may start repeating any time)
            if self._clearly_faster(bucket, choice):
                bucket.explore_every = min(2 * bucket.explore_every,
                                           self.settings.max_explore_every)
        else:
            bucket.explore_every = self.settings.explore_every
        bucket.choice = choice
        self._switch(bucket, choice, explored=False)

    def _clearly_faster(self, bucket: _Bucket, mode: Mode) -> bool:
        """Whether ``mode``'s rate beats the other's by the margin."""
        rates = bucket.rates
        return rates[mode].value > rates[mode.other].value * (1 + self.settings.margin)

    def _switch(self, bucket: _Bucket, mode: Mode, explored: bool) -> None:
        if mode is not bucket.mode:
            self.switches += 1
            bucket.mode = mode
            bucket.steps_in_mode = bucket.samples_in_mode = 0
        bucket.explored = explored

    def chosen_mode(self, batch_size: int) -> Mode | None:
        """The mode the comparison settled on for this batch size (None: not yet)."""
        return self._bucket(batch_size).choice
