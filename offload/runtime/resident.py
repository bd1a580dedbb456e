"""A CPU pass's resident layers in one compiled call: the executor's fast path where nothing streams.

Layer by layer, a pass costs ~0.1 ms of Python a layer (acquire, views, checks, numba's dispatch of ~30 arguments),
as much as a small model's products (SmolLM2-135M: 30 layers, ~3 ms of a 10-25 ms step). Where every layer of the
pass is resident on the CPU and takes the fused layer, `ResidentLayers` runs them back to back in one call
(`offload.model.fused.LayerRun`), with the same bits; each layer still gets its own compute span, timed inside the
call by the cycle counter. Knows the executor's seam (weights, KV view, timeline), not the math.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import numpy as np
import torch

from offload.model import functional as M
from offload.runtime.passes import LayerPass
from offload.weights.tiered import TieredWeights


class ResidentLayers:
    """`__call__(x, p)`: the pass's layers on x in one call, or None where they cannot run so (then layer by layer)."""

    def __init__(self, ex: Any) -> None:
        # the `offload.runtime.executor.Executor` (its seam: weights, KV view, timeline); a proxy, not a cycle
        self.ex = weakref.proxy(ex)
        self._run: tuple | None = None  # (its weights' key, `M.layer_run`: it holds views of the weights' memory)

    def forget(self) -> None:
        """Drop the compiled run's arguments (views of the weights: the executor closes, their memory goes)."""
        self._run = None

    @functools.cached_property
    def groups(self) -> list[str]:
        """The pass's layer groups, in order."""
        return [self.ex.layer_groups[i] for i in self.ex.layers]

    @functools.cached_property
    def possible(self) -> bool:
        """A CPU, every layer group resident (read in place, never streamed), no mixture-of-experts layer, one
        attention window."""
        ex = self.ex
        return (ex.device.type == "cpu" and isinstance(ex.weights, TieredWeights) and len(self.groups) > 1
                and all(ex.plan.is_resident(g) for g in self.groups)
                and not any(ex.cfg.moe_layers[i] for i in ex.layers)
                and len({ex.cfg.sliding_windows[i] for i in ex.layers}) == 1)

    def __call__(self, x: torch.Tensor, p: LayerPass) -> torch.Tensor | None:
        """All the pass's layers, where they are resident and take the fused layer and no KV block has to be fetched
        (the device's and the host tier's read where they lie); None otherwise. The same bits either way."""
        ex = self.ex
        if not self.possible or p.cold:
            return None
        first = ex.kv_view(ex.layers[0], p)
        paged = M.paged_pool(first, ex.cfg.sliding_windows[ex.layers[0]], x)
        if paged is None:
            return None
        groups = self.groups
        views = ex.weights.acquire_resident(groups)
        key = (x.dtype, *map(id, views))  # resident groups' views are the same objects pass after pass
        if self._run is None or self._run[0] != key:
            self._run = (key, M.layer_run(x, [M.LayerWeights.from_views(v) for v in views], ex.cfg))
        run = self._run[1]
        if run is None:  # a layer the fused layer does not take (the weights' kinds do not change: not asked again)
            self.possible = False
            ex.weights.release_resident(groups, [None] * len(groups))
            return None
        timeline = ex.timeline
        start = timeline.now()
        with timeline.range("offload/compute/layers"):
            x, stamps = M.run_layers(run, x, first, paged, p.layout, p.cos_sin, ex.cfg)
        ex.weights.release_resident(groups, functools.partial(spans_of, stamps, start, timeline.now()))
        return x


def spans_of(stamps: Any, start: float, end: float) -> list[tuple[float, float]]:
    """Each layer's (start, end) on the timeline from the cycle counter read at the start of a compiled run and after
    each layer (`fused.LayerRun`), placed linearly between the host clock's start and end around the call; equal
    shares where there is no counter (0s: not x86-64)."""
    c = np.asarray(stamps, dtype=np.float64)
    total = c[-1] - c[0]
    cuts = (start + (end - start) * (c - c[0]) / total if total > 0 else np.linspace(start, end, len(c))).tolist()
    return list(zip(cuts[:-1], cuts[1:]))
