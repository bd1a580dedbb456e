"""`offload chat --auto` (scripts/run_70b.sh): set up once for this machine, then every start reuses it all."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from offload.cli import auto
from offload.cli.main import main
from offload.fields import parse_size
from offload.model import kernels
from offload.plan import machine, memory
from offload.plan.calibrate import PACKED, Calibration, kernels_id, load_calibration
from offload.runtime.conversation import Conversation
from offload.runtime.engine import Sampling
from offload.runtime.overhead import engine_overhead_s
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
    calls = {"calibrate": 0, "convert": 0, "packed": []}

    def fake_calibrate(device, dtype, disk, engine=None, packed=PACKED, locked=False):  # measuring takes ~20 s
        assert engine is engine_overhead_s  # here; what matters: it runs once, and the engine's step is timed too
        calls["calibrate"] += 1
        calls["packed"].append(tuple(packed))  # the packed formats whose kernels it times
        cal = Calibration.defaults()
        cal.compute |= {f"cpu/{scheme}": cal.compute["cpu"] for scheme in packed}
        cal.meta |= {"kernels": kernels_id(), "machine": machine.identity(), "activations": dict(kernels.ACTIVATIONS)}
        return cal

    real_convert = auto.open_tier_store

    def counting_convert(*a, **kw):  # (a complete store is opened too, to check it: counted where it was built)
        store = real_convert(*a, **kw)
        calls["convert"] += store.built
        return store

    monkeypatch.setattr(auto, "calibrate", fake_calibrate)
    monkeypatch.setattr(auto, "compile_kernels", lambda dtype, packed: True)  # (children compiling: test_precompile)
    monkeypatch.setattr(kernels, "ACTIVATIONS", dict(kernels.ACTIVATIONS))  # (a run sets them for the process)
    monkeypatch.setattr(auto, "open_tier_store", counting_convert)
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
    assert "calibration: measuring" in first.err and calls == {"calibrate": 1, "convert": 1, "packed": [()]}
    assert re.search(r"decode step, batch 1, .* s/token\)", first.err)  # the plan with its prediction
    cfg = yaml.safe_load((disk / "offload.yaml").read_text())
    assert cfg["model"] == str(model) and cfg["tiers"]["disk"]["path"] == "store"
    assert cfg["kv_cache"]["gpu_blocks"] == "auto" and cfg["prefetch"]["depth"] == "auto"
    assert cfg["activations"] == {"prefill_chunk": "auto", "prefill_chunk_max": 256}
    assert "passes of 256 tokens" in first.err  # the cap where it fits

    # the user edits the YAML; the next start reads it as left and sets nothing up again
    (disk / "offload.yaml").write_text((disk / "offload.yaml").read_text().replace("prefill_chunk: auto,",
                                                                                  "prefill_chunk: 64,"))
    second = start(model, disk, monkeypatch, capsys, ["Hello there", "And then?"])
    assert "(reused; edit it" in second.err and "is complete (no conversion)" in second.err
    assert "(reused; no calibration)" in second.err and "converting" not in second.err
    assert calls == {"calibrate": 1, "convert": 1, "packed": [()]}  # (a bf16 run times no packed kernels)
    assert "passes of 64 tokens" in second.err
    assert "[turn 2: " in second.err and "ready in " in second.err

    # the replies are the model's: the first turn as a conversation on the checkpoint, all in memory, gives it
    with Runner.from_config(run_config(model)) as r:
        expected = Conversation(r, Sampling(4, stop_token_ids=frozenset(r.generation.eos_token_ids))).say(
            "Hello there").text
    assert second.out.startswith(expected + "\n") and "this machine" not in second.out  # the replies alone


def start_packed(model, disk, fmt, monkeypatch, capsys, lines=("Hello there",)):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", "--auto", str(model), "--disk", str(disk), "--weights", fmt, "--max-new-tokens", "4"]) == 0
    return capsys.readouterr()


def test_a_start_compiles_the_kernels_its_run_computes_with_before_it_calibrates(setup, monkeypatch, capsys):
    """Every start hands the kernels of its dtype and packed format to `compile_kernels` (child processes, where
    numba's cache lacks them) before its calibration times them and its run calls them."""
    model, disk, calls = setup
    order, fake_calibrate = [], auto.calibrate
    monkeypatch.setattr(auto, "compile_kernels", lambda dtype, packed: order.append((dtype, tuple(packed))) or True)
    monkeypatch.setattr(auto, "calibrate", lambda *a, **kw: order.append("calibrate") or fake_calibrate(*a, **kw))
    start_packed(model, disk, "int4", monkeypatch, capsys)
    start_packed(model, disk, "int4", monkeypatch, capsys)  # (a later start too: a new install's kernels)
    assert order == [(torch.float32, ("int4",)), "calibrate", (torch.float32, ("int4",))]


def test_a_calibration_of_older_kernels_another_machine_or_a_broken_one_is_measured_again(setup, monkeypatch, capsys):
    """The plan's compute times come from the kernels' measured speed: one measured with another version of the
    kernels, on another machine, or a file that is not a calibration is measured again, not trusted."""
    model, disk, calls = setup
    start(model, disk, monkeypatch, capsys)
    path = disk / "calibration.json"
    data = json.loads(path.read_text())
    data["kernels"] = "1-invariant"
    path.write_text(json.dumps(data))
    second = start(model, disk, monkeypatch, capsys)
    assert "(it measured older CPU kernels)" in second.err and calls["calibrate"] == 2
    path.write_text("{not json")
    third = start(model, disk, monkeypatch, capsys)
    assert "(it was not a calibration file)" in third.err and calls["calibrate"] == 3
    assert not Calibration.load(path).stale  # measured again, by these kernels
    fourth = start(model, disk, monkeypatch, capsys)
    assert "(reused; no calibration)" in fourth.err and calls["calibrate"] == 3
    data = json.loads(path.read_text())  # a file measured on another machine (a cache dir shared between hosts)
    data["machine"] |= {"features": ["avx2", "fma"] if "avx512f" in data["machine"]["features"] else ["avx512f"]}
    path.write_text(json.dumps(data))
    fifth = start(model, disk, monkeypatch, capsys)
    assert "(it measured another machine: a CPU with [" in fifth.err and calls["calibrate"] == 4
    assert Calibration.load(path).other_machine is None  # this one's now


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_auto_with_packed_weights_converts_plans_and_chats_packed_then_reuses_the_store(setup, monkeypatch,
                                                                                         capsys, fmt):
    model, disk, calls = setup
    first = start_packed(model, disk, fmt, monkeypatch, capsys)
    group = auto.packed(str(model), fmt).group_size  # the tiny model's 344-wide `down` is not a multiple of 64
    assert group == 8
    assert yaml.safe_load((disk / "offload.yaml").read_text())["weights"] == {"quantization": fmt, "group_size": group}
    manifest = json.loads((disk / "store" / "manifest.json").read_text())
    assert manifest["meta"]["weights"]["quantization"] == fmt  # converted packed, not in the checkpoint's dtype
    assert any(s.startswith(fmt) for s in manifest["meta"]["weights"]["tensors"].values())
    assert f"stored {fmt} g{group}" in first.err  # the plan counts packed bytes (the setup account: stderr)
    assert calls["convert"] == 1

    second = start_packed(model, disk, fmt, monkeypatch, capsys)
    assert "is complete (no conversion)" in second.err and calls["convert"] == 1
    assert calls["packed"] == [(fmt,)] and "(reused; no calibration)" in second.err  # its own format's kernels

    # a calibration without this format's kernels (another run's, say) is measured again, keeping the formats it had
    path, other = disk / "calibration.json", {"int8": "int4", "int4": "int8"}[fmt]
    data = json.loads(path.read_text())
    data["compute"][f"cpu/{other}"] = data["compute"].pop(f"cpu/{fmt}")
    path.write_text(json.dumps(data))
    third = start_packed(model, disk, fmt, monkeypatch, capsys)
    assert f"(it did not measure the {fmt} kernels)" in third.err
    assert calls["packed"][1] == tuple(s for s in PACKED if s in (fmt, other))

    # this setup's own store written by an earlier Offload in a scheme this one does not read (its manifest says so)
    # is converted again, not read as it is
    manifest["meta"]["weights"]["tensors"] = {t: v if v == "dense" else v + "-v0"
                                              for t, v in manifest["meta"]["weights"]["tensors"].items()}
    (disk / "store" / "manifest.json").write_text(json.dumps(manifest))
    fourth = start_packed(model, disk, fmt, monkeypatch, capsys)
    assert "another scheme or byte order" in fourth.err and "converting it again" in fourth.err
    after = json.loads((disk / "store" / "manifest.json").read_text())["meta"]["weights"]["tensors"]
    assert after["qkv"] == f"{fmt}-g{group}-asym-rtn" + ("-quads" if fmt == "int8" else "")  # written anew

    # the reply is the packed model's: the same conversation on an all-in-memory run of the same format
    config = run_config(model, dtype="auto", weights={"quantization": fmt, "group_size": group})
    with Runner.from_config(config) as r:
        expected = Conversation(r, Sampling(4, stop_token_ids=frozenset(r.generation.eos_token_ids))).say(
            "Hello there").text
    assert first.out == expected + "\n" and second.out == expected + "\n"  # stdout holds the reply alone
    assert fourth.out == expected + "\n"


def test_a_calibration_of_packed_kernels_in_other_activation_steps_is_measured_again(setup, monkeypatch, capsys):
    """`weights.int8_activations` / `int4_activations` choose the packed kernels' steps (int8 and int16 steps differ
    1.2-1.5x past one row; `auto` is int8 steps where the CPU has AVX-512 VNNI, int16 elsewhere): a calibration timed
    in the other steps is measured again, in the run's, then reused."""
    model, disk, calls = setup
    here = kernels.activation_steps("auto", 8)
    other = "int16" if here == "int8" else "int8"
    start_packed(model, disk, "int8", monkeypatch, capsys)
    path, yaml_path = disk / "calibration.json", disk / "offload.yaml"
    assert json.loads(path.read_text())["activations"]["int8"] == here and calls["calibrate"] == 1
    config = yaml.safe_load(yaml_path.read_text())
    config["weights"]["int4_activations"] = other  # (a format this run does not compute with: not a reason)
    yaml_path.write_text(yaml.safe_dump(config))
    assert "(reused; no calibration)" in start_packed(model, disk, "int8", monkeypatch, capsys).err
    config["weights"]["int8_activations"] = other
    yaml_path.write_text(yaml.safe_dump(config))
    again = start_packed(model, disk, "int8", monkeypatch, capsys)
    assert "(it measured the int8 kernels in other activation steps)" in again.err and calls["calibrate"] == 2
    assert json.loads(path.read_text())["activations"] == {"int4": other, "int8": other}
    assert "(reused; no calibration)" in start_packed(model, disk, "int8", monkeypatch, capsys).err


def test_two_starts_at_once_measure_the_machine_once(tmp_path, monkeypatch, capsys):
    """The second of two setups starting together waits for the first's calibration and reuses it."""
    measured = []

    def slow_calibrate(device, dtype, disk, engine=None, packed=PACKED, locked=False):
        measured.append(packed)
        time.sleep(0.5)  # (long enough for the other start to find the lock held)
        cal = Calibration.defaults()
        cal.meta |= {"kernels": kernels_id(), "machine": machine.identity(), "activations": dict(kernels.ACTIVATIONS)}
        return cal

    monkeypatch.setattr(auto, "calibrate", slow_calibrate)
    path = tmp_path / "calibration.json"
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: auto._ensure_calibration(path, (), torch.device("cpu"), torch.float32, tmp_path),
                      range(2)))
    out = capsys.readouterr().out
    assert len(measured) == 1 and Calibration.load(path).meta["kernels"] == kernels_id()
    # (who: "pid N (calibrating since ...)", or "another process" where the second looked before the first announced)
    assert "calibration: waiting for " in out and "(measured by the process it waited for; no calibration)" in out


