"""Profiling: trace files, the summary and its stall attribution, framework hooks, calibration, predictions."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from offload.cli.main import main
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.model import fused
from offload.model.checkpoint import Checkpoint
from offload.plan import calibrate, links, machine, probe
from offload.plan.calibrate import CACHE_SHARE, DEFAULTS, Calibration, load_calibration, measure_compute
from offload.plan.costmodel import simulate
from offload.plan.links import measure_disk, measure_memcpy
from offload.plan.placement import GroupSpec, make_plan
from offload.plan.planner import Planner
from offload.plan.predict import KVTiers, Workload, cold_kv, predict_decode
from offload.runtime.overhead import engine_overhead_s
from offload.runtime.runner import Runner
from schedulers.plan import Capacities
from schedulers.timeline import Timeline
from schedulers.trace import check_chrome, load_chrome, summarize
from storage.disk import DiskTier
from storage.errors import CapacityError
from storage.slots import DiskSlots
from tests.conftest import run_config


def streaming_config(model, store, depth=1, **kw):
    return run_config(model, tiers={"gpu": {"capacity": "3MiB"}, "cpu": {"capacity": "1MiB"},
                                    "disk": {"path": str(store)}},
                      prefetch={"depth": depth}, kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 16}, **kw)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("prof") / "store"


def test_trace_file_passes_the_schema_check_and_round_trips(tmp_path, tiny_llama, store):
    import yaml
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(streaming_config(tiny_llama, store)))
    trace = tmp_path / "t.json"
    assert main(["run", "--config", str(cfg), "--prompt", "hi", "--max-new-tokens", "6", "--trace", str(trace)]) == 0
    data = json.loads(trace.read_text())
    assert check_chrome(data) == []
    events = data["traceEvents"]
    assert all({"ph", "ts", "pid", "tid"} <= e.keys() for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all("dur" in e and e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    tracks = {e["cat"] for e in complete}
    assert {"compute", "disk-read"} <= tracks
    reads = [e for e in complete if e["cat"] == "disk-read"]
    assert all(e["args"]["bytes"] > 0 and "GB/s" in e["args"] and "step" in e["args"] for e in reads)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "stall", "disk-read", "h2d"} <= names
    assert any(e["ph"] == "C" and e["name"] == "bytes resident" for e in events)  # counter track
    spans, counters, meta = load_chrome(trace)
    assert len(spans) == len(complete) and meta["decode_steps"][1] > meta["decode_steps"][0]


def test_check_chrome_catches_bad_events():
    missing_dur = {"traceEvents": [{"ph": "X", "ts": 1, "pid": 1, "tid": 1}]}
    assert check_chrome(missing_dur) == ["complete event 0 has no 'dur'"]
    assert "event 0 has a negative time" in check_chrome({"traceEvents": [{"ph": "X", "ts": -1, "dur": 1, "pid": 1,
                                                                           "tid": 1}]})
    assert "event 0 has no 'pid'" in check_chrome({"traceEvents": [{"ph": "C", "ts": 1, "tid": 1}]})


def test_summary_bytes_equal_what_the_store_moved(tiny_llama, store):
    """The trace's spans and the one byte counter (runner.traffic) agree on every byte read from the store:
    homes filled at start, streamed layers, embedding rows."""
    with Runner.from_config(streaming_config(tiny_llama, store)) as r:
        r.generate([[1, 5, 9, 11, 13]], max_new_tokens=6, stop_on_eos=False)
        r.weights.close()  # stop prefetching ahead so nothing is read after we look
        moved = sum(n for route, n in r.traffic.routes("weights").items() if route.startswith("disk->"))
        summary = summarize(r.timeline.spans_resolved())
        on_track = r.timeline.bytes_on("disk-read")
    link = {x.link: x for x in summary.links}["disk read"]
    assert link.bytes == on_track == moved > 0


class SlowDisk:
    """Delays every read of a layer from disk by a fixed time: the disk becomes the bottleneck.
    (Embedding rows, read by the compute thread itself, keep their speed.)"""

    def __init__(self, monkeypatch, seconds):
        real = DiskTier._read_into

        def slow(tier, key, dest, offset):
            if key.startswith("layer."):
                time.sleep(seconds)
            return real(tier, key, dest, offset)

        monkeypatch.setattr(DiskTier, "_read_into", slow)


def test_stall_is_attributed_to_the_slow_disk_not_compute(tiny_llama, store, monkeypatch):
    with Runner.from_config(streaming_config(tiny_llama, store)) as r:
        SlowDisk(monkeypatch, 0.1)  # far above a tiny layer's compute even on a loaded machine (77 ms/step seen)
        r.generate([[1, 5, 9]], max_new_tokens=6, stop_on_eos=False)
        stats = r.last_stats
        steps = range(r.timeline.step - stats.decode_steps, r.timeline.step)
        summary = summarize(r.timeline.spans_resolved(), steps)
    per_step = summary.per_step()
    assert summary.stall_s > 0.5 * summary.wall_s  # the steps mostly wait
    assert summary.stall_by_cause["disk read"] > 0.8 * summary.stall_s  # and the disk is to blame
    assert per_step["exposed transfer"] > per_step["compute"]
    assert max(summary.stall_by_group, key=lambda g: sum(summary.stall_by_group[g].values())) in r.plan.streamed


def test_a_wait_for_cold_kv_is_a_stall_charged_to_the_kv_fetch_not_compute(tiny_llama, tmp_path, monkeypatch):
    """Every layer resident, the context's cold blocks on a slow disk: the steps wait for the side thread's fetch,
    and the summary says so (it was counted as compute: the wait fell between a layer's acquire and release)."""
    cfg = run_config(tiny_llama, tiers={"gpu": {"capacity": "64MiB"}, "cpu": {"capacity": "16MiB"},
                                        "disk": {"path": str(tmp_path / "store")}},
                     kv_cache={"gpu_blocks": 3, "cpu_blocks": 0, "disk_blocks": 16}, activations={"prefill_chunk": 16})
    read = DiskSlots.read_plane
    with Runner.from_config(cfg) as r:
        monkeypatch.setattr(DiskSlots, "read_plane", lambda *a, **k: time.sleep(0.03) or read(*a, **k))
        r.generate([list(range(3, 83))], max_new_tokens=4, stop_on_eos=False)
        steps = range(r.timeline.step - r.last_stats.decode_steps, r.timeline.step)
        summary = summarize(r.timeline.spans_resolved(), steps)
        layers = r.cfg.num_layers
    n = len(steps)
    assert summary.stall_by_cause.get("kv fetch", 0.0) > 0.8 * summary.stall_s > 0
    assert summary.stall_s / n > 0.5 * layers * 0.03  # the fetches are mostly waited for
    assert summary.compute_s / n < 0.5 * layers * 0.03  # and not inside the layers' compute


def test_framework_hooks_show_our_ranges_in_torch_profiler(tiny_llama, store):
    from torch.profiler import ProfilerActivity, profile

    with Runner.from_config(streaming_config(tiny_llama, store)) as r:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r.generate([[1, 5, 9]], max_new_tokens=3, stop_on_eos=False)
    names = {e.name for e in prof.events()}
    assert "offload/compute/layer.0" in names and "offload/compute/head" in names
    assert any(n.startswith("offload/disk-read/") for n in names)


def test_layers_run_in_one_call_still_get_a_compute_span_each_in_order(tiny_llama, monkeypatch):
    """All resident on a CPU, a pass's layers run in one compiled call (`fused.LayerRun`); each layer still gets its
    own compute span (timed inside the call), in layer order, one after the other, inside the call."""
    ran, real = [], fused.LayerRun.__call__
    monkeypatch.setattr(fused.LayerRun, "__call__", lambda *a: (ran.append(1), real(*a))[1])
    with Runner.from_config(run_config(tiny_llama)) as r:
        r.generate([[1, 5, 9]], max_new_tokens=4, stop_on_eos=False)
        layers = r.cfg.num_layers
        spans = [s for s in r.timeline.spans if s.track == "compute"]
    assert len(ran) == 4  # the prompt and three decode steps
    steps = sorted({s.step for s in spans})
    assert len(steps) == 4
    for step in steps:
        mine = [s for s in spans if s.step == step]
        assert [s.name for s in mine] == [f"layer.{i}" for i in range(layers)] + ["head"]
        assert all(s.end >= s.start for s in mine)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(mine, mine[1:]))


