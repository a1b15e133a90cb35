"""The speculation governor: drafting stays on while it measures faster, goes off (per batch
size) when it measures slower, and is tried again now and then; vLLM's static
``disable_by_batch_size`` rule; and the scheduler / runner wiring (a zero budget means no
drafts are proposed, and outputs stay those of plain decoding)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.scheduler.spec_governor import GovernorSettings, Mode, SpeculationGovernor

SETTINGS = GovernorSettings(warmup_steps=4, probe_steps=3, explore_every=8,
                            max_explore_every=32, margin=0.05)


def _run(governor: SpeculationGovernor, steps: int, batch: int, draft_rate: float,
         plain_rate: float) -> list[int]:
    """Drive ``steps`` decode steps whose per-request rates (tokens / s) are fixed per
    mode; returns the draft budgets the governor gave."""
    budgets = []
    for _ in range(steps):
        budget = governor.draft_budget(batch)
        budgets.append(budget)
        rate = draft_rate if budget else plain_rate
        governor.observe(batch, budget > 0, seconds=1.0, tokens=int(rate * batch))
    return budgets


def test_drafting_that_pays_stays_on_apart_from_short_probes():
    governor = SpeculationGovernor(4, settings=SETTINGS)
    budgets = _run(governor, 200, batch=1, draft_rate=300, plain_rate=100)
    assert governor.chosen_mode(1) is Mode.DRAFT
    assert budgets[:5] == [4] * 5  # it starts drafting
    off = budgets.count(0)
    assert 0 < off < 0.2 * len(budgets), off  # the plain probes are few ...
    assert budgets[-20:].count(0) <= SETTINGS.probe_steps + 1  # ... and sparser with time


def test_drafting_that_loses_goes_off_and_is_retried_less_and_less():
    governor = SpeculationGovernor(4, settings=SETTINGS)
    budgets = _run(governor, 300, batch=1, draft_rate=80, plain_rate=100)
    assert governor.chosen_mode(1) is Mode.PLAIN
    drafted = budgets.count(4)
    assert drafted < 0.2 * len(budgets), drafted
    first_half, second_half = budgets[:150].count(4), budgets[150:].count(4)
    assert second_half < first_half  # exploration backs off


@pytest.mark.parametrize("draft_rate", [100, 103])  # a tie, drafting ahead within the margin
def test_drafting_must_win_the_first_comparison_by_the_margin(draft_rate):
    """Speculation that does not clearly pay must not cost: a tie goes to plain steps."""
    governor = SpeculationGovernor(4, settings=SETTINGS)
    _run(governor, 100, batch=1, draft_rate=draft_rate, plain_rate=100)
    assert governor.chosen_mode(1) is Mode.PLAIN


def test_a_near_tie_is_explored_as_often_as_at_first():
    """Drafting that ties (an n-gram proposer that finds nothing drafts at plain speed)
    keeps being tried every explore_every steps: the back-off is for clear losses."""
    governor = SpeculationGovernor(4, settings=SETTINGS)
    budgets = _run(governor, 400, batch=1, draft_rate=101, plain_rate=100)
    assert governor.chosen_mode(1) is Mode.PLAIN
    late = budgets[200:]
    # explorations stay every ~explore_every (8) steps, not every max_explore_every (32)
    starts = [i for i in range(1, len(late)) if late[i] and not late[i - 1]]
    assert len(starts) >= 200 // (SETTINGS.explore_every + SETTINGS.probe_steps + 2), starts


def test_a_near_tie_keeps_the_incumbent():
    """Once drafting won, a later near tie does not flip it (hysteresis both ways)."""
    governor = SpeculationGovernor(4, settings=SETTINGS)
    _run(governor, 40, batch=1, draft_rate=200, plain_rate=100)
    assert governor.chosen_mode(1) is Mode.DRAFT
    _run(governor, 200, batch=1, draft_rate=100, plain_rate=103)  # within the margin
    assert governor.chosen_mode(1) is Mode.DRAFT


def test_one_slow_step_in_a_probe_does_not_decide():
    """A probe's rate is the median of its steps: one step that costs several (a
    proposer's catch-up pass, a graph's first replay) does not make plain steps look
    slower than drafting that loses."""
    governor = SpeculationGovernor(4, settings=SETTINGS)
    plain_steps = iter(range(10**6))
    while governor.chosen_mode(1) is None:  # warm-up drafting, then the plain probe
        budget = governor.draft_budget(1)
        if budget:
            rate = 90.0  # drafting loses by 10%
        else:
            rate = 15.0 if next(plain_steps) == 2 else 100.0  # one slow plain step
        governor.observe(1, budget > 0, seconds=1.0, tokens=int(rate))
    assert governor.chosen_mode(1) is Mode.PLAIN


def test_drafting_that_stops_paying_stops_before_the_next_exploration():
    """Acceptance collapses (the text stops repeating): drafting's own steps show it
    losing against the last plain measurement, and the governor turns it off within a
    probe's length, not after explore_every steps."""
    settings = GovernorSettings(warmup_steps=4, probe_steps=3, explore_every=500,
                                max_explore_every=1000, margin=0.05)
    governor = SpeculationGovernor(4, settings=settings)
    _run(governor, 30, batch=1, draft_rate=300, plain_rate=100)
    assert governor.chosen_mode(1) is Mode.DRAFT
    budgets = _run(governor, 30, batch=1, draft_rate=60, plain_rate=100)
    assert governor.chosen_mode(1) is Mode.PLAIN
    assert budgets.index(0) <= settings.probe_steps + 2, budgets


