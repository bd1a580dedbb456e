"""A speculative config that plans fine runs what it planned: the draft keeps its own small KV pool, so the target
keeps its automatic host/disk KV tiers, and `offload plan` says how much KV both hold (issue 18 item 4)."""

from __future__ import annotations

import json
import re

from tests.conftest import run_config
from tests.test_cli_flows import offload, write_yaml

PROMPT = ",".join(str(i) for i in range(3, 43))  # 40 tokens: with 16 new ones, 4 blocks of 16


def spec_config(model, store, draft: str = "self-int8") -> dict:
    return run_config(model, tiers={"gpu": {"capacity": "256MiB"}, "cpu": {"capacity": "64MiB"},
                                    "disk": {"path": str(store)}},
                      kv_cache={"gpu_blocks": 3}, speculative={"draft": draft, "tokens": 4})


def test_a_speculative_config_that_plans_runs_a_prompt_longer_than_the_device_pool(tiny_llama, tmp_path):
    config = write_yaml(tmp_path / "spec.yaml", spec_config(tiny_llama, tmp_path / "store"))
    plan = offload("plan", "--config", str(config))
    assert plan.returncode == 0, plan.stderr[-2000:]
    said = re.search(r"the draft's own KV pool mirrors the target's: (\d+) blocks .* the target keeps 3 on the device "
                     r"and (\d+) in its host/disk KV tiers", plan.stdout)
    assert said, plan.stdout
    mirror, cold = map(int, said.groups())
    assert mirror == 3 + cold >= 4  # what the plan says the KV holds, in all tiers, and the draft mirrors
    run = offload("run", "--config", str(config), "--prompt-ids", PROMPT, "--max-new-tokens", "16", "--json")
    assert run.returncode == 0, run.stderr[-2000:]  # was: "needs 4 KV blocks but the KV cache holds 3 in all tiers"
    alone = write_yaml(tmp_path / "alone.yaml", spec_config(tiny_llama, tmp_path / "store", draft="none"))
    plain = offload("run", "--config", str(alone), "--prompt-ids", PROMPT, "--max-new-tokens", "16", "--json")
    assert plain.returncode == 0, plain.stderr[-2000:]
    tokens = [json.loads(p.stdout)["results"][0]["token_ids"] for p in (run, plain)]
    assert len(tokens[0]) == 16 and tokens[0] == tokens[1]  # greedy speculation keeps the target's tokens
