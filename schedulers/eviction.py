"""Eviction policies: which KV blocks to demote when a tier is short of room, and which must leave anyway.

A tiny abstract class plus a factory keyed by the config's enum (vLLM `evictor.py`):

    lru        least recently touched first
    attention  lowest accumulated attention mass first (from the per-block log-sum-exp that
               attention computes anyway)
    idle       a timeout: a block untouched for more than `idle_seconds` is `expired` and leaves
               the device even when nothing needs its room (an idle conversation's KV stops
               holding device memory) and is not brought back until it is touched again; when
               room is short, least recently touched first (every idle block is older than every
               busy one). The clock is injectable for tests.

`order` answers "who goes first when room is needed"; `expired` answers "who goes now, needed
or not" (nobody, for the policies without a timeout). Candidates carry what a policy may look at;
the caller never offers the newest block of a running sequence (it is being written). Policies
know blocks and numbers, not models.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    block: int
    last_touch: float  # clock time of the last step that attended over the block
    attention_mass: float  # accumulated share of attention probability it received


class EvictionPolicy(ABC):
    timeout: float | None = None  # seconds after which a block is `expired` (None: never)

    @abstractmethod
    def order(self, candidates: Sequence[Candidate]) -> list[int]:
        """Block ids, the first to evict first."""

    def choose(self, candidates: Sequence[Candidate], n: int) -> list[int]:
        return self.order(candidates)[:n]

    def expired(self, candidates: Sequence[Candidate]) -> list[int]:
        """Block ids to demote now whether or not room is needed, the first to go first (none by default)."""
        return []


class LRU(EvictionPolicy):
    def order(self, candidates: Sequence[Candidate]) -> list[int]:
        return [c.block for c in sorted(candidates, key=lambda c: (c.last_touch, c.block))]


class AttentionMass(EvictionPolicy):
    def order(self, candidates: Sequence[Candidate]) -> list[int]:
        return [c.block for c in sorted(candidates, key=lambda c: (c.attention_mass, c.last_touch, c.block))]


class Idle(EvictionPolicy):
    def __init__(self, idle_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_seconds = self.timeout = idle_seconds
        self.clock = clock

    def order(self, candidates: Sequence[Candidate]) -> list[int]:
        return LRU().order(candidates)

    def expired(self, candidates: Sequence[Candidate]) -> list[int]:
        now = self.clock()
        return LRU().order([c for c in candidates if now - c.last_touch > self.idle_seconds])


POLICIES = ("lru", "attention", "idle")


def make_policy(name: str, idle_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "attention":
        return AttentionMass()
    if name == "idle":
        return Idle(idle_seconds, clock)
    raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}")
