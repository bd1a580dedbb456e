"""The KV cache across tiers: exact tokens with KV far beyond the device, policies, int8, sharing, disk slots."""

from __future__ import annotations

import pytest
import torch

from offload.errors import ConfigError
from offload.kv.blocks import KVSettings
from offload.kv.cache import PagedKVCache
from offload.kv.formats import dequantize_int8, quantize_int8
from offload.model import functional as M
from offload.model.config import ModelConfig
from offload.model.functional import attend_group
from offload.runtime.engine import Engine
from offload.runtime.executor import ForwardBatch
from offload.runtime.requests import Request
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling
from schedulers.eviction import Candidate, Idle, make_policy
from storage.block_pool import Admission
from storage.errors import StoreError
from storage.slots import DiskSlots, MemorySlots
from tests.conftest import run_config

PROMPTS = [list(range(1, 91)), list(range(200, 260))]  # 90 and 60 tokens
NEW = 80  # 11 + 9 = 20 blocks of 16 tokens: 4x the 4 + 1 blocks of the device and the host


@pytest.fixture(scope="module")
def small(model_factory):
    return model_factory("llama", "small")  # float32


@pytest.fixture(scope="module")
def reference(small):
    with Runner.from_config(run_config(small, activations={"prefill_chunk": 16})) as r:
        return [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]


def tiered(model, tmp_path, **kv):
    settings = {"gpu_blocks": 4, "cpu_blocks": 1, "disk_blocks": 64} | kv
    restore = settings.pop("restore", "transfer")
    return run_config(model, tiers={"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "256MiB"},
                                    "disk": {"path": str(tmp_path / "store")}},
                      kv_cache=settings, activations={"prefill_chunk": 16, "kv_restore": restore})


@pytest.mark.slow
@pytest.mark.parametrize("kv", [
    {"eviction": "lru"},
    {"eviction": "attention"},
    {"eviction": "idle", "idle_seconds": 0.0},
    {"eviction": "lru", "cpu_attention": True},
    {"eviction": "lru", "restore": "recompute"},
    {"eviction": "attention", "restore": "recompute", "cpu_attention": True},
], ids=["lru", "attention", "idle", "cpu-attention", "recompute", "recompute-cpu-attention"])
def test_kv_four_times_the_device_and_host_gives_the_device_tokens(small, tmp_path, reference, kv):
    with Runner.from_config(tiered(small, tmp_path, **kv)) as r:
        cache = r.kv
        need = sum(cache.blocks_for(len(p) + NEW) for p in PROMPTS)
        assert need >= 4 * (cache.pools["gpu"].num_blocks + cache.pools["cpu"].num_blocks)
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
        moved = cache.traffic.routes("kv")
        fetched = r.timeline.bytes_on("kv-fetch")
    assert got == reference
    assert moved.get("gpu->cpu", 0) > 0 and moved.get("cpu->disk", 0) > 0  # blocks really went down two tiers
    assert fetched > 0  # and cold blocks were read back each step


def test_restore_auto_picks_the_smaller_format(small, tmp_path):
    with Runner.from_config(tiered(small, tmp_path, restore="auto")) as r:
        # small llama: hidden 768 > 2 x 256 (K and V of 4 KV heads): keeping K/V is fewer bytes
        assert r.kv_settings.restore == "transfer"


def test_int8_with_recompute_is_refused(small, tmp_path):
    with pytest.raises(ConfigError, match="int8 applies to K/V"):
        Runner.from_config(tiered(small, tmp_path, restore="recompute", quantization="int8"))


# ----------------------------------------------------------------------------- policies
def cands(*rows):
    return [Candidate(b, t, m) for b, t, m in rows]


def test_lru_evicts_the_least_recently_touched():
    assert make_policy("lru").choose(cands((1, 5.0, 0), (2, 1.0, 9), (3, 3.0, 0)), 2) == [2, 3]


