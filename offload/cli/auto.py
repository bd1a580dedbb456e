"""`offload chat --auto MODEL_OR_PATH [--disk DIR] [--weights int8|int4]`: from a model to a chat in one command.

The first start looks at this machine (the GPU's free memory, the RAM, the disk and its free
space), writes an editable YAML next to the store, converts the checkpoint into the store
(with progress), calibrates the machine, prints the plan with its predicted seconds per
token and what would help, then opens the chat. Every later start reuses all of it and says
so: the YAML is read as the user left it, a complete store is not converted again, a saved
calibration is not measured again. `scripts/run_70b.sh` is this command. With `--weights int8|int4`
the YAML says `weights: {quantization: ...}`, and the store is converted, planned and read packed.

    DIR/offload.yaml        the run's configuration (written once, never overwritten)
    DIR/store/              the zarr store of the weights (the disk tier)
    DIR/calibration.json    this machine's links and kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from offload.cli import signals
from offload.cli.plan import show_plan
from offload.cli.prepare import store_to_fill
from offload.config import DiskTierConfig, OffloadConfig, cache_dir, format_size
from offload.errors import CheckpointError, ConfigError, StaleStoreError
from offload.model import compressed, fused, hub, kernels
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig, quant_method
from offload.model.generic import resolve_impl
from offload.plan.calibrate import BUSY, BUSY_ROUNDS, Calibration, CalibrationError, calibrate
from offload.plan.machine import calibration_lock
from offload.plan.memory import PACKED, packed_kernels, ram_available
from offload.plan.planner import Planner, resolve_capacities
from offload.runtime.device import resolve_dtype
from offload.runtime.overhead import engine_overhead_s
from offload.runtime.precompile import compile_kernels
from offload.weights import gptq
from offload.weights.convert import convert, open_tier_store
from offload.weights.groups import WeightFormat, kept_group
from storage.store import StoreState

WEIGHT_SCHEMES = ("int8", "int4")
BUSIER = "other work kept"  # (`why_measure`'s reason where other work slowed the last measurement)


@dataclass(frozen=True)
class Machine:
    """What this machine has free right now."""

    device: str  # "cuda" or "cpu"
    gpu_name: str | None
    gpu_free: int | None  # bytes free on the GPU (None: no GPU)
    ram_available: int
    disk: Path
    disk_free: int

    @classmethod
    def detect(cls, disk: Path) -> Machine:
        gpu_name = gpu_free = None
        if torch.cuda.is_available():
            gpu_free = torch.cuda.mem_get_info()[0]
            gpu_name = torch.cuda.get_device_name()
        probe = disk
        while not probe.exists():
            probe = probe.parent
        return cls("cuda" if gpu_free is not None else "cpu", gpu_name, gpu_free,
                   ram_available(), disk, shutil.disk_usage(probe).free)

    def describe(self) -> str:
        gpu = f"{self.gpu_name} with {format_size(self.gpu_free)} free" if self.gpu_free is not None else \
            "none (the model runs on the CPU)"
        return (f"GPU: {gpu}; RAM: {format_size(self.ram_available)} available; disk: {self.disk} with "
                f"{format_size(self.disk_free)} free")


def config_yaml(model: str, m: Machine, weights: WeightFormat | None) -> str:
    """The editable configuration for this machine; `auto` wherever the planner fits it at each start."""
    if m.device == "cuda":
        memory = ("  gpu:  {capacity: auto}          # free GPU memory at start (x0.9): homes, ring, KV, workspace\n"
                  "  cpu:  {capacity: auto}          # available RAM at start (x0.8): pinned homes of layers\n")
    else:  # a CPU device: the two tiers are one RAM, sized at each start (numbers fixed at the first start refused
        # the next one in a 600 MiB cgroup, the store and calibration it had made taking part of the room)
        memory = ("  gpu:  {capacity: auto}          # CPU run: RAM this process may fill at start (x0.8), the layers\n"
                  "  cpu:  {capacity: auto}          # homed there computed in place; the rest streamed from disk\n")
    lines = [
        f"# Written by `offload chat --auto` on {time.strftime('%Y-%m-%d %H:%M')} for {model}.",
        "# Edit freely: later starts read this file and never overwrite it.",
        f"# This machine then: {m.describe()}.",
        f"model: {model}",
        f"device: {m.device}",
        "dtype: auto                       # the checkpoint's own (bfloat16 for most)",
    ]
    if weights:
        lines.append(f"weights: {{quantization: {weights.quantization}, group_size: {weights.group_size}}}   "
                     "# matrices stored, streamed and planned packed")
    lines += [
        "tiers:",
        memory.rstrip("\n"),
        "  disk: {path: store, capacity: auto}   # the converted weights, streamed from here",
        "kv_cache: {block_size: 16, gpu_blocks: auto}",
        "prefetch: {depth: auto}           # layers in flight: the depth the cost model predicts fastest",
        "activations: {prefill_chunk: auto, prefill_chunk_max: 256}   # prompt tokens per pass: 256, fewer "
        "where memory is short",
        "calibration: calibration.json     # measured once by the first start",
    ]
    return "\n".join(lines) + "\n"


def _name(model: str) -> str:
    return (hub.split_id(model)[0].replace("/", "--") if hub.is_hub_id(model) else Path(model).resolve().name)


def packed(model: str, quantization: str) -> WeightFormat:
    """The packed format for this model: the default group size (64), or the largest that divides every matrix
    (an int4 / int8 checkpoint of smaller groups: at most its own, so its values stay: `compressed.kept_format`)."""
    directory, raw = _config_json(model)
    fmt = WeightFormat(quantization)
    if (kept := compressed.kept_format(raw)) is not None and kept[0] <= fmt.bits:
        fmt = dataclasses.replace(fmt, group_size=kept_group(fmt.group_size, kept[1]))
    if resolve_impl("auto", raw) == "native":
        return fmt.fitted(ModelConfig.from_dict(raw, str(directory / "config.json")))
    try:  # a model transformers runs: its matrices are its tensors, whose shapes the safetensors headers give
        return fmt.fitted(Checkpoint(directory).config)
    except CheckpointError:  # (a Hub model's weights, not fetched yet: the default group size; a conversion
        return fmt  # it does not fit names weights.group_size in the YAML)


def cpu_packing(model: str) -> str | None:
    """The format a GPTQ / AWQ checkpoint runs in on a machine without a GPU: its own packing is dequantized into a
    dense copy every pass (SmolLM2-135M: 1.3 tokens/s here), int4 keeps its codes and scales (153; int8 for 8-bit
    codes or act-order groups, which int4 would quantize again); None for any other checkpoint."""
    directory, raw = _config_json(model)
    if quant_method(raw) not in ("gptq", "awq"):
        return None
    pre = gptq.parse_quantization_config(raw["quantization_config"], str(directory / "config.json"))
    return "int8" if pre.act_order or pre.bits == 8 else "int4"


def _config_json(model: str) -> tuple[Path, dict]:
    """A model's directory (a Hub model's: its config.json alone fetched) and its config.json."""
    directory = hub.fetch(model, weights=False) if hub.is_hub_id(model) else Path(model)
    return directory, json.loads((directory / "config.json").read_text())


def _ensure_store(disk: DiskTierConfig, ckpt: Checkpoint, dtype: torch.dtype, fmt: WeightFormat, root: Path) -> None:
    """Convert the checkpoint into tiers.disk.path once (fmt: the YAML's, as the run reads it); a complete store is
    opened and checked. This setup's own store (under `root`) that an earlier Offload wrote in a format this one does
    not read is converted again, as the demo's cache is; a store the user pointed the YAML at is theirs: the error
    says how to convert it."""
    store = disk.path
    state = store_to_fill(store)
    if state is StoreState.COMPLETE:
        try:
            open_tier_store(ckpt, disk, dtype, fmt).close()
            print(f"store: {store} is complete (no conversion)")
            return
        except StaleStoreError as e:
            if not Path(store).resolve().is_relative_to(root):
                raise
            print(f"store: {e}\nstore: it is this setup's own: converting it again")
            t0 = time.perf_counter()
            convert(ckpt, store, dtype, force=True, capacity=disk.capacity, fmt=fmt, progress=True).close()
            print(f"store: converted in {time.perf_counter() - t0:.1f}s")
            return
    # (a partial store: an interrupted conversion, or another start's still running, which open_tier_store waits for)
    again = " (a conversion there has not finished: resumed, or waited for where another process runs it)" \
        if state is StoreState.PARTIAL else ""
    print(f"store: converting {ckpt.path} into {store}, once{again}")
    t0 = time.perf_counter()
    opened = open_tier_store(ckpt, disk, dtype, fmt, progress=True)  # (another process converting it too: waited
    opened.close()  # for, its store reused)
    print(f"store: {'converted' if opened.built else 'converted by the process it waited for'} in "
          f"{time.perf_counter() - t0:.1f}s")


#: what a calibration may leave the process holding before the command starts again (`signals.restart`): a first
#: start compiles the CPU kernels while it calibrates, and numba keeps the compiled code and its compiler's state for
#: the process's life (SmolLM2-135M int4: ~650 MiB, for want of which a run in 1 GiB streamed 26 of its 32 groups)
RESTART_HELD = 128 * 2**20
#: ... and at least this share of what the process may fill with it: where RAM is plenty that room changes no plan
#: (kernels compiled in the process where the children failed, ~650 MiB, are 3% of a 24 GiB machine; a 24 GiB first
#: start also restarted for 178-842 MiB of probe memory in reference cycles, which `calibrate` now collects)
RESTART_SHARE = 0.05


def _warn_compiling(packed: bool) -> None:
    """Say, before it starts, that a fresh install's first start compiles the CPU kernels, where the memory this
    process may fill is short of what that holds (a start in 700 MiB was stopped for memory after minutes)."""
    need, room = fused.compile_reserve(packed), ram_available()
    if need and room < need + 128 * 2**20:
        print(f"calibration: this install's CPU kernels are not compiled yet: this start compiles them (about a "
              f"minute) and holds ~{need >> 20} MiB more than later starts for it, where this process may fill "
              f"{format_size(room)}: if it is stopped for memory, give this one start more (later ones fit in less)")


def _anon() -> int:
    """This process's resident memory that is its own (not pages of files, such as the libraries it maps)."""
    m = psutil.Process().memory_info()
    return m.rss - getattr(m, "shared", 0)


def why_measure(path: Path, packed: Sequence[str] = ()) -> tuple[str | None, tuple[str, ...]]:
    """Why the calibration file at `path` is to be measured (again), None when it can be reused: missing, not a
    calibration, measured with other CPU kernels than these (`Calibration.stale`), or a CPU calibration without the
    `packed` formats' kernels (those a run computes with) or with them in other activation steps than this process's
    (`kernels.use_activations`: int8 and int16 steps differ 1.2-1.5x past one row), or measured while other work
    kept the CPUs busy (`Calibration.busy`, at most BUSY_ROUNDS measurements). Beside it, the packed formats a
    new measurement times (`calibrate`'s argument): `packed` and those the file holds, kept (it may be shared)."""
    if not path.is_file():
        return "there is none", _packed(packed)
    try:
        cal = Calibration.load(path)
    except CalibrationError:
        return "it was not a calibration file", _packed(packed)
    held = [table.removeprefix("cpu/") for table in cal.compute]
    if cal.stale:
        return "it measured older CPU kernels", _packed([*packed, *held])
    if other := cal.other_machine:
        return f"it measured another machine: {other}", _packed([*packed, *held])
    missing = [s for s in packed if "cpu" in cal.compute and f"cpu/{s}" not in cal.compute]
    if missing:
        return f"it did not measure the {' and '.join(missing)} kernels", _packed([*packed, *held])
    steps = cal.meta.get("activations") or {}  # (files before this record: the defaults of their kernels)
    other = [s for s in packed if f"cpu/{s}" in cal.compute and steps.get(s, "int8") != kernels.ACTIVATIONS[s]]
    if other:
        return f"it measured the {' and '.join(other)} kernels in other activation steps", _packed([*packed, *held])
    if cal.busy > BUSY and cal.meta.get("rounds", 1) < BUSY_ROUNDS:  # (the last reason: the rest is as measured)
        return f"{BUSIER} {cal.busy:.0%} of the CPUs busy while it measured", _packed([*packed, *held])
    return None, _packed([*packed, *held])


def _packed(names: Sequence[str]) -> tuple[str, ...]:
    """The packed formats among `names`, in PACKED's order."""
    return tuple(s for s in PACKED if s in names)


def _ensure_calibration(cal_path: Path, packed: tuple[str, ...], device: torch.device, dtype: torch.dtype,
                        disk: Path) -> None:
    """Measure this machine into cal_path once (again where `why_measure` says so), under one lock for every
    calibration of this machine (`calibration_lock`): another process starting the same setup at once waits and
    reuses what this one measured, one starting another setup waits and then measures its own (both measuring at
    once read each other's disk probe, and each would time the other's load). A measurement again because other work
    slowed the last one keeps the faster of each table (`Calibration.keep_faster`)."""
    cal_path.parent.mkdir(parents=True, exist_ok=True)
    lock, waited, held = calibration_lock(cal_path.parent), [], 0
    try:
        lock.exclusive(on_wait=lambda holder: (waited.append(holder),
                                               print(f"calibration: waiting for {holder} to finish measuring")))
        why, schemes = why_measure(cal_path, packed)
        if why is None:
            print(f"calibration: {cal_path} ({'measured by the process it waited for' if waited else 'reused'}; "
                  "no calibration)")
            return
        lock.announce("calibrating")
        why = ", once" if why == "there is none" else f" ({why})"
        print(f"calibration: measuring this machine's disk, copies and layer kernels{why} -> {cal_path}")
        if device.type == "cpu":
            _warn_compiling(bool(schemes))
        t0, anon = time.perf_counter(), _anon()
        cal = calibrate(device, dtype, disk, engine=engine_overhead_s, packed=schemes, locked=True)
        (cal.keep_faster(Calibration.load(cal_path)) if BUSIER in why else cal).save(cal_path)
        print(f"calibration: done in {time.perf_counter() - t0:.1f}s")
        held = _anon() - anon
    finally:
        lock.close()
    if held >= max(RESTART_HELD, RESTART_SHARE * (ram_available() + held)):
        signals.restart(f"calibration: this process holds {format_size(held)} more than before it (the CPU kernels "
                        "numba compiled or loaded, which it keeps): starting again, once, so that the run has that "
                        "room")


def prepare(model: str, disk: Path | None, weights: str | None) -> OffloadConfig:
    """Write (first start) or read the YAML, convert and calibrate once; returns the run's configuration."""
    if weights is not None and weights not in WEIGHT_SCHEMES:
        raise ConfigError(f"--weights {weights!r} is not supported; use one of: {', '.join(WEIGHT_SCHEMES)}")
    if not hub.is_hub_id(model):
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(f"{model!r} is neither a checkpoint directory nor a Hub id like org/name")
        model = str(path)
    root = (disk or cache_dir() / "models" / _name(model)).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    machine = Machine.detect(root)
    print(f"this machine: {machine.describe()}")
    yaml_path = root / "offload.yaml"
    if yaml_path.is_file():
        print(f"config: {yaml_path} (reused; edit it to change the run)")
    else:
        if weights is None and machine.device == "cpu" and (weights := cpu_packing(model)) is not None:
            print(f"weights: {weights} (a GPTQ / AWQ checkpoint's own packing, dequantized every pass, is slow on a "
                  f"CPU; {weights} keeps its codes and scales where its groups allow; weights: none in the YAML runs "
                  "it)")
        yaml_path.write_text(config_yaml(model, machine, None if weights is None else packed(model, weights)))
        print(f"config: {yaml_path} (written for this machine; edit it freely)")
    config = OffloadConfig.load(yaml_path)
    if weights is not None and config.weights.quantization != weights:
        raise ConfigError(f"--weights {weights}, but {yaml_path} (kept from the first start) says "
                          f"weights.quantization: {config.weights.quantization}; pass another --disk for a "
                          f"{weights} setup, or delete {root} to start over")
    if config.hub:
        print(f"checkpoint: {config.hub} from the Hugging Face cache (downloading what is missing)")
        config = config.replace(model=hub.fetch(config.hub))
    ckpt = Checkpoint(config.model, config.model_impl)
    dtype = resolve_dtype(config.dtype, ckpt.config.torch_dtype)
    device = torch.device("cuda" if config.device.startswith("cuda") else "cpu")
    if config.tiers is not None:  # a machine too small for the smallest plan is told before the conversion
        # (fit needs no timings; the whole RAM: a calibration that compiles the kernels starts the command again)
        planner = Planner(config.replace(calibration=None), ckpt.config, dtype, device,
                          resolve_capacities(config.tiers, device))
        planner.fit(planner.caps, 0)
    if config.tiers is not None and config.tiers.disk is not None:
        _ensure_store(config.tiers.disk, ckpt, dtype, WeightFormat.from_config(config.weights, ckpt.config), root)
    cal_path = config.calibration or root / "calibration.json"
    kernels.use_activations(config.weights.int4_activations, config.weights.int8_activations)  # (what it times)
    if device.type == "cpu":  # a fresh install's kernels, before the calibration and the run call them
        compile_kernels(dtype, packed_kernels(config))
    _ensure_calibration(cal_path, packed_kernels(config), device, dtype,
                        config.tiers.disk.path.parent if config.tiers and config.tiers.disk else root)
    config = config.replace(calibration=cal_path)
    show_plan(config, ckpt.config)
    return config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auto", default=None, metavar="MODEL_OR_PATH",
                   help="set everything up for this machine (YAML, store, calibration; reused later) and chat: "
                        "a checkpoint directory or a Hub id (org/name[@revision])")
    p.add_argument("--disk", type=Path, default=None, metavar="DIR",
                   help="with --auto: where the YAML, the store and the calibration live "
                        "(default: $OFFLOAD_CACHE/models/NAME)")
    p.add_argument("--weights", default=None, choices=WEIGHT_SCHEMES,
                   help="with --auto: store, stream and plan the weight matrices quantized (writes "
                        "weights.quantization into the first start's YAML; later starts read the YAML)")