def measured(rate: float, busy: float) -> Calibration:
    """A calibration of this machine and these kernels whose layers went at `rate`, other work keeping `busy` of the
    CPUs meanwhile."""
    cal = Calibration.defaults()
    cal.compute["cpu"]["weight_bytes_per_s"] = [rate] * len(cal.compute["cpu"]["tokens"])
    cal.meta |= {"kernels": kernels_id(), "machine": machine.identity(), "activations": dict(kernels.ACTIVATIONS),
                 "others_busy": busy}
    return cal


def test_two_setups_starting_at_once_take_turns_measuring(tmp_path, monkeypatch, capsys):
    """Two first starts with separate --disk directories measured at once, each timing the other's load (2 cores:
    a step of 8 ms planned at 20-23 ms by both); every calibration of the machine takes one lock now: the second
    waits, then measures its own file."""
    spans = []

    def slow_calibrate(device, dtype, disk, engine=None, packed=PACKED, locked=False):
        t0 = time.monotonic()
        time.sleep(0.4)
        spans.append((t0, time.monotonic()))
        return measured(10e9, 0.0)

    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(auto, "calibrate", slow_calibrate)
    paths = [tmp_path / f"disk{i}" / "calibration.json" for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: auto._ensure_calibration(p, (), torch.device("cpu"), torch.float32, p.parent), paths))
    (a0, a1), (b0, b1) = sorted(spans)
    assert len(spans) == 2 and a1 <= b0 and all(Calibration.load(p).meta["kernels"] == kernels_id() for p in paths)
    assert "calibration: waiting for " in capsys.readouterr().out


