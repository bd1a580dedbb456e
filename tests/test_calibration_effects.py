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
from offload.model.config import ModelConfig
from offload.plan import calibrate, machine, probe
from offload.plan.calibrate import Calibration
from offload.plan.predict import compute_sizes
from offload.weights.groups import WeightFormat


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


def _fake_layers(monkeypatch, times):
    """`probe._layer_seconds` answering (bytes, cached times, cold times) by the shape's hidden size; no pass timed."""
    def layer_seconds(shape, device, dtype, tokens, *args):
        nbytes, cached, cold = times[shape["hidden_size"]]
        return nbytes, cached[:len(tokens)], None if cold is None else cold[:len(tokens)]
    monkeypatch.setattr(probe, "_layer_seconds", layer_seconds)
    monkeypatch.setattr(probe, "pass_seconds", lambda dev, dt, tokens, *a, **k: [0.0] * len(tokens))


def test_a_layers_time_is_two_lines_in_its_bytes_through_a_small_a_narrow_and_a_wide_probe(monkeypatch):
    """A narrow layer reads its bytes slower than a wide one (SmolLM2-135M's 576-wide int4 layer at 30-40 GB/s of
    dense bytes on a 2-core Zen 4, where one line through the tiny and the 2048-wide probe said 60-70: its plan
    -20%). The probe times a third, narrow layer; a layer of each probe's bytes is priced at that probe's time,
    cached and (a pass past the cache) cold, a wide layer past it on the wide line, a small one on the narrow line."""
    small, narrow, wide = 100_000, probe.dense_layer_bytes(probe.NARROW, torch.bfloat16), 80_000_000
    times = {128: (small, [50e-6, 80e-6], None), 512: (narrow, [200e-6, 400e-6], [300e-6, 500e-6]),
             2048: (wide, [2200e-6, 4000e-6, 0.03], None)}  # (the wide one: past the cold bytes, its own runs)
    _fake_layers(monkeypatch, times)
    table = probe.measure_compute(torch.device("cpu"), torch.bfloat16, (1, 8, 64), cold_bytes=64 << 20)
    assert table["narrow_bytes"] == narrow
    cal = Calibration({}, {"cpu": table}, "measured", {"llc_bytes": 32 << 20})
    for i, n in enumerate((1, 8)):
        for hidden, (nbytes, cached, _) in times.items():
            assert cal.layer_seconds("cpu", n, nbytes) == pytest.approx(cached[i], rel=1e-6), (n, hidden)
        assert cal.layer_seconds("cpu", n, narrow, 10 << 30) == pytest.approx((300e-6, 500e-6)[i], rel=1e-6)
        assert cal.layer_seconds("cpu", n, wide, 10 << 30) == pytest.approx((2200e-6, 4000e-6)[i], rel=1e-6)
    half = (small + narrow) / 2  # on the narrow line: halfway in time, not what the wide line says
    assert cal.layer_seconds("cpu", 1, half) == pytest.approx(125e-6, rel=1e-6)
    assert cal.layer_seconds("cpu", 1, 2 * wide) == pytest.approx(2200e-6 + 2000e-6 * wide / (wide - narrow))
    assert cal.layer_seconds("cpu", 64, wide) == pytest.approx(0.03)  # past decode: the wide layer's rate alone
    times[1024] = (narrow * 2, [300e-6, 500e-6, 0.003], None)  # a test layer too close to the narrow one: one line
    one = probe.measure_compute(torch.device("cpu"), torch.bfloat16, (1, 8, 64), shape=probe.REFERENCE | {
        "hidden_size": 1024})
    assert not any("narrow" in k for k in one) and "cold_weight_bytes_per_s" not in one
    assert Calibration({}, {"cpu": one}).layer_seconds("cpu", 1, small) == pytest.approx(50e-6, rel=1e-6)


def test_a_packed_layer_is_sized_to_the_dense_bytes_that_take_its_time_on_its_own_line():
    """The plan prices a packed format's layer as the dense bytes whose layer takes as long as the format's kernels
    took on a layer of its bytes, fixed costs included (a ratio of two rates dropped the int4 layer's own fixed cost
    and line)."""
    dense = {"tokens": [1, 8], "weight_bytes_per_s": [30e9, 20e9], "layer_overhead_s": [20e-6, 40e-6],
             "narrow_weight_bytes_per_s": [20e9, 15e9], "narrow_layer_overhead_s": [30e-6, 50e-6],
             "narrow_bytes": 10e6}
    int4 = dense | {"weight_bytes_per_s": [70e9, 40e9], "layer_overhead_s": [60e-6, 80e-6],
                    "narrow_weight_bytes_per_s": [35e9, 30e9], "narrow_layer_overhead_s": [40e-6, 60e-6]}
    cal = Calibration({}, {"cpu": dense, "cpu/int4": int4}, "measured")
    for hidden, inter in ((576, 1536), (2048, 5632)):  # one below the narrow probe's bytes, one above
        cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
                                     "num_attention_heads": hidden // 64, "num_key_value_heads": 1,
                                     "num_hidden_layers": 2, "vocab_size": 1000})
        plain = compute_sizes(cfg, torch.bfloat16, WeightFormat("none"), cal, "cpu")
        packed = compute_sizes(cfg, torch.bfloat16, WeightFormat("int4"), cal, "cpu")
        n = plain["layer.0"]
        assert cal.layer_seconds("cpu", 1, packed["layer.0"]) == pytest.approx(cal.layer_seconds("cpu/int4", 1, n),
                                                                               rel=1e-6)
        assert packed["layer.0"] < n and packed["embed"] == plain["embed"]
