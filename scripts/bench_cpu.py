"""Offload against llama.cpp on this CPU: same machine, same run, each in its own process, all threads.

    python scripts/bench_cpu.py                          # 1.7B Llama shape and SmolLM2-135M, bf16 / int8 / int4
    python scripts/bench_cpu.py --models smollm2 --formats bf16 int4 --repeat 3
    python scripts/bench_cpu.py --quick                  # a tiny model, no llama.cpp: the smoke run the tests use

For each model and format (Offload bf16 / int8 / int4 against llama.cpp's BF16 / Q8_0 / Q4_0 GGUF of the same
checkpoint), in fresh subprocesses, `--repeat` times interleaved (other jobs share this machine: the best of the
repeats is reported, and the load average is recorded beside every number):
  offload    all weights resident: batch-1 decode tokens/s (a 64-token prompt, `--new` tokens), 64-token prefill
             tokens/s, and `offload plan --json`'s predicted decode step (this machine's calibration, measured
             once at the start of the run) against the measured one
  library    the same with OFFLOAD_CPU_KERNELS=library (torch's GEMMs, attention padded to the batch): what the
             row-invariant kernels cost or save
  llama.cpp  llama-bench: pp64 and tg32 (built by shared/peers/llama_cpp.sh from the registry's source package);
             on the first repeat also a pass of k+1 tokens for the largest k in `--verify` (its batch, as a verify
             pass is), over its decode step
  streamed   Offload with its weights on disk and a device tier of a quarter of them, the ring's three layers
             and 64 MiB of workspace (`--streamed` formats)
  verify     a verify pass over k+1 tokens (one sequence) over a plain decode step timed beside it (alternating,
             best of 5 each), for each k in `--verify`
  depth      with `--depth`: the prefill of a prompt of each length and decode tokens/s after it, both engines,
             every repeat (llama.cpp: llama-bench -p N -n 0, and -d N)
Writes OUT/cpu-vs-llama.json and OUT/cpu-vs-llama.md (OUT defaults to scripts/results/), the command line included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: The environment this command was started with, before anything it imports changes it: every worker (and
#: llama-bench, an OpenMP program too) starts from it (an OMP_WAIT_POLICY=PASSIVE leaked from this process slowed
#: llama.cpp's decode 2.6-5x in session 3's table)
START_ENV = dict(os.environ)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from scripts.machine import cpu_flags, load  # noqa: E402

#: Device-tier room beside a streamed run's quarter of the weights and its ring's three layers: a prefill chunk's
#: logits and activations, 16 KV blocks (SmolLM2-135M int4: a quarter of its weights is 27 MiB, the smallest plan 69)
WORKSPACE_MIB = 64
LLAMA = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}
QUANT = {"bf16": "none", "int8": "int8", "int4": "int4"}
#: llama.cpp's CMake options for a build without AMX (its native build's AMX Q8_0 / Q4_0 kernels crashed with SIGILL
#: on a 2-core Xeon VM whose torch runs AMX matmuls; this build's AVX-512 kernels, repacking on, are its fastest there)
LLAMA_NO_AMX = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON")
#: what a row's JSON keeps of each repeat of each engine
REPEAT_KEYS = ("decode_tok_s", "prefill_tok_s", "load_before", "memory_before")
#: shared/peers/llama_cpp.sh beside the checkout (/work/main) or beside a worktree's parent (/work/wt/NAME)
PEERS = Path(os.environ.get("OFFLOAD_PEERS", next((p / "shared" / "peers" / "llama_cpp.sh" for p in ROOT.parents
                                                   if (p / "shared" / "peers" / "llama_cpp.sh").is_file()),
                                                  ROOT.parent / "shared" / "peers" / "llama_cpp.sh")))


def prompt(length: int, vocab: int) -> list[int]:
    return [1] + [(7919 * i) % (vocab - 3) + 3 for i in range(1, length)]


# ----------------------------------------------------------------------------- workers (one per subprocess)
def worker_offload(spec: dict) -> dict:
    import torch

    from offload.runtime.runner import Runner

    out = {"kernels": os.environ.get("OFFLOAD_CPU_KERNELS", "invariant"), "threads": torch.get_num_threads(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "OpenMP's default")}
    with Runner.from_config(spec["config"]) as r:
        ids = prompt(spec["prompt"], r.cfg.vocab_size)
        r.generate([ids], max_new_tokens=2, stop_on_eos=False)  # warm-up: first-use compilation, page faults
        best = None
        for _ in range(spec.get("inner", 2)):
            res = r.generate([ids], max_new_tokens=spec["new"], stop_on_eos=False)[0]
            assert res.stats.cached_tokens == 0, "the prefill ran from the prefix cache"
            run = {"decode_ms": res.stats.decode_only_ms_per_step, "prefill_s": res.stats.prefill_s,
                   "tokens": res.token_ids}
            if best is not None:  # the best decode and the best prefill, each of its own run
                run["prefill_s"] = min(run["prefill_s"], best["prefill_s"])
            best = run if best is None or run["decode_ms"] < best["decode_ms"] else best | \
                {"prefill_s": run["prefill_s"]}
        # the threads the last pass ran on: fewer than `threads` where other work took cores (`offload.runtime.cores`)
        out |= best | {"compute_dtype": str(r.compute_dtype).removeprefix("torch."),
                       "threads_at_end": torch.get_num_threads()}
        for depth in spec.get("depths") or []:  # decode after a long prompt: attention over `depth` keys a step
            long = prompt(depth, r.cfg.vocab_size)
            steps = [r.generate([long], max_new_tokens=spec["new"], stop_on_eos=False)[0].stats for _ in range(2)]
            out.setdefault("depth", {})[str(depth)] = 1000 / min(s.decode_only_ms_per_step for s in steps)
            out.setdefault("depth_prefill", {})[str(depth)] = depth / min(s.prefill_s for s in steps)
        if spec.get("verify"):
            with torch.inference_mode():  # the KV pool was made inside generate's inference mode
                out["verify"] = verify_costs(r, ids, spec["verify"])
    return out


def verify_costs(r, ids: list[int], ks: list[int], rounds: int = 5) -> dict[str, float]:
    """A pass over k+1 new tokens of one sequence (a verify pass) over a plain decode step: each k's passes and plain
    steps alternate, `rounds` of each, and the best of each is compared (this host's speed swings minute to minute:
    a plain step timed once, before the passes, set some k against a faster minute than its own)."""
    from offload.runtime.executor import ForwardBatch

    ex = r.target  # offload.runtime.executor.Executor
    kv = ex.ensure_kv(ex.blocks_for(len(ids) + max(ks) + 2) + 1)
    sid = kv.add_sequence()
    try:
        ex.forward(ForwardBatch.last([sid], [ids]))

        def once(tokens: list[int], keep: list[int] | None) -> float:
            t0 = time.perf_counter()
            ex.forward(ForwardBatch.last([sid], [tokens]) if keep is None else
                       ForwardBatch.verify([sid], [tokens], keep))
            took = time.perf_counter() - t0
            kv.truncate(sid, len(ids))
            return took

        out, fastest = {}, float("inf")
        for k in ks:
            plain = verify = float("inf")
            for _ in range(rounds):
                plain = min(plain, once([5], None))
                verify = min(verify, once([5 + i for i in range(k + 1)], [k + 1]))
            out[str(k)], fastest = verify / plain, min(fastest, plain)
        return {"plain_ms": 1000 * fastest} | out
    finally:
        kv.free_sequence(sid)


def worker_llama(spec: dict) -> dict:
    proc = subprocess.run(["bash", str(PEERS), "bench", spec["gguf"], str(spec["threads"])], capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode in (132, 134, 139):  # SIGILL / SIGABRT / SIGSEGV through bash
        raise RuntimeError(f"llama-bench crashed (exit {proc.returncode}) on {spec['gguf']}: a native build on a CPU "
                           "that reports AMX runs ggml's AMX kernels for Q8_0 / Q4_0, which crashed on a 2-core Xeon "
                           f"VM whose torch runs AMX; build it with {LLAMA_NO_AMX} in the build directory llama_cpp.sh "
                           f"prints.\n{proc.stderr[-2000:]}")
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    pp = next(x for x in rows if x["n_prompt"] and not x["n_gen"])
    tg = next(x for x in rows if x["n_gen"] and not x["n_prompt"])
    out = {"prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"], "decode_tok_s_sd": tg["stddev_ts"],
           "build": rows[0].get("build_commit"), "cpu_info": rows[0].get("cpu_info"), "type": rows[0].get("type")}
    if spec.get("batch"):  # llama.cpp's own price of a batch of k+1 tokens, for the verify column
        batch = llama_bench(spec, "-p", str(spec["batch"]), "-n", "0")[0]
        out["batch_pass_over_step"] = {"tokens": spec["batch"],
                                       "ratio": spec["batch"] / batch["avg_ts"] * tg["avg_ts"]}
    if spec.get("depths"):  # decode after a prompt of each depth (its own pass first, not timed)
        rows = llama_bench(spec, "-p", "0", "-n", str(spec["new"]), "-d", ",".join(map(str, spec["depths"])))
        out["depth"] = {str(x["n_depth"]): x["avg_ts"] for x in rows}
        rows = llama_bench(spec, "-p", ",".join(map(str, spec["depths"])), "-n", "0")  # those prompts' prefill
        out["depth_prefill"] = {str(x["n_prompt"]): x["avg_ts"] for x in rows}
    return out


def llama_bin() -> str:
    """llama.cpp's build directory (`shared/peers/llama_cpp.sh build`: built once, then found)."""
    return subprocess.run(["bash", str(PEERS), "build"], capture_output=True, text=True, check=True,
                          timeout=3600).stdout.strip().splitlines()[-1]


