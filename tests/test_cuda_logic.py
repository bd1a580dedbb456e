"""The CUDA path's logic, checked on the CPU: staging room in CUDA-shaped plans, per-device timeline anchors.

What needs a GPU to show (copies racing the host, pinned memory) is in tests/test_cuda.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from offload.config import OffloadConfig
from offload.model.checkpoint import Checkpoint
from offload.plan.planner import Planner
from offload.weights.groups import model_layouts
from schedulers.timeline import Timeline
from storage.arena import PAGE, round_up
from storage.errors import CapacityError
from tests.test_tiered_runner import PLACEMENTS, config


def cuda_shaped(cfg: dict, model) -> dict:
    """A CPU test config made for CUDA: the cpu tier also holds two pinned staging slots when layers live on disk."""
    cfg = dict(cfg, device="cuda")
    tiers = cfg.get("tiers")
    if tiers and "disk" in tiers:
        layer = model_layouts(Checkpoint(model).config, torch.float32)["layer.0"].nbytes
        stage = round_up(layer, PAGE)
        cfg["tiers"] = dict(tiers, cpu={"capacity": int(tiers["cpu"]["capacity"]) + 2 * stage})
    return cfg


@pytest.fixture(scope="module")
def tiny8(model_factory):
    return model_factory("llama", overrides={"num_hidden_layers": 8})


def plan_for(cfg: dict, device: str):
    oc = OffloadConfig.load(cfg)
    ckpt = Checkpoint(oc.model)
    return Planner(oc, ckpt.config, torch.float32, torch.device(device)).run_plan().plan


def test_gpu_plus_disk_with_cpu_zero_is_refused_on_cuda_with_the_capacity_that_fits(tiny8, tmp_path):
    """The old plan put two staging slots in a cpu tier of 0 bytes; TieredWeights then failed to allocate."""
    cfg = config(tiny8, "all-disk", tmp_path / "store", 1)
    assert plan_for(cfg, "cpu").stage_slots == 0  # a CPU device reads the disk straight into the ring
    with pytest.raises(CapacityError, match=r"pinned staging buffers in the cpu tier, but tiers\.cpu\.capacity is "
                                            r"0\.0 MiB; raise tiers\.cpu\.capacity to at least"):
        plan_for(dict(cfg, device="cuda"), "cuda")


@pytest.mark.parametrize("placement", [p for p in PLACEMENTS if p != "all-gpu"])
def test_cuda_shaped_plans_of_the_cuda_tests_fit_their_cpu_tier(tiny8, tmp_path, placement):
    cfg = cuda_shaped(config(tiny8, placement, tmp_path / "store", 1), tiny8)
    plan = plan_for(cfg, "cuda")
    assert plan.used("cpu") <= plan.capacity("cpu")
    if placement in ("all-disk", "mixed"):
        assert plan.stage_slots == 2 and any(plan.homes[g] == "disk" for g in plan.streamed)
    if placement == "all-disk":
        assert all(plan.homes[f"layer.{i}"] == "disk" for i in range(8))


class FakeEvent:
    """Stands for torch.cuda.Event: remembers the device it was recorded on and a fake device time."""

    clock = {0: 0.0, 1: 0.0}

    def __init__(self, enable_timing: bool = False) -> None:
        self.device = None

    def record(self, stream=None) -> None:
        self.device = stream.device if stream is not None else FakeCuda.current
        FakeEvent.clock[self.device] += 1.0
        self.t = FakeEvent.clock[self.device]

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: FakeEvent) -> float:
        if other.device != self.device:  # what CUDA does with events of two devices
            raise RuntimeError("events from different devices")
        return (other.t - self.t) * 1000.0


class FakeStream:
    def __init__(self, device: int) -> None:
        self.device = device


class FakeCuda:
    current = 0

    @staticmethod
    @contextmanager
    def device(index):
        prev, FakeCuda.current = FakeCuda.current, index
        try:
            yield
        finally:
            FakeCuda.current = prev


def test_timeline_anchors_each_device_on_its_own_stream(monkeypatch):
    """Spans of cuda:1 resolve against an anchor recorded on cuda:1, not on the current device (cuda:0)."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", FakeCuda.device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: FakeCuda.current)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(
        FakeCuda.current if device is None else getattr(device, "index", device)))
    tl = Timeline()
    spans = []
    for dev in (1, 0, 1):
        start, end = FakeEvent(), FakeEvent()
        start.record(FakeStream(dev))
        end.record(FakeStream(dev))
        tl.add_cuda("h2d", f"on {dev}", start, end, device=torch.device("cuda", dev))
        spans.append((dev, start, end))
    resolved = tl.on("h2d")  # raises "events from different devices" with a single anchor on cuda:0
    assert len(resolved) == 3 and set(tl._anchors) == {0, 1}
    assert all(s.end - s.start == pytest.approx(1.0) for s in resolved)
