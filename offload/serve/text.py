"""Stop strings over streamed text: hold back what could be the start of a stop string, cut at a match.

    stops = StopText(("\\n\\n", "END"))
    stops.push("Hello EN")   -> ("Hello ", False)     # "EN" might become "END": held back
    stops.push("D more")     -> ("", True)            # matched: the text before "END" was all there was
    stops.flush()            -> ""                    # the end of a reply that matched nothing releases the rest

Knows text only (no tokens, no model).
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""  # emitted by the model, not yet given out (a possible stop-string prefix)
        self.matched = False

    def push(self, delta: str) -> tuple[str, bool]:
        """The text that is safe to give out now, and whether a stop string matched (the reply ends there)."""
        if self.matched:
            return "", True
        text = self._held + delta
        if not self.stops:
            self._held = ""
            return text, False
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._held, self.matched = "", True
            return text[:cut], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """What is still held back, when the reply ends without a match."""
        text, self._held = ("" if self.matched else self._held), ""
        return text
