"""A fresh install's CPU kernels compile in child processes, a stage each (`offload.runtime.precompile`), so that the
process that calibrates and runs keeps none of numba's compiler memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml

from offload.cli import prepare
from offload.cli.main import main
from offload.config import OffloadConfig
from offload.model import fused
from offload.plan import memory
from offload.runtime import precompile
from offload.runtime.runner import Runner
from storage.lock import FileLock
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(fused.layers_compiled() is None, reason="needs numba's kernel cache")


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):  # (the lock file of `compile_kernels` lives there)
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path))


def children(monkeypatch, returncode: int = 0, stderr: str = "", fails: str = "dense", cores: int = 1,
             room: int = 2**40, events: list | None = None) -> list[list[str]]:
    """The argv of every child `compile_kernels` starts, none started for real (the `fails` stage's child ends with
    `returncode`, writing `stderr`), on a machine with `cores` cores and `room` bytes this process may fill (one
    core: one child at a time, in order); events: ("start" / "poll" / "kill", stage) as they come."""
    calls: list[list[str]] = []
    events = [] if events is None else events
    message = stderr

    class Child:
        def __init__(self, argv, stderr, **_):
            calls.append(list(argv))
            self.stage, self.returncode = argv[3], None
            events.append(("start", self.stage))
            if self.stage == fails:
                stderr.write(message)

        def poll(self):
            events.append(("poll", self.stage))
            self.returncode = returncode if self.stage == fails else 0
            return self.returncode

        def kill(self):
            events.append(("kill", self.stage))

        def wait(self, timeout=None):
            return self.poll()

    monkeypatch.setattr(precompile.subprocess, "Popen", Child)
    monkeypatch.setattr(precompile, "cpus", lambda: cores)
    monkeypatch.setattr(precompile, "ram_available", lambda: room)
    return calls


@pytest.mark.parametrize("dense, packed_done, packed, stages", [
    (False, False, ("int4",), ["dense", "products", "packed"]),
    (True, False, ("int8",), ["products", "packed"]),
    (False, False, (), ["dense"]),  # a dense run compiles no packed kernel
    (True, True, ("int4",), []),
    (None, None, ("int4",), []),  # numba absent, or a cache it cannot read: the run compiles as before
])
def test_what_the_cache_lacks_compiles_in_children_stage_by_stage(monkeypatch, dense, packed_done, packed, stages):
    monkeypatch.setattr(fused, "layers_compiled", lambda p=None, dtype=None: packed_done if p else dense)
    calls, said = children(monkeypatch), []
    assert precompile.compile_kernels(torch.bfloat16, packed, said.append)
    assert [argv[3] for argv in calls] == stages
    for argv in calls:
        assert argv[:3] == [sys.executable, "-m", "offload.runtime.precompile"]
        assert argv[4:] == ["bfloat16", *packed[:1]]
    assert len(said) == (1 + len(stages) if stages else 0)
    assert not stages or "not compiled yet" in said[0] and all("compiled in" in s for s in said[1:])



def test_the_stages_look_for_the_layer_of_the_runs_dtype(monkeypatch):
    """Each activation dtype has its own compiled layer and products: a fresh install whose first run was in bf16
    compiles a float32 run's kernels in child processes too, not in that run (where its plan keeps no room for it).
    The layer's first argument says the dtype (its rows' raw bits: uint16 bf16, uint32 float32), uint8 arrays that
    it multiplies packed codes."""
    row = "Array({}, 2, 'C', False, aligned=True)"
    signatures = {"bf16 dense": f"({row.format('uint16')}, {row.format('uint16')}, {row.format('uint16')})",
                  "float32 packed": f"({row.format('uint32')}, {row.format('uint32')}, {row.format('uint8')})"}
    index: dict = {}
    monkeypatch.setattr(fused._layer._cache._cache_file, "_load_index", lambda: index)
    assert precompile.stages_needed(True, torch.bfloat16) == ["dense", "products", "packed"]  # a fresh install
    index[(signatures["bf16 dense"], "cpu")] = 0
    assert precompile.stages_needed(True, torch.bfloat16) == ["products", "packed"]
    assert precompile.stages_needed(False, torch.bfloat16) == []
    assert precompile.stages_needed(False, torch.float32) == ["dense"]  # (they looked at any dtype's layer)
    assert precompile.stages_needed(True, torch.float32) == ["dense", "products", "packed"]
    index[(signatures["float32 packed"], "cpu")] = 1
    assert precompile.stages_needed(True, torch.float32) == ["dense"]
    assert precompile.stages_needed(True) == [] and fused.layers_compiled(True, torch.bfloat16) is False


@pytest.mark.parametrize("returncode, stderr, why", [
    (-9, "", "signal 9, for memory?"),
    (1, "Traceback (most recent call last):\nValueError: no such thing", "ValueError: no such thing"),
])
def test_a_child_that_fails_is_said_and_the_run_compiles_the_rest(monkeypatch, returncode, stderr, why):
    monkeypatch.setattr(fused, "layers_compiled", lambda p=None, dtype=None: False)
    calls, said = children(monkeypatch, returncode, stderr), []
    assert not precompile.compile_kernels(torch.bfloat16, ("int4",), said.append)
    assert [argv[3] for argv in calls] == ["dense"]  # the stages after a failed one are not started
    assert why in said[-1] and "this process compiles what is left" in said[-1]
    assert ("give this one start about 1 GiB" in said[-1]) == (returncode == -9)
    # started beside it, the packed products finish; the packed layers (which link both) are not started
    for fails in ("dense", "products"):
        calls, said = children(monkeypatch, returncode, stderr, fails=fails, cores=2), []
        assert not precompile.compile_kernels(torch.bfloat16, ("int4",), said.append)
        assert sorted(argv[3] for argv in calls) == ["dense", "products"]
        assert f"compiling {precompile.STAGES[fails]} in a child process failed (" in said[-1] and why in said[-1]


@pytest.mark.parametrize("cores, room, together", [
    (2, 1700 * 2**20, True),
    (1, 64 * 2**30, False),  # numba compiles on one core: two children would take turns on it
    (2, 1500 * 2**20, False),  # not room for two children's peaks (`STAGE_PEAK`): one after the other
])
def test_the_dense_layers_and_packed_products_compile_at_once_where_cores_and_ram_allow(monkeypatch, cores, room,
                                                                                        together):
    """The dense layers and the packed products link none of each other's code: their children run at the same time
    where this process may use two cores and fill two children's peaks; the packed layers, which link both, after
    them. Each stage is said once, compiled."""
    monkeypatch.setattr(fused, "layers_compiled", lambda p=None, dtype=None: False)
    events, said = [], []
    children(monkeypatch, cores=cores, room=room, events=events)
    assert precompile.compile_kernels(torch.bfloat16, ("int4",), said.append)
    starts = [stage for what, stage in events if what == "start"]
    assert starts == ["dense", "products", "packed"]
    # at once: both started before either is looked at; else the products start after the dense layers ended
    assert (events.index(("start", "products")) < events.index(("poll", "dense"))) == together
    assert events.index(("poll", "products")) < events.index(("start", "packed"))
    assert ("the first two at once" in said[0]) == together and ("one after another" in said[0]) != together
    assert sorted(s.split(" compiled in ")[0] for s in said[1:]) == sorted(f"kernels: {v}"
                                                                          for v in precompile.STAGES.values())
    assert precompile.rounds(["products", "packed"], 2, 2**40) == [["products"], ["packed"]]  # dense compiled


def test_a_stopped_start_kills_the_children_compiling_at_once(monkeypatch):
    """Ctrl-C or SIGTERM (an exception in this process) while two children compile: both are killed with it, not left
    compiling for minutes while the command waits for them."""
    monkeypatch.setattr(fused, "layers_compiled", lambda p=None, dtype=None: False)
    events = []
    children(monkeypatch, cores=2, events=events)
    monkeypatch.setattr(precompile.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt()))
    Child = precompile.subprocess.Popen
    monkeypatch.setattr(Child, "poll", lambda self: events.append(("poll", self.stage)))  # (still compiling)
    with pytest.raises(KeyboardInterrupt):
        precompile.compile_kernels(torch.bfloat16, ("int4",), lambda _: None)
    assert [e for e in events if e[0] != "poll"] == [("start", "dense"), ("start", "products"), ("kill", "dense"),
                                                     ("kill", "products")]


def test_each_stage_runs_the_kernels_it_names():
    """The stages' own work (here in this process, whose kernels earlier tests compiled), and one as the child it is
    started as; a stage it does not know is refused with the ones it does."""
    for stage in ("dense", "products", "packed"):
        precompile.run_stage(stage, "float32", "int8")
    assert fused.layers_compiled(False) and fused.layers_compiled(True)
    child = subprocess.run([sys.executable, "-m", "offload.runtime.precompile", "products", "float32"],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr
    bad = subprocess.run([sys.executable, "-m", "offload.runtime.precompile", "all", "float32"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "stage must be one of dense, products, packed, not 'all'" in bad.stderr


def test_processes_starting_at_once_take_turns_and_the_next_finds_the_kernels_compiled(monkeypatch, tmp_path):
    """Two fresh starts at once: the second waits for the first's lock (and says whose), then finds the kernels in
    numba's cache and starts no child of its own."""
    compiled = {"now": False}
    monkeypatch.setattr(fused, "layers_compiled", lambda p=None, dtype=None: compiled["now"])
    calls, said = children(monkeypatch), []
    first = FileLock(tmp_path / ".kernels.lock")
    first.exclusive()
    first.announce("compiling the CPU kernels")
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(precompile.compile_kernels, torch.float32, ("int8",), said.append)
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.01)
        assert said and f"waiting for pid {os.getpid()} (compiling the CPU kernels since" in said[0]
        assert not second.done()
        compiled["now"] = True  # what the first process compiled
        first.close()
        assert second.result(timeout=30)
    assert calls == [] and len(said) == 1