def llama_bench(spec: dict, *args: str) -> list[dict]:
    """llama-bench's JSON rows for the GGUF and threads of `spec` with these arguments (3 repetitions)."""
    bin_dir = llama_bin()
    proc = subprocess.run([f"{bin_dir}/llama-bench", "-m", spec["gguf"], "-t", str(spec["threads"]), *args, "-r", "3",
                           "-o", "json"], capture_output=True, text=True, timeout=3600,
                          env=START_ENV | {"LD_LIBRARY_PATH": bin_dir})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout[proc.stdout.index("["):])


def worker_plan(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "offload", "plan", "--config", spec["config_path"], "--json",
                           "--context", str(spec["context"])],
                          capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {"predicted_step_ms": 1000 * data["prediction"]["step_s"], "compute_dtype": data.get("compute_dtype")}


WORKERS = {"offload": worker_offload, "llama": worker_llama, "plan": worker_plan}


def run_worker(kind: str, spec: dict, env: dict | None = None, timeout: int = 5400) -> dict:
    """One worker in its own process; its JSON with the load before and after and this machine's
    memory read rate just before (`memory_before`, a sum of 256 MiB: this host's swings 25-43 GB/s within an hour,
    so a row's engines are compared at the rates their repeats met)."""
    before, memory = load(), memory_bandwidth(2**28)["sum"]
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--spec", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                          env=START_ENV | {"PYTHONPATH": str(ROOT)} | (env or {}))
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"load_before": before, "load_after": load(),
                                                               "memory_before": memory}


