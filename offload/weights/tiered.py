"""Weights over the tiers: fill every memory home once, stream the rest through the prefetcher.

This is the runner's weight source. It executes a placement plan (made by `offload.plan`):
opens (or converts) the zarr store when the plan has a disk tier, fills every memory home
once, and hands streaming to `schedulers.prefetch`. With no `tiers:` section the plan is
"everything on the device", so the all-in-memory run is the same mechanism with nothing to
stream. It owns the run's transfer engine (`engine`: one copy stream on CUDA), which the KV
cache's cold blocks cross on too, and counts every byte it reads from the store in `traffic`
(filling homes, embedding rows, checks; the prefetcher counts what it streams).
"""

from __future__ import annotations

import logging

import torch

from offload.config import OffloadConfig
from offload.model import kernels
from offload.model.checkpoint import Checkpoint
from offload.weights.convert import open_tier_store
from offload.weights.experts import CachedExperts, PlanOrderExperts, Predictor
from offload.weights.groups import (
    WeightFormat,
    embedding_source,
    expert_groups,
    model_layouts,
    weight_views,
)
from offload.weights.quant import Scratch
from offload.weights.reading import fill_group
from schedulers.expert_cache import ExpertCache
from schedulers.expert_policy import make_policy
from schedulers.plan import Plan
from schedulers.prefetch import Prefetcher
from schedulers.timeline import Timeline
from schedulers.traffic import Traffic
from schedulers.transfer import make_engine
from storage.arena import check_pinnable
from storage.disk import DiskTier
from storage.store import Store
from storage.tiers import DeviceTier, HostTier, MemoryTier, Tier

log = logging.getLogger(__name__)


