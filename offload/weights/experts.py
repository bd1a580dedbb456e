"""The routed experts of one MoE layer, handed to the model math (`offload.model.moe.ExpertSource`).

An expert is a group (`layer.{i}.expert.{e}`). Two sources, by plan:

`CachedExperts` (a plan with an expert cache, or experts computed on the host): experts compute reads in
place (resident on the device; in host memory on a CPU, or computed on the host from a CUDA device) are
acquired only when routed; experts loaded on demand come through the expert cache
(`schedulers.expert_cache`): the layer's misses are queued first, then the next MoE layer's experts as
predicted by that layer's router applied to this layer's normed hidden rows (`Predictor`), so they load
while this layer computes; a misprediction is a miss there, loaded on demand. Experts are yielded in
ascending order either way, so the sums are those of every other placement (the same tokens).

`PlanOrderExperts` (`experts.cache: 0`): streamed experts flow through the prefetcher's ring in plan
order, one group held at a time, so every streamed expert of the layer is acquired and released in turn
and only the routed ones are computed.

Either way the layer's own group is released before the first expert is acquired (the math has read the
router and the shared expert by then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from offload.model.moe import ExpertWeights
from schedulers.expert_cache import ExpertCache
from schedulers.plan import Plan


class GroupSource(Protocol):
    def acquire(self, group: str) -> dict[str, Any]: ...
    def release(self, group: str) -> None: ...


class CachedSource(GroupSource, Protocol):
    plan: Plan
    cache: ExpertCache | None
    predictor: Predictor

    def views(self, group: str, buf: torch.Tensor) -> dict[str, Any]: ...


class Predictor:
    """The next MoE layer's experts from this layer's hidden rows: that layer's router, top k per row.

    Routers are kept (a copy, [E, H] each, on the compute device) as their layers' groups are first read, so
    the first pass predicts nothing for layers not yet seen."""

    def __init__(self, moe_layers: tuple[bool, ...], top_k: int, enabled: bool) -> None:
        self.top_k, self.enabled = top_k, enabled
        sparse = [i for i, m in enumerate(moe_layers) if m]
        self.next = dict(zip(sparse, sparse[1:]))  # MoE layer -> the next MoE layer
        self.routers: dict[int, torch.Tensor] = {}
        self.pending: dict[int, set[int]] = {}  # layer -> experts predicted for its coming routing

    def keep_router(self, layer: int, router: torch.Tensor) -> None:
        if self.enabled and layer not in self.routers:
            self.routers[layer] = router.detach().clone()

    def predict(self, layer: int, h: torch.Tensor) -> tuple[int, list[int]] | None:
        """(next MoE layer, its predicted experts ascending) from layer `layer`'s normed rows h [N, H]."""
        nxt = self.next.get(layer)
        router = self.routers.get(nxt) if nxt is not None and self.enabled else None
        if router is None:
            return None
        logits = F.linear(h.to(router.dtype), router)  # [N, E]: the softmax does not change the top k
        experts = sorted(set(torch.topk(logits, self.top_k, dim=-1).indices.reshape(-1).tolist()))
        self.pending[nxt] = set(experts)
        return nxt, experts


class CachedExperts:
    """One pass's experts of one MoE layer, over the expert cache; made after the layer's group was acquired."""

    def __init__(self, weights: CachedSource, layer: int, layer_group: str, expert_groups: list[str]) -> None:
        self.weights, self.layer, self.layer_group, self.groups = weights, layer, layer_group, expert_groups
        self._layer_held = True
        self._h: torch.Tensor | None = None
        self.computed: list[int] = []

    def _release_layer(self) -> None:
        if self._layer_held:
            self._layer_held = False
            self.weights.release(self.layer_group)

    def ahead(self, h: torch.Tensor) -> None:
        self._h = h

    def routed(self, experts: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) of every routed expert, ascending; misses queued before the next layer's prefetch."""
        self._release_layer()
        w, plan, cache = self.weights, self.weights.plan, self.weights.cache
        groups = [self.groups[e] for e in experts]
        predicted = w.predictor.pending.pop(self.layer, None)
        if cache is not None:
            cache.request([g for g in groups if g in plan.on_demand])
            guess = w.predictor.predict(self.layer, self._h) if self._h is not None else None
            if guess is not None:
                nxt, ids = guess
                cache.prefetch([g for g in (f"layer.{nxt}.expert.{e}" for e in ids) if g in plan.on_demand])
        self._h = None
        for e, g in zip(experts, groups):
            if cache is not None and g in plan.on_demand:
                views = w.views(g, cache.get(g))
                self.computed.append(e)
                yield e, ExpertWeights.from_views(views)
                cache.done(g)
            else:
                views = w.acquire(g)
                self.computed.append(e)
                host = torch.device("cpu") if g in plan.host_compute else None
                yield e, ExpertWeights.from_views(views, host)
                w.release(g)
        if cache is not None:
            cache.end_layer(self.layer, None if predicted is None else {self.groups[e] for e in predicted}, groups)

    def finish(self) -> None:
        self._release_layer()


class PlanOrderExperts:
    """One pass's experts of one MoE layer; made after the layer's group was acquired, `finish`ed after the layer."""

    def __init__(self, weights: GroupSource, layer_group: str, expert_groups: list[str],
                 streamed: Callable[[str], bool]) -> None:
        self.weights, self.layer_group, self.groups, self.streamed = weights, layer_group, expert_groups, streamed
        self._layer_held = True
        self.computed: list[int] = []  # the experts handed to the math this pass, in order

    def _release_layer(self) -> None:
        if self._layer_held:
            self._layer_held = False
            self.weights.release(self.layer_group)

    def routed(self, experts: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) of every routed expert, ascending; streamed experts not routed pass through."""
        self._release_layer()
        wanted = set(experts)
        for e, group in enumerate(self.groups):
            if e not in wanted and not self.streamed(group):
                continue
            views = self.weights.acquire(group)
            if e in wanted:
                self.computed.append(e)
                yield e, ExpertWeights.from_views(views)
            self.weights.release(group)  # not in a `finally`: a pass cut short is reset by the weight source

    def ahead(self, h: Any) -> None:
        """Streaming in plan order: nothing to predict."""

    def finish(self) -> None:
        """After the layer: release its group if the math never asked for experts."""
        self._release_layer()