# ----------------------------------------------------------------------------- models
def ensure_models(names: list[str], cache: Path, quick: bool) -> dict[str, Path]:
    from offload.testing.make_model import make_model
    from scripts.trained_model import ensure_trained_model

    out = {}
    for name in names:
        if name == "smollm2":
            out[name] = ensure_trained_model(dtype="bfloat16")
        else:
            size = "tiny" if quick else name
            path = cache / "models" / f"llama-{size}-bf16"
            if not (path / "config.json").is_file():
                tmp = make_model(path.with_name(path.name + ".partial"), family="llama", size=size, dtype="bfloat16",
                                 progress=True, overrides={"intermediate_size": 384} if quick else None)
                if size == "1.7b":  # SmolLM2-1.7B's tokenizer is SmolLM2-135M's (vocab 49152): llama.cpp's GGUF
                    # converter knows its pre-tokenizer, not the one make_model trains
                    smol = ensure_trained_model(dtype="bfloat16")
                    for f in ("tokenizer.json", "tokenizer_config.json"):
                        shutil.copy(smol / f, tmp / f)
                tmp.rename(path)
            out[name] = path
    return out


def ensure_gguf(model: Path, cache: Path) -> Path:
    base = cache / "gguf" / model.name
    base.parent.mkdir(parents=True, exist_ok=True)
    if not Path(f"{base}-q4_0.gguf").is_file():
        subprocess.run(["bash", str(PEERS), "gguf", str(model), str(base)], check=True, stdout=subprocess.DEVNULL)
    return base


