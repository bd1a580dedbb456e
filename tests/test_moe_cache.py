"""The expert cache of a mixture of experts: a frequency-aware policy that beats LRU on a skewed routing trace,
on-demand loads of routed experts only, the next layer's experts predicted and loaded ahead, hit rates per layer on
the timeline and in the run's stats, the planner's cache size and assumed hit rate, and the host-or-device choice
for experts homed in host RAM; every variant gives the tokens of the all-in-memory run."""

from __future__ import annotations

import pytest
import torch

from offload.config import OffloadConfig
from offload.model.checkpoint import Checkpoint
from offload.plan.planner import Planner
from offload.runtime.runner import Runner
from schedulers.expert_policy import LFU, LRU, coverage, hit_rate, make_policy, zipf_trace
from schedulers.plan import Capacities
from schedulers.trace import summarize
from tests.conftest import run_config

PROMPTS = [[1, 5, 9, 22, 31, 7, 3], [4, 8, 15, 16, 23, 42]]
NEW = 8


# ----------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("slots", [32, 64])
def test_lfu_with_decay_beats_lru_on_a_zipf_trace_with_temporal_locality(slots):
    # 8 layers x 16 experts, top 2: a token uses 16 experts; the cache holds 2 or 4 tokens' worth
    trace = zipf_trace(layers=8, experts=16, top_k=2, tokens=400, skew=1.0, repeat=0.3, seed=1)
    lru = hit_rate(trace, slots, make_policy("lru", slots), warmup=len(trace) // 4)
    lfu = hit_rate(trace, slots, make_policy("lfu", slots), warmup=len(trace) // 4)
    assert lfu > lru + 0.03, (lfu, lru)


def test_lfu_keeps_a_hot_key_through_a_burst_of_cold_ones_that_lru_flushes():
    trace = (["hot"] * 5 + [f"cold{i}" for i in range(3)]) * 4
    assert hit_rate(trace, 2, LFU(half_life=100)) > hit_rate(trace, 2, LRU())


def test_assumed_hit_rate_is_the_cached_share_under_uniform_routing_and_more_under_skew():
    assert coverage(16, 4, 8, 0.0) == pytest.approx(0.5)
    assert coverage(16, 4, 8, 1.0) > 0.5
    assert coverage(64, 4, 8, 1.0) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- runs
def _tiers(path, store, gpu: str, **experts) -> dict:
    return run_config(path, kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 16}, prefetch={"depth": 1},
                      tiers={"gpu": {"capacity": gpu}, "cpu": {"capacity": 0}, "disk": {"path": str(store)}},
                      experts=experts)


def _generate(cfg: dict) -> tuple[list[list[int]], Runner]:
    r = Runner.from_config(cfg)
    return [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)], r


@pytest.fixture(scope="module")
def qwen3(model_factory):
    path = model_factory("qwen3_moe")
    with Runner.from_config(run_config(path)) as r:
        ref = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
    return path, ref


@pytest.mark.parametrize("prefetch,policy", [(True, "lfu"), (False, "lfu"), (True, "lru")])
def test_cached_experts_give_the_tokens_of_the_resident_run_and_move_routed_experts_only(qwen3, tmp_path, prefetch,
                                                                                        policy):
    path, ref = qwen3
    got, r = _generate(_tiers(path, tmp_path / "store", "3.2MiB", cache=12, prefetch=prefetch, policy=policy))
    with r:
        plan, stats = r.plan, r.last_stats.experts
        experts = [g for g in plan.order if ".expert." in g]
        # on a CPU device what the cache leaves of the device tier is lent to the host tier: experts homed there
        # are read in place; the rest load on demand
        assert plan.on_demand == {g for g in experts if plan.homes[g] == "disk"} and plan.cache_slots == 12
        assert len(plan.on_demand) > len(experts) // 2 and {plan.homes[g] for g in experts} <= {"cpu", "disk"}
        moved = r.traffic.total("weights", "disk->gpu")
        streamed = sum(plan.sizes[g] for g in plan.streamed)  # layers and head, every pass
    assert got == ref
    passes = len(r.last_stats.passes)
    # only routed experts move, and the cache keeps some: far less than every expert every pass
    assert moved - streamed * passes < 0.6 * sum(plan.sizes[g] for g in experts) * passes
    assert stats["misses"] > 0 and stats["hits"] + stats["prefetched"] > 0
    assert stats["routed"] == stats["hits"] + stats["prefetched"] + stats["misses"]
    assert set(stats["per_layer_hit_rate"]) == {int(g.split(".")[1]) for g in plan.on_demand}
    if prefetch:
        assert stats["prefetched"] > 0 and stats["prediction_recall"] > 0.3
    else:
        assert stats["prefetched"] == 0 and stats["prediction_recall"] is None