def test_a_calibration_slowed_by_other_work_is_measured_again_keeping_the_faster_tables(tmp_path, monkeypatch,
                                                                                        capsys, caplog):
    """Measured while other work kept more than BUSY of the CPUs busy: the next start measures again and keeps the
    faster of each table, up to BUSY_ROUNDS measurements; then the file stands, and a run reading it is warned."""
    path, rounds = tmp_path / "calibration.json", [(10e9, 0.5), (5e9, 0.6), (20e9, 0.0)]
    monkeypatch.setattr(auto, "calibrate", lambda *a, **k: measured(*rounds.pop(0)))

    def start() -> str:
        auto._ensure_calibration(path, (), torch.device("cpu"), torch.float32, tmp_path)
        return capsys.readouterr().out

    def rate() -> float:
        return Calibration.load(path).compute["cpu"]["weight_bytes_per_s"][0]

    assert "once" in start() and rate() == 10e9
    assert "(other work kept 50% of the CPUs busy while it measured)" in start() and rate() == 10e9  # (kept)
    assert "(other work kept 60% of the CPUs busy while it measured)" in start() and rate() == 20e9
    assert "(reused; no calibration)" in start() and not rounds
    assert Calibration.load(path).meta["rounds"] == 3 and Calibration.load(path).busy == 0.0
    rounds[:] = [(10e9, 0.7), (9e9, 0.5), (8e9, 0.4)]  # busy every time: BUSY_ROUNDS measurements, then it stands
    path.unlink()
    for _ in range(4):
        start()
    assert not rounds and rate() == 10e9 and "(reused; no calibration)" in (start())
    with caplog.at_level(logging.WARNING):
        load_calibration(path)
    assert [r for r in caplog.records if "was measured while other work kept 40% of the CPUs busy" in r.message]


