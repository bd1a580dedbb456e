"""The routed experts of one MoE layer, handed to the model math (`offload.model.moe.ExpertSource`) from a
weight source whose streamed groups arrive in plan order.

An expert is a group (`layer.{i}.expert.{e}`). Experts whose group compute reads in place (resident on
the device, or in host memory on a CPU) are acquired only when routed. Streamed ones flow through the
prefetcher's ring in plan order, one group held at a time, so every streamed expert of the layer is
acquired and released in turn and only the routed ones are computed; and the layer's own group is
released before the first expert is acquired (the math has read the router and the shared expert by
then). Fetching only the routed experts of a streamed layer, caching hot ones and predicting the next
layer's needs on-demand loads that the in-order prefetcher does not offer yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from offload.model.moe import ExpertWeights


class GroupSource(Protocol):
    def acquire(self, group: str) -> dict[str, Any]: ...
    def release(self, group: str) -> None: ...


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

    def finish(self) -> None:
        """After the layer: release its group if the math never asked for experts."""
        self._release_layer()
