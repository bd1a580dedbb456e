"""A CPU pass's resident layers in runs of one compiled call each: the executor's fast path for what does not stream.

Layer by layer, a pass costs ~0.1 ms of Python a layer (acquire, views, checks, numba's dispatch of ~30 arguments),
as much as a small model's products (SmolLM2-135M: 30 layers, ~3 ms of a 10-25 ms step). Each run of consecutive
layers that are resident on the CPU and take the fused layer goes back to back in one call
(`offload.model.fused.LayerRun`), with the same bits; the streamed layers between runs go one by one, as they
arrive. Each layer still gets its own compute span, timed inside the call by the cycle counter. Knows the
executor's seam (weights, KV view, timeline), not the math.
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
    """`__call__(x, p)`: the pass's layers on x, its runs of resident layers each in one call where they take it."""

    def __init__(self, ex: Any) -> None:
        # the `offload.runtime.executor.Executor` (its seam: weights, KV view, timeline); a proxy, not a cycle
        self.ex = weakref.proxy(ex)
        # each run's (its weights' key, `M.layer_run`: it holds views of the weights' memory), by its groups
        self._runs: dict[tuple[str, ...], tuple[tuple, M.fused.LayerRun]] = {}
        self._refused: set[tuple[str, ...]] = set()  # runs with a layer the fused layer does not take (for good)

    def forget(self) -> None:
        """Drop the compiled runs' arguments (views of the weights: the executor closes, their memory goes)."""
        self._runs.clear()

    @functools.cached_property
    def possible(self) -> bool:
        """A CPU and tiered weights (resident ones read in place): runs may go in one call."""
        return self.ex.device.type == "cpu" and isinstance(self.ex.weights, TieredWeights)

    @functools.cached_property
    def segments(self) -> list[tuple[bool, list[int]]]:
        """The pass's layers in order as (one call?, layers): each run of two or more consecutive layers that are
        resident (never streamed), none a mixture-of-experts layer, all of one attention window, is one segment;
        every other layer is a segment of its own. (A plan that streams a few layers spreads them: SmolLM2-135M's
        int4 with a quarter of it resident streams 7 of 30 layers, every fourth, between 8 runs.)"""
        ex = self.ex
        out: list[tuple[bool, list[int]]] = []
        run: list[int] = []

        def close() -> None:
            out.extend([(True, list(run))] if len(run) > 1 else [(False, [i]) for i in run])
            run.clear()

        for i in ex.layers:
            joins = ex.plan.is_resident(ex.layer_groups[i]) and not ex.cfg.moe_layers[i]
            if not joins or (run and ex.cfg.sliding_windows[i] != ex.cfg.sliding_windows[run[0]]):
                close()
            if joins:
                run.append(i)
            else:
                out.append((False, [i]))
        close()
        return out

    def __call__(self, x: torch.Tensor, p: LayerPass, head: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All the pass's layers on x: runs of resident layers in one call each where no KV block has to be fetched
        (the device's and the host tier's read where they lie) and they take the fused layer, the rest layer by
        layer (`Executor.layer`). The same bits either way. -> (x, None), or with `head` (the pass's logits are
        every row's: a decode step) where the model's head is resident and the last run ends the model, (x, the
        logits) of the head computed with that run (`fused.LayerRun`)."""
        ex = self.ex
        if not self.possible or p.cold:
            segments: list[tuple[bool, list[int]]] = [(False, list(ex.layers))]
        else:
            segments = self.segments
        head = head and segments[-1][0] and segments[-1][1][-1] == ex.cfg.num_layers - 1 and \
            ex.plan.is_resident("head")
        logits = None
        for k, (together, layers) in enumerate(segments):
            y = None
            if together and head and k == len(segments) - 1:
                y = self._run(x, p, layers, head=True)
            if together and y is None:
                y = self._run(x, p, layers)
            if y is not None:
                x, logits = y
                continue
            for i in layers:
                x = ex.layer(i, x, p)
        return x, logits

    def _run(self, x: torch.Tensor, p: LayerPass, layers: list[int], head: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A run of resident layers on x in one call (with `head`, the model's head after them): (x, the logits or
        None), or None where it cannot go so (then layer by layer, or without the head)."""
        ex = self.ex
        groups = [ex.layer_groups[i] for i in layers] + (["head"] if head else [])
        name = tuple(groups)
        if name in self._refused:
            return None
        first = ex.kv_view(layers[0], p)
        paged = M.paged_pool(first, ex.cfg.sliding_windows[layers[0]], x)
        if paged is None:
            return None
        views = ex.weights.acquire_resident(groups)
        key = (x.dtype, *map(id, views))  # resident groups' views are the same objects pass after pass
        got = self._runs.get(name)
        if got is None or got[0] != key:
            run = M.layer_run(x, [M.LayerWeights.from_views(v) for v in views[:len(layers)]], ex.cfg,
                              M.HeadWeights.from_views(views[-1]) if head else None)
            if run is None:  # a layer the fused layer does not take (the weights' kinds do not change: not asked again)
                self._refused.add(name)
                ex.weights.release_resident(groups, [None] * len(groups))
                return None
            got = self._runs[name] = (key, run)
        timeline = ex.timeline
        start = timeline.now()
        with timeline.range("offload/compute/layers"):
            x, stamps, logits = M.run_layers(got[1], x, first, paged, p.layout, p.cos_sin, ex.cfg)
        ex.weights.release_resident(groups, functools.partial(spans_of, stamps, start, timeline.now()))
        return x, logits


def spans_of(stamps: Any, start: float, end: float) -> list[tuple[float, float]]:
    """Each layer's (start, end) on the timeline from the cycle counter read at the start of a compiled run and after
    each layer (`fused.LayerRun`), placed linearly between the host clock's start and end around the call; equal
    shares where there is no counter (0s: not x86-64)."""
    c = np.asarray(stamps, dtype=np.float64)
    total = c[-1] - c[0]
    cuts = (start + (end - start) * (c - c[0]) / total if total > 0 else np.linspace(start, end, len(c))).tolist()
    return list(zip(cuts[:-1], cuts[1:]))