def test_drafting_steps_that_verified_nothing_are_not_evidence():
    """An n-gram proposer finds a match in one step of three: the other drafting steps
    verify nothing and run at plain speed. Only the steps that verified drafts say
    whether drafts pay (here: they do), so drafting is chosen, not a diluted tie."""
    governor = SpeculationGovernor(4, settings=SETTINGS)
    steps = iter(range(10**6))
    for _ in range(100):
        budget = governor.draft_budget(1)
        verified = budget > 0 and next(steps) % 3 == 0
        rate = 300 if verified else 100
        governor.observe(1, budget > 0, seconds=1.0, tokens=rate, verified=verified)
    assert governor.chosen_mode(1) is Mode.DRAFT
    # an exploration of drafting that finds nothing to verify ends, back to the choice
    quiet = SpeculationGovernor(4, settings=SETTINGS)
    _run(quiet, 60, batch=1, draft_rate=80, plain_rate=100)
    assert quiet.chosen_mode(1) is Mode.PLAIN
    budgets = []
    for _ in range(200):
        budget = quiet.draft_budget(1)
        budgets.append(budget)
        quiet.observe(1, budget > 0, seconds=1.0, tokens=100, verified=False)
    assert quiet.chosen_mode(1) is Mode.PLAIN
    assert 0 < budgets.count(4) < 0.5 * len(budgets)


def test_plain_is_settled_only_by_the_comparison():
    """plain_settled: steps without drafts by the comparison's choice, not while warming
    up, probing, drafting, or under the static rule."""
    governor = SpeculationGovernor(4, settings=SETTINGS)
    settled = []
    for _ in range(120):
        settled.append((governor.draft_budget(1), governor.plain_settled(1)))
        rate = 80 if settled[-1][0] else 100
        governor.observe(1, settled[-1][0] > 0, seconds=1.0, tokens=rate)
    assert governor.chosen_mode(1) is Mode.PLAIN
    assert not any(s for _, s in settled[: SETTINGS.warmup_steps])  # warming up: drafts
    assert all(budget == 0 for budget, s in settled if s)  # settled: never a draft step
    assert any(s for _, s in settled)
    # the explorations of drafting, and the plain probe before the first choice, are not
    assert any(budget == 0 and not s for budget, s in settled)
    static = SpeculationGovernor(4, settings=SETTINGS, disable_by_batch_size=2)
    assert static.draft_budget(4) == 0 and not static.plain_settled(4)
    pinned = SpeculationGovernor(4, adaptive=False)
    assert not pinned.plain_settled(1)


