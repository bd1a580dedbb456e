"""`auto` means fit: the prefill chunk, the device KV pool and the cold KV tiers shrink to what the tiers hold.

Each test is a small-model copy of a budget that was refused before (issue 9): the same ratios
of ring, head, KV and workspace to the device tier. Every one must run with every knob left
`auto` and give the all-resident tokens; a budget that truly cannot fit is refused naming each
knob that would help, with a value that really does help.
"""

from __future__ import annotations

import re

import pytest
import torch

from offload.config import OffloadConfig
from offload.errors import CapacityError, ConfigError
from offload.model.checkpoint import Checkpoint
from offload.plan.passes import ATTENTION_KEYS_PER_CHUNK, pass_tokens, workspace_bytes
from offload.plan.placement import min_device_bytes
from offload.plan.planner import AUTO_CHUNKS, AUTO_HOST_KV_TOKENS, AUTO_KV_TOKENS, Planner
from offload.runtime.runner import DTYPES, Runner
from offload.weights.groups import model_layouts
from storage.units import blocks_for
from tests.conftest import run_config

PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41, 42, 43], [1, 8, 2], [1, 400, 33, 12, 19, 250]]
NEW = 8


@pytest.fixture(scope="module")
def tiny8(model_factory):
    return model_factory("llama", overrides={"num_hidden_layers": 8})


@pytest.fixture(scope="module")
def tied(model_factory):
    """SmolLM2-135M's proportions in miniature: a tied head larger than a layer, 3 KV heads of 9."""
    return model_factory("llama", tie=True, overrides={"num_hidden_layers": 6, "hidden_size": 72,
                                                       "num_attention_heads": 9, "num_key_value_heads": 3,
                                                       "head_dim": 8, "intermediate_size": 192,
                                                       "vocab_size": 4096})


_RESIDENT: dict[str, list[list[int]]] = {}


def resident(model, prompts, new=NEW):
    """The all-resident run's tokens (no tiers), computed once per model and prompts."""
    key = repr((str(model), prompts, new))
    if key not in _RESIDENT:
        with Runner.from_config(run_config(model)) as r:
            _RESIDENT[key] = [x.token_ids for x in r.generate(prompts, max_new_tokens=new, stop_on_eos=False)]
    return _RESIDENT[key]


def sizes(model):
    layouts = model_layouts(Checkpoint(model).config, torch.float32)
    return layouts["layer.0"].nbytes, layouts["head"].nbytes


def defaults_fit(raw, depth) -> bool:
    """Would the fixed defaults (a 2048-token device pool, a 512-token workspace) fit beside this depth's ring?"""
    p = plan_for(raw)
    fixed = blocks_for(AUTO_KV_TOKENS, 16) * p.block_bytes + workspace_bytes(p.cfg, 512, torch.float32, 512)
    return min_device_bytes(p.groups, depth, fixed) <= p.caps.gpu


def plan_for(raw, concurrency: int = 1, device: str = "cpu"):
    cfg = OffloadConfig.load(raw)
    return Planner(cfg, Checkpoint(cfg.model).config, DTYPES[cfg.dtype], torch.device(device), concurrency=concurrency)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_a_gpu_tier_of_five_layers_runs_at_every_depth_whose_ring_fits(tiny8, tmp_path, depth):
    layer, _ = sizes(tiny8)
    raw = run_config(tiny8, tiers={"gpu": {"capacity": 5 * layer}, "cpu": {"capacity": 4 * layer},
                                   "disk": {"path": str(tmp_path / "store")}}, prefetch={"depth": depth})
    assert not defaults_fit(raw, depth)
    with Runner.from_config(raw) as r:
        assert r.prefill_chunk < AUTO_CHUNKS[0]  # the default workspace alone would not fit beside the ring
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
    assert got == resident(tiny8, PROMPTS)


def test_a_ring_that_fills_the_gpu_tier_is_refused_naming_the_depth_that_fits(tiny8, tmp_path):
    layer, _ = sizes(tiny8)
    raw = run_config(tiny8, tiers={"gpu": {"capacity": 5 * layer}, "cpu": {"capacity": 4 * layer},
                                   "disk": {"path": str(tmp_path / "store")}}, prefetch={"depth": 4})
    with pytest.raises(CapacityError) as e:  # planned for CUDA: on a CPU device the cpu tier's layers need no ring
        plan_for(raw, device="cuda").run_plan()
    msg = str(e.value)
    assert "prefetch.depth: 3" in msg and "tiers.gpu.capacity: " in msg
    assert "lower prefetch.depth" not in msg  # no advice without a value


