"""Offloading never changes results, and budgets hold.

Every placement (all on one tier, mixed homes), prefetch depth (0, 1, 3) and batch shape
gives the same greedy tokens as the all-resident run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from offload.cli.main import main
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.model import kernels
from offload.model.checkpoint import Checkpoint
from offload.plan import calibrate
from offload.plan.calibrate import compute_dtype
from offload.plan.planner import Planner
from offload.runtime.runner import Runner
from offload.weights.groups import model_layouts
from storage.errors import CapacityError
from tests.conftest import run_config

PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41, 42, 43], [1, 8, 2], [1, 400, 33, 12, 19, 250]]
NEW = 16

# tiny llama (float32): layers 0.72 MB, head 0.26 MB, embed 0.26 MB; kv 8 blocks 0.25 MB, workspace ~0.27 MB
# (an 8-token chunk attending over 32 keys, op by op on a CPU). The gpu tier gets the ring (depth + 1 layers) plus
# 0.85 MiB: room for the KV, the workspace and the head only.
PLACEMENTS = ["all-gpu", "gpu-only-tier", "all-cpu", "all-disk", "mixed"]


def tiers_for(placement: str, layer: int, depth: int, store: Path) -> dict | None:
    ring = (depth + 1) * layer + int(0.85 * 2**20)
    return {
        "all-gpu": None,  # no tiers: the all-resident run
        "gpu-only-tier": {"gpu": {"capacity": "64MiB"}, "cpu": {"capacity": 0}},
        "all-cpu": {"gpu": {"capacity": ring}, "cpu": {"capacity": "64MiB"}},
        "all-disk": {"gpu": {"capacity": ring}, "cpu": {"capacity": 0}, "disk": {"path": str(store)}},
        "mixed": {"gpu": {"capacity": ring + layer}, "cpu": {"capacity": layer + 4096},
                  "disk": {"path": str(store)}},
    }[placement]


def config(model: Path, placement: str, store: Path, depth: int) -> dict:
    layer = model_layouts(Checkpoint(model).config, torch.float32)["layer.0"].nbytes
    return run_config(model, tiers=tiers_for(placement, layer, depth, store), prefetch={"depth": depth},
                      kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 8})


@pytest.fixture(scope="module")
def tiny8(model_factory):
    """The tiny llama with 8 layers, so that every depth leaves layers to stream."""
    return model_factory("llama", overrides={"num_hidden_layers": 8})


@pytest.fixture(scope="module")
def reference(tiny8):
    with Runner.from_config(run_config(tiny8)) as r:
        return [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("store") / "tiny-llama"


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_and_depth_gives_the_resident_tokens(tiny8, store, reference, placement, depth):
    with Runner.from_config(config(tiny8, placement, store, depth)) as r:
        homes = set(r.plan.homes.values())
        if placement.startswith("all-"):
            layer_homes = {r.plan.homes[f"layer.{i}"] for i in range(r.cfg.num_layers)}
            assert layer_homes == {placement.removeprefix("all-")}
        if placement == "mixed":
            assert homes == {"gpu", "cpu", "disk"}
        single = r.generate(PROMPTS[:1], max_new_tokens=NEW, stop_on_eos=False)
        ragged = r.generate(PROMPTS, max_new_tokens=NEW, stop_on_eos=False)
        streamed = r.plan.streamed
    assert single[0].token_ids == reference[0]
    assert [x.token_ids for x in ragged] == reference
    if "disk" in homes:
        assert streamed  # something really came off the disk


def test_bytes_per_step_match_the_plan(tiny8, store):
    with Runner.from_config(config(tiny8, "mixed", store, 1)) as r:
        r.generate(PROMPTS[:1], max_new_tokens=6, stop_on_eos=False)
        passes = r.timeline.step
        per_pass = r.plan.bytes_per_step()["disk->gpu"]
        reads = [s for s in r.timeline.on("disk-read") if "k" in s.args]  # streamed loads only
        for step in range(passes):
            assert sum(s.nbytes for s in reads if s.step == step) == per_pass
        served = r.traffic.served()
    assert served["disk"] == passes * sum(r.plan.sizes[g] for g in r.plan.order
                                          if r.plan.homes[g] == "disk" and g != "embed")


def test_describe_lists_what_each_tier_homes(tiny8, store):
    with Runner.from_config(config(tiny8, "mixed", store, 1)) as r:
        plan = r.plan
        text = plan.describe()
    assert "ring slots" in text
    for tier in ("gpu", "cpu", "disk"):
        [line] = [x for x in text.splitlines() if x.startswith(f"  {tier} ") and " homes " in x]
        homed = [g for g in plan.order if plan.homes[g] == tier]
        assert f"homes {len(homed):>3} groups" in line and homed, (tier, line)


def test_plan_command_reads_no_weights_and_refuses_what_cannot_fit(tmp_path, tiny8, store, capsys):
    import yaml
    cfg = config(tiny8, "mixed", store, 2)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "placement plan" in out and "per forward pass: disk->gpu" in out and "KV cache on the device" in out
    cfg["tiers"]["gpu"]["capacity"] = "1MiB"  # not even the ring fits
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot hold the smallest plan at prefetch depth 2" in err and "tiers.gpu.capacity: " in err
    cfg["tiers"] = {"gpu": {"capacity": "4MiB"}, "cpu": {"capacity": "1MiB"}}  # no disk
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", "--config", str(path)]) == 2
    assert "there is no disk tier; add tiers.disk" in capsys.readouterr().err


def test_convert_command(tmp_path, tiny_llama, capsys):
    assert main(["convert", str(tiny_llama), str(tmp_path / "s"), "--dtype", "float32"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["convert", str(tiny_llama), str(tmp_path / "s"), "--dtype", "float32"]) == 2
    assert "pass --force" in capsys.readouterr().err


def test_run_summary_prints_the_plan_and_what_each_tier_served(tmp_path, tiny8, store, capsys):
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config(tiny8, "mixed", store, 2)))
    assert main(["run", "--config", str(path), "--prompt", "hello", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    err = captured.err  # on stderr: stdout holds the generated text alone
    assert "placement plan" in err and "served per forward pass:" in err and "decode timeline:" in err
    assert "ms/step" in err.splitlines()[-1]  # the speed summary stays the last line
    assert "placement plan" not in captured.out


BUDGET_SCRIPT = textwrap.dedent("""
    import json, sys
    import psutil, torch, zarr, crc32c, tokenizers
    from offload.runtime.runner import Runner
    import offload.weights.tiered, schedulers.prefetch, storage.store
    model, store = sys.argv[1], sys.argv[2]
    base = psutil.Process().memory_info().rss
    cfg = {"model": model, "device": "cpu", "dtype": "bfloat16", "compute_dtype": "bfloat16",
           "tiers": {"gpu": {"capacity": "28MiB"}, "cpu": {"capacity": "16MiB"}, "disk": {"path": store}},
           "kv_cache": {"gpu_blocks": 8}, "prefetch": {"depth": 1}, "activations": {"prefill_chunk": 16}}
    with Runner.from_config(cfg) as r:
        res = r.generate([list(range(1, 17))], max_new_tokens=6, stop_on_eos=False)
        homes = sorted(set(r.plan.homes.values()))
    # VmHWM: this process image's peak RSS (ru_maxrss would include the forking parent's, kept across exec)
    status = open("/proc/self/status").read()
    peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
    print(json.dumps({"base": base, "peak": peak, "tokens": res[0].token_ids, "homes": homes}))