def ensure_store(model: Path, store: Path, quant: str) -> None:
    import torch

    from offload.model.checkpoint import Checkpoint
    from offload.weights.convert import convert, open_store
    from offload.weights.groups import WeightFormat
    from storage.errors import StoreError

    ckpt, fmt = Checkpoint(model), WeightFormat(quant)
    try:
        open_store(ckpt, store, torch.bfloat16, fmt=fmt).close()
    except StoreError as e:  # converted by an older version or in another format: this benchmark's own, rebuilt
        print(f"{store}: {e}; converting again", file=sys.stderr)
        convert(ckpt, store, torch.bfloat16, force=True, fmt=fmt).close()


def layer_bytes(model: Path, quant: str) -> tuple[int, int]:
    """(the model's bytes in this format, the bytes a decode step reads: all but a packed format's embedding table,
    of which a step looks up one row a token; a dense tied model's head is its embedding, read whole)."""
    import torch

    from offload.model.checkpoint import Checkpoint
    from offload.weights.groups import WeightFormat, model_layouts

    groups = model_layouts(Checkpoint(model).config, torch.bfloat16, WeightFormat(quant))
    return sum(g.nbytes for g in groups.values()), sum(g.nbytes for name, g in groups.items() if name != "embed")


# ----------------------------------------------------------------------------- orchestration
def best(runs: list[dict], key: str, high: bool = True) -> dict:
    return sorted(runs, key=lambda r: r[key], reverse=high)[0]


