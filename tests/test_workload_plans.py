"""`auto` sizes the KV pool for the workload the command implies, within what the model's context and the machine's
RAM can use, and the plan's lines say the same thing (issue 18 items 1 and 3), as real commands where a user meets them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from offload.config import OffloadConfig
from offload.errors import CapacityError
from offload.model.checkpoint import Checkpoint
from offload.plan.passes import pass_blocks
from offload.plan.planner import AUTO_CHUNKS, Planner
from offload.runtime.runner import Runner
from storage.units import blocks_for
from tests.conftest import run_config
from tests.test_cli_flows import offload, write_yaml

CPU = torch.device("cpu")
SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def planner(raw: dict, concurrency: int = 1) -> Planner:
    config = OffloadConfig.load(raw)
    return Planner(config, Checkpoint(config.model).config, torch.float32, CPU, concurrency=concurrency)


def tight_gpu(model: Path, store: Path) -> dict:
    """A device tier that holds the model, the largest automatic prefill chunk and its pass blocks and one block
    more: what a one-sequence plan fills (a prefill chunk given the room, batching off)."""
    raw = run_config(model, compute_dtype="float32", tiers={"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": 0},
                                                            "disk": {"path": str(store)}})
    p = planner(raw)
    chunk = AUTO_CHUNKS[0]
    fixed = (pass_blocks(chunk, p.bs) + 1) * p.block_bytes + p.workspace(chunk)
    raw["tiers"]["gpu"]["capacity"] = sum(g.nbytes for g in p.groups) + fixed  # every weight on the device
    return raw


def test_a_one_sequence_plan_gives_the_chunk_the_room_a_concurrent_workload_gives_kv(tiny_llama, tmp_path):
    raw = tight_gpu(tiny_llama, tmp_path / "store")
    alone = planner(raw).run_plan()
    assert alone.prefill_chunk == AUTO_CHUNKS[0] and alone.batch <= 2  # generate: the chunk takes the room
    served = planner(raw, concurrency=64).run_plan()
    assert served.batch >= 8 and served.prefill_chunk < alone.prefill_chunk  # serve: the chunk makes room
    assert served.kv.cpu_blocks + served.kv.disk_blocks > 0  # the sequences' older blocks go to the cold tiers
    assert served.plan.used("gpu") <= served.plan.capacity("gpu")


def test_the_throughput_mode_runs_a_batch_where_the_one_sequence_plan_would_not(tiny_llama, tmp_path):
    config = write_yaml(tmp_path / "c.yaml", tight_gpu(tiny_llama, tmp_path / "store"))
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"id": str(i), "prompt": [1, 5 + i, 9, 11], "max_tokens": 6}) + "\n"
                                for i in range(8)))
    proc = offload("run", "--config", str(config), "--input", str(requests), "--output", str(tmp_path / "o.jsonl"),
                   "--batch", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = re.search(r"the KV cache holds (\d+) sequences? decoding together \(--batch 8\); at most (\d+) ran in one "
                     r"pass", proc.stderr)
    assert said, proc.stderr[-2000:]
    holds, ran = map(int, said.groups())
    assert holds == 8 and ran >= 4  # all eight requests were admitted together, not one at a time


def test_plan_batch_plans_the_servers_workload_and_says_what_batch_it_holds(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    common = ("plan", "--model-config", str(tmp_path / "config.json"), "--device", "cpu", "--gpu", "64MiB",
              "--cpu", "64MiB", "--disk-path", str(tmp_path / "store"))
    one, many = offload(*common), offload(*common, "--batch", "8")
    assert one.returncode == 0 and many.returncode == 0, one.stderr + many.stderr
    held = [int(re.search(r"batch: up to (\d+) sequences? decodes? together", p.stdout).group(1)) for p in (one, many)]
    assert held[0] < 8 <= held[1]
    cold = int(re.search(r"; (\d+) more blocks in the host/disk KV tiers", one.stdout).group(1))
    assert cold >= 512 - 9  # one sequence's whole context (8192 tokens) fits the three KV tiers


def test_auto_kv_on_a_cpu_device_is_bounded_by_the_context_and_the_plan_lines_agree(tiny_llama, tmp_path):
    raw = run_config(tiny_llama, tiers={"gpu": {"capacity": "8GiB"}, "cpu": {"capacity": "1GiB"}})
    p = planner(raw)
    rp = p.run_plan()
    context_blocks = blocks_for(p.cfg.max_position_embeddings, p.bs)
    assert rp.kv_blocks <= context_blocks + pass_blocks(rp.prefill_chunk, p.bs)  # not the whole 8 GiB
    assert rp.plan.reserved_gpu["kv"] == rp.kv_blocks * rp.kv_block_bytes  # the tier's line counts the pool
    assert rp.kv.cpu_blocks == 0  # the device pool already holds a whole context: no cold blocks beside it
    served = planner(raw, concurrency=4).run_plan()
    assert context_blocks < served.kv_blocks <= 4 * context_blocks + pass_blocks(served.prefill_chunk, p.bs)
    out = offload("plan", "--config", str(write_yaml(tmp_path / "c.yaml", raw))).stdout
    gpu_used = float(re.search(r"gpu \(RAM\)\s+([\d.]+) MiB of", out).group(1))
    kv_mib = float(re.search(r"KV cache on the device: \d+ blocks x 16 tokens \(([\d.]+) MiB\)", out).group(1))
    assert kv_mib <= gpu_used < 1024  # one line's KV is inside the other's total


def test_a_cpu_plan_needing_more_ram_than_the_machine_has_is_refused(tiny_llama, monkeypatch):
    raw = run_config(tiny_llama, tiers={"gpu": {"capacity": "64GiB"}, "cpu": {"capacity": "1GiB"}},
                     kv_cache={"gpu_blocks": 200_000})
    monkeypatch.setattr("offload.plan.memory.ram_available", lambda: 4 << 30)
    with pytest.raises(CapacityError, match=r"needs [\d.]+ GiB of RAM .*both this machine's RAM.* 4.00 GiB is free"):
        planner(raw).run_plan()


def test_run_sizes_the_pool_for_its_own_prompts_and_homes_weights_in_the_rest(tiny_llama, tmp_path):
    """`offload run` knows its prompts and --max-new-tokens: an automatic pool holds that context (and a block), not
    2048 tokens, passes need be no longer than its prompts, and the room they leave homes layers; the tokens are the
    all-in-memory run's."""
    raw = run_config(tiny_llama, tiers={"gpu": {"capacity": "4MiB"}, "cpu": {"capacity": 0},
                                        "disk": {"path": str(tmp_path / "store")}}, prefetch={"depth": 1})
    default = planner(raw).run_plan()  # the model's context: the chunk and the pool take the room
    proc = offload("run", "--config", str(write_yaml(tmp_path / "c.yaml", raw)), "--prompt-ids", "1,17,99,23,5",
                   "--max-new-tokens", "8", "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    plan = got["plan"]
    on_device = [g for g, tier in plan["homes"].items() if tier == "gpu" and g.startswith("layer.")]
    assert plan["reserved_gpu"]["workspace"] < default.plan.reserved_gpu["workspace"] / 2
    assert plan["reserved_gpu"]["kv"] <= default.plan.reserved_gpu["kv"]
    assert len(on_device) > sum(1 for g, t in default.plan.homes.items() if t == "gpu" and g.startswith("layer."))
    with Runner.from_config(run_config(tiny_llama)) as r:
        want = r.generate([[1, 17, 99, 23, 5]], max_new_tokens=8, stop_on_eos=False)[0].token_ids
    assert got["results"][0]["token_ids"] == want
