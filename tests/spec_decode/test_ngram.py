"""NgramProposer against plain-loop references: random batches, edge cases, a big batch."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.spec_decode.ngram import NgramProposer


def reference_drafts(history: list[int], min_n: int, max_n: int, k: int, cap: int) -> list[int]:
    """Prompt lookup spelled out: longest n first; the most recent earlier occurrence that
    min(k, cap) history tokens follow, else the most recent one."""
    total, want = len(history), min(k, cap)
    for n in range(max_n, min_n - 1, -1):
        if total <= n:
            continue
        suffix = history[total - n :]
        # An occurrence must end before the final position: start s <= total - n - 1.
        starts = [s for s in range(total - n - 1, -1, -1) if history[s : s + n] == suffix]
        if starts:
            full = [s for s in starts if s + n + want <= total]
            s = full[0] if full else starts[0]
            return history[s + n : s + n + want]
    return []


def rfind_drafts(history: bytes, min_n: int, max_n: int, k: int, cap: int) -> list[int]:
    """Same rule via bytes.rfind (C speed) for byte-sized vocabularies; checks the big batch."""
    total, want = len(history), min(k, cap)
    for n in range(max_n, min_n - 1, -1):
        if total <= n:
            continue
        suffix = history[total - n :]
        s = history.rfind(suffix, 0, total - want)  # followed by `want` tokens
        if s < 0:
            s = history.rfind(suffix, 0, total - 1)
        if s >= 0:
            return list(history[s + n : s + n + want])
    return []


def pad(histories: list[list[int]], width: int | None = None, fill: int = 7) -> tuple:
    """[R, L] int64 batch with scratch ``fill`` after each history, plus lengths."""
    width = max([len(h) for h in histories] + [0]) if width is None else width
    tokens = np.full((len(histories), width), fill, dtype=np.int64)
    for r, h in enumerate(histories):
        tokens[r, : len(h)] = h
    return tokens, np.array([len(h) for h in histories], dtype=np.int64)


def propose(histories, k, min_n, max_n, caps=None, width=None, fill=7):
    """Run the proposer on python lists; return the drafts as lists (checking the padding)."""
    tokens, lengths = pad(histories, width, fill)
    caps = np.full(len(histories), k, dtype=np.int64) if caps is None else np.asarray(caps)
    drafts, num = NgramProposer(k, min_n, max_n).propose_tokens(tokens, lengths, caps)
    assert drafts.shape == (len(histories), k) and drafts.dtype == np.int64
    assert num.shape == (len(histories),) and num.dtype == np.int64
    out = []
    for r in range(len(histories)):
        assert (drafts[r, num[r] :] == -1).all()
        out.append(drafts[r, : num[r]].tolist())
    return out


A, B, C, D, E = 1, 2, 3, 4, 5


def test_example_from_spec_overlapping_suffix():
    # "a b a b a", n=2: suffix "b a" last seen at 1..2, followed by "b a" (overlaps the suffix).
    assert propose([[A, B, A, B, A]], k=3, min_n=2, max_n=2) == [[B, A]]


def test_no_match():
    assert propose([[A, B, C, D, E]], k=3, min_n=1, max_n=3) == [[]]


def test_suffix_itself_does_not_count():
    # The only occurrence of "d" is the final token itself.
    assert propose([[A, B, C, D]], k=2, min_n=1, max_n=1) == [[]]


def test_match_at_the_very_beginning():
    assert propose([[A, B, C, D, E, A, B]], k=3, min_n=2, max_n=2) == [[C, D, E]]


def test_a_loop_is_continued_for_a_full_draft():
    # "a b a b a b a", n=2: "b a" last ends at 4, followed by only "b a" before the history
    # ends; the occurrence ending at 2 is followed by "b a b": the loop, for all 3 drafts.
    assert propose([[A, B, A, B, A, B, A]], k=3, min_n=2, max_n=2) == [[B, A, B]]
    # a period-1 loop: four drafts from the occurrence four tokens back, not one
    assert propose([[C] + [A] * 8], k=4, min_n=1, max_n=3) == [[A, A, A, A]]
    # a cap of 1 is satisfied by the most recent occurrence
    assert propose([[A, B, A, B, A, B, A]], k=3, min_n=2, max_n=2, caps=[1]) == [[B]]


def test_most_recent_occurrence_wins():
    # "a b" occurs at 0 (followed by c) and at 3 (followed by d); the later one wins.
    assert propose([[A, B, C, A, B, D, E, A, B]], k=2, min_n=2, max_n=2) == [[D, E]]


def test_longest_n_wins_over_more_recent_shorter_match():
    # n=3 "c a b" only matches at 2..4 (followed by d); n=2 "a b" is more recent at 6..7 (e).
    history = [D, D, C, A, B, D, A, B, E, C, A, B]
    assert propose([history], k=1, min_n=1, max_n=3) == [[D]]
    assert propose([history], k=1, min_n=1, max_n=2) == [[E]]


def test_min_n_rejects_shorter_matches():
    # Only a 1-gram match exists ("b" at 1); min_n=2 forbids it.
    assert propose([[A, B, C, D, B]], k=2, min_n=2, max_n=3) == [[]]
    assert propose([[A, B, C, D, B]], k=2, min_n=1, max_n=3) == [[C, D]]


def test_drafts_truncated_by_end_of_history():
    # "c" last seen at 4, followed only by the final token.
    assert propose([[A, B, C, D, C, E, C]], k=5, min_n=1, max_n=1) == [[E, C]]


def test_max_drafts_caps_and_zero():
    histories = [[A, B, C, D, A, B]] * 3
    assert propose(histories, k=3, min_n=2, max_n=2, caps=[3, 1, 0]) == [[C, D, A], [C], []]


def test_history_shorter_than_min_n_and_empty_rows():
    histories = [[A, A], [A], [], [A, A, A, A]]
    assert propose(histories, k=2, min_n=3, max_n=4) == [[], [], [], [A]]


def test_scratch_after_history_is_ignored():
    # Scratch equal to real tokens must neither create matches nor leak into drafts.
    assert propose([[A, B, C, A]], k=4, min_n=1, max_n=2, width=12, fill=B) == [[B, C, A]]
    assert propose([[C, D, A, B]], k=4, min_n=1, max_n=2, width=12, fill=B) == [[]]


def test_zero_speculative_tokens_and_empty_batch():
    assert propose([[A, B, A]], k=0, min_n=1, max_n=2) == [[]]
    drafts, num = NgramProposer(3, 1, 2).propose_tokens(
        np.zeros((0, 5), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    )
    assert drafts.shape == (0, 3) and num.shape == (0,)


def test_invalid_config():
    with pytest.raises(ValueError):
        NgramProposer(3, 0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 3, 2)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 7))
        vocab = int(rng.integers(2, 5))
        rows = int(rng.integers(1, 12))
        width = int(rng.integers(1, 60))
        histories = [
            rng.integers(0, vocab, size=int(rng.integers(0, width + 1))).tolist()
            for _ in range(rows)
        ]
        caps = rng.integers(0, k + 1, size=rows)
        got = propose(histories, k, min_n, max_n, caps=caps, width=width, fill=0)
        want = [reference_drafts(h, min_n, max_n, k, int(c)) for h, c in zip(histories, caps)]
        assert got == want, (min_n, max_n, k, histories, caps)


def test_row_chunking_matches_reference(monkeypatch: pytest.MonkeyPatch):
    # Tiny chunks force many chunks, including chunks with no wanted rows.
    import engine.spec_decode.ngram as ngram

    monkeypatch.setattr(ngram, "_CHUNK_CELLS", 64)
    rng = np.random.default_rng(11)
    histories = [rng.integers(0, 3, size=int(rng.integers(0, 40))).tolist() for _ in range(40)]
    caps = rng.integers(0, 2, size=40) * 4
    got = propose(histories, 4, 2, 4, caps=caps, width=40, fill=0)
    assert got == [reference_drafts(h, 2, 4, 4, int(c)) for h, c in zip(histories, caps)]


def test_rfind_reference_agrees_with_loop_reference():
    rng = np.random.default_rng(5)
    for _ in range(300):
        h = rng.integers(0, 3, size=int(rng.integers(0, 30))).tolist()
        assert rfind_drafts(bytes(h), 1, 4, 3, 3) == reference_drafts(h, 1, 4, 3, 3)


def test_big_batch_fast_and_correct():
    rows, width, k, min_n, max_n = 256, 8192, 5, 2, 5
    rng = np.random.default_rng(0)
    tokens = np.empty((rows, width), dtype=np.int64)
    for r in range(rows):
        vocab = (3, 8, 50, 250)[r % 4]  # tiny vocabularies match long n-grams, big ones rarely
        tokens[r] = rng.integers(0, vocab, size=width)
    lengths = rng.integers(width // 2, width + 1, size=rows)
    lengths[:8] = width
    caps = rng.integers(0, k + 1, size=rows)
    proposer = NgramProposer(k, min_n, max_n)
    times = []
    for _ in range(3):  # the first call also pays for faulting in fresh work arrays
        t0 = time.perf_counter()
        drafts, num = proposer.propose_tokens(tokens, lengths, caps)
        times.append(time.perf_counter() - t0)
    print(
        f"ngram propose {rows}x{width}: first {times[0] * 1e3:.1f} ms, "
        f"best {min(times) * 1e3:.1f} ms, {int(num.sum())} drafts"
    )

    for r in range(rows):
        history = bytes(tokens[r, : lengths[r]].astype(np.uint8))
        want = rfind_drafts(history, min_n, max_n, k, int(caps[r]))
        assert drafts[r, : num[r]].tolist() == want, r
        assert (drafts[r, num[r] :] == -1).all()
    assert num.sum() > 0