def bench_model(name: str, model: Path, args, cache: Path, calibration: Path) -> list[dict]:
    rows = []
    gguf = None if args.no_llama else ensure_gguf(model, cache)
    for fmt in args.formats:
        # no prefix cache: every run repeats the prompt, and a cached prompt is not a prefill
        config = {"model": str(model), "device": "cpu", "dtype": "bfloat16", "calibration": str(calibration),
                  "weights": {"quantization": QUANT[fmt]}, "kv_cache": {"prefix_cache": "off"}}
        spec = {"config": config, "prompt": args.prompt, "new": args.new, "depths": args.depth}
        runs: dict[str, list[dict]] = {"offload": [], "library": [], "llama": []}
        for rep in range(args.repeat):  # interleaved: each peer sees the same stretch of this machine's load
            runs["offload"].append(run_worker("offload", spec | {"verify": args.verify if rep == 0 else []}))
            if not args.no_library:
                runs["library"].append(run_worker("offload", spec, {"OFFLOAD_CPU_KERNELS": "library"}))
            if gguf is not None:
                runs["llama"].append(run_worker("llama", {"gguf": f"{gguf}-{LLAMA[fmt]}.gguf",
                                                          "threads": args.threads, "new": args.new,
                                                          "depths": args.depth,
                                                          "batch": max(args.verify) + 1 if args.verify and rep == 0
                                                          else None}))
        for r in runs["offload"] + runs["library"]:
            r["decode_tok_s"], r["prefill_tok_s"] = 1000 / r["decode_ms"], args.prompt / r["prefill_s"]
        off = best(runs["offload"], "decode_tok_s")
        cfg_path = cache / f"plan-{name}-{fmt}.yaml"
        cfg_path.write_text(json.dumps(config))
        plan = run_worker("plan", {"config_path": str(cfg_path), "context": args.prompt + args.new // 2})
        size, read = layer_bytes(model, QUANT[fmt])
        row = {"model": name, "format": fmt, "llama_format": LLAMA[fmt].upper(),
               "bytes": size, "read_bytes": read,
               "offload": off, "offload_prefill_tok_s": best(runs["offload"], "prefill_tok_s")["prefill_tok_s"],
               "verify": runs["offload"][0].get("verify"), "plan": plan,
               "prediction_error": plan["predicted_step_ms"] / off["decode_ms"] - 1,  # against the fastest repeat
               # and each repeat's: a prediction is of a typical run, and the best of several on a noisy host is not
               "prediction_errors": [plan["predicted_step_ms"] / r["decode_ms"] - 1 for r in runs["offload"]],
               "repeats": {k: [{x: r.get(x) for x in REPEAT_KEYS} for r in v] for k, v in runs.items()}}
        if runs["library"]:
            lib = best(runs["library"], "decode_tok_s")
            row["library"] = lib | {"prefill_tok_s": best(runs["library"], "prefill_tok_s")["prefill_tok_s"]}
            row["tokens_equal_library"] = lib["tokens"] == off["tokens"]
        if runs["llama"]:
            row["llama"] = best(runs["llama"], "decode_tok_s") | {
                "prefill_tok_s": best(runs["llama"], "prefill_tok_s")["prefill_tok_s"]}
            if "batch_pass_over_step" in runs["llama"][0]:
                row["llama_batch_pass_over_step"] = runs["llama"][0]["batch_pass_over_step"]
        for key in ("depth", "depth_prefill") if args.depth else ():  # each engine's best of its repeats, each depth
            row[key] = {str(d): {e: max(r[key][str(d)] for r in runs[e]) for e in ("offload", "llama")
                                 if runs[e] and all(key in r for r in runs[e])} for d in args.depth}
        if fmt in args.streamed:
            store = cache / "stores" / f"{model.name}-{QUANT[fmt]}"
            ensure_store(model, store, QUANT[fmt])
            from offload.model.checkpoint import Checkpoint

            layers = Checkpoint(model).config.num_layers
            # a quarter of the weights, the ring's three layers' slots and the workspace
            tier = f"{(row['bytes'] // 4 + 3 * row['bytes'] // layers) // 2**20 + WORKSPACE_MIB}MiB"
            streamed = config | {"tiers": {"gpu": {"capacity": tier}, "cpu": {"capacity": "0MiB"},
                                           "disk": {"path": str(store)}},
                                 "kv_cache": {"gpu_blocks": 16, "prefix_cache": "off"}}
            try:
                s = run_worker("offload", {"config": streamed, "prompt": args.prompt, "new": args.new})
                row["streamed"] = s | {"decode_tok_s": 1000 / s["decode_ms"], "device_tier": tier,
                                       "tokens_equal_resident": s["tokens"] == off["tokens"]}
            except RuntimeError as e:  # recorded in its row: the resident rows above still count
                row["streamed"] = {"error": str(e).strip().splitlines()[-1], "device_tier": tier}
        rows.append(row)
        print(f"{name} {fmt}: offload {off['decode_tok_s']:.1f} tok/s"
              + (f", llama.cpp {row['llama']['decode_tok_s']:.1f}" if "llama" in row else ""), file=sys.stderr)
    return rows


def fmt_row(r: dict) -> str:
    o, lib, ll = r["offload"], r.get("library"), r.get("llama")
    v = r.get("verify") or {}

    def num(x: float | None, f: str = ".1f") -> str:
        return "-" if x is None else format(x, f)

    def ratio(a: float, b: float | None) -> str:
        return f"{a / b:.2f}" if b else "-"

    cells = [r["model"], f"{r['format']} / {r['llama_format']}", num(r["bytes"] / 2**20, ".0f"),
             num(o["decode_tok_s"]), num(r.get("read_bytes", r["bytes"]) / o["decode_ms"] / 1e6),
             num(ll and ll["decode_tok_s"]),
             ratio(o["decode_tok_s"], ll and ll["decode_tok_s"]),
             num(r["offload_prefill_tok_s"]), num(ll and ll["prefill_tok_s"]),
             ratio(r["offload_prefill_tok_s"], ll and ll["prefill_tok_s"]),
             num(lib and lib["decode_tok_s"]), num(lib and lib["prefill_tok_s"]),
             str(r["tokens_equal_library"]) if lib else "-",
             f"{r['plan']['predicted_step_ms']:.0f} / {o['decode_ms']:.0f} ({r['prediction_error']:+.0%}"
             + (f"; each repeat {' / '.join(f'{e:+.0%}' for e in r['prediction_errors'])})"
                if len(r.get("prediction_errors", ())) > 1 else ")"),
             num(r["streamed"].get("decode_tok_s")) if "streamed" in r else "-",
             " ".join(f"{k}: {x:.2f}" for k, x in v.items() if k != "plain_ms") or "-",
             (lambda b: f"{b['tokens']} tokens: {b['ratio']:.2f}" if b else "-")(r.get("llama_batch_pass_over_step"))]
    return "| " + " | ".join(cells) + " |"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"`{result['command']}`", "",
             f"Machine: {m['cpus']} CPUs, {m['processor']}; flags: {m['cpu_flags']}; load before / after: "
             f"{m['load_before']} / {m['load_after']}; memory {m['memory']['sum'] / 1e9:.1f} GB/s (sum of 1 GiB), "
             f"{m['memory']['copy'] / 1e9:.1f} GB/s (copy); torch {m['torch']}, numba {m['numba']}; OMP_WAIT_POLICY "
             f"{m.get('omp_wait_policy', '?')}; "
             f"{result['threads']} threads. Best of {result['repeat']} interleaved repeats (other jobs share this "
             "machine; each repeat's load is in the JSON). Decode: batch 1, all resident, a "
             f"{result['prompt']}-token prompt, {result['new']} new tokens; prefill: the {result['prompt']}-token "
             "prompt.", "",
             "| model | Offload / llama.cpp format | MiB | Offload decode tok/s | weights read GB/s "
             "| llama.cpp decode tok/s | ratio "
             "| Offload prefill tok/s | llama.cpp prefill tok/s | ratio | library-kernels decode tok/s "
             "| library prefill tok/s | same tokens | plan predicted / fastest measured ms (error) "
             "| streamed decode tok/s | verify k+1 over plain, by k | llama.cpp's pass of k+1 over its step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [fmt_row(r) for r in result["rows"]]
    deep = [(r, d, e) for r in result["rows"] for d, e in (r.get("depth") or {}).items()]
    if deep:
        lines += ["", f"A prompt of each length: its prefill, then decode after it (batch 1, {result['new']} new "
                      "tokens, best of the repeats; llama.cpp: llama-bench -p N -n 0 and -d N):", "",
                  "| model | format | depth | Offload prefill tok/s | llama.cpp prefill tok/s | ratio "
                  "| Offload decode tok/s | llama.cpp decode tok/s | ratio |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [(f"| {r['model']} | {r['format']} / {r['llama_format']} | {d} | "
                   + _pair((r.get("depth_prefill") or {}).get(d, {})) + _pair(e)).rstrip() for r, d, e in deep]
    met = [x["memory_before"] for r in result["rows"] for v in r["repeats"].values() for x in v
           if x.get("memory_before")]
    if met:
        lines += ["", f"Memory read rate just before each engine's run (a sum of 256 MiB): {min(met) / 1e9:.1f}-"
                      f"{max(met) / 1e9:.1f} GB/s; each repeat's is in the JSON (`repeats`)."]
    return "\n".join(lines) + "\n"


def _pair(e: dict) -> str:
    """Offload's and llama.cpp's figure and their ratio, as table cells."""
    ours = f"{e['offload']:.1f}" if "offload" in e else "-"
    return f"{ours} | " + (f"{e['llama']:.1f} | {e['offload'] / e['llama']:.2f} | " if "llama" in e and "offload" in e
                           else "- | - | ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["1.7b", "smollm2"], choices=("1.7b", "smollm2", "tiny"))
    ap.add_argument("--formats", nargs="*", default=["bf16", "int8", "int4"], choices=tuple(QUANT))
    ap.add_argument("--streamed", nargs="*", default=["int4"], choices=tuple(QUANT))
    ap.add_argument("--verify", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--depth", type=int, nargs="*", default=[],
                    help="also prompts of these lengths: their prefill and decode after them, both engines")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="the tiny model, one format, no llama.cpp")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-library", action="store_true")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("OFFLOAD_CACHE", Path.home() / ".cache/offload"))
                    / "bench-cpu", help="models, GGUFs, stores and the calibration")
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "results")
    ap.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](json.loads(args.spec))))
        return 0
    if args.quick:
        args.models, args.formats, args.streamed, args.no_llama, args.repeat = ["tiny"], ["int4"], ["int4"], True, 1
        args.verify, args.new, args.prompt = [1, 2], 4, 16
    import torch

    from offload.plan.calibrate import calibrate
    from offload.runtime.overhead import engine_overhead_s

    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    models = ensure_models(args.models, cache, args.quick)
    # measured at the start of every run, never one of an earlier run: the plan rows compare a prediction with runs
    # of this hour (a calibration 90 minutes old put the plan at +6..+37% where one of the run's own said -18..+1%)
    calibration = cache / "calibration.json"
    calibrate(torch.device("cpu"), torch.bfloat16, cache, engine=engine_overhead_s).save(calibration)  # (all packed)
    machine = {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
               "cpu_flags": cpu_flags(), "load_before": load(), "torch": torch.__version__,
               "numba": _numba_version(), "python": sys.version.split()[0], "memory": memory_bandwidth(),
               "omp_wait_policy": START_ENV.get("OMP_WAIT_POLICY", "unset")}
    rows = []
    for name, path in models.items():
        rows += bench_model(name, path, args, cache, calibration)
    machine["load_after"] = load()
    result = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "machine": machine,
              "threads": args.threads, "repeat": args.repeat, "prompt": args.prompt, "new": args.new, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cpu-vs-llama-quick" if args.quick else "cpu-vs-llama"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def memory_bandwidth(nbytes: int = 2**30, reps: int = 3) -> dict[str, float]:
    """This machine's memory bandwidth, all threads: a sum over `nbytes` of float32 (reads) and a copy of
    them (reads + writes, counted twice), best of `reps`, in bytes per second."""
    import torch

    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    out = {}
    for name, f, moved in (("sum", a.sum, nbytes), ("copy", lambda: b.copy_(a), 2 * nbytes)):
        f()
        t = min(_timed(f) for _ in range(reps))
        out[name] = moved / t
    return out


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _numba_version() -> str | None:
    try:
        import numba
    except ImportError:
        return None
    return numba.__version__


if __name__ == "__main__":
    sys.exit(main())
