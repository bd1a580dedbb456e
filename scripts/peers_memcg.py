"""Offload and llama.cpp at equal memory: each engine alone in a memory cgroup of the same limit, page cache dropped
first, interleaved; decode after a short prompt and after contexts of the given lengths.

    python -m scripts.peers_memcg --config C.yaml --gguf M.gguf --limit 1G --depths 0 1536 --repeat 2 --name NAME

Offload runs `offload run --config C --prompt-ids IDS --max-new-tokens N --json` (every `auto` of the YAML as
given); llama.cpp `llama-bench -m M -t CPUS -p 0 -n N -d DEPTH -r 2 -o json`, memory-mapping its GGUF (the page cache
it reads through counts in the same cgroup: an mmap engine's best budget is the whole limit). A run the cgroup's OOM
killer stops is recorded as such. Writes NAME.md and NAME.json (`scripts.machine.Result`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from offload.plan.machine import cpus  # noqa: E402
from scripts import memcg  # noqa: E402
from scripts.bench_cpu import START_ENV, llama_bin, prompt  # noqa: E402
from scripts.machine import Result  # noqa: E402


def offload_run(config: Path, depth: int, new: int, limit: str) -> dict:
    ids = ",".join(map(str, prompt(max(depth, 6), 32000)))  # (ids below every vocabulary's size here)
    cmd = [sys.executable, "-m", "offload", "run", "--config", str(config), "--prompt-ids", ids,
           "--max-new-tokens", str(new), "--json"]
    proc, stats = memcg.run(cmd, limit, drop=True, capture_output=True, text=True, timeout=3600, env=START_ENV)
    if proc.returncode != 0:
        return {"error": memcg.why_failed(proc, stats), "memcg": stats}
    out = json.loads(proc.stdout)
    s = out["stats"]
    return {"prompt_tokens": s["prompt_tokens"], "prefill_tok_s": s["prefill_tokens_per_s"],
            "decode_tok_s": s["decode_tokens_per_s"], "memcg": stats,
            "groups_in_ram": sum(home != "disk" for home in out["plan"]["homes"].values()),
            "groups": len(out["plan"]["homes"])}


def llama_run(gguf: Path, depth: int, new: int, limit: str) -> dict:
    bin_dir = llama_bin()
    cmd = [f"{bin_dir}/llama-bench", "-m", str(gguf), "-t", str(cpus()), "-p", "0", "-n", str(new), "-d", str(depth),
           "-r", "2", "-o", "json"]
    proc, stats = memcg.run(cmd, limit, drop=True, capture_output=True, text=True, timeout=3600,
                            env=START_ENV | {"LD_LIBRARY_PATH": bin_dir})
    if proc.returncode != 0 or "[" not in proc.stdout:
        return {"error": memcg.why_failed(proc, stats), "memcg": stats}
    return {"decode_tok_s": json.loads(proc.stdout[proc.stdout.index("["):])[0]["avg_ts"], "memcg": stats}


def cell(r: dict, key: str) -> str:
    return r["error"] if "error" in r else f"{r[key]:.2f}"


def markdown(args, rows: list[dict]) -> str:
    lines = [f"Offload (`{args.config}`) and llama.cpp (`{args.gguf}`), each alone in a {args.limit} memory cgroup, "
             f"page cache dropped first, interleaved; {args.new} new tokens after a prompt of each length.", "",
             "| context | repeat | Offload prefill tok/s | Offload decode tok/s | llama.cpp decode tok/s | ratio | "
             "Offload groups in RAM | limit hits (Offload / llama.cpp) |", "|---|---|---|---|---|---|---|---|"]
    tail = ["", "Offload's YAML:", "", "```yaml", args.config.read_text().rstrip("\n"), "```"]
    for row in rows:
        o, ll = row["offload"], row["llama.cpp"]
        ratio = "-" if "error" in o or "error" in ll else f"{o['decode_tok_s'] / ll['decode_tok_s']:.2f}"
        ram = "-" if "error" in o else f"{o['groups_in_ram']} of {o['groups']}"
        lines.append(f"| {row['depth']} | {row['repeat']} | {cell(o, 'prefill_tok_s')} | {cell(o, 'decode_tok_s')} | "
                     f"{cell(ll, 'decode_tok_s')} | {ratio} | {ram} | {o['memcg'].get('limit_hits')} / "
                     f"{ll['memcg'].get('limit_hits')} |")
    return "\n".join(lines + tail) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="Offload's YAML")
    ap.add_argument("--gguf", type=Path, required=True, help="the same checkpoint as llama.cpp's GGUF")
    ap.add_argument("--limit", default="1G", help="the memory cgroup's limit, the same for both (1G, 1536M)")
    ap.add_argument("--depths", type=int, nargs="+", default=[0], help="context lengths before decoding")
    ap.add_argument("--new", type=int, default=32, help="new tokens per run")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved repeats")
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "results")
    ap.add_argument("--name", default="peers-memcg")
    args = ap.parse_args(argv)
    result, rows = Result(), []
    for depth in args.depths:
        for repeat in range(1, args.repeat + 1):
            rows.append({"depth": depth, "repeat": repeat,
                         "offload": offload_run(args.config.resolve(), depth, args.new, args.limit),
                         "llama.cpp": llama_run(args.gguf, depth, args.new, args.limit)})
            print(json.dumps(rows[-1]), flush=True)
    print(result.write(args.out, args.name, markdown(args, rows), {"args": {k: str(v) for k, v in vars(args).items()},
                                                                   "config": args.config.read_text(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