def test_attention_evicts_the_lowest_mass():
    assert make_policy("attention").choose(cands((1, 5.0, 0.2), (2, 1.0, 9.0), (3, 3.0, 0.1)), 2) == [3, 1]


def test_idle_expires_blocks_untouched_for_more_than_idle_seconds_and_lru_expires_none():
    now = [100.0]
    policy = Idle(30.0, clock=lambda: now[0])
    rows = cands((1, 95.0, 0), (2, 60.0, 0), (3, 65.0, 0), (4, 99.0, 0), (5, 70.0, 0))
    assert policy.expired(rows) == [2, 3]  # idle for 40 s and 35 s, oldest first; 5 for exactly 30 s: not yet
    assert make_policy("lru").expired(rows) == [] and make_policy("attention").expired(rows) == []
    assert policy.choose(rows, 2) == [2, 3]  # room needed: least recently touched first
    now[0] = 1000.0
    assert policy.expired(rows) == [2, 3, 5, 1, 4]


def test_idle_blocks_leave_the_device_with_room_to_spare_and_come_back_exact(tiny_llama, tmp_path):
    """A conversation waits for its user: under `idle` its full blocks leave the device though nothing needs the
    room (LRU keeps them), come back when the next turn attends over them, and the tokens are the all-device run's."""
    def two_turns(eviction):
        now = [0.0]
        with Runner.from_config(tiered(tiny_llama, tmp_path / eviction, gpu_blocks=16, cpu_blocks=2,
                                       eviction=eviction, idle_seconds=30)) as r:
            r.kv.clock = r.kv.policy.clock = lambda: now[0]
            engine = Engine(r)
            first = engine.submit(Request(PROMPTS[0][:40], Sampling(8), keep=True))  # 48 tokens: 3 blocks
            while engine.busy:
                engine.step()
                now[0] += 1.0
            now[0] += 60.0  # the user reads the reply for a minute
            left = r.kv.expire_idle()
            where = {t: r.kv.count(t) for t in ("gpu", "cpu", "disk")}
            history = PROMPTS[0][:40] + first.outputs[0].token_ids
            second = engine.continue_(first.kept, history + [7, 8, 9], Sampling(8))
            while engine.busy:
                engine.step()
            cold_after = r.kv.count_cold()
        return first.outputs[0].token_ids, second.outputs[0].token_ids, left, where, cold_after

    lru = two_turns("lru")
    assert lru[2] == 0 and lru[3] == {"gpu": 3, "cpu": 0, "disk": 0}  # LRU: nothing needs the room, nothing moves
    assert lru[4] == 0  # so its run is the all-device run
    idle = two_turns("idle")
    assert idle[2] == 2 and idle[3] == {"gpu": 1, "cpu": 2, "disk": 0}  # the two full blocks left; the newest stays
    assert idle[4] == 0  # attended over again: back on the device
    assert idle[:2] == lru[:2]


CFG = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "num_hidden_layers": 2, "intermediate_size": 32,
                             "vocab_size": 50})


def test_the_newest_block_of_a_running_sequence_is_never_demoted(tmp_path):
    clock = [0.0]
    kv = PagedKVCache(CFG, 4, 2, torch.float32, "cpu", settings=KVSettings(block_size=4, gpu_blocks=2, cpu_blocks=8),
                      clock=lambda: clock[0])
    a, b = kv.add_sequence(), kv.add_sequence()
    kv.prepare([a], [4])  # a: block 0 full
    clock[0] = 1.0
    kv.prepare([b], [2])  # b: its newest block
    clock[0] = 2.0
    kv.prepare([a], [1])  # a needs a second block: the device has 2; a victim must go
    newest = {kv.seqs[a].blocks[-1], kv.seqs[b].blocks[-1]}
    assert all(kv.blocks[bid].tier == "gpu" for bid in newest)
    assert kv.blocks[kv.seqs[a].blocks[0]].tier == "cpu"  # a's full first block was the one to leave