def test_a_long_prompt_prefills_chunk_by_chunk_through_three_device_blocks(tiny_llama, tmp_path):
    prompt = [1] + [(7 * i) % 400 + 3 for i in range(149)]  # 150 tokens: 10 blocks of 16
    raw = run_config(tiny_llama, tiers={"gpu": {"capacity": "64MiB"}, "cpu": {"capacity": "64MiB"},
                                        "disk": {"path": str(tmp_path / "store")}}, kv_cache={"gpu_blocks": 3})
    with Runner.from_config(raw) as r:
        assert r.prefill_chunk == 32  # (3 - 1) blocks of 16: one block stays with the sequence's newest tokens
        [out] = r.generate([prompt], max_new_tokens=NEW, stop_on_eos=False)
        stats, demoted = r.last_stats, r.traffic.routes("kv")
        assert r.kv.pool.num_blocks == 3 and r.kv.settings.cpu_blocks >= 8
    assert stats.prefill_passes >= 150 // 32
    assert any(route.startswith("gpu->") for route in demoted)  # earlier blocks left the device
    assert out.token_ids == resident(tiny_llama, [prompt])[0]


def test_the_default_kv_and_workspace_shrink_beside_a_ring_of_the_tied_head(tied, tmp_path):
    layer, head = sizes(tied)
    assert head > 2 * layer
    # the device holds the head plus a ring of three layers and a little more: not the 2048-token pool, not a
    # 512-token workspace, but a few tokens' KV and a small chunk
    gpu = head + 3 * layer + workspace_bytes(Checkpoint(tied).config, 32, torch.float32, 128) + 64 * 1024
    raw = run_config(tied, tiers={"gpu": {"capacity": gpu}, "cpu": {"capacity": head // 2},
                                  "disk": {"path": str(tmp_path / "store")}})
    assert not defaults_fit(raw, 0)
    with Runner.from_config(raw) as r:
        assert r.prefill_chunk < AUTO_CHUNKS[0] and r.kv.pool.num_blocks < AUTO_KV_TOKENS // 16
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
    assert got == resident(tied, PROMPTS)


def test_prefill_chunk_max_caps_an_automatic_chunk_which_still_shrinks_to_fit(tied, tmp_path):
    """`offload chat --auto` writes `prefill_chunk: auto, prefill_chunk_max: 256`: passes of 256 tokens where they
    fit (not 512, whose attention workspace would take the room of resident layers), fewer where the device tier
    is short (a fixed 256 was refused on a 400 MiB machine); an explicit chunk is kept as given."""
    layer, head = sizes(tied)
    cfg = Checkpoint(tied).config
    tiers = {"cpu": {"capacity": head // 2}, "disk": {"path": str(tmp_path / "store")}}

    def chunk(gpu, **activations):
        raw = run_config(tied, tiers={"gpu": {"capacity": gpu}, **tiers}, prefetch={"depth": 0},
                         activations=activations)
        return plan_for(raw).run_plan().prefill_chunk

    roomy = 1 << 30  # (a 512-token workspace of 9 heads is ~160 MB)
    assert chunk(roomy) == AUTO_CHUNKS[0] and chunk(roomy, prefill_chunk_max=256) == 256
    assert chunk(roomy, prefill_chunk_max=300) == 300  # the cap is the first chunk tried
    assert chunk(roomy, prefill_chunk=512, prefill_chunk_max=256) == 512  # explicit: as given
    short = head + 2 * layer + workspace_bytes(cfg, 64, torch.float32, 256) + 64 * 1024
    assert chunk(short, prefill_chunk_max=256) < 256
    with pytest.raises(CapacityError, match=r"activations\.prefill_chunk: \d+ \(or auto\)"):
        chunk(short, prefill_chunk=256)


def test_medium_shaped_budget_runs_with_depth_two(tiny8, tmp_path):
    """gpu = 3 ring slots + a quarter of the model, cpu = a quarter: the rest on disk (the medium example's ratios;
    passes of 16 tokens: an automatic chunk takes the room of resident layers first)."""
    layer, head = sizes(tiny8)
    raw = run_config(tiny8, tiers={"gpu": {"capacity": 3 * layer + 2 * layer}, "cpu": {"capacity": 2 * layer},
                                   "disk": {"path": str(tmp_path / "store")}}, prefetch={"depth": 2},
                     activations={"prefill_chunk": 16})
    assert not defaults_fit(raw, 2)
    with Runner.from_config(raw) as r:
        assert set(r.plan.homes.values()) == {"gpu", "cpu", "disk"}
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
    assert got == resident(tiny8, PROMPTS)


def test_explicit_settings_are_kept_as_given(tiny8, tmp_path):
    layer, _ = sizes(tiny8)
    raw = run_config(tiny8, tiers={"gpu": {"capacity": "64MiB"}, "cpu": {"capacity": "8MiB"}},
                     kv_cache={"gpu_blocks": 8, "cpu_blocks": 5, "disk_blocks": 0},
                     activations={"prefill_chunk": 24})
    rp = plan_for(raw).run_plan()
    assert (rp.prefill_chunk, rp.kv_blocks, rp.kv.cpu_blocks, rp.kv.disk_blocks) == (24, 8, 5, 0)
    raw["activations"]["prefill_chunk"] = 200  # 13 blocks a pass: more than the 8 given
    with pytest.raises(ConfigError, match=r"lower prefill_chunk to at most 113 .*raise gpu_blocks to at least 14"):
        plan_for(raw)


def test_cold_kv_tiers_default_to_what_the_tiers_leave_free(tiny8, tmp_path):
    raw = run_config(tiny8, tiers={"gpu": {"capacity": "64MiB"}, "cpu": {"capacity": "2MiB"},
                                   "disk": {"path": str(tmp_path / "store")}})
    planner = plan_for(raw, concurrency=8)  # a server's workload: more KV than the device holds is useful
    rp = planner.run_plan()
    free = rp.plan.capacity("cpu") - (rp.plan.used("cpu") - rp.plan.host_reserve)
    assert 0 < rp.kv.cpu_blocks <= AUTO_HOST_KV_TOKENS // 16
    assert rp.kv.cpu_blocks == min(AUTO_HOST_KV_TOKENS // 16, free // planner.cold_block_bytes)  # as much as fits
    assert rp.plan.used("cpu") <= rp.plan.capacity("cpu") and rp.kv.disk_blocks > 0
    raw.pop("tiers")
    rp = plan_for(raw).run_plan()
    assert (rp.kv.cpu_blocks, rp.kv.disk_blocks, rp.kv_blocks) == (0, 0, 0)  # no tiers: sized per request


def test_long_contexts_take_smaller_passes_so_attention_stays_in_the_workspace():
    chunk = 64
    budget = chunk * ATTENTION_KEYS_PER_CHUNK * chunk
    context, passes = 0, []
    while context < 4000:
        t = pass_tokens(chunk, context)
        assert t * (context + t) <= budget or t == 1
        passes.append(t)
        context += t
    assert passes[0] == chunk and passes[-1] < chunk // 4


def test_the_workspace_covers_the_attention_of_its_chunk(tiny_llama):
    cfg = Checkpoint(tiny_llama).config
    one = workspace_bytes(cfg, 64, torch.float32, 64)
    four = workspace_bytes(cfg, 64, torch.float32, 256)
    assert four - one >= cfg.num_heads * 64 * (256 - 64) * 4 * 3  # float32 scores, masked, probabilities


def test_a_budget_that_cannot_fit_names_every_knob_with_a_value_that_fits(tiny8, tmp_path):
    layer, _ = sizes(tiny8)
    gpu = 3 * layer + 2**20  # the ring of depth 2 plus 1 MiB: not enough for 8 blocks and a 32-token workspace
    raw = run_config(tiny8, tiers={"gpu": {"capacity": gpu}, "cpu": {"capacity": "64MiB"}},
                     prefetch={"depth": 2}, kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 32})
    with pytest.raises(CapacityError) as e:  # planned for CUDA: on a CPU device RAM holds the model in place
        plan_for(raw, device="cuda").run_plan()
    msg = str(e.value)
    knobs = dict(re.findall(r"(tiers\.gpu\.capacity|prefetch\.depth|kv_cache\.gpu_blocks|activations\.prefill_chunk"
                            r"|dtype): ([^;\s]+)", msg))
    assert set(knobs) == {"tiers.gpu.capacity", "prefetch.depth", "kv_cache.gpu_blocks", "activations.prefill_chunk",
                          "dtype"}
    assert "lower prefetch.depth" not in msg
    for key, value in knobs.items():  # each one alone makes the plan fit
        fixed = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
        fixed["tiers"] = {**raw["tiers"], "gpu": {"capacity": value if key == "tiers.gpu.capacity" else gpu}}
        if key == "dtype":
            fixed["dtype"] = value
        elif key != "tiers.gpu.capacity":
            section, name = key.split(".")
            fixed[section][name] = int(value)
        plan_for(fixed, device="cuda").run_plan()
