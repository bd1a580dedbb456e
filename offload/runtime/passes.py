"""What one forward pass is made of: its rows (`ForwardBatch`), what its layers share (`LayerPass`), a prompt's
chunks (`PromptChunk`). Made by the executor (`offload.runtime.executor`) and its callers."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from offload.kv.blocks import StepKV
from offload.model import functional as M
from offload.model.layout import BatchLayout


@dataclass(frozen=True)
class ForwardBatch:
    """The rows of one pass: the new `tokens[b]` of sequence `sids[b]` (ids in the executor's KV pool), and
    which logits come back:

        default          each sequence's last new token                              [B, V]
        every=True       every new token                                             [sum(len(t)), V]
        keep=(k0, ...)   the last keep[b] tokens of each sequence, each token column multiplied as a plain
                         decode step would (speculative verification)                [sum(keep), V]
                         lanes[b]: the tree branch sequence b verifies (-1: a prompt chunk riding along)
    """

    sids: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    every: bool = False
    keep: tuple[int, ...] | None = None
    lanes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("sids", tuple(self.sids))
        set_("tokens", tuple(tuple(t) for t in self.tokens))
        if len(self.sids) != len(self.tokens) or not all(self.tokens):
            raise ValueError("a ForwardBatch has one non-empty token list per sequence")
        if self.keep is not None:
            set_("keep", tuple(self.keep))
            set_("lanes", tuple(self.lanes) if self.lanes is not None else (0,) * len(self.sids))
            if self.every or len(self.keep) != len(self.sids) or len(self.lanes) != len(self.sids) or any(
                    not 0 < k <= len(t) for k, t in zip(self.keep, self.tokens)):
                raise ValueError("verification keeps 1..len(tokens[b]) logits of each sequence, one lane each")
        elif self.lanes is not None:
            raise ValueError("lanes go with keep (speculative verification)")

    @classmethod
    def last(cls, sids: Sequence[int], tokens: Sequence[Sequence[int]]) -> ForwardBatch:
        return cls(sids, tokens)  # type: ignore[arg-type]  (made tuples by __post_init__)

    @classmethod
    def every_token(cls, sids: Sequence[int], tokens: Sequence[Sequence[int]]) -> ForwardBatch:
        return cls(sids, tokens, every=True)  # type: ignore[arg-type]

    @classmethod
    def verify(cls, sids: Sequence[int], tokens: Sequence[Sequence[int]], keep: Sequence[int],
               lanes: Sequence[int] | None = None) -> ForwardBatch:
        return cls(sids, tokens, keep=keep, lanes=lanes)  # type: ignore[arg-type]

    @property
    def q_lens(self) -> list[int]:
        return [len(t) for t in self.tokens]


@dataclass(frozen=True)
class LayerPass:
    """What every layer of one pass shares (made by `Executor.begin_pass`)."""

    batch: ForwardBatch
    ids: torch.Tensor  # [N] int64 (CPU): the new tokens, flat in row order
    layout: BatchLayout  # where each row's tokens sit among the KV positions
    step: StepKV  # this pass's block tables per tier (from `PagedKVCache.prepare`)
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # RoPE at every new token's position, [N, D] each
    rope_table: M.Rope | None  # only when the KV cache rebuilds cold blocks from their layer inputs
    cold: bool  # some blocks are fetched from cold tiers: each layer's fetch rides with its weights (blocks read
    # where they lie, a CPU run's host tier, are not: `PagedKVCache.fetches`)


class PromptChunk(NamedTuple):
    sid: int
    tokens: list[int]
    start: int  # position of tokens[0] in the prompt
