"""Planning from the command line: `offload plan` (what lives where, predicted speed, what would help)
and `offload calibrate` (measure this machine's links and kernels, saved for the planner).

`plan` reads a config and a model's `config.json` only (and, for a model transformers runs, its safetensors
headers: its groups are its tensors): no weights, no GPU memory, so it plans for machines you do not have
(with an example calibration file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from offload.cli.prepare import load_config, plan_as_run, plan_for
from offload.config import (
    CpuTierConfig,
    DiskTierConfig,
    GpuTierConfig,
    OffloadConfig,
    TiersConfig,
    WeightsConfig,
    format_size,
    parse_size,
)
from offload.errors import ConfigError
from offload.model.checkpoint import Checkpoint
from offload.model.config import ModelConfig
from offload.model.generic import resolve_impl
from offload.plan.calibrate import BUSY, calibrate, default_path, load_calibration
from offload.plan.costmodel import explain, plan_bytes
from offload.plan.experts import expert_choice
from offload.plan.memory import PACKED
from offload.plan.planner import Planner, RunPlan, run_capacities
from offload.plan.predict import KVTiers, Workload, cold_kv, predict_decode, predict_prefill_per_token, suggestions
from offload.plan.speculative import streaming_note, without_draft
from offload.plan.stages import plan_stages
from offload.runtime.device import resolve_dtype
from offload.runtime.overhead import engine_overhead_s
from offload.runtime.precompile import compile_kernels
from offload.runtime.speculative import auto_gain
from offload.weights.groups import model_layouts
from storage.errors import CapacityError
from storage.units import fmt_bytes


def cmd_calibrate(args: argparse.Namespace) -> int:
    device = torch.device(args.device) if args.device != "auto" else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available here")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    disk = Path(args.disk_path) if args.disk_path else (default_path().parent)
    if device.type == "cpu":  # a fresh install's kernels, in child processes (`compile_kernels`)
        compile_kernels(dtype, PACKED)
    cal = calibrate(device, dtype, disk, engine=engine_overhead_s)
    out = Path(args.output) if args.output else default_path()
    cal.save(out)
    for link, bps in sorted(cal.links.items()):
        print(f"  {link:<22} {bps / 1e9:8.2f} GB/s")
    table = cal.compute[device.type]
    for n, bps, fixed in zip(table["tokens"], table["weight_bytes_per_s"], table["layer_overhead_s"]):
        print(f"  layer kernels, {n:>4} tokens: {bps / 1e9:8.2f} GB/s of weights, {1000 * fixed:.2f} ms per layer")
    if cal.busy > BUSY:  # (the kernels' times: slower than a quiet machine's)
        print(f"other work kept {cal.busy:.0%} of the CPUs busy meanwhile: measure again when it is quieter")
    print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------- plan
def _plan_inputs(args: argparse.Namespace) -> tuple[OffloadConfig, ModelConfig]:
    """The config (YAML, or flags) and the model shape (config.json alone is enough: no weights are read)."""
    if args.config or args.model:  # a model given by --model (a directory or a Hub id: config.json alone is fetched)
        config = (load_config(args.config, args.model) if args.config else
                  OffloadConfig.load({"model": args.model, "device": args.device or "cuda"})).fetched(weights=False)
        model_json = Path(args.model_config) if args.model_config else config.model / "config.json"
    elif args.model_config:
        model_json = Path(args.model_config)
        if not model_json.is_file():
            raise ConfigError(f"--model-config {str(model_json)!r} does not exist; give a model's config.json")
        config = OffloadConfig.load({"model": str(model_json.resolve().parent), "device": args.device or "cuda"})
    else:
        raise ConfigError("give --config FILE, --model DIR_OR_HUB_ID or --model-config config.json")
    if not model_json.is_file():
        raise ConfigError(f"{model_json} does not exist; the plan needs the model's config.json")
    try:
        raw = json.loads(model_json.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{model_json}: not valid JSON ({e})") from None
    if isinstance(raw, dict) and resolve_impl(config.model_impl, raw) == "transformers":
        if not any(model_json.parent.glob("*.safetensors")):  # its groups are its tensors: the headers tell
            raise ConfigError(f"{model_json.parent}: a model transformers runs is planned from its safetensors "
                              "headers, and there are none here; download the checkpoint first")
        cfg = Checkpoint(model_json.parent, "transformers").config
    else:
        cfg = ModelConfig.from_dict(raw, str(model_json))
    overrides: dict[str, Any] = {}
    if args.device:
        overrides["device"] = args.device
    if args.calibration:
        overrides["calibration"] = Path(args.calibration).resolve()
    if args.weights:
        overrides["weights"] = WeightsConfig(args.weights, config.weights.group_size, config.weights.keep)
    if args.gpu or args.cpu or args.disk_path:
        tiers = config.tiers or TiersConfig()
        gpu = GpuTierConfig(parse_size(args.gpu, "--gpu")) if args.gpu else tiers.gpu
        cpu = CpuTierConfig(parse_size(args.cpu, "--cpu"), tiers.cpu.pinned) if args.cpu else tiers.cpu
        disk = DiskTierConfig(Path(args.disk_path).resolve()) if args.disk_path else tiers.disk
        overrides["tiers"] = TiersConfig(gpu, cpu, disk)
    return (config.replace(**overrides) if overrides else config), cfg


def cmd_plan(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        raise ConfigError(f"--ranks must be at least 1, got {args.ranks}")
    config, cfg = _plan_inputs(args)
    plan_as_run(config, cfg)
    show_plan(config, cfg, args.batch, args.context, args.json, args.ranks)
    return 0


def rank_plans(config: OffloadConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               world: int) -> dict[str, Any]:
    """What each rank of a `world`-rank launch plans (as `offload.runtime.pipeline.plan_stage` does, every rank
    with this machine's tiers), and the KV pool they agree on (each takes the minimum)."""
    if cfg.impl != "native":
        raise ConfigError("--ranks: the transformers path runs in one process; drop --ranks or use a model "
                          "Offload runs natively")
    if config.speculative.enabled:
        raise ConfigError("--ranks: speculative decoding runs in one process (a launch over ranks refuses it); "
                          "set speculative.draft: null to plan the ranks")
    stages = plan_stages(config, cfg, dtype, device, run_capacities(config, device), world)
    agreed = min(s.run.kv_blocks for s in stages)
    steps = [s.step_s for s in stages]
    return {"world": world, "kv_blocks": agreed, "stages": stages,
            "predicted_batch1_ms": None if None in steps else 1000 * sum(steps)}


def print_ranks(ranks: dict[str, Any]) -> None:
    print(f"over {ranks['world']} ranks (torchrun --nproc-per-node {ranks['world']}, each rank with these tiers; "
          "every rank logs its line at start):")
    for stage in ranks["stages"]:
        print(f"  {stage.describe(ranks['kv_blocks'])}")
    total = ranks["predicted_batch1_ms"]
    print(f"  every rank keeps {ranks['kv_blocks']} device KV blocks (the smallest rank's pool)"
          + (f"; a batch-1 decode step passes the stages in turn: {total:.1f} ms plus one hop a rank"
             if total is not None else ""))


def prefix_capacity(rp: RunPlan) -> dict[str, object]:
    """What the prefix cache may hold: idle full blocks in every KV tier (persist: on disk for later processes)."""
    kv = rp.kv
    out: dict[str, object] = {"mode": kv.prefix_cache}
    if kv.prefix_cache != "off":
        out["blocks"] = {"gpu": rp.kv_blocks, "cpu": kv.cpu_blocks, "disk": kv.disk_blocks}
    if kv.prefix_cache == "persist":
        out["persisted_blocks"] = kv.persist_blocks
        out["persisted_bytes"] = kv.persist_blocks * rp.kv_block_bytes
    return out


def prefix_line(rp: RunPlan, block_size: int) -> str:
    cap = prefix_capacity(rp)
    if cap["mode"] == "off":
        return "prefix cache: off"
    blocks = cap["blocks"]
    tiers = ", ".join(f"{t} {n}" for t, n in blocks.items() if n) or "sized per request"
    line = (f"prefix cache: {cap['mode']}, idle full blocks of {block_size} tokens kept in the KV tiers "
            f"({tiers} blocks) until a request needs their room")
    if cap["mode"] == "persist":
        line += (f"; up to {cap['persisted_blocks']} blocks ({fmt_bytes(cap['persisted_bytes'], 'MiB')}) on disk "
                 "for later processes")
    return line


def show_plan(config: OffloadConfig, cfg: ModelConfig, batch: int = 1, context: int | None = None,
              as_json: bool = False, world: int = 1) -> None:
    """Print where each group lives, the KV cache, the predicted speed and what would help most. `context`: plan
    for it (as `offload run` plans for its prompts) and predict at it; None: plan for the model's context (as
    `chat` and `serve` do) and predict at 128 tokens."""
    device = torch.device(config.device if config.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and config.tiers is not None and config.tiers.gpu.capacity is None \
            and not torch.cuda.is_available():
        raise ConfigError("tiers.gpu.capacity: auto needs the GPU itself; give a size (e.g. --gpu 24GiB) to plan "
                          "on paper")
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype)
    config, planner, draft, plain_note = plan_for(config, cfg, dtype, device, batch,  # as serve --max-batch N
                                                  context)
    rp = planner.run_plan()
    cal = load_calibration(config.calibration)
    work = Workload(batch=batch, context=context or Workload.context, prefill_chunk=rp.prefill_chunk)
    sizes, held = planner.compute_sizes, KVTiers.of(rp, planner)
    pred = predict_decode(rp.plan, cfg, cal, device.type, work, dtype.itemsize, sizes, held)
    per_token = predict_prefill_per_token(rp.plan, cfg, cal, device.type, work, dtype.itemsize, sizes)
    helps = suggestions(planner.placement, planner.caps, rp.plan.depth, cfg, cal, device.type, work, dtype.itemsize,
                        pred, sizes, held)
    schemes = compare_schemes(config, cfg, dtype, device, cal, work, context)
    experts = expert_lines(rp.plan, cfg, cal, sizes, batch, device.type)
    ranks = rank_plans(config, cfg, device, dtype, world) if world > 1 else None
    if as_json:
        print(json.dumps({"device": str(device), "model_impl": cfg.impl, "kv_blocks": rp.kv_blocks,
                          "prefix_cache": prefix_capacity(rp),
                          "calibration": cal.source,
                          "compute_dtype": str(rp.compute_dtype).removeprefix("torch."),
                          "prediction": pred.to_dict() | {"prefill_s_per_token": per_token,
                                                          "cold_kv": cold_kv(held, work)},
                          "suggestions": [s.__dict__ for s in helps], "weights": schemes,
                          "speculation_note": plain_note,
                          **({"expert_compute": experts} if experts else {}),
                          **({"ranks": ranks | {"stages": [s.to_dict() for s in ranks["stages"]]}} if ranks else {}),
                          **rp.plan.to_dict()},
                         indent=2))
        return
    dense = sum(layout.nbytes for layout in model_layouts(cfg, dtype).values())  # (compute_sizes: times, not bytes)
    params = dense / dtype.itemsize
    count = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    w = config.weights
    stored = "" if w.quantization == "none" else (
        f", stored {w.quantization} g{w.group_size}{' keeping ' + ', '.join(w.keep) if w.keep else ''}: "
        f"{format_size(sum(g.nbytes for g in planner.groups))}")
    impl = "Offload's own math" if cfg.impl == "native" else "run by transformers, KV in its DynamicCache"
    print(f"device {device}, {cfg.family} model ({impl}; model_impl: {config.model_impl}), "
          f"{cfg.num_layers} layers, {count} parameters "
          f"({format_size(dense)} in {str(dtype).removeprefix('torch.')}{stored})")
    if rp.compute_dtype != dtype:
        print(f"  compute in {str(rp.compute_dtype).removeprefix('torch.')} (compute_dtype: {config.compute_dtype}): "
              f"weights move as {str(dtype).removeprefix('torch.')} and are upcast after the transfer")
    print(rp.plan.describe())
    kv = "sized per request" if rp.kv_blocks == 0 else (
        f"{rp.kv_blocks} blocks x {config.kv_cache.block_size} tokens "
        f"({fmt_bytes(rp.kv_blocks * rp.kv_block_bytes, 'MiB')})")
    print(f"  KV cache on the device: {kv}")
    if rp.batch is not None:
        cold = rp.kv.cpu_blocks + rp.kv.disk_blocks
        rows = f"{rp.batch} sequences decode" if rp.batch > 1 else "1 sequence decodes"
        print(f"  batch: up to {rows} together (each keeps its newest KV block on the device, prefill passes of "
              f"{rp.prefill_chunk} tokens)" + (f"; {cold} more blocks in the host/disk KV tiers" if cold else "")
              + (f"; planned for --batch {batch}" if batch > 1 else ""))
    print(f"  {prefix_line(rp, config.kv_cache.block_size)}")
    if rp.depth_note:
        print(f"  {rp.depth_note}")
    src = ("conservative defaults (no calibration file: run `offload calibrate`)" if cal.source == "defaults"
           else cal.source)
    print(f"prediction (calibration: {src}):")
    print(f"  decode step, batch {work.batch}, context {work.context}: {1000 * pred.step_s:.0f} ms "
          f"({work.batch / pred.step_s:.2f} tokens/s, {pred.step_s / work.batch:.3g} s/token)")
    for line in explain(rp.plan, pred, cal.links):
        print(f"  {line}")
    cold = cold_kv(held, work)
    if cold["host_blocks"] or cold["disk_blocks"]:
        print(f"  context {work.context}: {cold['host_blocks']} KV blocks in RAM"
              f"{' (read where they lie)' if cold['host_in_place'] else ''} and {cold['disk_blocks']} on disk beyond "
              f"the device pool, {fmt_bytes(cold['bytes_per_step'], 'MiB', digits=1)} fetched every step "
              "(counted above)")
    if work.context > cfg.max_position_embeddings:
        print(f"  context {work.context} is beyond the model's ({cfg.max_position_embeddings} tokens): a run "
              "refuses it")
    elif cold["blocks_not_held"]:
        print(f"  context {work.context} x batch {work.batch} needs {cold['blocks_not_held']} KV blocks more than the "
              "device pool and the host/disk KV tiers hold: give kv_cache.disk_blocks (or cpu_blocks) a number, or "
              "a larger tiers.gpu.capacity")
    print(f"  prefill: {1000 * per_token:.2f} ms per prompt token (passes of {work.prefill_chunk} tokens)")
    for line in (experts or {}).get("lines", []):
        print(f"  {line}")
    print("by weight format (same tiers; bytes per group, bytes per token by link, predicted step):")
    for row in schemes:
        if "refused" in row:
            print(f"  {row['quantization']:<5} does not fit: {row['refused']}")
            continue
        links = ", ".join(f"{k} {format_size(v)}" for k, v in row["bytes_per_token"].items()) or "nothing streamed"
        print(f"  {row['quantization'] + row['kept']:<5} layer {format_size(row['layer_bytes'])}, model "
              f"{format_size(row['model_bytes'])}; per token {links}; {row['step_ms']:.0f} ms/step, "
              f"bound by {row['bottleneck']}")
    if plain_note:
        print(plain_note)
    if draft is not None:
        _print_speculative(config, draft, cfg, device, dtype, rp)
        alone = without_draft(config, cfg, dtype, device)
        note = streaming_note(rp.plan, alone.plan)
        if note:
            t_alone = predict_decode(alone.plan, cfg, cal, device.type, work, dtype.itemsize, sizes).step_s
            print(f"  without a draft: {1000 * t_alone:.0f} ms/step ({work.batch / t_alone:.2f} tokens/s), so "
                  f"speculation pays only above x{pred.step_s / t_alone:.2f} here. {note}")
    if ranks:
        print_ranks(ranks)
    if helps:
        print("what would help most:")
        for s in helps[:4]:
            print(f"  {s.change}: {1000 * s.step_s:.0f} ms/step, {s.tokens_per_s:.2f} tokens/s "
                  f"({s.tokens_per_s / (work.batch / pred.step_s):.1f}x)")


def expert_lines(plan, cfg: ModelConfig, cal, sizes: dict[str, int], batch: int, device_type: str) -> dict:
    """Where routed experts are computed, per home tier, with each path's predicted time per routed expert."""
    if not cfg.is_moe:
        return {}
    homes = {t: sum(1 for g in plan.order if ".expert." in g and plan.homes[g] == t) for t in ("gpu", "cpu", "disk")}
    lines = [f"experts: {cfg.num_experts} per MoE layer, top {cfg.experts_per_token}; homed gpu {homes['gpu']}, "
             f"cpu {homes['cpu']}, disk {homes['disk']}"]
    out: dict = {"homes": homes}
    if device_type != "cuda":
        lines.append("  a CPU device computes every expert where it lies (host RAM is its memory); disk-homed ones "
                     "load on demand into the expert cache")
        return out | {"lines": lines, "cpu": "host"}
    choice = expert_choice(plan, cfg, cal, sizes, tokens=batch)
    if choice is not None:
        where = "on the host, input moved" if plan.host_compute else "moved to the device"
        lines.append(f"  cpu-homed: {where} (per routed expert at batch {batch}: moved to the device "
                     f"{1000 * choice.device_s:.2f} ms at the assumed hit rate, computed on the host "
                     f"{1000 * choice.host_s:.2f} ms)")
        out["cpu"] = {"choice": "host" if plan.host_compute else "device", "device_s": choice.device_s,
                      "host_s": choice.host_s}
    if homes["disk"]:
        lines.append("  disk-homed: read and moved to the device on demand, through the expert cache")
    return out | {"lines": lines}


def _print_speculative(config, draft, cfg, device, dtype, rp) -> None:
    """The draft's placement and pass time, and the predicted speed-up by acceptance rate against plain decoding
    without a draft (the target then has the device to itself)."""
    drp, _ = draft
    g = auto_gain(config, cfg, dtype, device, run_capacities(config, device))
    print(f"speculative decoding (draft {config.speculative.draft}, resident, "
          f"{format_size(drp.plan.used('gpu'))} on the device): {1000 * g.t_draft:.0f} ms per draft pass, "
          f"a verify pass of 9 tokens x{g.verify(8):.2f} of a plain one")
    limit, bs = rp.caps.kv_blocks, config.kv_cache.block_size
    if limit is not None:
        cold = rp.kv.cpu_blocks + rp.kv.disk_blocks
        print(f"  the draft's own KV pool mirrors the target's: {limit} blocks ({limit * bs} tokens, "
              f"{fmt_bytes(limit * drp.kv_block_bytes, 'MiB')}); the target keeps {rp.kv_blocks} on the device"
              + (f" and {cold} in its host/disk KV tiers" if cold else " (no cold KV tiers)"))
    for alpha in (0.5, 0.7, 0.9):
        p = g.at(alpha, config.speculative.tokens)
        print(f"  acceptance {alpha:.1f}: tokens {p.tokens}, {p.tokens_per_pass:.2f} tokens per pass, "
              f"{p.tokens_per_pass / p.step_s:.2f} tokens/s (x{p.speedup:.2f} of plain decoding without a draft)")


def compare_schemes(config: OffloadConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, cal,
                    work: Workload, context: int | None = None) -> list[dict]:
    """The same tiers planned for dense, int8 and int4 weights: bytes per group, per link and step, what binds."""
    rows = []
    for scheme in ("none", "int8", "int4"):
        w = config.weights
        other = config.replace(weights=WeightsConfig(scheme, w.group_size, w.keep))
        try:
            planner = Planner(other, cfg, dtype, device, run_capacities(other, device, tell=False), context=context)
            rp = planner.run_plan()
        except (CapacityError, ConfigError) as e:
            rows.append({"quantization": scheme, "refused": str(e)})
            continue
        plan = rp.plan
        pred = predict_decode(plan, cfg, cal, device.type, work, dtype.itemsize, planner.compute_sizes,
                              KVTiers.of(rp, planner))
        moved = {link: plan_bytes(plan, link) / work.batch for link in ("disk read", "host->device")}
        fmt = planner.fmt  # (none of a GPTQ or an int4 / int8 checkpoint: its own codes, `WeightFormat.from_config`)
        kept = f" (the checkpoint's {fmt.quantization}, groups of {fmt.group_size}):" * (scheme != fmt.quantization)
        rows.append({"quantization": scheme, "kept": kept, "layer_bytes": plan.sizes["layer.0"],
                     "model_bytes": sum(plan.sizes.values()), "bytes_per_token": {k: v for k, v in moved.items() if v},
                     "step_ms": 1000 * pred.step_s, "bottleneck": pred.bottleneck})
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine's disk, copies and layer kernels")
    cal.add_argument("--disk-path", default=None, metavar="DIR", help="where to test disk reads (the store's disk)")
    cal.add_argument("-o", "--output", default=None, metavar="FILE",
                     help="where to save (default: $OFFLOAD_CACHE/calibration.json, which the planner reads)")
    cal.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    cal.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    cal.set_defaults(func=cmd_calibrate)

    plan = sub.add_parser("plan", help="where each layer lives, the predicted step time, what would help "
                                       "(reads no weights)")
    plan.add_argument("--config", default=None, metavar="FILE", help="YAML configuration")
    plan.add_argument("--model", default=None, metavar="DIR_OR_HUB_ID",
                      help="the model (overrides the YAML's model:); a Hub id fetches its config.json only")
    plan.add_argument("--model-config", default=None, metavar="config.json",
                      help="plan from a model's config.json alone (with --config or the flags below)")
    plan.add_argument("--calibration", default=None, metavar="FILE", help="a file from `offload calibrate`")
    plan.add_argument("--device", default=None, help="override the device (e.g. cuda, to plan on paper)")
    plan.add_argument("--gpu", default=None, metavar="SIZE", help="tiers.gpu.capacity")
    plan.add_argument("--cpu", default=None, metavar="SIZE", help="tiers.cpu.capacity")
    plan.add_argument("--disk-path", default=None, metavar="DIR", help="tiers.disk.path")
    plan.add_argument("--weights", default=None, choices=("none", "int8", "int4"),
                      help="weights.quantization (the plan also compares all three)")
    plan.add_argument("--batch", type=int, default=1,
                      help="sequences decoded together: the KV pool is planned for them (as serve --max-batch N and "
                           "run --input --batch N do) and the prediction assumes them")
    plan.add_argument("--context", type=int, default=None,
                      help="tokens of context: planned for (as `run` plans for its prompts) and predicted at; default: "
                           "planned for the model's context (as chat and serve are), predicted at 128")
    plan.add_argument("--ranks", type=int, default=1, metavar="N",
                      help="also plan each rank of a torchrun launch of N processes, each with these tiers (the "
                           "layers each holds, where its groups live, its KV pool, its predicted stage time)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)