""")
FIXED_OVERHEAD = 64 * 2**20  # interpreter objects, thread stacks, tokenizer, allocator slack, logits
# numba's LLVM runtime and the CPU kernels it loads (offload.model.kernels): a fixed cost whatever the model
# (measured: +56 MiB to import numba, +121 MiB to load and run the cached kernels, in a fresh process)
JIT_OVERHEAD = 128 * 2**20


@pytest.mark.slow
def test_peak_memory_stays_within_the_budget_for_a_model_4x_larger(tmp_path, model_factory):
    """A 204 MiB checkpoint under gpu 28 MiB + cpu 16 MiB: peak RSS growth <= budget + a fixed overhead."""
    model = model_factory("llama", "small", dtype="bfloat16", overrides={"num_hidden_layers": 16})
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    budget = (28 + 16) * 2**20
    assert size >= 4 * budget
    store = tmp_path / "store"
    subprocess.run([sys.executable, "-m", "offload", "convert", str(model), str(store)], check=True,
                   capture_output=True)
    proc = subprocess.run([sys.executable, "-c", BUDGET_SCRIPT, str(model), str(store)], capture_output=True,
                          text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = out["peak"] - out["base"]
    assert out["homes"] == ["cpu", "disk"]
    assert grown <= budget + FIXED_OVERHEAD + JIT_OVERHEAD, (
        f"peak RSS grew {grown / 2**20:.0f} MiB for a {budget / 2**20:.0f} MiB budget")
    with Runner.from_config(run_config(model, dtype="bfloat16", compute_dtype="bfloat16")) as r:  # all-resident
        assert r.generate([list(range(1, 17))], max_new_tokens=6, stop_on_eos=False)[0].token_ids == out["tokens"]


def test_float32_compute_over_bf16_weights_gives_the_float32_runs_tokens(model_factory, tmp_path, monkeypatch):
    """compute_dtype: weights stay bf16 in the store and on the wire and are upcast after the transfer, so the
    tokens are those of the all-float32 run of the same (bf16) checkpoint; `auto` picks float32 only on a CPU
    whose bf16 products are slow, and keeps the dtype on CUDA and for packed weights."""
    model = model_factory("llama", "small", dtype="bfloat16")
    prompts = [[1, 17, 99, 23, 5, 61, 7], [1, 8, 2]]
    with Runner.from_config(run_config(model, dtype="float32")) as r:
        want = [o.token_ids for o in r.generate(prompts, max_new_tokens=10, stop_on_eos=False)]
    layer = model_layouts(Checkpoint(model).config, torch.bfloat16)["layer.0"].nbytes
    cfg = run_config(model, dtype="bfloat16", compute_dtype="float32",
                     tiers=tiers_for("mixed", layer, 1, tmp_path / "store"))
    cfg["tiers"]["gpu"]["capacity"] += 4 * layer  # room for the upcast copy of a layer
    with Runner.from_config(cfg) as r:
        assert r.plan.streamed and r.compute_dtype == torch.float32 and r.kv.dtype == torch.float32
        got = [o.token_ids for o in r.generate(prompts, max_new_tokens=10, stop_on_eos=False)]
        assert r.weights.dtype == torch.bfloat16  # the store (and every transfer) stays bf16
    assert got == want
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(calibrate, "_slow_on_cpu", lambda dt: True)  # (torch's bf16 GEMM on an AVX2 machine)
    assert compute_dtype("auto", torch.bfloat16, cpu, packed=False) == torch.float32
    assert compute_dtype("auto", torch.bfloat16, cuda, packed=False) == torch.bfloat16
    assert compute_dtype("auto", torch.bfloat16, cpu, packed=True) == torch.bfloat16
    # with every `auto` on, such a CPU computes every placement in float32 (streamed and all-resident alike: the
    # same tokens), and keeps bf16 only where a float32 plan could not fit the budget
    auto = {k: v for k, v in cfg.items() if k != "compute_dtype"}
    with Runner.from_config(auto) as r:
        assert r.plan.streamed and r.compute_dtype == torch.float32
        streamed = [o.token_ids for o in r.generate(prompts, max_new_tokens=10, stop_on_eos=False)]
    with Runner.from_config(run_config(model, dtype="bfloat16")) as r:
        assert r.compute_dtype == torch.float32
        assert [o.token_ids for o in r.generate(prompts, max_new_tokens=10, stop_on_eos=False)] == streamed == want
    tight = auto | {"tiers": tiers_for("all-disk", layer, 1, tmp_path / "store"), "prefetch": {"depth": 1}}
    lo, hi = 0, 8 * layer  # the least device budget a bf16-compute plan fits in (a float32 one needs more)
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        tight["tiers"]["gpu"]["capacity"] = mid
        try:
            Planner(OffloadConfig.load(tight | {"compute_dtype": "bfloat16"}), Checkpoint(model).config,
                    torch.bfloat16, torch.device("cpu")).run_plan()
            hi = mid
        except CapacityError:
            lo = mid
    tight["tiers"]["gpu"]["capacity"] = hi
    with Runner.from_config(tight) as r:
        assert r.compute_dtype == torch.bfloat16
    monkeypatch.setattr(calibrate, "_slow_on_cpu", lambda dt: False)
    assert compute_dtype("auto", torch.bfloat16, cpu, packed=False) == torch.bfloat16  # fast bf16: kept
    with pytest.raises(ConfigError, match="compute_dtype: float32 differs from dtype.*compute_dtype: auto"):
        Runner.from_config(run_config(model, dtype="bfloat16", compute_dtype="float32",
                                      weights={"quantization": "int8"}))


def test_auto_compute_dtype_keeps_16_bits_the_kernels_multiply_as_stored_and_times_only_torch(monkeypatch):
    """`compute_dtype: auto` with the row-invariant kernels keeps bf16 and fp16 and times nothing: the kernels
    multiply the weight as stored whatever the activations' dtype, so a timing of the two would be noise, and two
    runs of one config could compute in different dtypes. Without them torch's products are timed, and a bf16 GEMM
    3x slower than float32's (an AVX2 machine's figures) means float32."""
    if not kernels.ROW_INVARIANT:
        pytest.skip("the row-invariant kernels need numba")
    cpu, timed = torch.device("cpu"), []
    real = calibrate._cpu_matmul_s
    monkeypatch.setattr(calibrate, "_cpu_matmul_s",
                        lambda dt: timed.append(dt) or (0.046 if dt == torch.float32 else 0.153))
    calibrate._slow_on_cpu.cache_clear()
    try:
        for dt in (torch.bfloat16, torch.float16):
            assert compute_dtype("auto", dt, cpu, packed=False) == dt
        assert timed == []
        monkeypatch.setattr(kernels, "ROW_INVARIANT", False)
        calibrate._slow_on_cpu.cache_clear()
        assert compute_dtype("auto", torch.bfloat16, cpu, packed=False) == torch.float32
        assert set(timed) == {torch.bfloat16, torch.float32}
        assert real(torch.float32) > 0  # the real timing runs torch's product
    finally:
        calibrate._slow_on_cpu.cache_clear()  # (decided with these figures: not for later tests)
