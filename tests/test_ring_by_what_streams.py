"""On a CPU device the ring is sized by what streams from disk, not by a tied head the cpu tier holds in place, and
refusals print sizes as people read them (issue 18 item 6), as real commands where a user meets them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from offload.config import OffloadConfig
from offload.model.checkpoint import Checkpoint
from offload.plan.planner import Planner
from offload.runtime.runner import Runner
from offload.weights.groups import model_layouts
from tests.conftest import run_config
from tests.test_autofit import NEW, PROMPTS, resident
from tests.test_cli_flows import offload
from tests.test_workload_plans import SMOL


@pytest.fixture(scope="module")
def tied(model_factory):
    """SmolLM2-135M's proportions in miniature (as tests/test_autofit.py's): a tied head larger than a layer."""
    return model_factory("llama", tie=True, overrides={"num_hidden_layers": 6, "hidden_size": 72,
                                                       "num_attention_heads": 9, "num_key_value_heads": 3,
                                                       "head_dim": 8, "intermediate_size": 192,
                                                       "vocab_size": 4096})


def test_a_cpu_device_whose_ram_holds_the_model_plans_no_ring_at_a_small_gpu_tier(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    proc = offload("plan", "--model-config", str(tmp_path / "config.json"), "--device", "cpu", "--gpu", "32MiB",
                   "--cpu", "512MiB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing moves (all resident)" in proc.stdout and "ring slots" not in proc.stdout


def test_the_ring_holds_a_layer_when_the_tied_head_is_homed_in_the_cpu_tier(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    proc = offload("plan", "--model-config", str(tmp_path / "config.json"), "--device", "cpu", "--gpu", "64MiB",
                   "--cpu", "64MiB", "--disk-path", str(tmp_path / "store"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert plan["depth"] >= 1 and plan["ring_slot_bytes"] < 8 * 2**20  # a layer (6.8 MiB), not the 54 MiB head
    assert plan["homes"]["head"] in ("gpu", "cpu")  # read in place, never through the ring


def test_a_tied_head_larger_than_the_gpu_tier_runs_from_the_cpu_tier_with_the_resident_tokens(tied, tmp_path):
    cfg = Checkpoint(tied).config
    layouts = model_layouts(cfg, torch.float32)
    head, layer = layouts["head"].nbytes, layouts["layer.0"].nbytes
    raw = run_config(tied, tiers={"gpu": {"capacity": head // 2 + 2**20 * 2}, "cpu": {"capacity": 4 * head},
                                  "disk": {"path": str(tmp_path / "store")}})
    rp = Planner(OffloadConfig.load(raw), cfg, torch.float32, torch.device("cpu")).run_plan()
    assert rp.plan.homes["head"] == "cpu" and rp.plan.ring_slot_bytes <= layer
    with Runner(raw) as r:
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]
    assert got == resident(tied, PROMPTS)


def test_a_refusal_prints_sizes_in_mib_and_each_suggested_size_fits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    common = ("plan", "--model-config", str(tmp_path / "config.json"), "--device", "cuda", "--cpu", "512MiB",
              "--disk-path", str(tmp_path / "store"))
    proc = offload(*common, "--gpu", "24MiB")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "KiB" not in line and re.search(r"the gpu tier \(24\.0 MiB\) cannot hold", line), line
    size = re.search(r"tiers\.gpu\.capacity: ([\d.]+MiB)", line).group(1)
    assert offload(*common, "--gpu", size).returncode == 0  # the suggestion, followed literally, plans
