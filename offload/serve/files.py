"""Throughput mode: a JSONL file of prompts through one engine loop, results written as they finish.

    {"id": "a", "prompt": "Once upon a time"}                      input lines (id optional: the line number)
    {"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "temperature": 0.7}
    {"id": "a", "prompt_tokens": 5, "cached_tokens": 0, "choices": [{"index": 0, "text": "...",
     "token_ids": [...], "finish_reason": "length"}]}              output lines, in the order they finish

`cached_tokens`: the prompt tokens the prefix cache supplied (`kv_cache.prefix_cache`), not computed.

Up to `max_batch` outputs run at once, so each pass over the weights (one read of every
layer) computes a token for all of them; newcomers join at step boundaries as others finish.
A rerun skips the ids already in the output file (an unfinished last line, from a killed run,
is dropped), so an interrupted job resumes where it stopped. Per-line keys override the
command's defaults: max_tokens, temperature, top_p, top_k, seed, n, stop.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from offload.errors import ConfigError
from offload.runtime.requests import blocks_needed
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling
from offload.serve.loop import EngineLoop, Event, Job, Limits
from offload.serve.schema import BadRequest, ChatBody, CompletionBody, ServedModel

log = logging.getLogger(__name__)

KEYS = {"id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop"}


@dataclass(frozen=True)
class FileDefaults:
    max_tokens: int = 64
    temperature: float | None = None  # None: the checkpoint's generation_config
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


@dataclass
class FileReport:
    done: int  # requests finished in this run
    skipped: int  # already in the output file
    tokens: int  # generated in this run
    seconds: float
    batch: int = 0  # sequences the KV pool keeps decoding together (min of it and max_batch)
    most_rows: int = 0  # the most sequences one pass computed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def read_requests(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"--input {str(path)!r} does not exist; give a JSONL file with one request per line")
    out, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e}); one JSON object per line") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise ConfigError(f"{path}:{n}: each line is an object with a 'prompt' or a 'messages' key")
        unknown = set(row) - KEYS
        if unknown:
            raise ConfigError(f"{path}:{n}: unknown key(s) {sorted(unknown)}; use {sorted(KEYS)}")
        row["id"] = str(row.get("id", n))
        if row["id"] in seen:
            raise ConfigError(f"{path}:{n}: id {row['id']!r} appears twice; ids must be unique to resume")
        seen.add(row["id"])
        row["_line"] = n
        out.append(row)
    return out


def finished_ids(path: Path) -> set[str]:
    """Ids already written; an unfinished last line (a killed run) is cut off so appending stays valid JSONL."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        log.warning("%s: dropping an unfinished last line (an interrupted run); it will be redone", path)
        path.write_bytes(keep)
    ids = set()
    for line in keep.decode("utf-8").splitlines():
        if line.strip():
            ids.add(str(json.loads(line)["id"]))
    return ids


def _job(served: ServedModel, row: dict[str, Any], d: FileDefaults) -> tuple[list[int], Sampling, tuple[str, ...]]:
    body: dict[str, Any] = {"model": served.name, "max_tokens": row.get("max_tokens", d.max_tokens),
                            "temperature": row.get("temperature", d.temperature), "top_p": row.get("top_p", d.top_p),
                            "top_k": row.get("top_k", d.top_k), "seed": row.get("seed", d.seed),
                            "n": row.get("n", 1), "stop": row.get("stop")}
    try:
        if "messages" in row:
            return served.chat(ChatBody(messages=row["messages"], **body))
        prompts, sampling, stops = served.completion(CompletionBody(prompt=row["prompt"], **body))
    except BadRequest as e:
        raise ConfigError(f"request {row['id']!r} (line {row['_line']}): {e}") from None
    except ValueError as e:  # pydantic: a field of the wrong type
        raise ConfigError(f"request {row['id']!r} (line {row['_line']}): {e}") from None
    if len(prompts) != 1:
        raise ConfigError(f"request {row['id']!r} (line {row['_line']}): 'prompt' must be one string or one list "
                          "of token ids")
    return prompts[0], sampling, stops


def run_file(runner: Runner, input_path: Path, output_path: Path, defaults: FileDefaults = FileDefaults(),
             max_batch: int = 256, progress: bool = True) -> FileReport:
    """Run every request of `input_path` not yet in `output_path`, appending each result as it finishes.

    Without a fixed KV pool (no tiers, kv_cache.gpu_blocks: auto) the pool is sized for the
    `max_batch` largest requests, so the whole batch runs in every pass.
    """
    served = ServedModel.from_runner(runner)
    rows = read_requests(input_path)
    done_before = finished_ids(output_path)
    todo = [r for r in rows if r["id"] not in done_before]
    jobs = [(r, *_job(served, r, defaults)) for r in todo]  # every line checked before anything runs
    if not jobs:
        return FileReport(0, len(rows), 0, 0.0)
    if runner.kv is None:
        bs = runner.kv_settings.block_size
        largest = sorted(((blocks_needed(len(p), s, bs), s.n) for _, p, s, _ in jobs), reverse=True)[:max_batch]
        runner.fix_kv_pool(runner.pool_blocks(sum(b for b, _ in largest), [n for _, n in largest]))
    loop = EngineLoop(runner, Limits(max_batch=max_batch, max_queue=None))
    output_path.parent.mkdir(parents=True, exist_ok=True)
    t0, tokens = time.perf_counter(), 0
    bar = tqdm(total=len(todo), unit="req", disable=not progress, desc="offload run")
    with bar, output_path.open("a", encoding="utf-8") as out:  # an interrupt ends the bar's line too
        def sink_for(row: dict[str, Any], n: int, prompt_len: int, job: Job):
            choices = [{"index": k, "text": "", "token_ids": [], "finish_reason": None} for k in range(n)]

            def sink(ev: Event) -> None:
                nonlocal tokens
                c = choices[ev.output]
                c["text"] += ev.text
                if ev.token_id is not None:
                    c["token_ids"].append(ev.token_id)
                    tokens += 1
                if ev.finish:
                    c["finish_reason"] = ev.finish
                    if all(x["finish_reason"] for x in choices):
                        cached = (job.request.cached or 0) if job.request is not None else 0
                        _write(out, {"id": row["id"], "prompt_tokens": prompt_len, "cached_tokens": cached,
                                     "choices": choices})
                        bar.update(1)
                        bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):.1f} tok/s")
            return sink

        for r, prompt, sampling, stops in jobs:  # one that could never fit is refused before any step runs
            job = Job(prompt, sampling, lambda ev: None, stops, f"request {r['id']!r}")
            job.sink = sink_for(r, sampling.n, len(prompt), job)
            loop.submit(job)
        while loop.busy:
            loop.step()
    return FileReport(len(todo), len(rows) - len(todo), tokens, time.perf_counter() - t0,
                      min(loop.engine.batch, max_batch), loop.engine.stats.most_rows)


def _write(out: TextIO, row: dict[str, Any]) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()  # a finished result survives a crash of the rest of the run
