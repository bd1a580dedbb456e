"""One dtype default for `convert` and `run`, and every command an error suggests, followed literally, works
(issue 18 item 5): each test runs the real commands, then the one the error names, then the run again."""

from __future__ import annotations

import re
import shlex

import yaml

from tests.conftest import run_config
from tests.test_cli_flows import offload, write_yaml

PROMPT = ("--prompt-ids", "1,5,9,11", "--max-new-tokens", "4")


def suggested(stderr: str) -> list[str]:
    """The `offload convert ...` command an error names, as argv."""
    found = re.search(r"`(offload convert [^`]+)`", stderr)
    assert found, stderr[-2000:]
    return shlex.split(found.group(1))[1:]


def test_convert_then_run_with_the_defaults_agree_on_the_dtype(tiny_llama, tmp_path):
    store = tmp_path / "store"
    assert offload("convert", str(tiny_llama), str(store)).returncode == 0  # the checkpoint's float32
    cfg = {"model": str(tiny_llama), "device": "cpu",
           "tiers": {"gpu": {"capacity": "64MiB"}, "disk": {"path": str(store)}}}
    run = offload("run", "--config", str(write_yaml(tmp_path / "c.yaml", cfg)), *PROMPT)
    assert run.returncode == 0, run.stderr[-2000:]  # was: the store holds float32, the run asks for bfloat16


def test_a_dtype_mismatch_names_a_convert_command_that_makes_the_run_work(tiny_llama, tmp_path):
    store = tmp_path / "store"
    cfg = run_config(tiny_llama, tiers={"gpu": {"capacity": "64MiB"}, "disk": {"path": str(store)}})
    config = write_yaml(tmp_path / "c.yaml", cfg)
    assert offload("run", "--config", str(config), *PROMPT).returncode == 0  # converts float32 on first run
    config.write_text(yaml.safe_dump(cfg | {"dtype": "bfloat16"}))
    refused = offload("run", "--config", str(config), *PROMPT)
    assert refused.returncode != 0 and "holds float32 weights but the run asks for bfloat16" in refused.stderr
    fix = offload(*suggested(refused.stderr))
    assert fix.returncode == 0, fix.stderr[-2000:]
    again = offload("run", "--config", str(config), *PROMPT)
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_weights_mismatch_names_a_convert_command_with_every_format_flag(tiny_llama, tmp_path):
    store = tmp_path / "store"
    cfg = run_config(tiny_llama, tiers={"gpu": {"capacity": "64MiB"}, "disk": {"path": str(store)}})
    config = write_yaml(tmp_path / "c.yaml", cfg)
    assert offload("run", "--config", str(config), *PROMPT).returncode == 0  # a dense store
    config.write_text(yaml.safe_dump(cfg | {"weights": {"quantization": "int8", "group_size": 8, "keep": []}}))
    refused = offload("run", "--config", str(config), *PROMPT)
    assert refused.returncode != 0 and "holds weights stored as" in refused.stderr
    argv = suggested(refused.stderr)
    assert "--group-size" in argv and "--keep" in argv and "--dtype" in argv
    assert offload(*argv).returncode == 0
    again = offload("run", "--config", str(config), *PROMPT)
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_corrupt_store_names_the_convert_command_of_this_run(tiny_llama, tmp_path):
    """A config that sets dtype and packed weights: the checksum error's command rebuilds the store this run
    reads (the bare `--force` advice wrote a float32 dense store, and the next run failed on the format)."""
    store = tmp_path / "store"
    cfg = run_config(tiny_llama, dtype="bfloat16", weights={"quantization": "int8", "group_size": 8, "keep": []},
                     tiers={"gpu": {"capacity": "1MiB"}, "cpu": {"capacity": "1MiB"}, "disk": {"path": str(store)}})
    config = write_yaml(tmp_path / "c.yaml", cfg)
    assert offload("run", "--config", str(config), *PROMPT).returncode == 0  # converts int8 bf16 on first run
    chunk = store / "layer.2" / "c.0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))
    refused = offload("run", "--config", str(config), *PROMPT)
    assert refused.returncode != 0 and "checksum mismatch" in refused.stderr, refused.stderr[-2000:]
    fix = offload(*suggested(refused.stderr))
    assert fix.returncode == 0, fix.stderr[-2000:]
    again = offload("run", "--config", str(config), *PROMPT)
    assert again.returncode == 0, again.stderr[-2000:]
