"""Benchmark: Offload streaming from disk vs its physical bound and vs Accelerate disk offload, in one run.

    python scripts/bench.py                  # medium (TinyLlama-1.1B shape) bf16, gpu 512MiB + cpu 512MiB + disk
    python scripts/bench.py --quick          # small model, small budgets: a smoke run (the test suite runs it)
    python scripts/bench.py --weights none int8 int4   # dense bf16 vs group-wise int8 / int4 stores, one run

For each batch size, in fresh subprocesses (so peak RSS is each run's own):
  resident    all weights in RAM: the compute-only step time
  offload     the tiered run, the store's page cache evicted first: decode ms/step, disk bytes per step, peak RSS
  (resident and offload run once per `--weights` scheme, each from its own store; the bound of a quantized
  run is its own compute-only time vs its packed bytes over the disk)
  accelerate  transformers + Accelerate `device_map="auto"`, `max_memory` = Offload's total RAM budget, the rest
              offloaded to disk, page cache evicted first: decode ms/step, peak RSS, tokens equal to ours?
The disk's bandwidth is measured in the same run (cold, parallel preadv over the store's chunk files), so
`disk_time = bytes read per step / bandwidth` and the ratio `step / max(compute, disk_time)` use this
machine's numbers. Results go to RESULTS/NAME.{md,json} (default OUT/bench), with the command line, the
machine and the load (`scripts.machine.Result`).

Accelerate runs the checkpoint's dense bf16 weights (it has no packed format): its row is the same-format
peer of the `none` rows only. A packed row (`int8`, `int4`) is compared with it as "packed vs dense", which
counts the format's fewer bytes (and, for int4, fitting in RAM) as well as the scheduler, and is also shown
against Offload's own dense row of the same batch and depth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python scripts/bench.py` as well as `python -m scripts.bench`
from scripts import memcg  # noqa: E402
from scripts.machine import Result  # noqa: E402
from storage.units import blocks_for  # noqa: E402

PROFILES = {
    # name: model size, budgets, prompt, new tokens, batches, depth, prefill chunk
    "full": dict(size="medium", gpu="512MiB", cpu="512MiB", prompt=64, new=32, batches=[1, 8], depths=[1, 2],
                 chunk=64, weights=["none"]),
    "quick": dict(size="small", gpu="64MiB", cpu="32MiB", prompt=16, new=6, batches=[2], depths=[2], chunk=16,
                  weights=["none"]),
}


def vm_hwm() -> int:
    """Peak RSS of this process image in bytes (unlike ru_maxrss, not inherited across fork + exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def evict(paths: list[Path]) -> int:
    """Drop every file under `paths` from the page cache; returns the bytes covered."""
    total = 0
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def disk_bandwidth(store: Path, groups: list[str] | None = None, threads: int = 4, piece: int = 8 * 2**20) -> dict:
    """Cold read of the groups' chunk files (all by default), `threads` preadv pieces in flight, as the
    prefetcher reads them but without checksums: what the disk itself delivers, in bytes per second."""
    import torch

    from storage.io import preadv_into

    chunks = sorted(p for p in store.rglob("c.*") if p.is_file())
    if groups is not None:
        chunks = [store / g / "c.0" for g in groups]
    evict(chunks)
    buf = torch.empty(max(p.stat().st_size for p in chunks), dtype=torch.uint8)
    total = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for path in chunks:
            n = path.stat().st_size
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # as the prefetcher's reader does
                list(pool.map(lambda s, fd=fd, n=n: preadv_into(fd, buf[s : min(s + piece, n)], s),
                              range(0, n, piece)))
            finally:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            total += n
    seconds = time.perf_counter() - t0
    return {"bytes": total, "seconds": seconds, "bytes_per_s": total / seconds}


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist() for _ in range(batch)]


