"""Stop strings: end a reply when its decoded text contains one, and never show the stop string.

    m = StopMatcher(("\\nUser:", "###"))
    shown, stopped = m.push(delta)      # text safe to show now; True once a stop string appeared
    m.text                              # everything shown so far (the reply, stop string excluded)

Text that could still turn into a stop string (a suffix that is a prefix of one) is held
back until the next delta decides, so a streamed reply never shows half a stop string. The
work per delta is bounded by the longest stop string, not by the reply's length. This module
knows text only; which tokens made it is the engine's business.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""  # text not shown yet: it may be the start of a stop string
        self._shown: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        return "".join(self._shown)

    def push(self, delta: str) -> tuple[str, bool]:
        """Feed a text delta; (text to show now, whether a stop string has been found)."""
        if self.stopped:
            return "", True
        buf = self._held + delta
        hits = [i for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            shown, self._held, self.stopped = buf[: min(hits)], "", True
        else:
            keep = self._holdback(buf)
            shown, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if shown:
            self._shown.append(shown)
        return shown, self.stopped

    def flush(self) -> str:
        """The reply ended for another reason: what was held back is plain text after all."""
        shown, self._held = ("" if self.stopped else self._held), ""
        if shown:
            self._shown.append(shown)
        return shown

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that begins some stop string."""
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
