"""Mixture-of-experts feed-forward math, as pure functions of (activations, weights, an expert source).

A MoE layer's own weights (the router, and Qwen2-MoE's shared expert with its gate) come with the
layer, as `MoEWeights`; each routed expert's weights come from an `ExpertSource` that the forward
loop passes in, and only after routing: the source is told which experts this pass routes to before
it hands over any, so it may fetch only those, in the order it has them (a cache, a prefetch, an
on-demand read). Tokens are grouped by expert: one gated-MLP product per routed expert per pass,
over all the rows routed to it (argsort by expert, `index_add_` back), never a loop over tokens.

Routing is softmax over the router logits, then the top k, then (Mixtral always, the others when
`norm_topk_prob`) the k probabilities renormalised to sum 1; that is the same as Mixtral's original
top-k-then-softmax. This module knows nothing about tiers, groups or files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

#: A weight matrix [out, in]: a dense tensor or a packed one with `.linear(x, bias)` (see `functional.Weight`).
Weight = Any


def _linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w.linear(x)


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One routed expert: a gated SiLU MLP."""

    gate_up: Weight  # [2 I, H]: gate rows, then up rows
    down: Weight  # [H, I]
    device: torch.device | None = None  # where they lie when not on the compute device (computed there: rows move)

    @classmethod
    def from_views(cls, v: dict[str, Weight], device: torch.device | None = None) -> ExpertWeights:
        return cls(v["gate_up"], v["down"], device)


@dataclass(frozen=True, slots=True)
class MoEWeights:
    """What a MoE layer's own group holds besides attention and norms."""

    router: torch.Tensor  # [E, H] (kept dense: routing decisions are sensitive to rounding)
    shared_gate_up: Weight | None = None  # [2 S, H] Qwen2-MoE's shared expert
    shared_down: Weight | None = None  # [H, S]
    shared_gate: torch.Tensor | None = None  # [1, H]: the shared expert's output is scaled by sigmoid(h @ gate.T)

    @classmethod
    def from_views(cls, v: dict[str, Weight]) -> MoEWeights | None:
        """None for a dense layer (no router among the views)."""
        if "router" not in v:
            return None
        return cls(v["router"], v.get("shared_gate_up"), v.get("shared_down"), v.get("shared_gate"))


class ExpertSource(Protocol):
    """Where a MoE layer gets its routed experts' weights, one layer at a time.

    `ahead(h)` comes first, with the layer's normed hidden rows h [N, H] (a source may predict the next
    layer's experts from them). `routed` is called once per MoE layer per pass, after the layer's own
    weights (router, shared expert, attention) have been read for the last time: a source that streams
    groups in order may release the layer's group then. It yields (expert id, weights) for every id in
    `experts` exactly once, in any order; the weights may be read until the next item is asked for.
    """

    def ahead(self, h: torch.Tensor) -> None: ...
    def routed(self, experts: list[int]) -> Iterable[tuple[int, ExpertWeights]]: ...


@dataclass(frozen=True)
class Routing:
    """Which rows go to which expert, grouped by expert (built once per layer per pass)."""

    experts: list[int]  # the routed experts, ascending (host list: the source fetches these)
    counts: list[int]  # rows routed to each of them
    rows: torch.Tensor  # [N * k] long: flat token row of each (token, choice), grouped by expert
    weights: torch.Tensor  # [N * k] float32: its routing weight, in the same order

    def slices(self) -> dict[int, slice]:
        """Expert id -> its range in `rows` / `weights`."""
        out, start = {}, 0
        for e, n in zip(self.experts, self.counts):
            out[e] = slice(start, start + n)
            start += n
        return out


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] float32, experts [N, k] long): softmax, top k, renormalised
    when `normalize` (as transformers computes them: the softmax in float32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def group_by_expert(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> Routing:
    """(weights, experts) [N, k] -> the rows of each routed expert, contiguous, experts ascending.

    One host sync (the counts): the caller needs the routed set on the host to fetch weights anyway.
    """
    flat = experts.reshape(-1)  # [N * k], choice j of token t at t * k + j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    routed = [e for e, n in enumerate(counts) if n]
    rows = torch.div(order, experts.shape[1], rounding_mode="floor")
    return Routing(routed, [counts[e] for e in routed], rows, weights.reshape(-1)[order])


def gated_mlp(x: torch.Tensor, gate_up: Weight, down: Weight) -> torch.Tensor:
    """x [n, H] -> down(silu(gate(x)) * up(x)) [n, H]."""
    gate, up = _linear(x, gate_up).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, down)


def moe_mlp(h: torch.Tensor, w: MoEWeights, experts: ExpertSource, top_k: int, normalize: bool) -> torch.Tensor:
    """The feed-forward output of a MoE layer for normed hidden rows h [N, H] -> [N, H] (without the residual).

    Reads `w` (router, shared expert) first, then asks `experts` for the routed experts only.
    """
    logits = F.linear(h, w.router)  # [N, E]
    routing = group_by_expert(*route(logits, top_k, normalize), w.router.shape[0])
    shared = None
    if w.shared_gate_up is not None:  # computed now: the layer's weights are not read once experts are asked for
        shared = torch.sigmoid(F.linear(h, w.shared_gate)) * gated_mlp(h, w.shared_gate_up, w.shared_down)
    out = torch.zeros_like(h)
    where = routing.slices()
    experts.ahead(h)
    for e, ew in experts.routed(routing.experts):
        s = where.pop(e)
        rows = routing.rows[s]
        if ew.device is not None and ew.device != h.device:  # computed where its weights lie: its rows move
            y = gated_mlp(h[rows].to(ew.device), ew.gate_up, ew.down).to(h.device)
        else:
            y = gated_mlp(h[rows], ew.gate_up, ew.down)  # one product per expert, over all its rows
        out.index_add_(0, rows, (y * routing.weights[s, None]).to(out.dtype))
    if where:
        raise RuntimeError(f"the expert source did not hand over routed experts {sorted(where)}")
    return out if shared is None else out + shared
