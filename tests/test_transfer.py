"""One transfer layer: weights and cold KV share one engine (one copy stream, one marker type), cold KV
is staged in pinned buffers carved from the cpu tier's memory, one persistent thread fetches it pass after
pass, KV slot blocks are checksummed on disk, and the byte counters agree.

The CUDA side (one copy stream, events, no host sync) is in the `cuda`-marked tests at the end.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from offload.config import OffloadConfig
from offload.kv.blocks import KVSettings
from offload.kv.cache import PagedKVCache
from offload.kv.fetch import ColdFetcher, host_bytes, receive
from offload.kv.formats import ColdFormat
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from offload.plan.planner import Planner
from offload.runtime.runner import Runner
from schedulers.side import SideWorker
from schedulers.traffic import COMPUTE
from schedulers.transfer import CudaMarker, Marker, ThreadEngine, TransferEngine, Upload
from storage.arena import PAGE, HostArena, aligned_empty
from storage.errors import StoreError
from storage.slots import DiskSlots
from tests.test_kv_tiers import PROMPTS, tiered

CFG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 64}


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("llama")


def generate_with_cold_kv(model, tmp_path, new=8, **kv):
    """A tiny run whose KV spills to the host and disk tiers (4 device blocks for 10 blocks of prompt)."""
    r = Runner.from_config(tiered(model, tmp_path, **kv))
    r.generate(PROMPTS, max_new_tokens=new, stop_on_eos=False)
    return r


# ----------------------------------------------------------------------------- one engine, one marker type
class FakeMarker(Marker):
    host_waits = 0

    def wait(self) -> None:
        FakeMarker.host_waits += 1

    def done(self) -> bool:
        return True


class CopyingEngine(ThreadEngine):
    """A CPU engine that behaves like the CUDA one for the KV path: uploads copy, markers must be waited on."""

    copies_to_device = True

    def __init__(self) -> None:
        super().__init__("cpu")
        self.sources: list[tuple[int, int]] = []  # (address, bytes) of every uploaded source
        self.waited: list[Marker] = []  # markers compute waited on

    def upload(self, parts, after=()):
        self.sources += [(v.data_ptr(), v.numel() * v.element_size()) for v in parts.values()]
        return Upload({k: v.clone() for k, v in parts.items()}, FakeMarker())

    def compute_wait(self, marker: Marker) -> None:
        self.waited.append(marker)


def test_weights_and_cold_kv_cross_on_one_engine(tiny, tmp_path):
    with generate_with_cold_kv(tiny, tmp_path, new=2) as r:
        assert isinstance(r.weights.engine, TransferEngine)
        assert r.kv.engine is r.weights.engine is r.weights.prefetcher.engine
        assert r.kv.fetcher.engine is r.weights.engine


def test_staged_cold_kv_comes_from_the_given_pinned_region_in_pieces_and_compute_waits_on_markers(tmp_path,
                                                                                                  monkeypatch):
    """The CUDA path's logic on a CPU: host and disk blocks are read into staging carved from the cold tiers'
    host region (no pin_memory per call), cross in pieces of `stage_blocks`, alternate two buffers (a buffer
    is refilled only after its copies' marker passed), and compute waits on every marker through the engine."""
    cfg = ModelConfig.from_dict(CFG)
    engine = CopyingEngine()
    settings = KVSettings(block_size=4, cpu_blocks=3, disk_blocks=8, stage_blocks=2)
    total, stage = host_bytes(ColdFormat.for_config(cfg, 4, torch.float32, "none", "transfer"), cfg.num_layers, 3, 2)
    arena = HostArena(total)
    region = arena.data[:total]
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda *a, **k: pytest.fail("pinned per call"))
    cache = PagedKVCache(cfg, 4, 2, torch.float32, "cpu", settings=settings, disk_dir=tmp_path, host_memory=region,
                         engine=engine)
    try:
        sid = cache.add_sequence(reserve_tokens=40)
        g = torch.Generator().manual_seed(0)
        for _ in range(7):  # 7 blocks of 4 tokens: the device keeps 2, the rest go down to the host and the disk
            layout, step = cache.prepare([sid], [4])
            for layer in range(cfg.num_layers):
                k, v = (torch.randn(4, cfg.num_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
                cache.view(layer, layout, step).write(k, v)
        layout, step = cache.prepare([sid], [1])
        cold = [grp for grp in step.groups if grp.tier != "gpu"]
        assert {grp.tier for grp in cold} == {"cpu", "disk"} and sum(len(grp.slots) for grp in cold) >= 5
        FakeMarker.host_waits = 0
        fetched, nbytes = cache.fetch_cold(1, step)
        start = region.data_ptr() + total - stage
        assert engine.sources and all(start <= a and a + n <= start + stage for a, n in engine.sources)
        assert FakeMarker.host_waits >= 1  # the third piece waited for the first one's copies
        for grp in cold:
            assert isinstance(fetched[grp.tier], list) and all(isinstance(u, Upload) for u in fetched[grp.tier])
            assert len(fetched[grp.tier]) == -(-len(grp.slots) // 2)
            parts = receive(engine, fetched[grp.tier])
            truth = cache.stores[grp.tier].read_plane(1, grp.slots)
            assert all(torch.equal(parts[k], truth[k]) for k in truth)
        assert len(engine.waited) == sum(-(-len(grp.slots) // 2) for grp in cold)
        assert nbytes == sum(len(grp.slots) * cache.stores[grp.tier].slot_nbytes for grp in cold)
    finally:
        cache.close()
        arena.close()


def test_without_a_copying_engine_cold_parts_pass_through():
    cfg = ModelConfig.from_dict(CFG)
    fetcher = ColdFetcher(ColdFormat.for_device(cfg, 4, torch.float32, "transfer"), 3, 2, 2, ThreadEngine())
    assert not fetcher.staged and fetcher._buffers == []


def test_cuda_plans_reserve_the_cold_kv_staging_in_the_cpu_tier_and_cpu_plans_do_not(tiny, tmp_path):
    for device in ("cpu", "cuda"):
        oc = OffloadConfig.load(dict(tiered(tiny, tmp_path), device=device))
        planner = Planner(oc, Checkpoint(oc.model).config, torch.float32, torch.device(device))
        rp = planner.run_plan()
        kv, plan = rp.kv, rp.plan
        host, stage = host_bytes(planner.cold_fmt, planner.cfg.num_layers, kv.cpu_blocks, kv.stage_blocks)
        assert (plan.host_reserve, plan.kv_stage_bytes) == (host, stage)
        assert plan.used("cpu") <= plan.capacity("cpu") and kv.cpu_blocks == 1 and kv.disk_blocks == 64
        if device == "cpu":
            assert stage == 0 and kv.stage_blocks == 0 and "cold KV staging" not in plan.describe()
        else:  # one staging buffer holds every cold block of a layer here (65 blocks of a tiny model < 64 MiB)
            assert kv.stage_blocks == 65 and stage > 0 and "cold KV staging" in plan.describe()
            assert plan.pinned_bytes() >= host


# ----------------------------------------------------------------------------- one persistent fetch thread
def test_the_side_worker_runs_every_pass_on_one_thread_even_after_an_aborted_pass():
    side = SideWorker(lead=2)
    seen: list[threading.Thread] = []
    job = lambda: (seen.append(threading.current_thread()), 0)  # noqa: E731
    try:
        for p in range(6):
            side.submit({"a": job, "b": job}, {"a": 0, "b": 1})
            side.result("a")
            side.advance()
            if p == 3:
                side.cancel()  # a pass cut short: the thread stays for the next
                continue
            side.result("b")
            side.advance()
    finally:
        side.close()
    assert len(seen) >= 10 and all(t is seen[0] for t in seen)
    assert side.threads_started == 1 and not seen[0].is_alive()


def test_cold_kv_is_fetched_by_one_thread_across_passes(tiny, tmp_path):
    with Runner.from_config(tiered(tiny, tmp_path)) as r:
        threads: list[threading.Thread] = []
        real = r.kv.fetch_cold

        def fetch(layer, step):
            threads.append(threading.current_thread())
            return real(layer, step)

        r.kv.fetch_cold = fetch
        r.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)
        passes = r.timeline.step
        assert [t.name for t in threading.enumerate()].count("offload-side") == 1
        assert r.weights.prefetcher.side.threads_started == 1
    assert passes >= 8 and len(threads) >= 8 * 4  # every pass fetched cold KV, for every layer
    assert all(t is threads[0] for t in threads)


# ----------------------------------------------------------------------------- checksummed KV slots
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_a_corrupted_kv_block_on_disk_is_detected_by_its_checksum(tmp_path, direct):
    shape = (2, PAGE // 8) if direct else (2, 3)  # a page per slot: read straight into aligned memory
    slots = DiskSlots(tmp_path, "kv", planes=3, slots=6, slot_shape=shape, dtype=torch.float32, direct_io=direct)
    g = torch.Generator().manual_seed(0)
    blocks = {s: torch.randn(3, *shape, generator=g) for s in (1, 2, 4)}
    for s, b in blocks.items():
        slots.write(s, b)
    out = aligned_empty(3 * slots.slot_nbytes).view(torch.float32).view(3, *shape)
    assert torch.equal(slots.read_plane(1, [1, 2, 4], out=out), torch.stack([blocks[s][1] for s in (1, 2, 4)]))
    if direct and not slots.reader.direct(slots.path):
        slots.close()
        pytest.skip("this file system refuses O_DIRECT")
    fd = os.open(slots.path, os.O_RDWR)
    try:  # one byte of slot 2 in plane 1 flips, as a failing disk would return it
        offset = (1 * 6 + 2) * slots.slot_nbytes + 5
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x40]), offset)
    finally:
        os.close(fd)
    try:
        assert torch.equal(slots.read_plane(1, [1, 4]), torch.stack([blocks[1][1], blocks[4][1]]))  # others intact
        with pytest.raises(StoreError, match=r"KV block in slot 2 \(layer 1\) does not match the checksum"):
            slots.read_plane(1, [1, 2, 4], out=out)
        with pytest.raises(StoreError, match="does not match the checksum"):
            slots.read(2)
    finally:
        slots.close()


def test_slots_read_in_the_files_order_in_one_request_a_run_and_come_back_in_the_order_asked(tmp_path, monkeypatch):
    """Blocks demoted newest first sit in descending slots: a layer of them is read as the file holds them, one
    request a run of adjacent slots (not one a slot), checked, and returned in the order asked; with O_DIRECT into
    page-aligned memory of its own, and no page cache to drop after."""
    shape = (2, PAGE // 8)  # a page per slot
    slots = DiskSlots(tmp_path, "kv", planes=2, slots=12, slot_shape=shape, dtype=torch.float32, direct_io=True)
    g = torch.Generator().manual_seed(1)
    blocks = {s: torch.randn(2, *shape, generator=g) for s in range(12)}
    for s, b in blocks.items():
        slots.write(s, b)
    requests, drops = [], []
    run_jobs = slots.reader._run_jobs

    def counted(jobs, path):
        requests.append(len(jobs))
        return run_jobs(jobs, path)

    monkeypatch.setattr(slots.reader, "_run_jobs", counted)
    monkeypatch.setattr("storage.io.drop_page_cache", lambda *a: drops.append(a))
    asked = [9, 8, 7, 6, 5, 2, 1, 0, 11]
    try:
        got = slots.read_plane(1, asked)
        assert torch.equal(got, torch.stack([blocks[s][1] for s in asked]))
        assert requests == [3]  # 0-2, 5-9, 11
        assert slots.read_plane(0, [3, 4]).data_ptr() % PAGE == 0
        if slots.reader.direct(slots.path):
            assert drops == []  # O_DIRECT brought no pages in
        else:
            assert drops  # (a file system that refuses O_DIRECT: buffered, and its pages dropped)
    finally:
        slots.close()


# ----------------------------------------------------------------------------- one byte counter
def test_the_byte_counters_agree_on_every_kv_and_weight_byte(tiny, tmp_path):
    """`runner.traffic` is the counter; the trace's spans carry the same bytes (`bytes_on` derives from them)."""
    with generate_with_cold_kv(tiny, tmp_path) as r:
        r.weights.close()  # stop prefetching ahead so nothing moves after we look
        kv = r.traffic.routes("kv")
        served = r.traffic.served("kv")
        weights_from_disk = sum(n for route, n in r.traffic.routes("weights").items() if route.startswith("disk->"))
        fetched, spilled = r.timeline.bytes_on("kv-fetch"), r.timeline.bytes_on("kv-spill")
        read = r.timeline.bytes_on("disk-read")
    promoted = sum(n for route, n in kv.items() if route.endswith("->gpu"))
    demoted = sum(n for route, n in kv.items() if not route.endswith("->gpu"))
    assert served.get("cpu", 0) > 0 and served.get("disk", 0) > 0 and demoted > 0
    assert fetched == sum(served.values()) + promoted
    assert spilled == demoted
    assert read == weights_from_disk
    assert COMPUTE not in "".join(kv)  # routes() leaves out what is handed to compute


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_one_copy_stream_and_cuda_markers_for_weights_and_cold_kv(model_factory, tmp_path, monkeypatch):
    """A CUDA run with weights streaming and KV on the host and the disk creates one copy stream; its cold KV
    crosses on it from the pinned arena, as int8, with CUDA-event markers, and no host sync in a decode pass."""
    streams = []
    real = torch.cuda.Stream

    def counting(*a, **k):
        s = real(*a, **k)
        streams.append(s)
        return s

    monkeypatch.setattr(torch.cuda, "Stream", counting)
    cfg = tiered(model_factory("llama", "small"), tmp_path, quantization="int8")
    cfg["device"] = "cuda"
    with Runner.from_config(cfg) as r:
        r.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)
        assert len(streams) == 1 and r.kv.engine is r.weights.engine
        kv = r.kv
        sids = [kv.add_sequence(reserve_tokens=64) for _ in PROMPTS]
        for p, s in zip(PROMPTS, sids):
            kv.prepare([s], [len(p)])
        _, step = kv.prepare(sids, [1] * len(sids))
        fetched, _ = kv.fetch_cold(0, step)
        assert fetched
        arena = r.weights.tiers["cpu"].arena
        for uploads in fetched.values():
            for u in uploads:
                assert isinstance(u.marker, CudaMarker) and u.tensors["kv8"].dtype == torch.int8
                assert u.tensors["kv8"].device.type == "cuda"
        assert arena is not None and kv.fetcher._buffers[0]["kv8"].data_ptr() >= arena.data.data_ptr()
        torch.cuda.synchronize()
        for s in sids:
            kv.free_sequence(s)