def test_a_calibration_that_leaves_the_process_holding_memory_starts_the_command_again(tmp_path, monkeypatch):
    """A first start's calibration compiles the CPU kernels, and numba keeps ~550 MiB of what it compiled for the
    process's life: the command starts again in its place (`signals.restart`) where a calibration left the process
    holding RESTART_HELD or more; not where it held less, nor where the calibration was reused, nor where what it
    holds is under RESTART_SHARE of the memory the process may fill (a 24 GiB machine started again for 180 MiB)."""
    restarts, kept = [], []

    def calibrate(device, dtype, disk, engine=None, packed=PACKED, locked=False, hold=0):
        kept.append(b"\x01" * hold)  # written, so resident: what the compiled kernels are to the process
        cal = Calibration.defaults()
        cal.meta |= {"kernels": kernels_id(), "machine": machine.identity(), "activations": dict(kernels.ACTIVATIONS)}
        return cal

    monkeypatch.setattr(auto.signals, "restart", restarts.append)
    path, gib = tmp_path / "calibration.json", 2**30
    # (hold, reuse the file, RAM the process may fill after it, restarts so far): where RAM is plenty, that room
    # changes no plan (RESTART_SHARE)
    cases = [(0, False, gib, 0), (auto.RESTART_HELD + (16 << 20), False, gib, 1), (auto.RESTART_HELD * 2, True, gib, 1),
             (auto.RESTART_HELD * 2, False, 20 * gib, 1)]
    for hold, reuse, room, want in cases:
        if not reuse:
            path.unlink(missing_ok=True)
        monkeypatch.setattr(auto, "calibrate", lambda *a, hold=hold, **k: calibrate(*a, hold=hold, **k))
        monkeypatch.setattr(auto, "ram_available", lambda room=room: room)
        auto._ensure_calibration(path, (), torch.device("cpu"), torch.float32, tmp_path)
        assert len(restarts) == want, (hold, reuse, room)
    assert len(kept) == 3 and "numba compiled or loaded, which it keeps" in restarts[0]


