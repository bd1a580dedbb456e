"""What a calibration leaves behind in the process, and what the plan says from it whatever it measured."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from offload.cli.main import main
from offload.plan import calibrate, probe
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
