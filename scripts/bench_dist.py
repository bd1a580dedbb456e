"""Benchmark: a model larger than one rank's budget, on 1 rank (what does not fit streamed from the store) or 2
ranks (each holds its half; nothing streamed), decode tokens/s at batch 1 and 16; a 70B over 1-4 GPUs on paper.

    python scripts/bench_dist.py --quick       # small model (113 MB bf16), budget 80 MiB per rank
    python scripts/bench_dist.py               # medium (TinyLlama-1.1B shape, 2.2 GB bf16), budget 1.2 GiB per rank

Both runs use the same cores: the 1-rank run gets every thread, each of the 2 ranks half of them (one
machine, gloo on 127.0.0.1; the 2-rank run is launched with `python -m torch.distributed.run`). Each rank gets
the memory of one machine of the profile's size (`memory_max`, --memory-max): the 1-rank run inside a memory
cgroup of that size, the 2-rank launch inside one of twice that plus 256 MiB for torchrun's agent
(scripts/memcg.py, the page cache dropped first), so what one rank streams comes from the disk, not from a page
cache larger than its machine. Without a limit (--quick, --memory-max none) the store is read through the page
cache. Results go to scripts/results/bench-dist{,-quick}.{md,json} with the command, the machine and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offload.config import OffloadConfig  # noqa: E402
from offload.runtime.pipeline import run_stage  # noqa: E402
from offload.runtime.ranks import env_rank, launched  # noqa: E402
from offload.runtime.runner import Runner  # noqa: E402
from scripts import memcg  # noqa: E402
from scripts.bench import ensure_model, ensure_store, prompts  # noqa: E402
from scripts.machine import Result  # noqa: E402

PROFILES = {
    "full": dict(size="medium", budget="1200MiB", prompt=16, new=8, batches=[1, 16], memory_max="1792M"),
    "quick": dict(size="small", budget="80MiB", prompt=16, new=8, batches=[1, 16], memory_max=None),
}

# on paper: Llama-70B int4 (0.56 bytes per weight: ~40 GB of weights), 80 layers, H = 8192
PAPER = dict(weights_gb=40.0, layers=80, hidden=8192, gpu_gb=24.0, gpu_bw_gbs=900.0, pcie_gbs=25.0,
             hop_ms=0.5)


def worker(spec: dict) -> None:
    """One run (or one rank of it): rank 0 decodes each batch and writes tokens/s to spec['out']."""
    import torch

    torch.set_num_threads(spec["threads"])
    if launched() and env_rank() > 0:
        run_stage(OffloadConfig.load(spec["config"]))
        return
    out = {}
    with Runner(spec["config"]) as r:
        streamed = len(r.plan.streamed)
        for b in spec["batches"]:
            ps = prompts(b, spec["prompt"], r.cfg.vocab_size)
            r.generate(ps, max_new_tokens=2, temperature=0.0, stop_on_eos=False)  # warm
            r.generate(ps, max_new_tokens=spec["new"], temperature=0.0, stop_on_eos=False)
            st = r.last_stats
            out[str(b)] = {"decode_tok_s": st.decode_tokens / st.decode_s, "ms_per_step": 1000 * st.decode_s /
                           st.decode_steps, "rank0_streamed_groups": streamed}
    Path(spec["out"]).write_text(json.dumps(out))


def run(spec: dict, ranks: int, tmp: Path, memory_max: int | None = None) -> dict:
    path = tmp / f"spec-{ranks}.json"
    spec = spec | {"out": str(tmp / f"out-{ranks}.json")}
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(spec["threads"])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path)]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(port), *cmd[1:]]
    limit = None if memory_max is None else ranks * memory_max + (256 << 20 if ranks > 1 else 0)
    proc, stats = memcg.run(cmd, limit, drop=limit is not None, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the {ranks}-rank run failed (exit {proc.returncode}; memory cgroup: {stats})")
    return json.loads(Path(spec["out"]).read_text()) | {"memcg": stats}


def paper() -> list[dict]:
    """Decode on paper: each GPU reads its share of the weights once per pass at gpu_bw, one GPU alone streams
    what does not fit over PCIe; a decode pass is bound by those bytes at batch 1 and 16 alike (int4 matrices,
    16 rows), and the stages run one after another: pass = sum of the stages + one hop per GPU."""
    p, rows = PAPER, []
    for gpus in (1, 2, 3, 4):
        share = p["weights_gb"] / gpus
        stream = max(share - (p["gpu_gb"] - 4), 0)  # 4 GB of each GPU for KV, ring and workspace
        stage_s = (share - stream) / p["gpu_bw_gbs"] + stream / p["pcie_gbs"]
        pass_s = gpus * stage_s + (gpus * p["hop_ms"] / 1000 if gpus > 1 else 0)
        rows.append({"gpus": gpus, "streamed_gb_per_gpu": round(stream, 1), "stage_ms": round(1000 * stage_s, 1),
                     "b1_tok_s": round(1 / pass_s, 1), "b16_tok_s": round(16 / pass_s, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--results", default=str(ROOT / "scripts" / "results"))
    ap.add_argument("--memory-max", default=None, help="one rank's machine memory (default: the profile's; none)")
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    result = Result()
    prof = PROFILES["quick" if args.quick else "full"]
    out = Path(tempfile.gettempdir()) / "offload-bench"
    model = ensure_model(out, prof["size"])
    store = out / "stores" / f"{prof['size']}-bf16"
    ensure_store(model, store)
    config = {"model": str(model), "device": "cpu", "dtype": "bfloat16", "compute_dtype": "bfloat16",
              "tiers": {"gpu": {"capacity": prof["budget"]}, "cpu": {"capacity": 0}, "disk": {"path": str(store)}},
              "kv_cache": {"gpu_blocks": 40}, "activations": {"prefill_chunk": 32}, "prefetch": {"depth": 1}}
    spec = {"config": config, "batches": prof["batches"], "prompt": prof["prompt"], "new": prof["new"]}
    data: dict = {"profile": prof, "config": config, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        limit = memcg.limit_arg(args.memory_max, prof["memory_max"])
        data["memory_max_per_rank"] = limit
        data["runs"]["1 rank"] = run(spec | {"threads": args.threads}, 1, Path(tmp), limit)
        data["runs"]["2 ranks"] = run(spec | {"threads": max(args.threads // 2, 1)}, 2, Path(tmp), limit)
    data["paper_70b_int4"] = {"assumptions": PAPER, "rows": paper()}
    lines = [f"Model: {prof['size']} llama, bfloat16, CPU; each rank's device tier {prof['budget']}; what "
             "does not fit streams from the store; prompt "
             f"{prof['prompt']} tokens, {prof['new']} new. Memory per rank: "
             + (f"{limit / 2**20:.0f} MiB (a memory cgroup per run, page cache counted: the 1-rank run's streamed "
                "half comes from the disk)" if limit else "unlimited (streaming reads the page cache)") + ".", "",
             "| run | batch | decode tok/s | ms/step | rank 0 streamed groups |", "|---|---|---|---|---|"]
    for name, rows in data["runs"].items():
        for b, r in rows.items():
            if b == "memcg":
                continue
            lines.append(f"| {name} | {b} | {r['decode_tok_s']:.2f} | {r['ms_per_step']:.1f} | "
                         f"{r['rank0_streamed_groups']} |")
    lines += ["", "On paper: Llama-70B int4 (~40 GB) over 24 GB GPUs at 900 GB/s, PCIe 25 GB/s for what one GPU "
              "streams, 0.5 ms per hop (`PAPER` in the script):", "",
              "| GPUs | streamed GB per GPU | stage ms | b1 tok/s | b16 tok/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['gpus']} | {r['streamed_gb_per_gpu']} | {r['stage_ms']} | {r['b1_tok_s']} | {r['b16_tok_s']} |"
              for r in data["paper_70b_int4"]["rows"]]
    path = result.write(args.results, "bench-dist-quick" if args.quick else "bench-dist", "\n".join(lines), data)
    print(path.read_text())


if __name__ == "__main__":
    main()