# ----------------------------------------------------------------------------- workers (one per subprocess)
def worker_offload(spec: dict) -> dict:
    from offload.config import OffloadConfig
    from offload.runtime.runner import Runner
    from schedulers.timeline import Timeline

    base = vm_hwm()
    cfg = spec["config"]
    if cfg.get("tiers", {}).get("disk"):
        evict([Path(cfg["tiers"]["disk"]["path"])])
    with Runner(OffloadConfig.load(cfg), timeline=Timeline(enabled=spec.get("spans", True))) as r:
        batch = prompts(spec["batch"], spec["prompt"], r.cfg.vocab_size)
        t0 = time.perf_counter()
        [res, *rest] = r.generate(batch, max_new_tokens=spec["new"], stop_on_eos=False)
        wall = time.perf_counter() - t0
        stats = res.stats
        decode_steps = set(stats.decode_only_steps)  # the steady state: passes that only decoded
        disk = r.timeline.bytes_on("disk-read", decode_steps)
        stall = sum(s.duration for s in r.timeline.on("stall") if s.step in decode_steps)
        from schedulers.timeline import busy_time

        disk_busy = busy_time([s for s in r.timeline.on("disk-read") if s.step in decode_steps])
        compute = sum(s.duration for s in r.timeline.on("compute") if s.step in decode_steps)
        kv_spans = [s for s in r.timeline.on("kv-fetch") if s.step in decode_steps]
        out = {
            "kv_fetch_bytes_per_step": sum(s.nbytes for s in kv_spans) / max(len(decode_steps), 1),
            "kv_fetch_busy_ms_per_step": 1000 * busy_time(kv_spans) / max(len(decode_steps), 1),
            "kv_blocks_moved": r.traffic.routes("kv"),
            "ms_per_step": stats.decode_only_ms_per_step,
            "step_ms": stats.step_ms,
            "prefill_s": stats.prefill_s,
            "wall_s": wall,
            "disk_bytes_per_step": disk / max(len(decode_steps), 1),
            "stall_ms_per_step": 1000 * stall / max(len(decode_steps), 1),
            "disk_busy_ms_per_step": 1000 * disk_busy / max(len(decode_steps), 1),
            "compute_ms_per_step": 1000 * compute / max(len(decode_steps), 1),
            "tokens": [x.token_ids for x in [res, *rest]],
            "plan": r.plan.to_dict(),
        }
    out["peak_rss"] = vm_hwm()
    out["base_rss"] = base
    return out


def worker_accelerate(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    base = vm_hwm()
    model_dir, offload_dir = Path(spec["model"]), Path(spec["offload_folder"])
    offload_dir.mkdir(parents=True, exist_ok=True)
    evict([model_dir, offload_dir])
    torch.manual_seed(0)
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, device_map="auto", max_memory={"cpu": spec["max_memory"]},
        offload_folder=str(offload_dir),
    ).eval()
    load_s = time.perf_counter() - t_load
    devices = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()})
    evict([model_dir, offload_dir])
    batch = prompts(spec["batch"], spec["prompt"], model.config.vocab_size)
    ids = torch.tensor(batch)
    steps, tokens = [], []
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - t0
        cache = out.past_key_values
        nxt = out.logits[:, -1].float().argmax(-1)
        tokens.append(nxt.tolist())
        for _ in range(spec["new"] - 1):
            if spec.get("evict_steps", True):  # equal budgets: no page cache beyond max_memory (not timed); inside
                evict([model_dir, offload_dir])  # a memory cgroup the limit bounds it: what fits stays cached
            t = time.perf_counter()
            out = model(nxt[:, None], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].float().argmax(-1)
            steps.append(1000 * (time.perf_counter() - t))
            tokens.append(nxt.tolist())
    per_seq = [[step[b] for step in tokens] for b in range(len(batch))]
    return {"ms_per_step": sum(steps) / len(steps), "step_ms": steps, "prefill_s": prefill, "load_s": load_s,
            "tokens": per_seq, "devices": devices, "peak_rss": vm_hwm(), "base_rss": base}


