"""`offload chat --auto` (scripts/run_70b.sh): set up once for this machine, then every start reuses it all."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from offload.cli import auto
from offload.cli.main import main
from offload.plan.calibrate import Calibration
from offload.runtime.conversation import Conversation
from offload.runtime.engine import Sampling
from offload.runtime.runner import Runner
from tests.conftest import run_config
from tests.test_chat_template import CHATML

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup(tmp_path, tiny_llama, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": "<s>",
                                                             "eos_token": "</s>"}))
    calls = {"calibrate": 0, "convert": 0}

    def fake_calibrate(device, dtype, disk):  # measuring takes ~20 s here; what matters is that it runs once
        calls["calibrate"] += 1
        return Calibration.defaults()

    real_convert = auto.convert

    def counting_convert(*a, **kw):
        calls["convert"] += 1
        return real_convert(*a, **kw)

    monkeypatch.setattr(auto, "calibrate", fake_calibrate)
    monkeypatch.setattr(auto, "convert", counting_convert)
    small = auto.Machine.detect(tmp_path)
    monkeypatch.setattr(auto.Machine, "detect", classmethod(lambda cls, disk: auto.Machine(
        "cpu", None, None, 256 * 2**20, disk, small.disk_free)))  # a small machine: small tiers, a small KV pool
    return model, tmp_path / "run", calls


def start(model, disk, monkeypatch, capsys, lines=("Hello there",)):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", "--auto", str(model), "--disk", str(disk), "--max-new-tokens", "4"]) == 0
    return capsys.readouterr()


def test_second_start_reuses_config_store_and_calibration(setup, monkeypatch, capsys):
    model, disk, calls = setup
    first = start(model, disk, monkeypatch, capsys)
    # the setup's account (machine, config, store, calibration, plan) goes to stderr: stdout is the chat's
    assert "written for this machine" in first.err and "store: converting" in first.err
    assert "calibration: measuring" in first.err and calls == {"calibrate": 1, "convert": 1}
    assert re.search(r"decode step, batch 1, .* s/token\)", first.err)  # the plan with its prediction
    cfg = yaml.safe_load((disk / "offload.yaml").read_text())
    assert cfg["model"] == str(model) and cfg["tiers"]["disk"]["path"] == "store"
    assert cfg["kv_cache"]["gpu_blocks"] == "auto" and cfg["prefetch"]["depth"] == "auto"

    # the user edits the YAML; the next start reads it as left and sets nothing up again
    (disk / "offload.yaml").write_text((disk / "offload.yaml").read_text().replace("prefill_chunk: 256",
                                                                                  "prefill_chunk: 64"))
    second = start(model, disk, monkeypatch, capsys, ["Hello there", "And then?"])
    assert "(reused; edit it" in second.err and "is complete (no conversion)" in second.err
    assert "(reused; no calibration)" in second.err and "converting" not in second.err
    assert calls == {"calibrate": 1, "convert": 1}
    assert "passes of 64 tokens" in second.err
    assert "[turn 2: " in second.err and "ready in " in second.err

    # the replies are the model's: the first turn as a conversation on the checkpoint, all in memory, gives it
    with Runner.from_config(run_config(model)) as r:
        expected = Conversation(r, Sampling(4, stop_token_ids=frozenset(r.generation.eos_token_ids))).say(
            "Hello there").text
    assert second.out.startswith(expected + "\n") and "this machine" not in second.out  # the replies alone


def test_weights_int4_is_refused_until_quantized_weights_exist(setup, capsys):
    model, disk, _ = setup
    if "weights" in {f.name for f in auto.dataclasses.fields(auto.OffloadConfig)}:
        pytest.skip("this Offload has quantized weights")
    assert main(["chat", "--auto", str(model), "--disk", str(disk), "--weights", "int4"]) == 2
    assert "weights: {quantization: int4}" in capsys.readouterr().err
    assert not (disk / "offload.yaml").exists()  # refused before anything was written


def test_run_70b_script_shows_its_usage():
    proc = subprocess.run([str(ROOT / "scripts" / "run_70b.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "MODEL_OR_PATH" in proc.stdout
