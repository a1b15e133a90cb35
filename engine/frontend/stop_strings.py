"""Stop strings: find the first match in growing text without rescanning all of it.

After each update only the region that could hold a *new* match is searched: the new
text plus the ``max_stop_len - 1`` characters before it (a stop string may straddle the
boundary). "First" means the match that ends earliest (ties: the one starting earliest),
which is exactly what checking after every single character would find, so the result
does not depend on how the text was split into updates.

While streaming, the last ``max_stop_len - 1`` characters are withheld: they could be the
beginning of a stop string that must not be shown. When the stop string is kept in the
output (``include_in_output``) nothing needs withholding, since text after a match is only
ever cut from the current, not-yet-emitted update.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    truncate_to: int  # keep text[:truncate_to]
    end: int  # where the match ends in the text


class StopStringMatcher:
    def __init__(self, stop: list[str], include_in_output: bool) -> None:
        if not stop or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(
                f"stop strings must be a non-empty list of non-empty strings, got {stop!r}"
            )
        self.stop = list(dict.fromkeys(stop))
        self.include_in_output = include_in_output
        self.max_stop_len = max(len(s) for s in self.stop)

    @property
    def holdback(self) -> int:
        """Characters at the end of the text that streaming must not release yet."""
        return 0 if self.include_in_output else self.max_stop_len - 1

    def find(self, text: str, new_start: int) -> StopMatch | None:
        """First match in ``text`` that ends after ``new_start`` (where the unchecked text
        begins); matches ending earlier were looked for by previous calls."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = text.find(stop, max(new_start - len(stop) + 1, 0))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop = best
        return StopMatch(stop, end if self.include_in_output else start, end)

    def stable_length(self, text_length: int, finished: bool) -> int:
        """How much of the text may be shown now."""
        if finished:
            return text_length
        return max(text_length - self.holdback, 0)