def test_batch_sizes_are_judged_apart():
    governor = SpeculationGovernor(4, settings=SETTINGS)
    _run(governor, 100, batch=1, draft_rate=300, plain_rate=100)  # pays at batch 1
    _run(governor, 100, batch=48, draft_rate=60, plain_rate=100)  # loses at batch 48
    assert governor.chosen_mode(1) is Mode.DRAFT
    assert governor.chosen_mode(40) is Mode.PLAIN  # 40 and 48: one bucket (32-63)
    assert governor.draft_budget(1) == 4 and governor.draft_budget(48) == 0


def test_when_the_text_changes_the_choice_follows():
    governor = SpeculationGovernor(4, settings=SETTINGS)
    _run(governor, 120, batch=2, draft_rate=80, plain_rate=100)
    assert governor.chosen_mode(2) is Mode.PLAIN
    _run(governor, 300, batch=2, draft_rate=400, plain_rate=100)  # now it copies text
    assert governor.chosen_mode(2) is Mode.DRAFT


def test_static_and_pinned_settings():
    static = SpeculationGovernor(3, adaptive=False, disable_by_batch_size=8)
    assert [static.draft_budget(b) for b in (1, 7, 8, 64)] == [3, 3, 0, 0]
    pinned = SpeculationGovernor(3, adaptive=False)
    assert _run(pinned, 50, batch=1, draft_rate=1, plain_rate=100) == [3] * 50


def test_speculative_config_takes_the_settings():
    from engine.core.config import SpeculativeConfig

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                               disable_by_batch_size=4, adaptive=False)
    assert (config.disable_by_batch_size, config.adaptive) == (4, False)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=0)


def test_adaptive_by_default_unless_the_environment_pins_it(monkeypatch):
    from engine.core.config import SPEC_ADAPTIVE_ENV, SpeculativeConfig

    monkeypatch.delenv(SPEC_ADAPTIVE_ENV, raising=False)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).adaptive is True
    monkeypatch.setenv(SPEC_ADAPTIVE_ENV, "0")  # what this suite runs with (conftest)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).adaptive is False
    monkeypatch.setenv(SPEC_ADAPTIVE_ENV, "maybe")
    with pytest.raises(ValueError, match="expected 1 or 0"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2)


PROMPT = "one two three four one two three four one two three"


def test_a_zero_budget_proposes_nothing_and_decodes_as_without_speculation():
    """``disable_by_batch_size=1``: every step's budget is 0, so no draft is ever
    proposed or verified, and the greedy output is plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(enforce_eager=True) as plain:
        want = plain.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    with LLM(enforce_eager=True, speculative_config={**spec, "disable_by_batch_size": 1}) as llm:
        got = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.get_spec_decoding_stats()
    assert got == want
    assert stats.num_drafts == 0
    with LLM(enforce_eager=True, speculative_config={**spec, "adaptive": False}) as llm:
        assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == want
        assert llm.get_spec_decoding_stats().num_drafts > 0  # it did draft


def test_a_draft_model_skipped_for_some_steps_catches_up(monkeypatch):
    """Steps with a zero budget skip the draft model altogether; its next proposal first
    runs over the positions it missed, so its KV cache has every position of the
    sequence (a gap would leave its drafts attending over stale entries) and the output
    is plain greedy's."""
    from engine.core.scheduler import spec_governor
    from engine.spec_decode.draft_model import DraftModelProposer

    prompt = "The hacker is a person who"
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(enforce_eager=True) as plain:
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    covered: set[int] = set()  # positions any of its passes wrote KV for
    run = DraftModelProposer._run

    def recording(self, input_batch, step, **extra):
        covered.update(step.positions.tolist())
        return run(self, input_batch, step, **extra)

    calls = iter(range(10**6))
    monkeypatch.setattr(spec_governor.SpeculationGovernor, "draft_budget",
                        lambda self, batch: 0 if next(calls) % 4 < 2 else self.k)
    monkeypatch.setattr(DraftModelProposer, "_run", recording)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
    with LLM(enforce_eager=True, speculative_config=spec) as llm:
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        stats = llm.get_spec_decoding_stats()
    assert list(got.token_ids) == list(want.token_ids)
    assert stats.num_drafts > 0  # it drafted in the steps with a budget
    newest = max(covered)
    assert newest >= 40  # it followed the sequence to (near) its end
    assert covered == set(range(newest + 1)), sorted(set(range(newest + 1)) - covered)
