"""The sequences of one pass through transformers' model in lockstep, so that each streamed block is read once a
pass, not once a sequence.

transformers runs a batch in one shape, which a ragged batch of sequences, each with its own `DynamicCache` and
length, does not have; so each sequence runs its own forward (the same ops as alone: the same tokens). Run one
after the other, a pass of B sequences took every streamed block through the ring B times (a Gemma 2 of 8
blocks, 60 MB, streamed from disk on 2 cores: 28.8 ms a step for one sequence, 123.9 for four). Here each
sequence's forward is a greenlet (one thread: the kernels' thread team, the autograd mode and Ctrl-C are the
caller's), and the hooks in front of each block (and of the head) are the points where it yields:

    steps = Lockstep(n)
    outs = steps.run([forward_0, ..., forward_n-1])     # each a callable: one sequence's whole forward

At each such point every sequence arrives in turn, 0 .. n-1, before any runs the next: the first to run a block
binds its group (`first`), the last releases it (`last`), the others find it bound. Anything before the first
block (the embeddings, the masks) runs in turn as well. A forward that raises ends every other one (each is
thrown `Aborted` where it waits) and the first real error is raised; so does a Ctrl-C, wherever it lands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:
    import greenlet
except ImportError:  # (the `hf` extra brings it: without it, sequences run one after another)
    greenlet = None


class Aborted(Exception):
    """Thrown into a sequence's forward where it waits: another one of its pass failed."""


class Lockstep:
    """n sequences' forwards taking turns at each block (see the module doc)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.index = 0  # the sequence now running
        self._stage: list[Any] = [None] * n  # where each sequence last arrived (a block's index, "head")
        self._main: Any = None

    @staticmethod
    def available() -> bool:
        return greenlet is not None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.n - 1

    def arrive(self, stage: Any) -> None:
        """The running sequence reaches `stage`: returns once every sequence before it has run up to there (at
        once where it is already there: a second module of the head)."""
        if self._stage[self.index] == stage:
            return
        self._stage[self.index] = stage
        self._main.switch()

    def run(self, forwards: Sequence[Callable[[], Any]]) -> list[Any]:
        """Each forward's result, in order (every forward arrives at the same stages in the same order)."""
        assert len(forwards) == self.n and greenlet is not None
        self._main = greenlet.getcurrent()
        runs = [greenlet.greenlet(f) for f in forwards]
        out: list[Any] = [None] * self.n
        try:
            while not all(g.dead for g in runs):
                for i, g in enumerate(runs):
                    if not g.dead:
                        self.index = i
                        value = g.switch()
                        if g.dead:
                            out[i] = value
            return out
        except BaseException:
            for g in runs:  # unwind the others where they wait (their hooks' `finally`s run)
                if not g.dead and g:
                    try:
                        g.throw(Aborted())
                    except Aborted:
                        pass
            raise