class TieredWeights:
    """The runner's weight source over GPU, pinned RAM and the zarr store."""

    def __init__(self, config: OffloadConfig, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 timeline: Timeline, plan: Plan, traffic: Traffic | None = None,
                 compute_dtype: torch.dtype | None = None, layers: range | None = None) -> None:
        """`layers`: a pipeline stage's slice; only its groups (`stage_groups`) are homed and streamed."""
        self.cfg, self.device, self.dtype = ckpt.config, device, dtype
        self.compute_dtype = compute_dtype or dtype  # weights are upcast to it after the transfer when it differs
        self.timeline = timeline
        self.traffic = traffic or Traffic()
        self.engine = make_engine(device)  # the run's one transfer engine: weights and cold KV blocks
        self.fmt = WeightFormat.from_config(config.weights, ckpt.config)
        self.fmt.check(ckpt.config)
        if self.fmt.prequant is not None and device.type == "cpu":
            log.warning("the checkpoint's %s packing is dequantized into a dense copy every pass, slow on a CPU "
                        "(SmolLM2-135M: 1.3 tokens/s); weights.quantization: int4 (--weights int4) keeps its codes "
                        "and scales in Offload's int4, multiplied as they lie (100-150 tokens/s)",
                        self.fmt.prequant.method)
        self.layouts = model_layouts(ckpt.config, dtype, self.fmt, layers)
        self._views: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (group, address) -> its typed views
        self._upcast: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # the same, at the compute dtype
        self._packed: dict[tuple[str, int], dict] = {}  # the same, packed matrices as their weight objects
        self._resident: dict[tuple[str, ...], tuple[list, list[dict]]] = {}  # `acquire_resident`'s runs
        self.scratch = Scratch()  # packed matrices are dequantized here when no fused kernel applies
        self.plan = plan
        embed_group, self._embed_tensor = embedding_source(ckpt.config, self.fmt)
        log.info("%s", self.plan.describe())
        self.store: Store | None = None
        tiers_cfg = config.tiers
        pinned = (tiers_cfg.cpu.pinned if tiers_cfg else True) and device.type == "cuda"
        if pinned and self.plan.pinned_bytes():
            check_pinnable(self.plan.pinned_bytes())
        self.tiers: dict[str, Tier] = {"gpu": DeviceTier(self.plan.capacity("gpu"), device)}
        # one pinned arena of exactly the plan's host regions (homes, staging, cold KV), each rounded to pages
        self.tiers["cpu"] = HostTier(self.plan.capacity("cpu"), pinned=pinned,
                                     arena_bytes=self.plan.pinned_bytes() if pinned else None)
        self.prefetcher: Prefetcher | None = None
        self.cache: ExpertCache | None = None  # routed experts loaded on demand (a mixture of experts)
        self.predictor = Predictor(ckpt.config.moe_layers, ckpt.config.experts_per_token,
                                   config.experts.prefetch and bool(self.plan.on_demand))
        try:
            if tiers_cfg is not None and tiers_cfg.disk is not None:
                self.store = open_tier_store(ckpt, tiers_cfg.disk, dtype, self.fmt)
                self.tiers["disk"] = self.store.tier
            self._fill_homes(ckpt)
            for name in self.plan.rows_only:  # read by rows later: check the whole group once, now
                if self.plan.homes[name] == "disk":
                    with timeline.span("disk-read", name, nbytes=self.layouts[name].nbytes, verify=True):
                        self.store.tier.verify_region(name)
                    self.traffic.add("weights", "disk", "cpu", self.layouts[name].nbytes)
            ring = self._slots("gpu", "ring", self.plan.ring_slots, self.plan.ring_slot_bytes)
            stage = self._slots("cpu", "stage", self.plan.stage_slots, self.plan.stage_slot_bytes)
            self.prefetcher = Prefetcher(self.plan, self.tiers, self.engine, timeline, ring, stage, self.traffic)
            if self.plan.on_demand:
                slots = self._slots("gpu", "expert-cache", self.plan.cache_slots, self.plan.cache_slot_bytes)
                self.cache = ExpertCache(self.plan, self.tiers, self.engine, timeline, slots,
                                         make_policy(config.experts.policy, self.plan.cache_slots), self.traffic)
        except BaseException:
            self.close()
            raise
        self._embed_group = embed_group
        # a stage after the first embeds nothing (its input is the previous stage's hidden states)
        self._embed_spec = self.layouts[embed_group].spec(self._embed_tensor) if embed_group in self.layouts else None

    # -- set-up -------------------------------------------------------------------------------
    def _fill_homes(self, ckpt: Checkpoint) -> None:
        """Every group homed in memory gets its bytes once: from the store when there is one, else the checkpoint."""
        staging: torch.Tensor | None = None
        for name, layout in self.layouts.items():
            home = self.plan.homes[name]
            if home == "disk":
                continue
            tier = self.tiers[home]
            assert isinstance(tier, MemoryTier)
            tier.allocate(name, layout.nbytes)
            dest = tier.view(name)
            if dest.device.type != "cpu":
                if staging is None or staging.numel() < layout.nbytes:
                    staging = torch.empty(layout.nbytes, dtype=torch.uint8)
                host = staging[: layout.nbytes]
            else:
                host = dest
            if self.store is not None:
                with self.timeline.span("disk-read", name, nbytes=layout.nbytes, home=home):
                    self.store.tier.read_into(name, host)
                self.traffic.add("weights", "disk", home, layout.nbytes)
            else:
                fill_group(ckpt, layout, host, self.fmt)
            if host is not dest:
                dest.copy_(host)

    def _slots(self, tier: str, prefix: str, count: int, nbytes: int) -> list[torch.Tensor]:
        t = self.tiers[tier]
        assert isinstance(t, MemoryTier)
        for i in range(count):
            t.allocate(f"{prefix}.{i}", nbytes)
        return [t.view(f"{prefix}.{i}") for i in range(count)]

    def allocate_kv(self, nbytes: int, tier: str = "gpu") -> torch.Tensor:
        """Memory for KV blocks as a region of a tier: the device pool ("gpu"), or the cold host blocks ("cpu",
        carved from the pinned arena the plan sized for them)."""
        t = self.tiers[tier]
        assert isinstance(t, MemoryTier)
        key = "kv" if tier == "gpu" else "kv-cold"
        t.allocate(key, nbytes)
        return t.view(key)

    # -- the weight source interface ------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, H], read by rows from wherever the embedding table lives."""
        spec = self._embed_spec
        assert spec is not None, "this pipeline stage has no token embeddings (it starts after layer 0)"
        home = self.plan.homes[self._embed_group]
        tier = self.tiers[home]
        if isinstance(tier, MemoryTier):
            table = self._typed(self._embed_group, tier.view(self._embed_group))[1][self._embed_tensor]
            return table[ids.to(table.device)].to(self.device, self.compute_dtype)
        assert isinstance(tier, DiskTier)
        unique, inverse = torch.unique(ids.cpu(), return_inverse=True)
        row_bytes = spec.shape[1] * self.dtype.itemsize
        rows = torch.empty(len(unique), spec.shape[1], dtype=self.dtype)
        with self.timeline.span("disk-read", f"{self._embed_group} rows", nbytes=len(unique) * row_bytes):
            for i, token in enumerate(unique.tolist()):
                tier.read_into(self._embed_group, rows[i], offset=spec.offset + token * row_bytes)
        self.traffic.add("weights", "disk", "cpu", len(unique) * row_bytes)
        return rows[inverse].to(self.device, self.compute_dtype)

    def acquire(self, group: str) -> dict:
        """The group's tensors as views into its slot; packed matrices as `PackedLinear`s."""
        return self._acquired(group, self.prefetcher.acquire(group))

    def acquire_resident(self, groups: list[str]) -> list[dict]:
        """`acquire` of a run of resident groups in one call (`Prefetcher.acquire_resident`); their views are made
        once a run where they are the same objects each step (the same bytes in the same place: the prefetcher's
        same list; not where matrices are upcast per pass)."""
        bufs = self.prefetcher.acquire_resident(groups)
        got = self._resident.get(key := tuple(groups))
        if got is None or got[0] is not bufs:
            got = (bufs, [self.views(g, buf) for g, buf in zip(groups, bufs)])
            if self.compute_dtype == self.dtype or all(self._upcast.get(self._typed(g, b)[0]) is v for g, b, v in
                                                       zip(groups, bufs, got[1])):
                self._resident[key] = got
        if self.predictor.enabled:
            for group, views in zip(groups, got[1]):
                self._keep_router(group, views)
        return got[1]

    def _acquired(self, group: str, buf: torch.Tensor) -> dict:
        views = self.views(group, buf)
        self._keep_router(group, views)
        return views

    def _keep_router(self, group: str, views: dict) -> None:
        if "router" in views and self.predictor.enabled:  # kept for predicting this layer's experts
            self.predictor.keep_router(int(group.split(".")[1]), views["router"])

    def release_resident(self, groups: list[str], spans: list[tuple[float, float] | None]) -> None:
        self.prefetcher.release_resident(groups, spans)

    def views(self, group: str, buf: torch.Tensor) -> dict:
        """A group's tensors over its bytes `buf` (1-D uint8) at the compute dtype; packed ones as `PackedLinear`s."""
        key, views = self._typed(group, buf)
        if self.compute_dtype != self.dtype:  # upcast after the transfer (dense weights only: see compute_dtype),
            # except the matrices a CPU kernel widens as it multiplies (no float32 copy of them per pass)
            if (up := self._upcast.get(key)) is None:
                up = {name: t if kernels.widens(t, self.compute_dtype) else t.to(self.compute_dtype)
                      for name, t in views.items()}
                if all(t.dim() == 1 for name, t in up.items() if t is not views[name]):  # norms, biases: kept
                    self._upcast[key] = up  # (the same objects each step: the fused layer keeps its arguments)
            return up
        if (packed := self._packed.get(key)) is None:  # the same weight objects each step (the fused layer keeps
            packed = self._packed[key] = weight_views(self.cfg, group, views, self.scratch, self.fmt,  # its args)
                                                      self.dtype)
        return packed

    def _typed(self, group: str, buf: torch.Tensor) -> tuple[tuple[str, int], dict[str, torch.Tensor]]:
        """(key, the group's typed views over buf): the same bytes in the same place (a home, a ring or expert-cache
        slot) get the same views, not ~10 new ones per layer a step."""
        key = (group, buf.data_ptr())
        if (views := self._views.get(key)) is None:
            views = self._views[key] = self.layouts[group].views(buf)
        return key, views

    def release(self, group: str, span: tuple[float, float] | None = None) -> None:
        self.prefetcher.release(group, span)

    def experts(self, layer: int) -> PlanOrderExperts | CachedExperts:
        """Layer `layer`'s routed experts for this pass (its group acquired); the source releases that group."""
        if self.plan.on_demand or self.plan.host_compute:
            return CachedExperts(self, layer, f"layer.{layer}", expert_groups(self.cfg, layer))
        return PlanOrderExperts(self, f"layer.{layer}", expert_groups(self.cfg, layer),
                                lambda g: not self.plan.is_resident(g))

    def expert_stats(self) -> dict:
        """The expert cache's counts so far: hits, prefetched, misses, hit rates per layer, the prediction's
        recall and precision (empty without a cache)."""
        return self.cache.stats.to_dict() if self.cache is not None else {}

    def abort_pass(self) -> None:
        self.prefetcher.reset()
        if self.cache is not None:
            self.cache.reset()
        self.predictor.pending.clear()

    def submit_side(self, jobs) -> None:
        self.prefetcher.submit_side(jobs)

    def side_result(self, group: str):
        """The group's side job's result (its cold KV), once done: a wait for it is a stall charged to the kv fetch
        first (`schedulers.trace`); the executor asks before it acquires the group, so the wait is not compute."""
        start = self.timeline.now()
        out = self.prefetcher.side_result(group)
        if (waited := self.timeline.now()) - start > 1e-4:
            self.timeline.add("stall", group, start, waited, waits="kv-fetch")
        return out

    def close(self) -> None:
        self._views.clear()
        self._upcast.clear()
        self._packed.clear()
        self._resident.clear()
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        for name in ("gpu", "cpu"):
            if name in self.tiers:
                self.tiers[name].close()
        if self.store is not None:
            self.store.close()
            self.store = None