def test_a_step_demotes_the_blocks_of_a_sequence_idle_too_long_though_the_device_has_room():
    clock = [0.0]
    settings = KVSettings(block_size=4, gpu_blocks=8, cpu_blocks=8, eviction="idle", idle_seconds=30.0)
    kv = PagedKVCache(CFG, 4, 8, torch.float32, "cpu", settings=settings, clock=lambda: clock[0])
    a, b = kv.add_sequence(), kv.add_sequence()
    kv.prepare([a], [9])  # a: two full blocks and a partial one
    kv.prepare([b], [2])
    clock[0] = 30.0
    kv.prepare([b], [1])  # a untouched for exactly idle_seconds: not yet
    assert kv.count("cpu") == 0
    clock[0] = 31.0
    kv.prepare([b], [1])  # b's step, a idle for 31 s: a's full blocks leave with 5 device blocks free
    assert [kv.blocks[x].tier for x in kv.seqs[a].blocks] == ["cpu", "cpu", "gpu"]  # its newest is written next
    assert kv.pool.num_free == 6 and kv.blocks[kv.seqs[b].blocks[0]].tier == "gpu"
    clock[0] = 32.0
    kv.prepare([b], [1])  # room on the device, but a is still idle: its blocks stay cold
    assert kv.count("cpu") == 2
    kv.prepare([a], [1])  # a attended over again: back on the device
    assert [kv.blocks[x].tier for x in kv.seqs[a].blocks] == ["gpu"] * 3


def test_attention_mass_comes_from_attention(small, tmp_path):
    with Runner.from_config(tiered(small, tmp_path, eviction="attention")) as r:
        r.generate([PROMPTS[0][:40]], max_new_tokens=4, stop_on_eos=False)
        # (blocks are freed with their sequence, so look during a run)
        cache = r.kv
        sid = cache.add_sequence(reserve_tokens=40)
        r.target.forward(ForwardBatch.last([sid], [PROMPTS[0][:40]]))
        masses = [cache.blocks[b].mass for b in cache.seqs[sid].blocks]
        cache.free_sequence(sid)
    assert all(m > 0 for m in masses)
    # every query's probabilities sum to one over the blocks it sees: the masses add up to heads x queries x layers
    assert sum(masses) == pytest.approx(40 * r.cfg.num_heads * r.cfg.num_layers, rel=1e-3)


# ----------------------------------------------------------------------------- int8
def test_int8_kv_error_and_bytes(model_factory, tmp_path):
    model = model_factory("llama", "small", dtype="bfloat16")
    # the KV cache in bf16 whatever this CPU computes fastest in (auto picks float32 where bf16 is slow)
    cfg = lambda q: run_config(model, dtype="bfloat16", compute_dtype="bfloat16",
                               **{k: v for k, v in tiered(model, tmp_path, quantization=q).items()
                                  if k not in ("model", "dtype")})
    per_step = {}
    for q in ("none", "int8"):
        with Runner.from_config(cfg(q)) as r:
            r.generate(PROMPTS[:1], max_new_tokens=40, stop_on_eos=False)
            stats = r.last_stats
            steps = range(r.timeline.step - stats.decode_steps, r.timeline.step)
            fetched = sum(s.nbytes for s in r.timeline.on("kv-fetch") if s.step in steps)
            per_step[q] = fetched / stats.decode_steps
    ratio = per_step["int8"] / per_step["none"]
    assert 0.45 < ratio < 0.55, f"int8 moved {ratio:.3f} of the bf16 bytes per step"

    assert int8_attention_error(model_factory("llama", "small")) <= 1e-2


