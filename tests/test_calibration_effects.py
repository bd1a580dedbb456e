"""What a calibration leaves behind in the process, and what the plan says from it whatever it measured."""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from offload.cli.main import main
from offload.plan import calibrate, machine, probe
from offload.plan.calibrate import Calibration


def test_a_calibration_leaves_no_probe_kv_pool_behind(tmp_path, monkeypatch):
    """The probes' paged KV pools sat in reference cycles (blocks and their pool) after `calibrate` returned (a first
    start on 24 GiB held 842 MiB more after it until the collector ran), which the run planning next counted as
    taken: it collects them."""
    made = []

    class Tracked(probe.PagedKVCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(weakref.ref(self))

    monkeypatch.setattr(probe, "PagedKVCache", Tracked)
    monkeypatch.setattr(calibrate, "ram_available", lambda: 512 << 20)  # (small probes: ~5 s)
    gc.disable()  # (as if the collector's thresholds had not come round)
    try:
        cal = calibrate.calibrate(torch.device("cpu"), torch.bfloat16, tmp_path, packed=())
        assert "cpu" in cal.compute and made and all(ref() is None for ref in made)
    finally:
        gc.enable()


def test_the_plan_counts_a_packed_models_parameters_as_the_dense_ones(tmp_path, capsys):
    """`offload plan` (and `chat --auto`) said a model's parameters from the compute sizes, which scale a packed
    format's layers by how fast its kernels went in the calibration: SmolLM2-135M int4 came out at 95-114 M from one
    start to the next. The count and the dense size are the checkpoint's whatever the format and calibration."""
    root = Path(__file__).resolve().parent.parent / "scripts"
    table = {"tokens": [1, 8, 64], "weight_bytes_per_s": [10e9, 10e9, 5e9]}
    cal = Calibration({}, {"cpu": table, "cpu/int4": table | {"weight_bytes_per_s": [25e9, 20e9, 9e9]}}, "measured",
                      {"kernels": calibrate.kernels_id()})
    cal.save(tmp_path / "cal.json")
    for weights in ("none", "int4"):
        assert main(["plan", "--model-config", str(root / "examples" / "llama3-70b" / "config.json"), "--device",
                     "cpu", "--gpu", "8GiB", "--cpu", "0", "--disk-path", str(tmp_path), "--calibration",
                     str(tmp_path / "cal.json"), "--weights", weights]) == 0
        out = capsys.readouterr().out
        assert "80 layers, 70.55 B parameters (131.42 GiB in bfloat16" in out, (weights, out[:400])


def test_every_calibration_waits_for_the_one_measuring_the_machine(tmp_path, monkeypatch, caplog):
    """`offload calibrate` and the scripts call `calibrate` without the lock `offload chat --auto` measures under:
    one of them started beside a first start timed the other's load (each then plans a slow step). `calibrate` takes
    the machine's lock itself, waiting for its holder, and lets it go whatever the measurement raises."""
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))
    started = []

    def links(*_):
        started.append(time.monotonic())
        raise KeyboardInterrupt  # (the measurement interrupted: Ctrl-C)

    monkeypatch.setattr(calibrate, "measure_links", links)
    holder = machine.calibration_lock(tmp_path)
    holder.exclusive()
    holder.announce("calibrating")
    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.WARNING):
        measuring = pool.submit(calibrate.calibrate, torch.device("cpu"), torch.float32, tmp_path)
        time.sleep(0.5)
        assert not started and not measuring.done()
        released = time.monotonic()
        holder.close()
        with pytest.raises(KeyboardInterrupt):
            measuring.result(timeout=30)
    assert started[0] >= released
    assert [r for r in caplog.records if f"waiting for pid {os.getpid()} (calibrating since" in r.getMessage()]
    again = machine.calibration_lock(tmp_path)
    assert again.try_exclusive()  # (let go after the interruption)
    again.close()
