"""Speculative decoding on the target's side of one engine pass: forks, acceptance, rollback.

    v = Verification(speculator, kv, rows, width)   # the draft proposes; each row's tokens get its chain,
                                                    # each further tree branch a fork of the row's sequence
    ... one target pass: the decode rows (keep=v.keep), the prompt rows (1 each), then v.forks ...
    done, prompt_logits = v.accept(logits, prompt_rows, emit)   # per output: the branch it keeps, its KV
                                                    # rolled back, its tokens emitted
    v.record(timeline, step, t_pass, t_end, done)   # the speculator's timing, a "verify" span
    v.abort()                                       # a failed pass: its forks go

Which tokens are kept is the speculator's rule (`offload.runtime.speculative`); this module keeps
the target's KV in step with it: the sequence of the branch an output keeps becomes its own (the
others are freed), and it is truncated past the drafts that were rejected. It knows rows and
sequences, not the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offload.kv.cache import PagedKVCache
from offload.runtime.requests import DecodeRow, Output, Request
from offload.runtime.speculative import TREE_WIDTH, Speculator
from schedulers.timeline import Timeline
from storage.units import blocks_for


def row_blocks(chain: int, block_size: int) -> int:
    """Device blocks a running sequence may hold in a pass: its newest, plus those a `chain` of tokens fills."""
    return 1 + blocks_for(chain, block_size)


def tree_blocks(outputs: int, blocks_per_row: int) -> int:
    """Device blocks the branches of `outputs` trees may take in a pass (each branch a sequence or its fork,
    writing a chain, its partial block copied on write)."""
    return outputs * TREE_WIDTH * (blocks_per_row + 1)


def tree_room(kv: PagedKVCache, decode_rows: int, blocks_per_row: int, prefill_blocks: int) -> bool:
    """Are there free device slots and logical blocks for a tree's extra branches this pass (each a fork that
    may copy its partial block and write a chain) beside the chains' and a prefill pass's blocks? Otherwise
    the pass verifies chains (a full device is not made fuller by demotions for a tree)."""
    need = tree_blocks(decode_rows, blocks_per_row) + prefill_blocks
    return kv.pools["gpu"].num_free >= need and kv.logical.num_free >= need


@dataclass(frozen=True)
class Fork:
    """A tree's further branch, verified in a fork of its output's sequence in the same pass."""

    row: int  # the decode row it branches from
    branch: int  # 1.. (branch 0 is the row itself)
    sid: int
    tokens: list[int]  # the output's last token, then the branch's drafts


@dataclass(frozen=True)
class Verified:
    emitted: int  # tokens emitted, over every row
    drafted: int  # draft tokens the target checked (of the branches kept)
    accepted: int  # ... and kept


class Verification:
    def __init__(self, speculator: Speculator, kv: PagedKVCache, rows: list[DecodeRow], width: int) -> None:
        self.speculator, self.kv, self.rows = speculator, kv, rows
        self.branches = speculator.propose([(r.req, r.output) for r in rows], width)
        for row, br in zip(rows, self.branches):
            row.tokens.extend(br[0])
        self.forks: list[Fork] = []
        try:
            for i, br in enumerate(self.branches):
                for b in range(1, len(br)):
                    sid = kv.fork(rows[i].sid, kv.length(rows[i].sid) + len(br[b]) + 1)
                    self.forks.append(Fork(i, b, sid, [rows[i].tokens[0], *br[b]]))
        except BaseException:
            self.abort()
            raise

    @property
    def keep(self) -> list[int]:
        """Logits the pass keeps for each decode row: its last token's and each draft's."""
        return [len(r.tokens) for r in self.rows]

    def abort(self) -> None:
        """The pass failed: no fork is left behind (the draft's sequences go with `Speculator.release`)."""
        for f in self.forks:
            self.kv.free_sequence(f.sid)
        self.forks = []

    def accept(self, logits: torch.Tensor, prompt_rows: int, emit: Callable[[Request, Output, int], Any]
               ) -> tuple[Verified, list[torch.Tensor]]:
        """Accept or reject each output's drafts; keep the sequence of the branch it took (the others are
        freed), roll its KV back; `emit` what it keeps. `logits` [rows, V]: the pass's (the decode rows'
        `keep`, one per prompt row, then each fork's). Returns the prompt rows' logits [V] besides."""
        parts = torch.split(logits, self.keep + [1] * prompt_rows + [len(f.tokens) for f in self.forks])
        decode = len(self.rows)
        done = self._accept(list(parts[:decode]), list(parts[decode + prompt_rows:]), emit)
        return done, [p[-1] for p in parts[decode : decode + prompt_rows]]

    def _accept(self, row_logits: list[torch.Tensor], fork_logits: list[torch.Tensor],
                emit: Callable[[Request, Output, int], Any]) -> Verified:
        """logits [k + 1, V] per row and fork: the target's at the last token and at each draft."""
        seen = [[(row.sid, lg)] for row, lg in zip(self.rows, row_logits)]  # (sid, logits) of each branch
        for f, lg in zip(self.forks, fork_logits):
            seen[f.row].append((f.sid, lg))
        kept = self.speculator.accept([(r.req, r.output) for r in self.rows], [[lg for _, lg in s] for s in seen])
        emitted = drafted = accepted = 0
        for row, br, (tokens, best), lane in zip(self.rows, self.branches, kept, seen):
            o, kv = row.output, self.kv
            for b, (sid, _) in enumerate(lane):
                if b != best:
                    kv.free_sequence(sid)
            if best:  # the branch's fork becomes the output's sequence, with its worst case reserved again
                o.sid = lane[best][0]
                kv.reserve(o.sid, row.req.worst_case_tokens)
            kv.truncate(o.sid, kv.length(o.sid) - (len(br[best]) + 1 - len(tokens)), reserve=True)
            drafted += len(br[best])
            accepted += len(tokens) - 1
            for tok in tokens:
                if o.finish_reason:
                    break
                emit(row.req, o, tok)
                emitted += 1
        self.forks = []  # each is now an output's sequence or freed
        return Verified(emitted, drafted, accepted)

    def record(self, timeline: Timeline, step: int, t_pass: float, t_end: float, done: Verified) -> None:
        """The verify pass's time for the speculator's choice of chain length, and a span on the timeline."""
        self.speculator.timed_verify(t_end - t_pass, max(len(br[0]) for br in self.branches))
        timeline.add("speculative", "verify", t_pass - timeline.origin, t_end - timeline.origin, step=step,
                     proposed=sum(len(c) for br in self.branches for c in br),
                     accepted=done.emitted - len(self.rows), rows=len(self.rows),
                     branches=len(self.rows) + sum(len(br) - 1 for br in self.branches))
