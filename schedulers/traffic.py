"""The one counter of bytes moved: what moved (`weights` or `kv`), from where, to where.

    traffic.add("weights", "disk", "gpu", n)     a streamed group read into a device ring slot
    traffic.add("weights", "cpu", "compute", n)  a group handed to compute from its home (in place or copied)
    traffic.add("kv", "gpu", "cpu", n)           a KV block demoted

`routes(kind)` gives the totals per "src->dst"; `served()` is what each home tier handed to
compute. Bytes are counted once, by whoever moves them: the prefetcher (streamed groups, what
each home hands to compute), the weight source (its reads of the store: homes, embedding rows,
checks) and the KV cache (blocks demoted and promoted, cold blocks fetched for attention). The
tiers count nothing; the timeline's spans carry the same bytes for the trace. Thread-safe (the
prefetcher's threads add to it). Knows names and numbers only.
"""

from __future__ import annotations

import threading
from collections import defaultdict

COMPUTE = "compute"


class Traffic:
    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)  # (kind, "src->dst") -> bytes
        self._lock = threading.Lock()

    def add(self, kind: str, src: str, dst: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[(kind, f"{src}->{dst}")] += nbytes

    def routes(self, kind: str) -> dict[str, int]:
        """Bytes per route between tiers ("disk->cpu", "gpu->cpu", ...), handing to compute left out."""
        with self._lock:
            return {route: n for (k, route), n in self._bytes.items()
                    if k == kind and not route.endswith(f"->{COMPUTE}")}

    def served(self, kind: str = "weights") -> dict[str, int]:
        """Bytes each home tier handed to compute (read in place, copied or streamed)."""
        with self._lock:
            return {route.split("->")[0]: n for (k, route), n in self._bytes.items()
                    if k == kind and route.endswith(f"->{COMPUTE}")}

    def total(self, kind: str, route: str) -> int:
        with self._lock:
            return self._bytes.get((kind, route), 0)

    def to_dict(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for (kind, route), n in sorted(self._bytes.items()):
                out.setdefault(kind, {})[route] = n
        return out