def test_a_run_of_spans_is_made_when_read_in_the_order_recorded_and_forgotten_like_the_others():
    """`Timeline.add_many` with a function (a pass's resident layers: their times from the cycle counter) calls it
    only when the spans are read, keeps them where they were recorded, and the bounded window drops them too."""
    tl, calls = Timeline(keep_steps=40), []  # (forgets every 10 steps)

    def times(step):
        calls.append(step)
        return [(step, step + 0.25), (step + 0.25, step + 0.5)]
    for step in range(100):
        tl.add("stall", "layer.0", step, step)
        tl.add_many("compute", ["layer.0", "layer.1"], lambda step=step: times(step))
        tl.add("compute", "head", step + 0.5, step + 1)
        if step == 3:
            assert calls == [] and [s.name for s in tl.spans] == ["layer.0", "layer.0", "layer.1", "head"] * 4
            assert calls == [0, 1, 2, 3] and [s.start for s in tl.on("compute", step=2)] == [2, 2.25, 2.5]
        tl.next_step()
    kept = tl.spans
    assert 40 <= len({s.step for s in kept}) <= 50 and {s.step for s in kept} >= set(range(60, 100))
    assert [s.name for s in kept if s.track == "compute"][-3:] == ["layer.0", "layer.1", "head"]
    assert len(calls) == len(set(calls)) and set(calls) >= set(range(60, 100))  # each run's times made once, and
    assert not set(calls) & set(range(11, 20))  # a run forgotten before it was read never (forgetting reads none)
    off = Timeline(enabled=False)
    off.add_many("compute", ["layer.0"], lambda: calls.append("off") or [(0, 1)])
    assert off.spans == [] and "off" not in calls


