"""CUDA paths: copy streams, pinned host slots, events. Skipped without a GPU (marker `cuda`)."""

from __future__ import annotations

import pytest
import torch

from offload.model.functional import attend_group
from offload.runtime.executor import ForwardBatch
from offload.runtime.runner import Runner
from schedulers.plan import Capacities, Plan
from schedulers.prefetch import Prefetcher
from schedulers.timeline import Timeline
from schedulers.transfer import CudaEngine, Upload
from storage.disk import DiskTier
from storage.slots import MemorySlots
from storage.tiers import DeviceTier, HostTier
from tests.conftest import run_config
from tests.test_cuda_logic import cuda_shaped
from tests.test_tiered_runner import PLACEMENTS, PROMPTS, config

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def tiny8(model_factory):
    return model_factory("llama", overrides={"num_hidden_layers": 8})


def cuda_config(model, placement, store, depth):
    """The CPU placements, plus room in the cpu tier for the two pinned staging buffers disk reads land in."""
    return cuda_shaped(config(model, placement, store, depth), model)


@pytest.fixture(scope="module")
def cuda_reference(tiny8):
    with Runner.from_config(run_config(tiny8, device="cuda")) as r:
        return [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=16, stop_on_eos=False)]


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_cuda_placements_give_the_resident_tokens(tiny8, tmp_path_factory, cuda_reference, placement, depth):
    store = tmp_path_factory.getbasetemp() / "cuda-store"
    with Runner.from_config(cuda_config(tiny8, placement, store, depth)) as r:
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=16, stop_on_eos=False)]
        streamed = r.plan.streamed
        routes = {r.plan.route(g) for g in streamed}
        h2d = r.timeline.on("h2d")
    assert got == cuda_reference
    if placement in ("all-cpu", "mixed", "all-disk"):
        assert streamed and all(route[-2:] == ("cpu", "gpu") for route in routes)  # every stream crosses PCIe
        assert h2d and all(s.end >= s.start for s in h2d)  # timed by CUDA events


def test_host_tier_is_pinned_on_cuda():
    tier = HostTier(None, pinned=True)
    tier.allocate("a", 4096)
    assert tier.view("a").is_pinned()
    assert not HostTier(None, pinned=False).pin_memory


def test_the_pinned_arena_pins_the_budget_not_a_power_of_two_per_region():
    """Three 1.5 MiB regions: per-region pinning takes 2 MiB each; the arena pins 4.5 MiB, one registration."""
    n = 3 * 2**19
    tier = HostTier(3 * n, pinned=True, arena_bytes=3 * n)
    for i in range(3):
        tier.allocate(f"r{i}", n)
    assert all(tier.view(f"r{i}").is_pinned() for i in range(3))
    assert tier.pinned_bytes == 3 * n
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    tier.view("r1").fill_(7)
    dev.copy_(tier.view("r1"), non_blocking=True)
    torch.cuda.synchronize()
    assert int(dev.sum()) == 7 * n
    tier.close()  # unregisters


def test_cuda_scheduler_never_overwrites_a_slot_in_use(tmp_path):
    """Slow kernels on the compute stream; copies must wait for the slot's release event."""
    from tests.test_prefetch import SIZES, overwrites

    g = torch.Generator().manual_seed(0)
    data = {n: torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g) for n, s in SIZES.items()}
    homes = {"g0": "disk", "g1": "gpu", "g2": "cpu", "g3": "disk", "g4": "cpu", "g5": "disk"}
    order = tuple(SIZES)
    probe = Plan(order, SIZES, homes, 1, 0, 0, 0, 0, True, Capacities(None, None, None, True))
    slot = max(SIZES[n] for n in probe.streamed)
    plan = Plan(order, SIZES, homes, 1, 2, slot, 2, slot, True, Capacities(None, None, None, True))
    disk = DiskTier(tmp_path / "s")
    tiers = {"gpu": DeviceTier(None, "cuda"), "cpu": HostTier(None), "disk": disk}
    for name, d in data.items():
        disk.allocate(name, d.numel())
        disk.write(name, d)
        if homes[name] in ("gpu", "cpu"):
            tiers[homes[name]].allocate(name, d.numel())
            tiers[homes[name]].write(name, d)
    ring = []
    for i in range(2):
        tiers["gpu"].allocate(f"ring.{i}", slot)
        ring.append(tiers["gpu"].view(f"ring.{i}"))
    stage = []
    for i in range(2):
        tiers["cpu"].allocate(f"stage.{i}", slot)
        stage.append(tiers["cpu"].view(f"stage.{i}"))
    timeline = Timeline()
    pf = Prefetcher(plan, tiers, CudaEngine("cuda"), timeline, ring, stage)
    expected = {n: d.cuda() for n, d in data.items()}
    seen = []
    try:
        for _ in range(4):
            for name in order:
                buf = pf.acquire(name)
                torch.cuda._sleep(2_000_000)  # the compute stream is busy ~1 ms before it reads the slot
                seen.append((name, buf.clone()))  # queued after the sleep; the host does not wait for it
                pf.release(name)  # only an event on the compute stream: the next copy into the slot must wait on it
            timeline.next_step()
        torch.cuda.synchronize()
    finally:
        pf.close()
        disk.close()
    # had a copy into a slot not waited for the release event, it would have landed during the sleep
    assert [n for n, got in seen if not torch.equal(got, expected[n])] == []
    assert overwrites(timeline.on("h2d") + timeline.on("compute")) == []