WORKERS = {"offload": worker_offload, "accelerate": worker_accelerate}


def call_worker(kind: str, spec: dict, memory_max: str | None = None, timeout: int = 3600,
                check: bool = False) -> dict:
    """Worker `kind` in a fresh process, inside a memory cgroup of `memory_max` when given (scripts/memcg.py: page
    cache dropped first, the cgroup's peak under "memcg"); a failed run gives {"error": why, "stderr": ...}, or
    raises when `check`."""
    if memory_max is not None:
        spec = spec | {"evict_steps": False}  # the cgroup bounds the page cache: a peer may use its spare room
    return memcg.run_json([sys.executable, __file__, "--worker", kind, "--spec", json.dumps(spec)], memory_max,
                          timeout=timeout, drop=memory_max is not None, check=check)


def run_worker(kind: str, spec: dict, timeout: int = 3600, memory_max: str | None = None) -> dict:
    """`call_worker`, raising when the run fails."""
    return call_worker(kind, spec, memory_max, timeout, check=True)


# ----------------------------------------------------------------------------- orchestration
def ensure_model(out: Path, size: str) -> Path:
    from offload.testing.make_model import make_model

    path = out / "models" / f"{size}-llama-bf16"
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + ".partial")
        make_model(tmp, family="llama", size=size, dtype="bfloat16", seed=0, progress=True)
        tmp.rename(path)
    return path


def plan_homes(config: dict) -> dict[str, str]:
    from offload.config import OffloadConfig
    from offload.model.checkpoint import Checkpoint
    from offload.plan.planner import Planner
    from offload.runtime.device import resolve_device, resolve_dtype

    cfg = OffloadConfig.load(config)
    ckpt = Checkpoint(cfg.model)
    dtype = resolve_dtype(cfg.dtype, ckpt.config.torch_dtype)
    rp = Planner(cfg, ckpt.config, dtype, resolve_device(cfg.device)).run_plan()
    return rp.plan.homes


def ensure_store(model: Path, store: Path, weights: str = "none") -> None:
    import torch

    from offload.model.checkpoint import Checkpoint
    from offload.weights.convert import open_store
    from offload.weights.groups import WeightFormat

    open_store(Checkpoint(model), store, torch.bfloat16, fmt=WeightFormat(weights)).close()


def store_for(out: Path, model: Path, weights: str) -> Path:
    return out / "stores" / (model.name if weights == "none" else f"{model.name}-{weights}")


KV_PROFILES = {
    # the small model, a long context, the KV budget on device + host a quarter of what the batch needs
    "full": dict(batch=4, prompt=1024, new=32, chunk=256),
    "quick": dict(batch=2, prompt=96, new=6, chunk=32),
}