def test_a_first_start_short_of_the_memory_its_compiling_holds_is_told_before_it_compiles(tmp_path, monkeypatch,
                                                                                          capsys):
    """A fresh install's first start compiles the CPU kernels while it calibrates (~650 MiB held with the packed
    ones, ~300 without): where the process may fill less than that and 128 MiB, it says so first (a start in 700 MiB
    was stopped for memory after minutes, saying nothing); not once the kernels are compiled, nor with room."""
    def calibrate(device, dtype, disk, engine=None, packed=PACKED, locked=False):
        cal = Calibration.defaults()
        cal.meta |= {"kernels": kernels_id(), "machine": machine.identity(), "activations": dict(kernels.ACTIVATIONS)}
        return cal

    monkeypatch.setattr(auto, "calibrate", calibrate)
    path, mib = tmp_path / "calibration.json", 2**20
    for compiled, room, packed, told in [(False, 600 * mib, ("int4",), True), (False, 900 * mib, ("int4",), False),
                                         (True, 300 * mib, ("int4",), False), (False, 400 * mib, (), True),
                                         (False, 600 * mib, (), False)]:
        path.unlink(missing_ok=True)
        monkeypatch.setattr(auto.fused, "layers_compiled", lambda packed=None, dtype=None, compiled=compiled: compiled)
        monkeypatch.setattr(auto, "ram_available", lambda room=room: room)
        auto._ensure_calibration(path, packed, torch.device("cpu"), torch.float32, tmp_path)
        out = capsys.readouterr().out
        assert ("kernels are not compiled yet" in out) == told, (compiled, room, packed)
        assert not told or "give this one start more" in out


def test_auto_weights_other_than_the_kept_yaml_are_refused(setup, monkeypatch, capsys):
    model, disk, calls = setup
    start(model, disk, monkeypatch, capsys)
    assert main(["chat", "--auto", str(model), "--disk", str(disk), "--weights", "int4"]) == 2
    assert "weights.quantization: none" in capsys.readouterr().err and calls["convert"] == 1


def test_auto_refuses_a_store_directory_holding_other_files_before_converting(setup, monkeypatch, capsys):
    model, disk, calls = setup
    (disk / "store").mkdir(parents=True)
    (disk / "store" / "notes.txt").write_text("mine")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--auto", str(model), "--disk", str(disk), "--max-new-tokens", "4"]) == 2
    out = capsys.readouterr()
    assert f"tiers.disk.path {disk / 'store'} is a non-empty directory that is not an Offload store" in out.err
    assert "converting" not in out.out + out.err and calls["convert"] == 0
    assert [p.name for p in (disk / "store").iterdir()] == ["notes.txt"]


def test_run_70b_script_shows_its_usage():
    proc = subprocess.run([str(ROOT / "scripts" / "run_70b.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "MODEL_OR_PATH" in proc.stdout


def test_a_machine_too_small_for_the_smallest_plan_is_told_before_anything_is_converted(setup, monkeypatch, capsys):
    """A first start on a machine whose free RAM cannot hold even the smallest plan (a 300 MiB container) is refused
    before the conversion and the calibration (minutes on a large model), naming the RAM that would do."""
    model, disk, calls = setup
    monkeypatch.setattr(memory, "ram_available", lambda: 256 * 2**10)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n"))
    assert main(["chat", "--auto", str(model), "--disk", str(disk), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert calls == {"calibrate": 0, "convert": 0, "packed": []} and "converting" not in err
    need = re.search(r"any one of these fits: (\d+(?:\.\d+)?[KMG]iB) of free RAM \(this process has 0\.2 MiB", err)
    assert need, err
    # the RAM it names is enough: with it the same start converts, plans and chats, on a fresh install too (the
    # check before converting counts the RAM a first run keeps for compiling, which the calibration's restart frees)
    monkeypatch.setattr(memory, "ram_available", lambda: parse_size(need[1]))
    monkeypatch.setattr(memory.fused, "layers_compiled", lambda packed=None, dtype=None: False)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n"))
    assert main(["chat", "--auto", str(model), "--disk", str(disk), "--max-new-tokens", "2"]) == 0
    assert calls["convert"] == 1 and "passes of 16 tokens" in capsys.readouterr().err
