"""Which cached expert leaves the device first: LRU, and a frequency-aware LFU with decay.

    policy = make_policy("lfu", slots)     # or "lru"
    policy.touch(key)                      # a routed use (hit or miss); prefetches are not uses
    policy.victim(candidates) -> key       # the cached key to evict among those not in use

`LFU` keeps, for every key ever routed (cached or not: the history survives eviction), a score that
adds 1 per use and halves every `half_life` uses of any key; the victim is the lowest score among the keys
not used in the last `protect` uses (ties to the least recently used; all keys when every one is that
recent). A newcomer with little history is therefore among the next victims once it leaves the protected
window, so a burst of cold experts cannot flush the hot ones (what LRU does when a pass cycles through more
experts than fit), while the recent window keeps a run of tokens that repeat their experts. On Zipf-skewed
synthetic traces it beats LRU once the cache holds about two tokens' routed experts or more, and loses to it
when the cache holds about one token's (tests/test_moe_cache.py, scripts/bench_moe.py).

`hit_rate(trace, slots, policy)` replays a routing trace (a list of keys, in use order) through a
cache of `slots` entries: the tests and `offload plan`'s assumed hit rate use it. This module knows
keys and counts, nothing about models or tiers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Iterable, Sequence

#: uses of any key, per cache slot, over which an LFU score halves (many passes over the cache)
HALF_LIFE_PER_SLOT = 32
#: the most recent uses, per cache slot, whose keys LFU does not evict while older ones are cached
PROTECT_PER_SLOT = 0.5


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self.clock = 0
        self.last: dict[Hashable, int] = {}

    def touch(self, key: Hashable) -> None:
        self.clock += 1
        self.last[key] = self.clock

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        return min(candidates, key=lambda k: self.last.get(k, 0))


class LFU:
    """Least frequently used, frequencies decayed (half-life in uses), with the history of evicted keys kept."""

    name = "lfu"

    def __init__(self, half_life: float, protect: int = 0) -> None:
        self.clock, self.protect = 0, protect
        self.rate = math.log(2) / max(half_life, 1.0)
        # key -> (log of its score at its last use, last use): a log keeps old scores from overflowing
        self.score: dict[Hashable, tuple[float, int]] = {}

    def _log_score(self, key: Hashable) -> float:
        s = self.score.get(key)
        return -math.inf if s is None else s[0] - self.rate * (self.clock - s[1])

    def touch(self, key: Hashable) -> None:
        self.clock += 1
        old = self._log_score(key)
        self.score[key] = (0.0 if old == -math.inf else _log_add_one(old), self.clock)

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        keys = list(candidates)
        old = [k for k in keys if self.clock - self.score.get(k, (0.0, 0))[1] >= self.protect]
        return min(old or keys, key=lambda k: (self._log_score(k), self.score.get(k, (0.0, 0))[1]))


def _log_add_one(x: float) -> float:
    """log(exp(x) + 1) without overflow."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def make_policy(name: str, slots: int) -> LRU | LFU:
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU(HALF_LIFE_PER_SLOT * max(slots, 1), int(PROTECT_PER_SLOT * slots))
    raise ValueError(f"unknown expert cache policy {name!r} (lru | lfu)")


def hit_rate(trace: Sequence[Hashable], slots: int, policy: LRU | LFU, warmup: int = 0) -> float:
    """The share of uses (after the first `warmup`) that found their key cached, through a cache of `slots` keys
    that loads every miss and evicts the policy's victim."""
    cached: set[Hashable] = set()
    hits = uses = 0
    for i, key in enumerate(trace):
        hit = key in cached
        if i >= warmup:
            hits, uses = hits + hit, uses + 1
        if not hit and slots > 0:
            if len(cached) >= slots:
                cached.discard(policy.victim(cached))
            cached.add(key)
        policy.touch(key)
    return hits / uses if uses else 0.0


def coverage(slots: int, layers: int, experts: int, skew: float) -> float:
    """The hit rate a frequency-aware cache of `slots` experts tends to under independent routing: the routing
    mass of the hottest `slots / layers` experts of each layer, expert popularity falling as rank**-skew
    (skew 0: uniform routing, the hit rate is simply slots / (layers * experts))."""
    if layers <= 0 or experts <= 0:
        return 0.0
    per_layer = min(slots / layers, experts)
    mass = [r ** -skew for r in range(1, experts + 1)]
    whole, frac = int(per_layer), per_layer - int(per_layer)
    covered = sum(mass[:whole]) + (frac * mass[whole] if whole < experts else 0.0)
    return covered / sum(mass)


def zipf_trace(layers: int, experts: int, top_k: int, tokens: int, skew: float, repeat: float,
               seed: int = 0) -> list[tuple[int, int]]:
    """A synthetic routing trace: (layer, expert) uses in pass order, `top_k` distinct experts per layer per token,
    each layer's popularity Zipf(skew) over its own random ranking, and with probability `repeat` a token keeps
    the previous token's choice at a layer (temporal locality)."""
    rng = random.Random(seed)
    ranks = [rng.sample(range(experts), experts) for _ in range(layers)]
    weights = [r ** -skew for r in range(1, experts + 1)]
    prev: list[list[int]] = [[] for _ in range(layers)]
    out: list[tuple[int, int]] = []
    for _ in range(tokens):
        for layer in range(layers):
            if prev[layer] and rng.random() < repeat:
                chosen = prev[layer]
            else:
                chosen = []
                while len(chosen) < top_k:
                    e = ranks[layer][rng.choices(range(experts), weights)[0]]
                    if e not in chosen:
                        chosen.append(e)
                chosen.sort()
            prev[layer] = chosen
            out += [(layer, e) for e in chosen]
    return out