def bench_kv(out: Path, quick: bool, repeat: int) -> list[dict]:
    """Decode with KV beyond the device and host: step time against its bound from the spans."""
    prof = KV_PROFILES["quick" if quick else "full"]
    model = ensure_model(out, "small")
    store = out / "stores" / f"{model.name}"
    ensure_store(model, store)
    need = prof["batch"] * blocks_for(prof["prompt"] + prof["new"], 16)
    quarter = need // 4
    spec = {"batch": prof["batch"], "prompt": prof["prompt"], "new": prof["new"]}
    common = {"model": str(model), "device": "cpu", "dtype": "bfloat16",
              "activations": {"prefill_chunk": prof["chunk"]}}
    cold = common | {"tiers": {"gpu": {"capacity": "2GiB"}, "cpu": {"capacity": "1GiB"},
                               "disk": {"path": str(store)}},
                     "kv_cache": {"block_size": 16, "gpu_blocks": quarter - quarter // 4, "cpu_blocks": quarter // 4,
                                  "disk_blocks": need}}
    rows = []
    for quant in ("none", "int8"):
        config = cold | {"kv_cache": cold["kv_cache"] | {"quantization": quant}}
        runs = {"device": [], "tiered": []}
        for _ in range(repeat):
            runs["device"].append(run_worker("offload", spec | {"config": common}))
            runs["tiered"].append(run_worker("offload", spec | {"config": config}))
        device, tiered = median_run(runs["device"]), median_run(runs["tiered"])
        bound = max(tiered["compute_ms_per_step"], tiered["kv_fetch_busy_ms_per_step"])
        rows.append({
            "quantization": quant, "batch": prof["batch"], "context": prof["prompt"] + prof["new"],
            "kv_blocks_needed": need, "kv_blocks_gpu_cpu": quarter, "ms_per_step": tiered["ms_per_step"],
            "all_device_ms_per_step": device["ms_per_step"], "compute_ms_per_step": tiered["compute_ms_per_step"],
            "kv_fetch_ms_per_step": tiered["kv_fetch_busy_ms_per_step"],
            "kv_fetch_bytes_per_step": tiered["kv_fetch_bytes_per_step"], "bound_ms_per_step": bound,
            "ratio_to_bound": tiered["ms_per_step"] / bound,
            "tokens_equal_device": tiered["tokens"] == device["tokens"],
            "moved": tiered["kv_blocks_moved"],
        })
        print(f"kv {quant}: {rows[-1]['ms_per_step']:.0f} ms/step vs bound {bound:.0f} (all on device "
              f"{device['ms_per_step']:.0f})", file=sys.stderr)
    return rows


