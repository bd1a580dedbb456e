"""A model's layers over ranks (torch.distributed, gloo on 127.0.0.1): the one-process run's tokens, a dead rank named.

Each case spawns 2-3 processes (the ranks of a launch, as torchrun would set them up); rank 0 runs the Runner,
the others `run_stage`. The reference is the same calls in this process, outside any launch.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from offload.cli.main import main
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.model.checkpoint import Checkpoint
from offload.plan.stages import RankSpeed, balance, split_layers
from offload.runtime import pipeline
from offload.runtime.executor import ForwardBatch
from offload.runtime.pipeline import auto_micro_batches, micro_batches, run_stage
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling
from offload.weights.groups import model_layouts, stage_groups
from tests.conftest import run_config
from tests.test_chat_template import CHATML

PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41, 42, 43], [1, 8, 2], [1, 400, 33, 12, 19, 250]]
NEW = 6
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, model_factory) -> Path:
    d = tmp_path_factory.mktemp("dist") / "model"
    shutil.copytree(model_factory("llama"), d)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>"}))
    return d


def drive(cfg: dict, chat: bool) -> dict:
    """What rank 0 (or the one process) computes: a ragged greedy batch, and a two-turn chat."""
    with Runner(cfg) as r:
        out = {"tokens": [res.outputs[0].token_ids for res in r.generate(PROMPTS, max_new_tokens=NEW,
                                                                         temperature=0.0, stop_on_eos=False)]}
        if chat:
            conv = r.chat(sampling=Sampling(NEW, stop_token_ids=frozenset()))
            out["chat"] = [conv.say(t).token_ids for t in ("Hello there", "And then?")]
    return out


def _rank(rank: int, world: int, port: int, cfg: dict, out: str, job: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if rank == 0:
        if "serve" in job:  # the CLI's server, as torchrun would run it on rank 0
            Path(out).write_text(json.dumps({"status": main(job["serve"])}))
            return
        try:
            result = drive(cfg, job.get("chat", False))
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}", "at": time.time()}
        Path(out).write_text(json.dumps(result))
        return
    if job.get("die_when") is not None and rank == 1:  # once this file exists, this rank dies in its next pass
        forward, flag = pipeline.Executor.forward, Path(job["die_when"])

        def dying(self, batch, hidden=None):
            if flag.exists():
                (flag.parent / "died").write_text(str(time.time()))
                if job.get("hang"):
                    os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead: its sockets stay open
                os._exit(9)
            return forward(self, batch, hidden)
        pipeline.Executor.forward = dying
    try:
        run_stage(OffloadConfig.load(cfg))
    except Exception:
        sys.exit(1)


def launch(cfg: dict, world: int, tmp: Path, limit: float = 60, grace: float = 20,
           **job) -> tuple[dict, list[int | None], float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"rank0-{port}.json"
    ctx = mp.get_context("forkserver")  # each rank a fork of one clean process that imported torch once
    ctx.set_forkserver_preload(["tests.test_pipeline"])
    procs = [ctx.Process(target=_rank, args=(r, world, port, cfg, str(out), job)) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    procs[0].join(limit)
    took = time.monotonic() - t0  # until rank 0 ended
    for p in procs[1:]:
        p.join(max(min(grace, limit - (time.monotonic() - t0)), 1))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return json.loads(out.read_text()) if out.exists() else {}, codes, took


def test_two_ranks_give_the_one_process_tokens_for_a_ragged_batch_and_a_chat(chat_model, tmp_path):
    cfg = run_config(chat_model, kv_cache={"gpu_blocks": 16}, activations={"prefill_chunk": 8},
                     distributed={"micro_batches": 2})
    expected = drive(cfg, chat=True)
    got, codes, _ = launch(cfg, 2, tmp_path, chat=True)
    assert got == expected and codes == [0, 0]


def test_three_ranks_with_uneven_layers_and_streamed_tiers_give_the_same_tokens(tiny_llama, tmp_path):
    layer = model_layouts(Checkpoint(tiny_llama).config, torch.float32)["layer.0"].nbytes
    tiers = {"gpu": {"capacity": layer + int(0.7 * 2**20)}, "cpu": {"capacity": layer + 4096},
             "disk": {"path": str(tmp_path / "store")}}  # one store, shared read-only by every rank
    cfg = run_config(tiny_llama, tiers=tiers, prefetch={"depth": 0}, kv_cache={"gpu_blocks": 8},
                     activations={"prefill_chunk": 8}, distributed={"layers": [2, 1, 1], "micro_batches": 3})
    expected = drive(cfg, chat=False)  # one process: it streams from the store it converts
    got, codes, _ = launch(cfg, 3, tmp_path)
    assert got == expected and codes == [0, 0, 0]


def test_a_killed_rank_ends_every_rank_with_an_error_naming_it(tiny_llama, tmp_path):
    cfg = run_config(tiny_llama, distributed={"timeout_s": 10})
    (tmp_path / "die").touch()
    got, codes, _ = launch(cfg, 3, tmp_path, limit=60, die_when=str(tmp_path / "die"))
    assert "rank 1 stopped answering" in got.get("error", ""), got
    assert codes[1] == 9 and codes[2] not in (0, None) and None not in codes, codes  # nothing left running
    assert got["at"] - float((tmp_path / "died").read_text()) < 15  # a dead peer's sockets close at once


def test_micro_batches_keep_sequences_whole_and_the_rows_in_order():
    b = ForwardBatch.last([0, 1, 2, 3], [[1] * 9, [2], [3], [4] * 5])
    parts = micro_batches(b, 2)
    assert [p.sids for p in parts] == [(0,), (1, 2, 3)]
    assert [p.sids for p in micro_batches(ForwardBatch.last([5, 6, 7], [[1], [2], [3]]), 3)] == [(5,), (6,), (7,)]
    v = ForwardBatch.verify([0, 1], [[1, 2], [3, 4, 5]], keep=[2, 1], lanes=[0, -1])
    assert [(p.keep, p.lanes) for p in micro_batches(v, 2)] == [((2,), (0,)), ((1,), (-1,))]
    assert micro_batches(ForwardBatch.last([0], [[1, 2]]), 4) == [ForwardBatch.last([0], [[1, 2]])]
    decode, prefill = ForwardBatch.last(range(16), [[1]] * 16), ForwardBatch.last([0, 1], [[1] * 200, [2] * 100])
    assert auto_micro_batches(decode, 2, resident=True) == 1  # a few rows: bound by reading the weights
    assert auto_micro_batches(prefill, 2, resident=True) == 2 and auto_micro_batches(prefill, 2, False) == 1


def test_a_hung_rank_ends_rank_0_within_the_timeout_with_an_error_naming_it(tiny_llama, tmp_path):
    cfg = run_config(tiny_llama, distributed={"timeout_s": 3})
    (tmp_path / "die").touch()
    got, codes, _ = launch(cfg, 2, tmp_path, limit=60, grace=1, die_when=str(tmp_path / "die"),
                              hang=True)
    assert "rank 1 stopped answering" in got.get("error", ""), got
    assert codes[0] == 0 and codes[1] is None, (got, codes)  # rank 0 ended by itself; the stopped one is killed
    assert got["at"] - float((tmp_path / "died").read_text()) < 3 + 15, got  # the timeout, then the beats checked


def test_layers_auto_balances_the_stages_and_a_wrong_list_is_refused(tiny_llama):
    assert balance([1, 1, 1, 1], 2) == (2, 2) and balance([1, 1, 1, 5], 2) == (3, 1)
    counts = balance([4, 1, 1, 1, 1], 3)
    assert counts[0] == 1 and sum(counts) == 5 and max(counts[1:]) <= 3  # no stage costs more than the first
    config = OffloadConfig.load(run_config(tiny_llama, distributed={"layers": [3, 2]}))
    cfg = Checkpoint(tiny_llama).config
    with pytest.raises(ConfigError, match="summing to the model's 4"):
        split_layers(config, cfg, torch.float32, 2)
    auto = split_layers(OffloadConfig.load(run_config(tiny_llama)), cfg, torch.float32, 3)
    assert auto == [range(0, 1), range(1, 3), range(3, 4)]  # the head weighs on the last rank
    # each layer 0.72 MB, the head 0.26 MB; `small` holds one layer and streams the rest from a slow disk
    big, small = (RankSpeed(1e9, 1e9, 1e9, 0.0, 1e8), RankSpeed(0.8e6, 0.0, 1e9, 0.0, 1e8))
    config = OffloadConfig.load(run_config(tiny_llama))
    assert [len(r) for r in split_layers(config, cfg, torch.float32, 2, [big, big])] == [2, 2]
    assert [len(r) for r in split_layers(config, cfg, torch.float32, 2, [small, big])] == [1, 3]
    assert [len(r) for r in split_layers(config, cfg, torch.float32, 2, [big, small])] == [3, 1]
    assert stage_groups(cfg, range(0, 2)) == ["embed", "layer.0", "layer.1"]
    assert stage_groups(cfg, range(2, 4)) == ["layer.2", "layer.3", "head"]


def test_offload_run_under_torchrun_prints_the_one_process_text(tiny_llama, tmp_path, capsys):
    yaml = tmp_path / "x.yaml"
    yaml.write_text(json.dumps(run_config(tiny_llama)))
    args = ["run", "--config", str(yaml), "--prompt-ids", "1,17,99,23", "--max-new-tokens", "5", "--temperature",
            "0", "--no-spans"]
    assert main(args) == 0
    one = capsys.readouterr().out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(port), "-m", "offload", *args],
                         capture_output=True, text=True, env=env, timeout=120)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one and one.strip()
    assert "rank 1 of 2: layers" in two.stderr  # each rank says which layers it holds
    # `offload plan --ranks 2` shows, before any launch, the very lines the two ranks logged
    assert main(["plan", "--config", str(yaml), "--ranks", "2"]) == 0
    shown = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("rank ")]
    logged = sorted(line[line.index("rank "):] for line in two.stderr.splitlines() if " of 2: layers " in line)
    assert len(shown) == 2 and sorted(shown) == logged, (shown, logged)


def completion(port: int, prompt: list[int]) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_over_two_ranks_answers_concurrent_clients_and_a_dead_rank_gets_503_and_exit_2(tiny_llama, tmp_path):
    cfg = run_config(tiny_llama, distributed={"timeout_s": 10})
    with Runner(cfg) as r:
        expected = [res.outputs[0].text for res in r.generate(PROMPTS, max_new_tokens=NEW, temperature=0.0)]
    yaml = tmp_path / "x.yaml"
    yaml.write_text(json.dumps(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http = s.getsockname()[1]
    args = ["serve", "--config", str(yaml), "--port", str(http), "--model-name", "tiny", "--kv-tokens", "256"]
    result: list = []
    runner = threading.Thread(target=lambda: result.append(launch(cfg, 2, tmp_path, limit=90, serve=args,
                                                                  die_when=str(tmp_path / "die"))))
    runner.start()
    for _ in range(600):  # the ranks start and plan
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda p: completion(http, p), PROMPTS))
    assert [a[0] for a in answers] == [200] * 3
    assert [a[1]["choices"][0]["text"] for a in answers] == expected
    (tmp_path / "die").touch()
    status, body = completion(http, PROMPTS[0])
    assert status == 503 and "rank 1 stopped answering" in body["error"]["message"], body
    runner.join(90)
    got, codes, _ = result[0]
    assert got == {"status": 2} and codes == [0, 9], (got, codes)  # rank 0 exits 2 (its process ends cleanly)
