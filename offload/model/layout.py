"""How a pass's flat token rows map onto its sequences (`BatchLayout`), and the index tensors that follow from it.

Every pass builds these, and a decode step's Python runs with its caches cold (the weights went through them just
before), where each small torch op costs tens of microseconds. So the tensors that depend only on a pass's shape
(a decode step's pad / unpad rows, a verify pass's column groups and kept rows) are made once per shape and kept
(`functools.lru_cache`, a few shapes a process runs); callers read them, never write them. Knows nothing about
weights, tiers or files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from storage.tiers import on

#: distinct pass shapes whose index tensors are kept (batch sizes, verify chains' lengths)
KEPT_SHAPES = 32


@functools.lru_cache(KEPT_SHAPES)
def _decode_rows(batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's pad_index [B, 1] and unpad_index [B]: one row a sequence, the same every step."""
    rows = on(torch.arange(batch), torch.device(device))
    return rows.view(batch, 1), rows


@functools.lru_cache(KEPT_SHAPES)
def _column_groups(lens: tuple[int, ...], device: str, lanes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    starts = np.cumsum([0, *lens[:-1]]).tolist()
    lanes = lanes or (0,) * len(lens)
    groups = [torch.tensor([s + j for s, n, b in zip(starts, lens, lanes) if n > j and b == lane], device=device)
              for lane in sorted(set(lanes) - {-1}) for j in range(max(n for n, b in zip(lens, lanes) if b == lane))]
    if -1 in lanes:  # prompt chunks riding in the pass: one product (their bits are not a decode step's anyway)
        groups.append(torch.tensor([s + j for s, n, b in zip(starts, lens, lanes) if b == -1 for j in range(n)],
                                   device=device))
    return tuple(groups)


def column_groups(lens: list[int], device: torch.device | str = "cpu",
                  lanes: list[int] | None = None) -> list[torch.Tensor]:
    """Flat rows of sequences with `lens` rows each, grouped by column: group j holds row j of every
    sequence that has one (the j-th new token of each chain). With `lanes` (tree mode: the branch each
    sequence verifies), a group is a column of one lane: one row per output, as a plain step has; lane -1
    (a prompt chunk in the same pass) is one group whatever its length. (Made once per shape: read-only.)"""
    return list(_column_groups(tuple(lens), str(device), tuple(lanes or ())))


@functools.lru_cache(KEPT_SHAPES)
def _kept_rows(lens: tuple[int, ...], keep: tuple[int, ...], device: str) -> torch.Tensor:
    ends = np.cumsum(lens).tolist()
    return torch.cat([torch.arange(e - n, e) for e, n in zip(ends, keep)]).to(device)


def kept_rows(lens: list[int], keep: list[int], device: torch.device | str) -> torch.Tensor | None:
    """The flat rows of the last `keep[b]` of each sequence's `lens[b]` rows (a verify pass's logits), or None where
    that is every row. (Made once per shape: read-only.)"""
    if list(lens) == list(keep):
        return None
    return _kept_rows(tuple(lens), tuple(keep), str(device))


@dataclass(frozen=True)
class BatchLayout:
    """How the flat token rows of one step map onto sequences; built once per step, shared by all layers.

    Sequence b contributes `q_lens[b]` new tokens (rows `q_starts[b]:q_starts[b]+q_lens[b]`)
    and, after this step, has `kv_lens[b]` tokens of context; its new tokens sit at
    positions `kv_lens[b] - q_lens[b] ...`.
    """

    q_lens: list[int]
    kv_lens: list[int]
    positions: torch.Tensor  # [N] long, absolute position of each flat token
    pad_index: torch.Tensor  # [B, Tq] long, flat row of each padded query slot (0 for padding)
    unpad_index: torch.Tensor  # [N] long, index of each flat token into the flattened [B * Tq] padded queries
    q_pos: torch.Tensor  # [B, Tq] long, position of each padded query (-1 for padding)
    row_groups: list[torch.Tensor] | None = None  # matrix products one group of rows at a time (see linear)
    columns: int = 0  # with row_groups: query columns attended one at a time (the verified chains' longest)

    @classmethod
    def build(cls, q_lens: list[int], kv_lens: list[int], device: torch.device | str) -> BatchLayout:
        B, Tq = len(q_lens), max(q_lens)  # (numpy: a decode step's few rows at ~1 us an op, not torch's ~5-20)
        if min(q_lens) == Tq == 1:  # a decode step: a row a sequence at its last position (q_pos: a view of it)
            last = on(torch.from_numpy(np.asarray(kv_lens, np.int64) - 1), device)
            return cls(list(q_lens), list(kv_lens), last, *_decode_rows(B, str(device)), last.view(B, 1))
        pad, q_pos, unpad, start = np.zeros((B, Tq), np.int64), np.full((B, Tq), -1, np.int64), [], 0
        for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
            pad[b, :ql] = np.arange(start, start + ql)
            q_pos[b, :ql] = np.arange(kl - ql, kl)
            unpad.append(np.arange(b * Tq, b * Tq + ql))
            start += ql
        arrays = [np.concatenate([row[:ql] for row, ql in zip(q_pos, q_lens)]), pad, np.concatenate(unpad), q_pos]
        return cls(list(q_lens), list(kv_lens), *(on(torch.from_numpy(a), device) for a in arrays))

    @property
    def uniform(self) -> bool:
        return len(set(self.q_lens)) == 1

    def last_token_rows(self) -> torch.Tensor:
        """Flat row of each sequence's last new token (`kept_rows` of one a sequence: made once per shape)."""
        return _kept_rows(tuple(self.q_lens), (1,) * len(self.q_lens), str(self.positions.device))

    def column_keys(self, block: int) -> list[int]:
        """Key slots a decode step gathers for the j-th new token of every sequence (keys in token order,
        `block` to a block): up to the block holding the latest such token, for each column j."""
        last = [max(kl - ql + j for ql, kl in zip(self.q_lens, self.kv_lens) if ql > j)
                for j in range(min(self.columns, max(self.q_lens)))]
        return [-(-(p + 1) // block) * block for p in last]

    def mask(self, key_positions: torch.Tensor, key_valid: torch.Tensor, window: int | None) -> torch.Tensor:
        """[B, Tq, Tk] bool: may padded query (b, i) attend to key slot (b, j)?

        key_positions: [B, Tk] absolute position of each gathered key; key_valid: [B, Tk].
        Causal, plus a sliding window (q - k < window) when the layer has one.
        """
        qp, kp = self.q_pos[:, :, None], key_positions[:, None, :]
        m = key_valid[:, None, :] & (kp <= qp) & (qp >= 0)
        if window is not None:
            m &= (qp - kp) < window
        return m