def predict_rows(rows: list[dict], model: Path, common: dict, tiers: dict, prof: dict, out: Path) -> None:
    """The cost model's prediction for each measured row, from a calibration measured in this run."""
    import torch

    from offload.config import OffloadConfig
    from offload.model.checkpoint import Checkpoint
    from offload.plan.calibrate import calibrate
    from offload.plan.planner import Planner
    from offload.plan.predict import Workload, predict_decode

    packed = sorted({r["weights"] for r in rows} - {"none"})  # only the formats measured: each is timed twice
    cal = calibrate(torch.device("cpu"), torch.bfloat16, out, packed=packed)
    path = out / "calibration.json"  # the planner's too: its packed layers' compute bytes scale by this machine's
    cal.save(path)  # int8 / int4 rates (without it, the planner's own file or defaults: the medium int4 row +111%)
    cfg = Checkpoint(model).config
    for r in rows:
        kv = common["kv_cache"] | {"gpu_blocks": r["batch"] * blocks_for(prof["prompt"] + prof["new"], 16)}
        tiers_q = tiers | {"disk": {"path": r["store"]}}
        config = OffloadConfig.load(common | {"tiers": tiers_q, "kv_cache": kv, "prefetch": {"depth": r["depth"]},
                                              "weights": {"quantization": r["weights"]}, "calibration": str(path)})
        planner = Planner(config, cfg, torch.bfloat16, torch.device("cpu"))
        plan = planner.run_plan().plan
        work = Workload(batch=r["batch"], context=prof["prompt"] + prof["new"] // 2)
        pred = predict_decode(plan, cfg, cal, "cpu", work, 2, planner.compute_sizes)
        r["predicted_ms_per_step"] = 1000 * pred.step_s
        r["prediction_error"] = pred.step_s * 1000 / r["offload_ms_per_step"] - 1
        r["calibration"] = {"disk read": cal.links["disk read"], "compute": cal.compute["cpu"]}


def median_run(runs: list[dict]) -> dict:
    """The run with the median ms/step (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r["ms_per_step"])
    return ordered[(len(ordered) - 1) // 2]


def compare(batch: int, depth: int, resident: dict, streamed: dict, peer: dict | None, disk: dict,
            weights: str = "none") -> dict:
    disk_ms = 1000 * streamed["disk_bytes_per_step"] / disk["bytes_per_s"]
    bound = max(resident["ms_per_step"], disk_ms)
    row = {
        "weights": weights,
        "batch": batch,
        "depth": depth,
        "offload_ms_per_step": streamed["ms_per_step"],
        "compute_only_ms_per_step": resident["ms_per_step"],
        "disk_bytes_per_step": streamed["disk_bytes_per_step"],
        "disk_ms_per_step": disk_ms,
        "disk_bytes_per_s": disk["bytes_per_s"],
        "disk_bytes_per_s_samples": disk.get("samples"),
        "ratio_to_disk_busy": streamed["ms_per_step"] / max(resident["ms_per_step"], streamed["disk_busy_ms_per_step"]),
        "bound_ms_per_step": bound,
        "ratio_to_bound": streamed["ms_per_step"] / bound,
        "offload_stall_ms_per_step": streamed["stall_ms_per_step"],
        "offload_peak_rss": streamed["peak_rss"],
        "offload_base_rss": streamed["base_rss"],
        "resident_peak_rss": resident["peak_rss"],
        "tokens_equal_resident": streamed["tokens"] == resident["tokens"],
        "plan": streamed["plan"],
    }
    if peer is not None:
        row |= {
            "accelerate_ms_per_step": peer["ms_per_step"],
            "accelerate_peak_rss": peer["peak_rss"],
            "accelerate_base_rss": peer["base_rss"],
            "accelerate_devices": peer["devices"],
            "accelerate_load_s": peer["load_s"],
            "tokens_equal_accelerate": peer["tokens"] == streamed["tokens"],
            "accelerate_first_difference": first_difference(peer["tokens"], streamed["tokens"]),
            "speedup_vs_accelerate": peer["ms_per_step"] / streamed["ms_per_step"],
        }
    return row


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    for seq_a, seq_b in zip(a, b):
        for i, (x, y) in enumerate(zip(seq_a, seq_b)):
            if x != y:
                return i
    return None


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, small budgets (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out", help="results, models and stores go here")
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--new", type=int, default=None, help="new tokens per run (default: the profile's)")
    ap.add_argument("--depths", type=int, nargs="*", default=None, help="prefetch depths to measure")
    ap.add_argument("--weights", nargs="*", choices=("none", "int8", "int4"), default=None,
                    help="weight formats to stream (weights.quantization), each from its own store")
    ap.add_argument("--no-accelerate", action="store_true", help="skip the Accelerate peer")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved repeats of every run; medians reported")
    ap.add_argument("--sections", nargs="*", choices=("stream", "kv"), default=["stream", "kv"],
                    help="what to measure: weights streamed from disk, the KV cache beyond the device")
    ap.add_argument("--results", type=Path, default=None, help="where NAME.md and NAME.json go (default: OUT)")
    ap.add_argument("--name", default="bench", help="the results' file name (without .md / .json)")
    ap.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](json.loads(args.spec))))
        return 0
    header = Result()

    prof = dict(PROFILES["quick" if args.quick else "full"])
    if args.batches:
        prof["batches"] = args.batches
    if args.depths:
        prof["depths"] = args.depths
    if args.weights:
        prof["weights"] = args.weights
    if args.new:
        prof["new"] = args.new
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_model(out, prof["size"])
    store = store_for(out, model, "none")
    ensure_store(model, store)
    stores = {q: store_for(out, model, q) for q in prof["weights"]}
    for q, path in stores.items():
        ensure_store(model, path, q)
    from offload.config import parse_size

    budget = parse_size(prof["gpu"]) + parse_size(prof["cpu"])
    disk = disk_bandwidth(store)
    print(f"disk: {disk['bytes_per_s'] / 1e9:.2f} GB/s cold over {disk['bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    common = {"model": str(model), "device": "cpu", "dtype": "bfloat16",
              "kv_cache": {"block_size": 16}, "activations": {"prefill_chunk": prof["chunk"]}}
    tiers = {"gpu": {"capacity": prof["gpu"]}, "cpu": {"capacity": prof["cpu"]}, "disk": {"path": str(store)}}
    rows = []
    for batch in prof["batches"] if "stream" in args.sections else []:
        spec = {"batch": batch, "prompt": prof["prompt"], "new": prof["new"]}
        # the KV pool holds what this batch needs, so the rest of the gpu budget goes to weights
        kv = common["kv_cache"] | {"gpu_blocks": batch * blocks_for(prof["prompt"] + prof["new"], 16)}
        runs: dict[str, list] = {}
        for _ in range(args.repeat):  # interleaved repeats: this disk drifts by tens of percent over minutes
            if not args.no_accelerate:
                runs.setdefault("accelerate", []).append(run_worker(
                    "accelerate", spec | {"model": str(model), "max_memory": budget,
                                          "offload_folder": str(out / "accelerate-offload")}))
            for q in prof["weights"]:
                wq = {"weights": {"quantization": q}}
                runs.setdefault(f"{q}/resident", []).append(run_worker("offload", spec | {"config": common | wq}))
                if q == "none":  # the cost of recording spans, on the compute-bound run (the disk's noise hides it)
                    runs.setdefault("resident-no-spans", []).append(
                        run_worker("offload", spec | {"config": common, "spans": False}))
                for depth in prof["depths"]:
                    tiers_q = tiers | {"disk": {"path": str(stores[q])}}
                    cfg = common | wq | {"tiers": tiers_q, "kv_cache": kv, "prefetch": {"depth": depth}}
                    # measure the disk right beside each streamed run, reading the very chunks the run streams,
                    # twice before and twice after; the bound uses the mean
                    homed = [g for g, h in plan_homes(cfg).items() if h == "disk" and g != "embed"]
                    samples = ([disk_bandwidth(stores[q], homed)["bytes_per_s"] for _ in range(2)] if homed
                               else [])
                    streamed = run_worker("offload", spec | {"config": cfg})
                    samples += [disk_bandwidth(stores[q], homed)["bytes_per_s"] for _ in range(2)] if homed else []
                    samples = samples or [disk["bytes_per_s"]]  # nothing streamed from disk: the bound is compute
                    streamed["disk"] = {"bytes_per_s": sum(samples) / len(samples), "samples": samples}
                    runs.setdefault(f"{q}/depth{depth}", []).append(streamed)
        peer = median_run(runs["accelerate"]) if "accelerate" in runs else None
        for q in prof["weights"]:
            resident = median_run(runs[f"{q}/resident"])
            for depth in prof["depths"]:
                streamed = median_run(runs[f"{q}/depth{depth}"])
                r = compare(batch, depth, resident, streamed, peer, streamed["disk"], q)
                r["store"] = str(stores[q])
                r["repeats_ms_per_step"] = {k: [x["ms_per_step"] for x in v] for k, v in runs.items()}
                r["span_recording_overhead"] = (median_run(runs["none/resident"])["ms_per_step"]
                                                / median_run(runs["resident-no-spans"])["ms_per_step"] - 1
                                                if "resident-no-spans" in runs else None)
                rows.append(r)
                print(f"{q} batch {batch} depth {depth}: offload {r['offload_ms_per_step']:.0f} ms/step, bound "
                      f"{r['bound_ms_per_step']:.0f} (ratio {r['ratio_to_bound']:.2f})"
                      + (f", accelerate {r['accelerate_ms_per_step']:.0f} ms/step" if peer else ""), file=sys.stderr)
        # what is measured so far, in case a long run is stopped before the end
        (out / "bench-partial.json").write_text(json.dumps({"settings": prof, "disk": disk, "rows": rows}, indent=2))
    if rows:
        predict_rows(rows, model, common, tiers, prof, out)
    kv_rows = bench_kv(out, args.quick, args.repeat) if "kv" in args.sections else []
    result = {"profile": "quick" if args.quick else "full", "settings": prof, "model": str(model),
              "budget_bytes": budget, "disk": disk, "rows": rows, "kv": kv_rows,
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    print(header.write(args.results or out, args.name, markdown(result), result).read_text())
    return 0


def markdown(result: dict) -> str:
    s = result["settings"]
    profile = ("the `--quick` profile (a small model and budgets, not the medium one)" if result["profile"] == "quick"
               else "the full profile")
    lines = [
        f"Model {Path(result['model']).name}, bf16, {profile}: budgets gpu {s['gpu']} + cpu {s['cpu']} + disk, "
        f"prompt {s['prompt']}, {s['new']} new tokens; the disk is measured cold right before and after each "
        f"streamed run (first measurement {result['disk']['bytes_per_s'] / 1e9:.2f} GB/s). Accelerate runs the "
        "dense bf16 weights: `x Accelerate` is a same-format comparison on `none` rows and a packed-vs-dense one "
        "on `int8`/`int4` rows (the format's fewer bytes, and fitting in RAM, count as well as the scheduler); "
        "`x Offload none` compares a packed row with Offload's own dense row of the same batch and depth.",
        "",
        "| weights | batch | depth | Offload ms/step | compute-only ms/step | disk GB/step | disk GB/s "
        "| disk-time ms/step "
        "| ratio to bound | ratio to disk busy "
        "| stall ms/step | predicted ms/step | Offload peak RSS MiB | x Offload none "
        "| Accelerate (bf16) ms/step | Accelerate peak RSS MiB | x Accelerate | comparison | tokens = Accelerate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    dense = {(r["batch"], r["depth"]): r["offload_ms_per_step"] for r in result["rows"]
             if r.get("weights", "none") == "none"}
    for r in result["rows"]:
        acc = "accelerate_ms_per_step" in r
        packed = r.get("weights", "none") != "none"
        same = dense.get((r["batch"], r["depth"]))
        lines.append(
            f"| {r.get('weights', 'none')} | {r['batch']} | {r['depth']} "
            f"| {r['offload_ms_per_step']:.0f} | {r['compute_only_ms_per_step']:.0f} | "
            f"{r['disk_bytes_per_step'] / 1e9:.3f} | {r['disk_bytes_per_s'] / 1e9:.2f} | {r['disk_ms_per_step']:.0f} | "
            f"{r['ratio_to_bound']:.2f} | {r['ratio_to_disk_busy']:.2f} | "
            f"{r['offload_stall_ms_per_step']:.0f} | {r.get('predicted_ms_per_step', float('nan')):.0f} | "
            f"{mib(r['offload_peak_rss'])} | "
            + (f"{same / r['offload_ms_per_step']:.2f}x | " if packed and same else "- | ")
            + (f"{r['accelerate_ms_per_step']:.0f} | {mib(r['accelerate_peak_rss'])} | "
               f"{r['speedup_vs_accelerate']:.2f}x | {'packed vs dense' if packed else 'same format'} | "
               f"{r['tokens_equal_accelerate']} |" if acc else "- | - | - | - | - |")
        )
    if not result["rows"]:
        lines = []
    kv = result.get("kv") or []
    if kv:
        lines += ["", "KV cache beyond the device and host (small model, KV budget on gpu + cpu = 1/4 of need):", "",
                  "| KV quantization | batch | context | ms/step | all-device ms/step | compute ms/step | "
                  "KV fetch ms/step | KV fetch MiB/step | ratio to bound | tokens = all-device |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in kv:
            lines.append(f"| {r['quantization']} | {r['batch']} | {r['context']} | {r['ms_per_step']:.0f} | "
                         f"{r['all_device_ms_per_step']:.0f} | {r['compute_ms_per_step']:.0f} | "
                         f"{r['kv_fetch_ms_per_step']:.0f} | {r['kv_fetch_bytes_per_step'] / 2**20:.1f} | "
                         f"{r['ratio_to_bound']:.2f} | {r['tokens_equal_device']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