@pytest.mark.parametrize("weights, packed", [({}, ()), ({"quantization": "int8", "group_size": 8}, ("int8",))])
def test_a_cli_run_from_a_yaml_compiles_first_what_it_computes_with(tiny_llama, tmp_path, monkeypatch, capsys,
                                                                   weights, packed):
    """`offload run` (as `serve` and `chat --config`) hands the kernels of its dtype and packed format to
    `compile_kernels` before the runner starts; what it says goes to stderr (stdout is the run's output)."""
    seen = []

    def compile_kernels(dtype, formats, say):
        seen.append((dtype, tuple(formats)))
        say("kernels: compiled")
        return True

    monkeypatch.setattr(prepare, "compile_kernels", compile_kernels)
    started, real_init = [], Runner.__init__  # (how many compiles came before the runner started)
    monkeypatch.setattr(Runner, "__init__", lambda *a, **kw: started.append(len(seen)) or real_init(*a, **kw))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run_config(tiny_llama, weights=weights)))
    assert main(["run", "--config", str(cfg), "--prompt-ids", "1,5,6", "--max-new-tokens", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert seen == [(torch.float32, packed)] and started == [1]  # compiled before the runner
    assert "kernels: compiled" in out.err and "kernels" not in out.out



def test_a_command_plans_its_run_as_compiled_in_children_and_keeps_the_reserve_where_one_failed(
        tiny_llama, tmp_path, monkeypatch, capsys):
    """A command's run compiles a fresh install's kernels in child processes before its runner plans
    (`prepare.before_run`): its auto tiers, and the conversion's plan before them, keep no room for compiling in the
    process, and `offload plan` plans so (saying the first run compiles them first; a fresh install's plan had
    streamed 7 of SmolLM2 int4's 32 groups in 1 GiB that the run holds in RAM). Where a child failed the run compiles
    the rest itself and keeps the room, as a Runner made in Python does."""
    mib, cpu = 2**20, torch.device("cpu")
    monkeypatch.setattr(memory, "ram_available", lambda: 2000 * mib)
    monkeypatch.setattr(fused, "layers_compiled", lambda packed=None, dtype=None: False)
    monkeypatch.setattr(memory, "_told", set())
    tiers, weights = {"gpu": {"capacity": "auto"}}, {"quantization": "int8", "group_size": 8}
    config = OffloadConfig.load(run_config(tiny_llama, tiers=tiers, weights=weights))

    def room() -> int:
        return memory.run_capacities(config, cpu, tell=False).gpu

    assert room() == int((2000 - 650) * mib * 0.8)  # a Runner made in Python compiles in its own process
    for compiled, held in ((True, 0), (False, 650)):
        monkeypatch.setattr(prepare, "compile_kernels", lambda dtype, formats, say, ok=compiled: ok)
        prepare.before_run(config)
        assert room() == int((2000 - held) * mib * 0.8), compiled
    memory.compile_apart(False)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(run_config(tiny_llama, tiers=tiers, weights=weights)))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert "not compiled yet: the first run compiles them in child processes" in out.err
    assert json.loads(out.out)["device"] == "cpu" and room() == int(2000 * mib * 0.8)
    monkeypatch.setattr(fused, "layers_compiled", lambda packed=None, dtype=None: True)  # compiled: nothing to say
    assert main(["plan", "--config", str(path)]) == 0
    assert "kernels" not in capsys.readouterr().err



def test_a_store_of_another_dtype_is_refused_before_the_kernels_compile(tiny_llama, tmp_path, monkeypatch, capsys):
    """A YAML whose complete store holds another dtype (or format, or checkpoint) is told so at once, as the runner
    would tell it, not after a fresh install's kernels compiled for minutes (a float32 run on a bfloat16 store of
    SmolLM2 int4: refused after 135 s of compiling)."""
    compiled = []
    monkeypatch.setattr(prepare, "compile_kernels", lambda dtype, formats, say: compiled.append(dtype) or True)
    store = tmp_path / "store"
    tiers = {"gpu": {"capacity": "auto"}, "disk": {"path": str(store)}}
    for dtype, rc in (("float32", 0), ("bfloat16", 2)):
        path = tmp_path / f"{dtype}.yaml"
        path.write_text(yaml.safe_dump(run_config(tiny_llama, tiers=tiers) | {"dtype": dtype}))
        assert main(["run", "--config", str(path), "--prompt-ids", "1,5,6", "--max-new-tokens", "2"]) == rc
    err = capsys.readouterr().err
    assert compiled == [torch.float32]  # the first run's; the second compiled nothing
    assert f"{store} holds float32 weights but the run asks for bfloat16" in err


def test_a_cache_directory_it_cannot_make_a_lock_in_compiles_unlocked(monkeypatch):
    """Where no lock file can be made (a read-only cache directory: `FileLock` goes without), it compiles all the
    same, with nothing to announce."""
    class NoFile(FileLock):
        def __init__(self, path):
            super().__init__(path)
            self.close()
            self.fd = -1  # as FileLock leaves it where it can make no lock file

    monkeypatch.setattr(precompile, "FileLock", NoFile)
    monkeypatch.setattr(fused, "layers_compiled", lambda p=None, dtype=None: False)
    calls = children(monkeypatch)
    assert precompile.compile_kernels(torch.float32, (), lambda line: None)
    assert [argv[3] for argv in calls] == ["dense"]