def test_no_spans_when_the_timeline_is_off(tiny_llama, store):
    cfg = OffloadConfig.load(streaming_config(tiny_llama, store))
    with Runner(cfg, timeline=Timeline(enabled=False)) as r:
        r.generate([[1, 5, 9]], max_new_tokens=4, stop_on_eos=False)
        assert r.timeline.spans == [] and r.timeline.counters == []


def test_trace_summary_and_plot_commands(tmp_path, tiny_llama, store, capsys):
    pytest.importorskip("matplotlib")
    import yaml
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(streaming_config(tiny_llama, store)))
    trace = tmp_path / "t.json"
    main(["run", "--config", str(cfg), "--prompt", "hi", "--max-new-tokens", "5", "--trace", str(trace)])
    capsys.readouterr()
    assert main(["trace", "summary", str(trace), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"links", "stall_by_cause", "overlap", "per_step_s"} <= data.keys()
    assert main(["trace", "plot", str(trace), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["trace", "summary", str(tmp_path / "missing.json")]) == 2


# ----------------------------------------------------------------------------- calibration and cost model
def test_two_disk_probes_into_one_directory_at_once_each_read_their_own_file(tmp_path):
    """Two processes calibrating one setup at once shared one probe file: each truncated and removed the other's."""
    with ThreadPoolExecutor(2) as pool:
        rates = list(pool.map(lambda _: measure_disk(tmp_path, nbytes=16 * 2**20, piece=2**20), range(2)))
    assert all(r > 1e6 for r in rates) and not list(tmp_path.iterdir())


def test_calibration_measures_and_round_trips(tmp_path):
    disk = measure_disk(tmp_path, nbytes=16 * 2**20)
    assert disk > 1e6 and not list(tmp_path.iterdir())  # the test file is removed
    assert measure_memcpy(8 * 2**20) > 1e8
    table = measure_compute(torch.device("cpu"), torch.float32, tokens=(1, 8))
    assert len(table["weight_bytes_per_s"]) == 2 and all(x > 0 for x in table["weight_bytes_per_s"])
    cal = Calibration({"disk read": disk, "memcpy": 5e9}, {"cpu": table}, "measured")
    cal.save(tmp_path / "cal.json")
    back = Calibration.load(tmp_path / "cal.json")
    assert back.links["disk read"] == pytest.approx(disk) and back.source == str(tmp_path / "cal.json")
    assert back.links["host->device"] > 0  # missing links fall back to the defaults


def test_a_calibration_keeps_the_faster_of_two_timings_of_its_dense_layers():
    """Measured twice (before and after the packed kernels), at each pass size the rate, fixed cost and cold rate
    come from the timing that went faster, and the pass costs are the smaller: a slow stretch of a shared host during
    one of them no longer sets the plan of every dense run."""
    a = {"tokens": [1, 8], "weight_bytes_per_s": [11e9, 20e9], "layer_overhead_s": [1e-5, 2e-5],
         "cold_weight_bytes_per_s": [10e9, 19e9], "pass_overhead_s": [3e-4, 1e-4], "cold_pass_overhead_s": [5e-4, 6e-4]}
    b = {"tokens": [1, 8], "weight_bytes_per_s": [30e9, 15e9], "layer_overhead_s": [4e-5, 5e-5],
         "cold_weight_bytes_per_s": [28e9, 14e9], "pass_overhead_s": [2e-4, 2e-4], "cold_pass_overhead_s": [7e-4, 1e-4]}
    merged = probe.faster_of(a, b)
    assert merged["weight_bytes_per_s"] == [30e9, 20e9] and merged["layer_overhead_s"] == [4e-5, 2e-5]
    assert merged["cold_weight_bytes_per_s"] == [28e9, 19e9]
    assert merged["pass_overhead_s"] == [2e-4, 1e-4] and merged["cold_pass_overhead_s"] == [5e-4, 1e-4]
    assert a["weight_bytes_per_s"] == [11e9, 20e9]  # its arguments untouched
    no_cold = {k: v for k, v in a.items() if not k.startswith("cold_")}
    assert "cold_weight_bytes_per_s" not in probe.faster_of(no_cold, {k: v for k, v in b.items()
                                                                     if not k.startswith("cold_")})
    # the cache curve too: at each size the faster read (the share of a pass the cache holds moves with its edge)
    c1, c2 = {"bytes": [16, 24, 32], "bytes_per_s": [5e10, 3.3e10, 3e10]}, {"bytes": [16, 24, 32], "bytes_per_s":
                                                                           [4.9e10, 4.3e10, 2.9e10]}
    assert probe.faster_curve(c1, c2) == {"bytes": [16, 24, 32], "bytes_per_s": [5e10, 4.3e10, 3e10]}


def test_calibration_defaults_and_bad_files(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "empty"))
    assert load_calibration().source == "defaults"
    with pytest.raises(ConfigError, match="does not exist; run `offload calibrate"):
        load_calibration(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a calibration file"):
        load_calibration(tmp_path / "bad.json")


def test_a_calibration_names_the_machine_it_measured_where_it_is_not_this_one(tmp_path, caplog):
    """A calibration records its machine; read on another (another CPU, other vector features, fewer CPUs) it says
    how they differ, in a warning a run or a plan shows once; files without the record (older ones, the examples
    for machines we do not have) are taken as they are."""
    here = machine.identity()
    assert here["cpus"] >= 1 and set(here["features"]) <= set(machine.SPEED_FLAGS) and here["cpu"]
    path = tmp_path / "cal.json"
    cal = Calibration(dict(DEFAULTS["links"]), {"cpu": dict(DEFAULTS["compute"]["cpu"])}, "measured",
                      {"machine": here, "kernels": calibrate.kernels_id()})
    cal.save(path)
    assert Calibration.load(path).other_machine is None
    for change, words in [({"cpu": "Elsewhere CPU 9000"}, "a 'Elsewhere CPU 9000' CPU, this is a"),
                          ({"features": [*here["features"], "amx_int8"]}, "amx_int8], this one has ["),
                          ({"cpus": here["cpus"] + 6}, f"{here['cpus'] + 6} CPUs, this process may use")]:
        cal.meta["machine"] = here | change
        cal.save(path)
        assert words in Calibration.load(path).other_machine
    with caplog.at_level(logging.WARNING, logger="offload.plan.calibrate"):
        load_calibration(path), load_calibration(path)
    warned = [r.getMessage() for r in caplog.records if "measured another machine" in r.getMessage()]
    assert len(warned) == 1 and "CPUs, this process may use" in warned[0]
    assert f"offload calibrate -o {path}" in warned[0]
    del cal.meta["machine"]
    cal.save(path)
    assert Calibration.load(path).other_machine is None and Calibration.defaults().other_machine is None


@pytest.mark.parametrize("room, hidden", [(8 << 30, 2048), (600 << 20, 1024), (200 << 20, 512)])
def test_calibration_probes_fit_in_a_quarter_of_the_ram_the_process_may_fill(tmp_path, monkeypatch, room, hidden):
    """Inside a 600 MiB memory cgroup the first `chat --auto` was killed calibrating: its probes (a 256 MiB memcpy
    pair, a 512 MiB disk buffer, TinyLlama's layer in float32) took what the cgroup had. Each now takes at most a
    quarter of the room (`ram_available`: the cgroup's if that is less), the test layer shrinking to fit."""
    budget, probes = room // 4, []
    monkeypatch.setattr(calibrate, "ram_available", lambda: room)
    monkeypatch.setattr(links, "measure_memcpy", lambda nbytes: probes.append(("memcpy", 2 * nbytes)) or 5e9)
    monkeypatch.setattr(links, "measure_disk", lambda d, nbytes: probes.append(("disk", 2 * nbytes)) or 1e9)
    monkeypatch.setattr(calibrate, "cache_curve", lambda limit: probes.append(("curve", limit)) or
                        {"bytes": [16 << 20, limit], "bytes_per_s": [5e10, 3e10]})
    shapes = []

    def layer_seconds(shape, device, dtype, tokens, context, compute, quantization, cold_bytes):
        if shape is not calibrate.SMALL:
            shapes.append(shape)
            layer = calibrate.layer_probe_bytes(shape, dtype, compute)  # the cold rate's copies: one layer more
            probes.append(("layer", layer + cold_bytes))
        if shape is calibrate.SMALL:
            return 4 << 20, [1e-3] * len(tokens), None
        return 64 << 20, [1e-2] * len(tokens), [2e-2] * len(tokens)
    monkeypatch.setattr(probe, "_layer_seconds", layer_seconds)
    cal = calibrate.calibrate(torch.device("cpu"), torch.float32, tmp_path,
                              engine=lambda c, device, dtype: {"engine_overhead_s": 7e-4})
    assert cal.compute["cpu"]["engine_overhead_s"] == 7e-4  # the runtime's timing joins the CPU's table
    assert probes and all(n <= budget for _, n in probes), probes
    assert {"cpu", "cpu/int8", "cpu/int4"} <= cal.compute.keys()  # measured, on a smaller layer where RAM is short
    widths = {s["hidden_size"] for s in shapes if s is not probe.NARROW}  # (and NARROW's, beside a wide one)
    assert widths == {hidden} == {cal.meta["reference_hidden_size"]}


def test_calibration_with_too_little_ram_for_a_test_layer_keeps_default_compute_tables(tmp_path, monkeypatch, caplog):
    """(And a calibration records how busy other work kept the CPUs meanwhile: `Calibration.busy`.)"""
    readings = [(0.0, 100.0, 10.0), (4.0, 106.0, 12.0)]  # (monotonic s, all CPU s, ours): others 4 s of 8
    monkeypatch.setattr(machine, "busy_mark", lambda: readings.pop(0))
    monkeypatch.setattr(machine, "cpus", lambda: 2)
    monkeypatch.setattr(calibrate, "ram_available", lambda: 40 << 20)
    monkeypatch.setattr(probe, "_layer_seconds", lambda *a: pytest.fail("a test layer was measured"))
    cal = calibrate.calibrate(torch.device("cpu"), torch.float32, tmp_path,
                              engine=lambda *a: pytest.fail("the engine was timed against default tables"))
    assert cal.compute == {} and cal.links["memcpy"] > 0 and cal.links["disk read"] > 0
    assert cal.weight_bytes_per_s("cpu", 1) == calibrate.DEFAULTS["compute"]["cpu"]["weight_bytes_per_s"][0]
    assert [r.message for r in caplog.records if "fits no test layer" in r.message]
    assert cal.busy == 0.5 and not readings


def test_a_pass_larger_than_the_cache_is_planned_at_the_cold_rate():
    """The probe times layers from the cache and from DRAM (`offload.plan.probe`); a pass whose weights fit in
    CACHE_SHARE of the last-level cache is planned at the cached rate, a larger one at the cold rate."""
    table = {"tokens": [1, 64], "weight_bytes_per_s": [30e9, 8e9], "cold_weight_bytes_per_s": [15e9, 7e9]}
    cal = Calibration({}, {"cpu": table}, "measured", {"llc_bytes": 100 << 20})
    fits = int(CACHE_SHARE * (100 << 20))
    assert cal.weight_bytes_per_s("cpu", 1, fits) == 30e9 and cal.weight_bytes_per_s("cpu", 1, fits + 1) == 15e9
    assert cal.weight_bytes_per_s("cpu", 64, 10 << 30) == 7e9 and cal.weight_bytes_per_s("cpu", 1) == 30e9
    no_cold = Calibration({}, {"cpu": {"tokens": [1], "weight_bytes_per_s": [30e9]}}, "measured", {"llc_bytes": 1})
    assert no_cold.weight_bytes_per_s("cpu", 1, 10 << 30) == 30e9  # an older file: the one rate it has


def test_a_pass_is_planned_at_the_cached_rate_for_the_share_of_its_bytes_the_cache_curve_finds_cached():
    """sysfs can name a host's shared cache: a 2-core Xeon VM's says 480 MiB, its buffers were read at the cache's
    pace up to 96 MiB, and SmolLM2 int8 (175 MB a step, under CACHE_SHARE of 480 MiB) was planned -48% off. A
    calibration's cache curve (read rate by buffer size) says what share of a pass's bytes comes from the cache."""
    curve = {"bytes": [16 << 20, 64 << 20, 128 << 20, 256 << 20], "bytes_per_s": [50e9, 50e9, 30e9, 30e9]}
    table = {"tokens": [1], "weight_bytes_per_s": [60e9], "cold_weight_bytes_per_s": [20e9],
             "pass_overhead_s": [1e-4], "cold_pass_overhead_s": [5e-4]}
    cal = Calibration({}, {"cpu": table}, "measured", {"llc_bytes": 480 << 20, "cache_curve": curve})
    assert cal.weight_bytes_per_s("cpu", 1, 32 << 20) == 60e9 and cal.weight_bytes_per_s("cpu", 1) == 60e9
    assert cal.weight_bytes_per_s("cpu", 1, 190 << 20) == pytest.approx(20e9)  # beyond the curve's cache: cold
    halfway = 2**26.5  # between 64 and 128 MiB in log(bytes): read at 40 GB/s, half the way from DRAM to the cache
    assert cal.weight_bytes_per_s("cpu", 1, halfway) == pytest.approx(1 / (0.5 / 60e9 + 0.5 / 20e9))
    assert cal.pass_overhead_s("cpu", 1, halfway, engine=False) == pytest.approx(3e-4)
    assert probe.hot_share(curve | {"bytes_per_s": [50e9, 50e9, 30e9, 33e9]}, 250 << 20) == 0.0  # never above 0
    flat = {"bytes": [16 << 20, 64 << 20], "bytes_per_s": [30e9, 30e9]}  # no cache the curve sees
    assert probe.hot_share(flat, 8 << 20) == 1.0 and probe.hot_share(flat, 32 << 20) == 0.0
    measured = probe.cache_curve(40 << 20)
    assert measured["bytes"] == [16 << 20, 24 << 20, 32 << 20] and all(r > 1e8 for r in measured["bytes_per_s"])


def test_the_cache_evictor_takes_at_most_a_quarter_of_the_ram_the_process_may_fill(monkeypatch):
    """A Xeon VM's sysfs names a 480 MiB last-level cache: the evictor's 512 MiB buffer had the first `chat --auto`
    in a 600 MiB memory cgroup killed while calibrating."""
    monkeypatch.setattr(probe, "llc_bytes", lambda: 480 << 20)
    monkeypatch.setattr(probe, "ram_available", lambda: 400 << 20)
    flush = probe.evictor()
    flush()
    assert next(c.cell_contents for c in flush.__closure__).numel() * 4 <= 100 << 20


def test_the_probe_measures_a_cold_rate_through_copies_beyond_the_cache_no_faster_than_the_cached_one():
    shape = probe.SMALL | {"hidden_size": 256, "intermediate_size": 512}
    table = measure_compute(torch.device("cpu"), torch.float32, (1, 8), shape=shape, cold_bytes=16 << 20)
    assert len(table["cold_weight_bytes_per_s"]) == 2 and all(c > 0 for c in table["cold_weight_bytes_per_s"])
    cal = Calibration({}, {"cpu": table}, "measured", {"llc_bytes": 1})
    nbytes = probe.dense_layer_bytes(shape, torch.float32)
    assert all(cal.layer_seconds("cpu", n, nbytes, 10 << 30) >= cal.layer_seconds("cpu", n, nbytes) > 0 for n in (1, 8))
    assert "cold_weight_bytes_per_s" not in measure_compute(torch.device("cpu"), torch.float32, (1,), shape=shape)


def test_throughput_interpolates_between_measured_token_counts():
    cal = Calibration({}, {"cpu": {"tokens": [1, 64], "weight_bytes_per_s": [1e9, 4e9]}})
    assert cal.weight_bytes_per_s("cpu", 1) == 1e9 and cal.weight_bytes_per_s("cpu", 64) == 4e9
    assert 1e9 < cal.weight_bytes_per_s("cpu", 8) < 4e9
    assert cal.weight_bytes_per_s("cpu", 128) == pytest.approx(2e9)  # past the table: time grows with tokens



def test_a_layers_fixed_cost_is_calibrated_and_predicted_on_top_of_its_bytes(tiny_llama):
    """A small model's step is mostly what each layer costs whatever its size (ops, allocations): the calibration
    splits a layer's time into that and a byte rate (two layer shapes), and the cost model adds it per layer."""
    table = measure_compute(torch.device("cpu"), torch.float32, tokens=(1, 8, 64))
    assert len(table["layer_overhead_s"]) == 3 and all(x >= 0 for x in table["layer_overhead_s"])
    assert table["layer_overhead_s"][2] == 0  # past decode-like passes: the large layer's rate alone
    cfg = Checkpoint(tiny_llama).config
    plan = Planner(OffloadConfig.load({"model": str(tiny_llama), "device": "cpu"}), cfg, torch.float32,
                   torch.device("cpu")).run_plan().plan
    rates = {"tokens": [1, 512], "weight_bytes_per_s": [1e9, 1e9]}
    bare = Calibration({"memcpy": 4e9}, {"cpu": rates})
    fixed = Calibration({"memcpy": 4e9}, {"cpu": rates | {"layer_overhead_s": [0.002, 0.002]}})
    assert fixed.layer_overhead_s("cpu", 4) == 0.002 and bare.layer_overhead_s("cpu", 4) == 0.0
    steps = [predict_decode(plan, cfg, c, "cpu", Workload(), 4).step_s for c in (bare, fixed)]
    assert steps[1] - steps[0] == pytest.approx(0.002 * cfg.num_layers)



def test_the_engines_step_is_timed_through_the_runtime_and_added_to_every_pass_cold_where_the_weights_pass_the_cache():
    """A step's cost beyond the probes' tables (sampling, the head's and embedding's calls) is timed by decoding a
    tiny model through the real engine, less what the calibration already counts for it; the planner adds it to a
    pass, the cold column where a pass's weights pass the cache."""
    table = {"tokens": [1, 64], "weight_bytes_per_s": [30e9, 8e9], "pass_overhead_s": [1e-4, 2e-4],
             "cold_pass_overhead_s": [4e-4, 5e-4]}
    bare = Calibration({}, {"cpu": dict(table)}, "measured", {"llc_bytes": 100 << 20})
    measured = engine_overhead_s(bare, torch.device("cpu"), torch.float32)
    assert set(measured) == {"engine_overhead_s", "cold_engine_overhead_s"}
    assert 0 <= measured["engine_overhead_s"] <= measured["cold_engine_overhead_s"] < 0.5
    cal = Calibration({}, {"cpu": table | {"engine_overhead_s": 1e-3, "cold_engine_overhead_s": 3e-3}}, "measured",
                      {"llc_bytes": 100 << 20})
    assert cal.pass_overhead_s("cpu", 1) == pytest.approx(1e-4 + 1e-3)
    assert cal.pass_overhead_s("cpu", 1, 10 << 30) == pytest.approx(4e-4 + 3e-3)
    assert cal.pass_overhead_s("cpu", 1, 10 << 30, engine=False) == pytest.approx(4e-4)
    assert bare.pass_overhead_s("cpu", 64, 10 << 30) == pytest.approx(5e-4)  # an older file: no engine column


MiB = 2**20


def small_plan(depth, copy_to_device=False, gpu=None, cpu=0):
    gpu = gpu if gpu is not None else 10 * (depth + 1)  # the ring and nothing else: every group streams
    groups = [GroupSpec(f"layer.{i}", 10 * MiB) for i in range(8)] + [GroupSpec("head", 5 * MiB)]
    return make_plan(groups, Capacities(gpu * MiB, cpu * MiB, None, True), depth, copy_to_device=copy_to_device)


def test_simulation_all_resident_is_the_sum_of_compute():
    plan = small_plan(1, gpu=1000)  # everything fits
    comp = {g: 0.01 for g in plan.order}
    pred = simulate(plan, comp, {"disk read": 1e9, "host->device": 1e10})
    assert pred.step_s == pytest.approx(0.09) and pred.exposed_s == 0 and pred.bottleneck == "compute"


def test_simulation_disk_bound_with_prefetch_is_the_disk_time():
    plan = small_plan(2)  # ring 3 x 10 MiB: every group streams from disk
    assert len(plan.streamed) == 9
    comp = {g: 0.001 for g in plan.order}
    pred = simulate(plan, comp, {"disk read": 100 * MiB, "host->device": 1e10})  # 0.1 s per layer
    assert pred.step_s == pytest.approx(0.85, rel=0.02) and pred.bottleneck == "disk read"


def test_simulation_depth_zero_adds_compute_to_the_disk_time():
    comp = {f"layer.{i}": 0.05 for i in range(8)} | {"head": 0.0}
    bw = {"disk read": 100 * MiB, "host->device": 1e10}
    deep = simulate(small_plan(2), comp, bw).step_s
    none = simulate(small_plan(0), comp, bw).step_s
    assert deep == pytest.approx(0.85, rel=0.02)  # the disk alone: every compute hides under a read
    assert none == pytest.approx(sum(comp.values()) + 0.85, rel=0.02)  # nothing overlaps


def test_cold_kv_blocks_are_fetched_beside_the_weights_and_share_their_disk():
    """A context beyond the device pool: its cold blocks, host tier first, are read every step (side jobs, on the
    disk the weights stream from too): all resident, they alone bound the step; streamed, the disk does both."""
    kv = KVTiers(block_size=16, device=4, cpu=2, disk=100, cold_bytes=8 * 5 * MiB)  # 5 MiB a block a layer
    assert kv.cold(Workload(context=64)) == (0, 0)  # 4 blocks: the pool
    assert kv.cold(Workload(context=16 * 10)) == (2, 4)  # 10 blocks: 6 cold, the host tier's 2 first
    bw = {"disk read": 100 * MiB, "host->device": 1e10, "memcpy": 1e12}
    resident = small_plan(1, gpu=1000)
    comp = {g: 0.01 for g in resident.order}
    side = kv.side(resident, Workload(context=16 * 10))
    assert side == {f"layer.{i}": (2 * 5 * MiB, 4 * 5 * MiB) for i in range(8)}
    alone = simulate(resident, comp, bw).step_s
    with_kv = simulate(resident, comp, bw, side=side)
    assert alone == pytest.approx(0.09)
    assert with_kv.step_s == pytest.approx(8 * 0.2 + 0.01, rel=0.05) and with_kv.bottleneck == "disk read"
    streamed = small_plan(2)  # 0.1 s a layer's weights, 0.2 s its cold blocks: 8 x 0.3 s of disk a step
    both = simulate(streamed, {g: 0.001 for g in streamed.order}, bw, side=kv.side(streamed, Workload(context=160)))
    assert both.step_s == pytest.approx(0.85 + 8 * 0.2, rel=0.05)
    cpu = dataclasses.replace(kv, host_in_place=True)  # a CPU run reads its host tier's blocks where they lie
    assert cpu.side(resident, Workload(context=160)) == {f"layer.{i}": (0, 4 * 5 * MiB) for i in range(8)}
    assert cold_kv(cpu, Workload(context=160))["bytes_per_step"] == 4 * 8 * 5 * MiB


def test_simulation_predicts_a_run_with_a_known_slow_disk(tiny_llama, store, monkeypatch):
    """A disk made slow by a fixed delay per read: the prediction and the measured step agree within 25%."""
    delay = 0.04
    with Runner.from_config(streaming_config(tiny_llama, store)) as r:
        SlowDisk(monkeypatch, delay)
        r.generate([[1, 5, 9]], max_new_tokens=8, stop_on_eos=False)
        measured = r.last_stats.decode_ms_per_step / 1000
        steps = range(r.timeline.step - r.last_stats.decode_steps, r.timeline.step)
        comp = {}
        for s in r.timeline.on("compute"):
            if s.step in steps:
                comp[s.name] = comp.get(s.name, 0.0) + s.duration / len(steps)
        size = max(r.plan.sizes[g] for g in r.plan.streamed)
        pred = simulate(r.plan, comp, {"disk read": size / delay, "host->device": 1e12})
    assert pred.step_s == pytest.approx(measured, rel=0.25)


def test_auto_depth_picks_the_fastest_predicted_depth(model_factory, tmp_path):
    # a machine whose disk is as slow as its compute: no prefetch doubles the step, a deeper ring hides compute
    cal = Calibration({"disk read": 0.2e9, "memcpy": 5e9},
                      {"cpu": {"tokens": [1, 512], "weight_bytes_per_s": [0.2e9, 0.2e9]}}, "measured")
    cal.save(tmp_path / "cal.json")
    tiny8 = model_factory("llama", overrides={"num_hidden_layers": 8})
    raw = streaming_config(tiny8, tmp_path / "store", depth="auto", calibration=str(tmp_path / "cal.json"))
    raw["tiers"]["gpu"]["capacity"], raw["tiers"]["cpu"]["capacity"] = "4MiB", 0  # rings of 1..5 slots fit
    cfg = OffloadConfig.load(raw)
    planner = Planner(cfg, Checkpoint(tiny8).config, torch.float32, torch.device("cpu"))
    rp = planner.run_plan()
    work = Workload(prefill_chunk=cfg.activations.prefill_chunk)
    steps = {}
    for depth in range(7):
        try:
            plan = planner.placement(planner.caps, depth)
        except CapacityError:
            break
        steps[depth] = predict_decode(plan, planner.cfg, load_calibration(cfg.calibration), "cpu", work, 4).step_s
    chosen, best = rp.plan.depth, min(steps.values())
    assert len(steps) >= 3 and steps[0] > 1.1 * best  # the choice matters here
    assert steps[chosen] <= 1.01 * best  # the fastest, within the 1% tie margin ...
    assert all(steps[d] > 1.01 * best for d in steps if d < chosen)  # ... and the smallest ring among ties
    assert rp.depth_note.startswith(f"depth auto -> {chosen}")
    with Runner.from_config(raw) as r:
        assert r.plan.depth == chosen


def test_plan_on_paper_for_llama3_70b(capsys):
    root = Path(__file__).resolve().parent.parent / "scripts"
    assert main(["plan", "--config", str(root / "examples" / "llama3-70b-24gb.yaml"), "--calibration",
                 str(root / "calibrations" / "rtx4090-pcie4-nvme.json")]) == 0
    out = capsys.readouterr().out
    assert "80 layers" in out and "70.55 B parameters" in out
    assert "bottleneck: disk read" in out and "what would help most" in out
    assert main(["plan", "--model-config", str(root / "examples" / "llama3-70b" / "config.json"), "--gpu", "24GiB",
                 "--cpu", "64GiB", "--disk-path", "/tmp/x", "--calibration",
                 str(root / "calibrations" / "rtx4090-pcie4-nvme.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prediction"]["step_s"] > 1 and data["device"] == "cuda"
    assert data["prediction"]["cold_kv"] == {"host_blocks": 0, "disk_blocks": 0, "bytes_per_step": 0,
                                             "host_in_place": False, "blocks_not_held": 0}  # 128 tokens: the pool
    # the model's whole context: blocks beyond the pool are fetched every step, on the disk the weights stream from
    assert main(["plan", "--model-config", str(root / "examples" / "llama3-70b" / "config.json"), "--gpu", "24GiB",
                 "--cpu", "64GiB", "--disk-path", "/tmp/x", "--calibration",
                 str(root / "calibrations" / "rtx4090-pcie4-nvme.json"), "--json", "--context", "8192"]) == 0
    long = json.loads(capsys.readouterr().out)["prediction"]
    cold = long["cold_kv"]
    assert cold["disk_blocks"] > 0 and cold["blocks_not_held"] == 0
    assert cold["bytes_per_step"] == (cold["host_blocks"] + cold["disk_blocks"]) * 80 * 16 * 2 * 8 * 128 * 2
    assert long["link_s"]["disk read"] > data["prediction"]["link_s"]["disk read"] + 0.5 * cold["disk_blocks"] * (
        cold["bytes_per_step"] / (cold["host_blocks"] + cold["disk_blocks"])) / 6.5e9
    assert long["step_s"] > data["prediction"]["step_s"]
