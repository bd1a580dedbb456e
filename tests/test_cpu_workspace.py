"""A CPU plan's workspace is what a prompt pass adds: the CPU attention kernel makes no scores, so the planner
reserves the op-by-op layer's temporaries in their place (`offload.plan.passes.workspace_bytes`), and the C heap
gives a prompt's temporaries back (`storage.heap.trim_heap`). Measured in a process of its own: the
growth of its anonymous memory over a prompt that runs every layer op by op over cold KV blocks."""

import json
import subprocess
import sys

import pytest
import torch

from offload.config import OffloadConfig
from offload.model import kernels
from offload.model.checkpoint import Checkpoint
from offload.plan.passes import ATTENTION_KEYS_PER_CHUNK, workspace_bytes
from offload.plan.planner import Planner
from tests.conftest import run_config

PROBE = r"""
import json, sys, threading, time
from offload.runtime.runner import Runner

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) << 10

peak, done = [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

r = Runner(json.loads(sys.argv[1]))
r.generate([[5] * 40], max_new_tokens=2, stop_on_eos=False)  # compiles, allocates the pools
before = peak[0] = anon()
threading.Thread(target=sample, daemon=True).start()
r.generate([[(i * 7919) % 500 + 3 for i in range(int(sys.argv[2]))]], max_new_tokens=2, stop_on_eos=False)
done[0] = True
time.sleep(0.01)
demoted = sum(route.startswith("gpu->") for route in r.traffic.routes("kv"))
print(json.dumps({"before": before, "peak": peak[0], "after": anon(), "demoted": demoted,
                  "workspace": r.plan.reserved_gpu["workspace"]}))
r.close()
"""


@pytest.fixture(scope="module")
def wide(model_factory):
    """Two layers wide enough that a pass's temporaries are tens of MiB (float32: 134 MiB of weights)."""
    return model_factory("llama", overrides={"num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 4096,
                                             "num_attention_heads": 16, "num_key_value_heads": 16})


def planner(raw: dict, device: str = "cpu") -> Planner:
    config = OffloadConfig.load(raw)
    return Planner(config, Checkpoint(config.model).config, torch.float32, torch.device(device))


@pytest.mark.skipif(kernels.numba is None, reason="the CPU attention kernel needs numba")
def test_a_cpu_plan_reserves_no_attention_scores_where_its_kernel_makes_none(wide, tmp_path):
    raw = run_config(wide, tiers={"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "64MiB"}})
    cfg, keys = Checkpoint(wide).config, ATTENTION_KEYS_PER_CHUNK * 512
    cpu = planner(raw).workspace(512)
    assert cpu == workspace_bytes(cfg, 512, torch.float32, keys, scores=False)
    scored = workspace_bytes(cfg, 512, torch.float32, keys)
    assert cpu < scored / 2  # 16 heads x 512 x 2048 float32 scores, three times, are most of the old estimate
    raw["kv_cache"] = {"eviction": "attention"}  # tracking attention mass materialises the scores
    assert planner(raw).workspace(512) == scored


@pytest.mark.skipif(kernels.numba is None or not sys.platform.startswith("linux"),
                    reason="the CPU attention kernel needs numba; RssAnon is Linux's")
def test_a_prompt_over_cold_kv_blocks_stays_within_its_workspace_and_gives_it_back(wide):
    tokens = 1500  # passes of 512 over 33 device blocks (528 tokens): the older blocks go cold, layers run op by op
    raw = run_config(wide, tiers={"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "64MiB"}},
                     kv_cache={"gpu_blocks": 33}, activations={"prefill_chunk": 512})
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(raw), str(tokens)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = Checkpoint(wide).config
    kv = tokens * cfg.num_layers * 2 * cfg.kv_size * 4  # the prompt's K/V, cold blocks included, may be new pages
    assert got["demoted"] > 0
    grew, kept = got["peak"] - got["before"], got["after"] - got["before"]
    assert grew <= got["workspace"] + kv, (grew, got)
    # the pass's temporaries went back to the system (measured: 31-36 MiB kept of a 143 MiB workspace, without
    # `trim_heap` 70-100)
    assert kept <= kv + got["workspace"] // 4, (kept, got)