def test_device_to_host_slot_write_is_complete_when_write_returns():
    """A KV demotion: values made by a slow kernel, written into host slots and read at once (old code stored
    `values.to("cpu", non_blocking=True)`, a pinned copy still in flight, and read stale bytes)."""
    slots = MemorySlots(2, 4, (4096,), torch.float32, "cpu", pin_memory=True)
    for i in range(8):
        x = torch.empty(2, 4096, device="cuda")
        torch.cuda._sleep(5_000_000)  # the device is busy a few ms before it writes the values
        x.fill_(float(i + 1))
        slots.write(i % 4, x)
        assert torch.equal(slots.read(i % 4), torch.full((2, 4096), float(i + 1)))


@pytest.mark.parametrize("kv", [
    {},
    {"quantization": "int8"},
    {"cpu_attention": True},
    {"restore": "recompute"},
], ids=["transfer", "int8", "cpu-attention", "recompute"])
def test_cuda_kv_beyond_the_device_gives_the_device_tokens(model_factory, tmp_path, kv):
    """Cold KV blocks on the host and the disk of a CUDA run: the tokens of a run whose KV stays on the device."""
    from tests.test_kv_tiers import NEW, PROMPTS, tiered

    small = model_factory("llama", "small")
    with Runner.from_config(run_config(small, device="cuda", activations={"prefill_chunk": 16})) as r:
        reference = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
    cfg = tiered(small, tmp_path, **kv)
    cfg["device"] = "cuda"
    with Runner.from_config(cfg) as r:
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
        moved = r.kv.traffic.routes("kv")
    assert moved.get("gpu->cpu", 0) > 0 and moved.get("cpu->disk", 0) > 0
    if kv.get("quantization") == "int8":  # int8 rounds: most tokens agree, the first ones exactly
        assert got[0][:8] == reference[0][:8]
    else:
        assert got == reference


def test_cuda_attention_is_the_fused_kernel_exact_and_linear_in_context():
    """A 512-token chunk over 32k keys, 32 heads: float32 scores alone would be 2 GiB; the fused kernel returns
    the same attention and log-sum-exp (checked against the float32 CPU kernel on a small case)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 7, 8, 64), (2, 50, 2, 64), (2, 50, 2, 64)))
    mask = torch.rand(2, 7, 50, generator=g) > 0.3
    mask[0, 3] = False
    ref_out, ref_lse, _ = attend_group(q, k, v, mask, 0.125)
    out, lse, _ = attend_group(q.cuda(), k.cuda(), v.cuda(), mask.cuda(), 0.125)
    assert torch.allclose(out.cpu(), ref_out, atol=1e-4) and torch.allclose(lse.cpu(), ref_lse, atol=1e-4)
    B, Tq, Hq, Hkv, D, Tk = 1, 512, 32, 4, 64, 32768
    q = torch.randn(B, Tq, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Tk, Hkv, D, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(B, Tq, Tk, dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attend_group(q, k, k, mask, 0.125)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 512 * 2**20  # scores would be 2 GiB


def test_cold_kv_crosses_pcie_in_its_cold_format_without_a_host_sync(model_factory, tmp_path):
    """Cold int8 blocks: the side thread stages them (the pinned arena, the engine's copy stream, an event);
    they reach the layer as int8 on the device (dequantized there, so PCIe carries int8), and a decode pass over
    host and disk blocks runs with `set_sync_debug_mode("error")`: nothing in it waits on the device from the
    host."""
    from tests.test_kv_tiers import PROMPTS, tiered

    cfg = tiered(model_factory("llama", "small"), tmp_path, quantization="int8")
    cfg["device"] = "cuda"
    with Runner.from_config(cfg) as r:
        r.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)  # blocks demoted to the host and the disk
        kv = r.kv
        sids = [kv.add_sequence(reserve_tokens=64) for _ in PROMPTS]
        for chunk in r.target.prefill_chunks(sids, [list(p) for p in PROMPTS]):
            r.target.forward(ForwardBatch.last([c.sid for c in chunk], [c.tokens for c in chunk]))
        layout, step = kv.prepare(sids, [1] * len(sids))
        assert any(g.tier != "gpu" for g in step.groups)  # the step reads cold blocks
        staged = kv.fetch_cold(0, step)[0]
        for uploads in staged.values():
            for u in uploads:
                assert isinstance(u, Upload) and u.tensors["kv8"].dtype == torch.int8
                assert u.tensors["kv8"].device.type == "cuda"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = r.target.forward(ForwardBatch.last(sids, [[5]] * len(sids)))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.isfinite(logits).all()