def int8_attention_error(model) -> float:
    """Worst relative error, over the layers, of attention with int8 K/V against float K/V: the model's own
    queries over the model's own keys and values for an 80-token prompt (float32)."""
    queries = {}
    original = M.attention

    def capture(q, kv, layout, window, scale, restore=None):
        queries[kv.layer] = q.clone()
        return original(q, kv, layout, window, scale, restore)

    with Runner.from_config(run_config(model, activations={"prefill_chunk": 128})) as r:
        cache = r.ensure_kv(16)
        sid = cache.add_sequence()
        M.attention = capture
        fused, M.fused.layer_supported = M.fused.layer_supported, lambda *a: False  # op by op: queries seen
        try:
            r.target.forward(ForwardBatch.last([sid], [PROMPTS[0][:80]]))
        finally:
            M.attention, M.fused.layer_supported = original, fused
        slots = [cache.blocks[b].slot for b in cache.seqs[sid].blocks]
        data = cache.stores["gpu"].arrays["kv"].data[:, slots].clone()  # [layers, 5, 2, 16, kv_heads, head_dim]
        cache.free_sequence(sid)
    pos = torch.arange(80)
    mask = pos[None, :, None] >= pos[None, None, :]
    errors = []
    for layer, kv in enumerate(data):
        q8, scale = quantize_int8(kv)
        back = dequantize_int8(q8, scale, torch.float32)
        split = lambda x: (x[:, 0].reshape(1, -1, *x.shape[-2:]), x[:, 1].reshape(1, -1, *x.shape[-2:]))  # noqa
        (k, v), (k8, v8) = split(kv), split(back)
        d = kv.shape[-1] ** -0.5
        ref, _, _ = attend_group(queries[layer][None], k, v, mask, d)
        got, _, _ = attend_group(queries[layer][None], k8, v8, mask, d)
        errors.append(((got - ref).norm() / ref.norm()).item())
    return max(errors)


# ----------------------------------------------------------------------------- sharing
def test_four_samples_of_a_512_token_prompt_share_its_blocks(small):
    prompt = [1] + list(range(3, 514))  # 512 tokens = 32 full blocks
    # 32 prompt blocks + 4 samples x 1 block for their 8 new tokens: 36; unshared it would be 4 x 33 = 132
    # (the prefix cache off: its reference to the prompt's blocks would add one to each count)
    cfg = run_config(small, kv_cache={"gpu_blocks": 40, "prefix_cache": "off"}, activations={"prefill_chunk": 128})
    with Runner.from_config(cfg) as r:
        seen = {}
        original = r.target.forward

        def spy(batch, **kw):
            out = original(batch, **kw)
            sids = batch.sids
            if len(sids) == 4:  # a decode step of the four samples
                cache = r.kv
                prompt_blocks = cache.seqs[sids[0]].blocks[:32]
                seen["shared"] = all(cache.seqs[s].blocks[:32] == prompt_blocks for s in sids)
                seen["refs"] = {cache.logical.refcount(b) for b in prompt_blocks}
                seen["materialised"] = len(cache.blocks)
            return out

        r.target.forward = spy
        [greedy] = r.generate([prompt], max_new_tokens=8, stop_on_eos=False, num_samples=4)
        [sampled] = r.generate([prompt], max_new_tokens=8, temperature=1.0, seed=3, stop_on_eos=False,
                               num_samples=4)
        [alone] = r.generate([prompt], max_new_tokens=8, stop_on_eos=False)
    assert seen == {"shared": True, "refs": {4}, "materialised": 36}
    assert len(greedy.outputs) == 4 and all(x.token_ids == alone.token_ids for x in greedy.outputs)  # sharing
    assert len({tuple(x.token_ids) for x in sampled.outputs}) > 1  # each sample draws its own tokens


# ----------------------------------------------------------------------------- admission
def test_admission_answers_ok_later_never(small):
    with Runner.from_config(run_config(small, kv_cache={"gpu_blocks": 12}, activations={"prefill_chunk": 16})) as r:
        cache = r.ensure_kv(12)
        assert cache.admit(100) is Admission.OK
        sid = cache.add_sequence(reserve_tokens=150)  # 10 of the 12 blocks reserved
        assert cache.admit(100) is Admission.LATER
        assert cache.admit(1000) is Admission.NEVER
        cache.free_sequence(sid)
        assert cache.admit(100) is Admission.OK