def test_a_cache_of_one_slot_still_gives_the_same_tokens(qwen3, tmp_path):
    path, ref = qwen3
    got, r = _generate(_tiers(path, tmp_path / "store", "3.2MiB", cache=1))
    r.close()
    assert got == ref


def test_the_timeline_summary_reports_the_hit_rate_per_layer(qwen3, tmp_path):
    path, _ = qwen3
    _, r = _generate(_tiers(path, tmp_path / "store", "3.2MiB", cache=12))
    with r:
        s = summarize(r.timeline.spans_resolved())
        stats = r.last_stats.experts
    assert list(s.experts["per_layer_hit_rate"]) == [f"layer.{i}" for i in range(4)]
    assert s.experts["routed"] == stats["routed"] and s.experts["misses"] == stats["misses"]
    assert s.experts["hit_rate"] == stats["hit_rate_with_prefetch"]


# ----------------------------------------------------------------------------- the plan
def _plan(path, gpu: int, device: str = "cpu", **experts):
    cfg = OffloadConfig.load(_tiers(path, "/tmp/unused-store", f"{gpu}B", **experts) | {"device": device})
    caps = Capacities(gpu=gpu, cpu=0 if device == "cpu" else 64 << 20, disk=None, has_disk=True)
    return Planner(cfg, Checkpoint(path).config, torch.float32, torch.device(device), caps).run_plan().plan


def test_the_planner_sizes_the_cache_from_what_the_ring_and_kv_leave_and_states_its_assumed_hit_rate(qwen3):
    path, _ = qwen3
    small, large = _plan(path, 4 << 20), _plan(path, 5 << 20)
    assert 2 <= small.cache_slots < large.cache_slots
    for p in (small, large):
        assert p.used("gpu") <= p.capacity("gpu")
        assert p.reserved_gpu["expert cache"] == p.cache_slots * p.cache_slot_bytes
        assert p.hit_rate == pytest.approx(p.cache_slots / len(p.on_demand))
        assert "assumed hit rate" in p.describe()
    assert not any(large.homes[g] == "gpu" for g in large.on_demand)
    # bytes per step count the routed, missed share of the on-demand experts only
    all_experts = sum(large.sizes[g] for g in large.on_demand)
    layers = sum(large.sizes[g] for g in large.streamed)
    assert large.bytes_per_step()["disk->gpu"] < layers + 0.3 * all_experts


def test_no_cache_streams_every_expert_through_the_ring_as_before(qwen3):
    path, _ = qwen3
    p = _plan(path, 2 << 20, cache=0)
    assert not p.on_demand and p.cache_slots == 0 and any(".expert." in g for g in p.streamed)


def test_on_cuda_experts_homed_in_host_ram_are_computed_there_when_asked_or_when_faster(qwen3):
    path, _ = qwen3
    host = _plan(path, 3 << 20, device="cuda", compute="host")
    device = _plan(path, 3 << 20, device="cuda", compute="device")
    in_ram = {g for g in device.on_demand if device.homes[g] == "cpu"}
    assert in_ram and host.host_compute == in_ram and not host.on_demand & in_ram
    assert all(host.is_resident(g) for g in in_ram) and not device.host_compute
    assert "computed on the host" in host.describe()
    assert host.bytes_per_step().get("cpu->gpu", 0) < device.bytes_per_step()["cpu->gpu"]


@pytest.mark.cuda
def test_host_computed_experts_give_the_tokens_of_the_resident_run_on_cuda(qwen3, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, ref = qwen3
    cfg = _tiers(path, tmp_path / "store", "3MiB", compute="host") | {"device": "cuda"}
    cfg["tiers"]["cpu"]["capacity"] = "64MiB"
    got, r = _generate(cfg)
    with r:
        assert r.plan.host_compute
    assert got == ref