def test_disk_slots_round_trip_and_read_planes_in_runs(tmp_path, monkeypatch):
    import zarr
    disk = DiskSlots(tmp_path, "kv", planes=3, slots=10, slot_shape=(2, 4), dtype=torch.float32)
    mem = MemorySlots(3, 10, (2, 4), torch.float32)
    writes = []
    monkeypatch.setattr(zarr.Array, "__setitem__", lambda *a, **k: writes.append(a))  # never a zarr write
    g = torch.Generator().manual_seed(0)
    for slot in (1, 2, 3, 7):
        block = torch.randn(3, 2, 4, generator=g)
        disk.write(slot, block)
        mem.write(slot, block)
    assert writes == []
    assert torch.equal(disk.read(7), mem.read(7))
    assert torch.equal(disk.read_plane(2, [7, 1, 2, 3]), mem.read_plane(2, [7, 1, 2, 3]))
    with pytest.raises(StoreError, match="read before it was written"):
        disk.read_plane(0, [5])
    meta = zarr.open_array(str(tmp_path / "kv"), mode="r")
    assert meta.shape == (3, 10, 32) and meta.attrs["dtype"] == "float32"
    disk.close()
    assert not disk.path.exists()  # scratch: removed with the cache


@pytest.mark.parametrize("how", ["fused-layer", "op-by-op", "layer-run"])
def test_cold_blocks_in_bf16_give_the_device_tokens_bit_for_bit(model_factory, tmp_path, monkeypatch, how):
    """Cold blocks are read beside the device pool through one table (the fused layer's attention and the op-by-op
    layer's), each key where it lies in token order: the arithmetic of a cache that never left the device, so even
    bf16 (where any reordering of a sum shows) gives the very same tokens. Host blocks are read in place (never
    copied); with no block to fetch, resident layers still run in one call (`fused.LayerRun`)."""
    model = model_factory("llama", "small", dtype="bfloat16")
    prompts = [list(range(1, 121)), list(range(300, 400))]
    base = run_config(model, dtype="bfloat16", activations={"prefill_chunk": 32})
    with Runner.from_config(base) as r:
        ref = [x.token_ids for x in r.generate(prompts, max_new_tokens=24, stop_on_eos=False)]
    cold_layers, runs = [], []  # fused layers that read cold blocks: (blocks read in place, blocks read); runs'
    real, real_run = M.fused.decoder_layer, M.fused.LayerRun.__call__
    monkeypatch.setattr(M.fused, "decoder_layer", lambda *a: (cold_layers.append(
        (sum(len(i) for _, i in a[7] if i is not None), sum(len(t) for t, i in a[7] if i is None))) if a[7] else None,
        real(*a))[1])
    monkeypatch.setattr(M.fused.LayerRun, "__call__", lambda *a: (runs.append(a[6] is not None), real_run(*a))[1])
    if how == "op-by-op":
        monkeypatch.setattr(M.fused, "layer_supported", lambda *a: False)
    kv = {"gpu_blocks": 5, "cpu_blocks": 40, "disk_blocks": 0} if how == "layer-run" else \
        {"gpu_blocks": 5, "cpu_blocks": 2, "disk_blocks": 32}
    cfg = base | {"tiers": {"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "256MiB"},
                            "disk": {"path": str(tmp_path / "store")}}, "kv_cache": kv}
    with Runner.from_config(cfg) as r:
        assert [x.token_ids for x in r.generate(prompts, max_new_tokens=24, stop_on_eos=False)] == ref
        assert r.traffic.routes("kv").get("cpu->disk" if kv["disk_blocks"] else "gpu->cpu", 0) > 0
    # the host tier's blocks where they lie, the disk's read: both in one layer
    assert any(host and disk for host, disk in cold_layers) == (how == "fused-layer")
    if how == "layer-run":  # no block to fetch: every layer in one call over the host tier's blocks
        assert any(runs) and not cold_layers
