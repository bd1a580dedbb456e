"""Reliability: clean exits, one store shared by several processes, bounded memory, hostile inputs refused
before they cost anything, and a full disk or a SIGKILL at the worst moment.

Subprocess checks run the real `offload` command (or a five-line script) on tiny models; the rest run in
this process. `scripts/exit_check.py` is the 20-run version of the clean-exit check.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.cli.main import main
from offload.config import ConfigError, OffloadConfig
from offload.errors import CheckpointError, StoreError
from offload.model.checkpoint import Checkpoint, read_safetensors_header
from offload.model.config import ModelConfig
from offload.runtime.runner import Runner
from offload.weights.convert import convert, open_store
from schedulers.timeline import Timeline
from scripts.exit_check import FIVE_LINES, five_line_config
from storage.disk import DiskTier
from storage.lock import SCRATCH_LOCK, FileLock
from storage.store import LOCK, MARKER, StoreState, read_manifest, store_state
from tests.conftest import run_config

PROMPT = [1, 40, 41, 300, 7, 99, 12]
REPO = Path(__file__).resolve().parents[1]
#: worker threads a runner starts (the prefetcher's, the disk tier's and the KV slot file's pools)
WORKERS = ("offload-", "disk-read", "kv-disk")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def streamed(model: Path, store: Path, disk_blocks: int = 0, **kw) -> dict:
    """Weights streamed from the store through a 3-slot ring; KV spilled to a slot file when disk_blocks."""
    kv = {"gpu_blocks": 8} if not disk_blocks else {"gpu_blocks": 2, "cpu_blocks": 0, "disk_blocks": disk_blocks}
    return run_config(model, tiers={"gpu": {"capacity": "3MiB"}, "cpu": {"capacity": "1MiB"},
                                    "disk": {"path": str(store)}},
                      prefetch={"depth": 2}, kv_cache=kv, activations={"prefill_chunk": 16}, **kw)


def tokens(cfg: dict, n: int = 12, prompt=PROMPT) -> list[int]:
    with Runner.from_config(cfg) as r:
        return r.generate([prompt], max_new_tokens=n, stop_on_eos=False)[0].token_ids


def workers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(WORKERS) and t.is_alive()]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return tokens(run_config(tiny_llama), n=40)


# ----------------------------------------------------------------------------- lifecycle
def test_a_five_line_script_without_close_exits_cleanly(tmp_path, tiny_llama):
    """The bug report: bf16, tiers, prefetch depth 2, no close(): exit status 0, nothing on stderr about threads
    (`scripts/exit_check.py --runs 20` is the long version). An atexit hook registered before the runner runs
    after its finalizer, and sees every worker joined."""
    config = tmp_path / "five.yaml"
    config.write_text(yaml.safe_dump(five_line_config(tiny_llama, tmp_path / "store")))
    script = tmp_path / "five.py"
    probe = ("import atexit, threading\n"
             f"atexit.register(lambda: print('alive at exit:', [t.name for t in threading.enumerate() "
             f"if t.name.startswith({WORKERS!r})]))\n")
    script.write_text(probe + FIVE_LINES.format(config=config))
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env(), timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr and "Exception ignored" not in proc.stderr
        assert "alive at exit: []" in proc.stdout  # the finalizer joined every worker before exit


def test_close_and_garbage_collection_join_every_thread(tmp_path, tiny_llama, reference):
    r = Runner.from_config(streamed(tiny_llama, tmp_path / "s", disk_blocks=16))
    assert r.generate([PROMPT], max_new_tokens=12, stop_on_eos=False)[0].token_ids == reference[:12]
    assert any(n.startswith("offload-loader") for n in workers_alive())
    scratch = r.kv._scratch.path
    r.close()
    r.close()  # twice is harmless
    assert workers_alive() == [] and not scratch.exists()

    r = Runner.from_config(streamed(tiny_llama, tmp_path / "s", disk_blocks=16))
    r.generate([PROMPT], max_new_tokens=4, stop_on_eos=False)
    scratch = r.kv._scratch.path
    assert workers_alive()
    del r
    gc.collect()
    assert workers_alive() == [] and not scratch.exists()


def test_an_interrupted_generate_leaves_the_runner_usable(tmp_path, tiny_llama, reference):
    """Ctrl-C in a notebook: the blocks of the interrupted requests go back to the pool, the next call is exact."""
    with Runner.from_config(streamed(tiny_llama, tmp_path / "s", disk_blocks=16)) as r:
        free = {t: p.num_free for t, p in r.kv.pools.items()}, r.kv.logical.num_free

        def stop(i, token, text):
            if len(seen) == 5:
                raise KeyboardInterrupt
            seen.append(token)
        seen: list[int] = []
        with pytest.raises(KeyboardInterrupt):
            r.generate([PROMPT], max_new_tokens=30, stop_on_eos=False, on_token=stop)
        assert seen == reference[:5] and not r.kv.seqs
        assert ({t: p.num_free for t, p in r.kv.pools.items()}, r.kv.logical.num_free) == free
        assert r.generate([PROMPT], max_new_tokens=20, stop_on_eos=False)[0].token_ids == reference[:20]


def start_run(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "offload", "run", "--config", str(config), "--prompt",
                             "Once upon a time", "--max-new-tokens", "4000", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=REPO)


def wait_for_tokens(proc: subprocess.Popen, n: int = 40) -> bytes:
    """Read the streamed text until `n` bytes past the prompt have arrived."""
    got = b""
    while len(got) < len(b"Once upon a time") + n:
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, proc.stderr.read().decode()[-2000:]
        got += chunk
    return got


@pytest.mark.parametrize("sig,status,word", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_and_sigterm_stop_run_within_a_second(tmp_path, tiny_llama, sig, status, word):
    """`offload run` stops within a second of the signal, prints what it generated, and leaves the store valid."""
    store = tmp_path / "store"
    config = tmp_path / "run.yaml"
    cfg = streamed(tiny_llama, store, disk_blocks=64)
    cfg["kv_cache"] = {"gpu_blocks": 8, "disk_blocks": 8000}  # room for the 4000 new tokens: outlasts the test
    config.write_text(yaml.safe_dump(cfg))
    proc = start_run(config)
    head = wait_for_tokens(proc)
    sent = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == status, err.decode()[-2000:]
    assert took < 1.0 + 1.0 * (os.getloadavg()[0] > 4)  # a second (plus one on a machine this loaded)
    text, err = (head + out).decode(), err.decode()
    assert text.startswith("Once upon a time") and text.endswith("\n")  # the text alone, its line ended
    done = int(err.split("[interrupted after ")[1].split()[0])  # on stderr, on a line of its own
    assert done > 0 and f"; {4000 - done} more of the 4000 asked for were not generated]" in err
    assert f"offload: {word}" in err
    assert store_state(store) is StoreState.COMPLETE
    assert [p.name for p in (store / "kv-scratch").iterdir()] == []  # its slot files went with it
    assert tokens(streamed(tiny_llama, store), n=8) == tokens(run_config(tiny_llama), n=8)


# ----------------------------------------------------------------------------- one store, many processes
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_simultaneous_first_runs_share_one_store(tmp_path, tiny_llama, reference, n):
    store = tmp_path / "store"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(streamed(tiny_llama, store, disk_blocks=16)))
    cmd = [sys.executable, "-m", "offload", "run", "--config", str(config), "--json", "--max-new-tokens", "12",
           "--prompt", "Once upon a time"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=REPO)
             for _ in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-2000:]
    ids = [json.loads(out)["results"][0]["token_ids"] for out, _ in outs]
    assert all(i == ids[0] for i in ids) and len(ids[0]) == 12
    assert store_state(store) is StoreState.COMPLETE


def test_a_waiting_process_names_the_converter_then_uses_its_store(tmp_path, tiny_llama, reference, caplog):
    store = tmp_path / "store"
    store.mkdir()
    converter = FileLock(store / LOCK)  # another "process" (an open file of its own) is converting
    converter.exclusive()
    converter.announce("converting")
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(ids=tokens(streamed(tiny_llama, store))))
    with caplog.at_level(logging.WARNING, logger="storage.store"):
        worker.start()
        deadline = time.monotonic() + 60
        while not any("waiting for" in m for m in caplog.messages) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.is_alive()
        [msg] = [m for m in caplog.messages if "waiting for" in m]
        assert f"waiting for pid {os.getpid()} (converting since" in msg and str(store) in msg
        converter.close()  # it ended without a store (as if killed): the waiter converts it itself
        worker.join(120)
    assert result["ids"] == reference[:12] and store_state(store) is StoreState.COMPLETE


def test_an_open_store_says_whether_this_process_converted_it(tmp_path, tiny_llama):
    """`chat --auto` says "converted" only where it converted: a process that waited for another's conversion
    (or found the store complete) reused it."""
    ckpt, store = Checkpoint(tiny_llama), tmp_path / "store"
    store.mkdir()
    holder = FileLock(store / LOCK)  # another "process" (an open file of its own) converts
    holder.exclusive()
    opened: dict = {}
    waiter = threading.Thread(target=lambda: opened.update(s=open_store(ckpt, store, torch.float32)))
    waiter.start()
    time.sleep(0.5)
    convert(ckpt, store, torch.float32, lock=holder).close()  # the other process converts while it waits
    holder.close()
    waiter.join(120)
    assert not opened["s"].built and store_state(store) is StoreState.COMPLETE
    opened["s"].close()
    fresh = open_store(ckpt, tmp_path / "fresh", torch.float32)
    assert fresh.built
    fresh.close()


def test_a_lock_held_by_a_killed_converter_is_taken_over(tmp_path, tiny_llama, reference):
    store = tmp_path / "store"
    store.mkdir()
    code = (f"import fcntl, os\nfd = os.open({str(store / LOCK)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, b'pid %d (converting)' % os.getpid())\n"
            f"open({str(store / MARKER)!r}, 'w').write('{{}}')\nos.makedirs({str(store / 'layer.0')!r})\n"
            "os.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, "-c", code])
    assert proc.returncode == -signal.SIGKILL and store_state(store) is StoreState.PARTIAL
    assert tokens(streamed(tiny_llama, store)) == reference[:12]  # no wait: the dead hold nothing


def test_kv_slot_files_are_per_process_and_the_dead_ones_are_swept(tmp_path, tiny_llama, reference):
    store = tmp_path / "store"
    cfg = streamed(tiny_llama, store, disk_blocks=16)
    tokens(cfg, n=2)  # converts the store
    dead = store / "kv-scratch" / "4242-gone"  # a scratch dir whose owner died (its lock is free)
    dead.mkdir()
    (dead / SCRATCH_LOCK).touch()
    (dead / "kv-kv").mkdir()
    with Runner.from_config(cfg) as a, Runner.from_config(cfg) as b:
        assert not dead.exists()
        assert a.kv._scratch.path != b.kv._scratch.path
        for _ in range(2):  # interleaved: neither overwrites the other's spilled blocks
            ra = a.generate([PROMPT], max_new_tokens=30, stop_on_eos=False)[0].token_ids
            rb = b.generate([PROMPT], max_new_tokens=30, stop_on_eos=False)[0].token_ids
            assert ra == rb == reference[:30]
            assert a.traffic.total("kv", "gpu->disk") > 0 or a.traffic.total("kv", "cpu->disk") > 0
    assert list((store / "kv-scratch").iterdir()) == []


# ----------------------------------------------------------------------------- bounded memory
def test_the_timeline_keeps_a_bounded_window():
    tl = Timeline(keep_steps=10)
    for _ in range(1000):
        tl.add("compute", "layer.0", tl.now(), tl.now())
        tl.count("bytes resident", gpu=1)
        tl.next_step()
    assert len(tl.spans) <= 13 and {s.step for s in tl.spans} >= set(range(990, 1000))
    assert len(tl.counters) <= 14
    everything = Timeline(keep_steps=None)
    for _ in range(100):
        everything.add("compute", "x", 0, 1)
        everything.next_step()
    assert len(everything.spans) == 100


def internal_sizes(r: Runner) -> dict[str, int]:
    p = r.weights.prefetcher
    return {"spans": len(r.timeline.spans), "counters": len(r.timeline.counters), "pending": len(r.timeline._pending),
            "loads": len(p._loads), "staged": len(p._staged), "staged_events": len(p._staged_events),
            "current": len(p._current), "taken": len(p._taken), "seqs": len(r.kv.seqs), "blocks": len(r.kv.blocks)}


@pytest.mark.slow
def test_rss_and_every_list_stay_flat_over_2000_decode_steps(tmp_path, tiny_llama):
    cfg = streamed(tiny_llama, tmp_path / "s", disk_blocks=16, timeline={"keep_steps": 64})
    me = psutil.Process()
    with Runner.from_config(cfg) as r:
        steps = 0

        def run(calls: int) -> None:
            nonlocal steps
            for _ in range(calls):
                out = r.generate([PROMPT], max_new_tokens=100, stop_on_eos=False)[0]
                steps += out.stats.decode_steps
        run(4)  # warm up: allocator pools, rope tables, the first window of spans
        gc.collect()
        rss0, sizes0, warm = me.memory_info().rss, internal_sizes(r), steps
        run(21)  # 21 x 99 decode steps (the first token of each call comes from its prefill)
        gc.collect()
        rss1, sizes1 = me.memory_info().rss, internal_sizes(r)
    assert steps - warm >= 2000
    assert abs(rss1 - rss0) <= 16 * 2**20, f"RSS moved {(rss1 - rss0) / 2**20:.1f} MiB over {steps} steps"
    for k, v in sizes1.items():
        assert v <= max(sizes0[k], 1) * 1.3 + 8, (k, sizes0[k], v)


# ----------------------------------------------------------------------------- hostile inputs
def safetensors_file(path: Path, header: object, data: bytes = b"", hlen: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data)
    return path


GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize("header,hlen,match", [
    (GOOD, 2**62, r"header length 4611686018427387904 is invalid"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, None, r"data_offsets overlap"),
    ({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1600]}}, None, r"tensor 'a' ends at byte"),
    ({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}}, None, r"'a': data_offsets \[16, 0\]"),
    ({"a": {"dtype": "Q7", "shape": [2, 2], "data_offsets": [0, 16]}}, None, r"'a': dtype 'Q7' is not"),
    ({"a": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}}, None, r"'a': data_offsets give 16 bytes"),
    ({"a": {"dtype": "F32", "shape": [-4, -1], "data_offsets": [0, 16]}}, None, r"'a': shape \[-4, -1\] is not"),
    ({"a": "F32"}, None, r"'a': its header entry is not an object"),
    ([1, 2], None, r"header is not a JSON object"),
])
def test_bad_safetensors_headers_are_one_clear_error(tmp_path, header, hlen, match):
    f = safetensors_file(tmp_path / "model.safetensors", header, bytes(16), hlen)
    with pytest.raises(CheckpointError, match=match) as info:
        read_safetensors_header(f)
    assert str(f) in str(info.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=8), st.one_of(
    st.none(), st.integers(), st.text(max_size=6), st.lists(st.integers(-3, 40), max_size=4),
    st.fixed_dictionaries({}, optional={"dtype": st.sampled_from(["F32", "BF16", "I8", "X", 3]),
                                        "shape": st.lists(st.integers(-2, 5), max_size=3) | st.integers(),
                                        "data_offsets": st.lists(st.integers(-2, 80), max_size=3)})),
    max_size=4), tail=st.binary(max_size=64), hlen_delta=st.sampled_from([0, 0, 0, -1, 3, 2**40]))
def test_any_safetensors_header_is_read_or_refused_cleanly(tmp_path, header, tail, hlen_delta):
    raw = json.dumps(header).encode()
    f = safetensors_file(tmp_path / "fuzz.safetensors", raw, tail, max(len(raw) + hlen_delta, 0))
    try:
        entries, _ = read_safetensors_header(f)
    except CheckpointError as e:
        assert str(f) in str(e) and "\n" not in str(e)
        return
    spans = sorted((e.start, e.start + e.nbytes) for e in entries.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and all(end <= f.stat().st_size for _, end in spans)


BASE_CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}


@pytest.mark.parametrize("change,match", [
    ({"num_hidden_layers": 10**9}, r"num_hidden_layers is 1000000000, expected an integer from 1 to 4096"),
    ({"hidden_size": 0}, r"hidden_size is 0"),
    ({"num_attention_heads": 3}, r"hidden_size \(128\) is not a multiple of num_attention_heads \(3\)"),
    ({"vocab_size": "512"}, r"vocab_size is 512, expected an integer"),
    ({"rms_norm_eps": -1}, r"rms_norm_eps is -1"),
    ({"rope_scaling": "big"}, r"malformed"),
    ({"eos_token_id": ["x"]}, r"eos_token_id must be integers"),
])
def test_absurd_config_json_is_refused(change, match):
    with pytest.raises(CheckpointError, match=match) as info:
        ModelConfig.from_dict({**BASE_CONFIG, **change}, "ckpt/config.json")
    assert str(info.value).startswith("ckpt/config.json: ")


def test_a_config_json_promising_a_huge_model_costs_nothing(tmp_path, tiny_llama):
    """hidden 2^17 with the tiny shards: refused from the headers, before a byte is allocated for weights."""
    fake = tmp_path / "fake"
    fake.mkdir()
    for f in tiny_llama.iterdir():
        (fake / f.name).symlink_to(f)
    (fake / "config.json").unlink()
    raw = json.loads((tiny_llama / "config.json").read_text())
    (fake / "config.json").write_text(json.dumps({**raw, "hidden_size": 2**17, "intermediate_size": 2**19}))
    rss = psutil.Process().memory_info().rss
    with pytest.raises(CheckpointError, match=r"has shape \[.*\] but config.json implies"):
        Runner.from_config(run_config(fake, tiers={"gpu": {"capacity": "1TiB"}}))
    assert psutil.Process().memory_info().rss - rss < 64 * 2**20


@pytest.mark.parametrize("name", ["../../evil", "a/b", "x\0y", ".hidden", "..", ""])
def test_names_that_would_escape_the_store_are_refused(tmp_path, name):
    tier = DiskTier(tmp_path / "t")
    with pytest.raises(StoreError, match="is not allowed"):
        tier.allocate(name, 4096)
    tier.close()
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["zarr.json"]


@pytest.fixture(scope="module")
def manifest(tiny_llama, tmp_path_factory):
    store = tmp_path_factory.mktemp("m") / "s"
    convert(Checkpoint(tiny_llama), store, torch.float32, progress=False).close()
    return json.loads((store / "manifest.json").read_text())


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["groups"].update({"../../etc": m["groups"].pop("layer.1")}), r"groups\.\.\./\.\./etc.*not allowed"),
    (lambda m: m["groups"]["layer.0"]["tensors"][0].update(name="a/../../b"), r"tensors\[0\]\.name .* not allowed"),
    (lambda m: m["groups"]["layer.0"]["tensors"][1].update(offset=0), r"tensors overlap or are out of order"),
    (lambda m: m["groups"]["layer.0"]["tensors"][0].update(dtype="float128"), r"dtype 'float128' is not one of"),
    (lambda m: m["groups"]["layer.0"].update(nbytes=-4096), r"nbytes -4096 is not a positive multiple"),
    (lambda m: m["groups"]["layer.0"].update(crc32c="x"), r"crc32c x is not a 32-bit checksum"),
    (lambda m: m.update(total_bytes="lots"), r"total_bytes \(lots\) is not the sum"),
    (lambda m: m.update(meta=[]), r"meta is not an object"),
])
def test_a_hand_edited_manifest_is_one_clear_error(tmp_path, manifest, edit, match):
    m = json.loads(json.dumps(manifest))
    edit(m)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=match) as info:
        read_manifest(tmp_path / "manifest.json")
    assert str(info.value).startswith(str(tmp_path / "manifest.json"))


def json_values():
    return st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                      max_size=3), max_leaves=8)


def paths_of(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths_of(v, prefix + (i,))


def has(parent, k) -> bool:
    return (isinstance(parent, dict) and k in parent) or (
        isinstance(parent, list) and isinstance(k, int) and k < len(parent))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_edit_of_a_manifest_is_read_or_refused_cleanly(tmp_path, manifest, data):
    m = json.loads(json.dumps(manifest))
    paths = [p for p in paths_of(m) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = m
        for k in path[:-1]:  # an earlier edit may have replaced what this path walks through
            parent = parent[k] if has(parent, k) else None
        if isinstance(parent, dict) or has(parent, path[-1]):
            parent[path[-1]] = data.draw(json_values())
    f = tmp_path / "manifest.json"
    f.write_text(json.dumps(m))
    try:
        read = read_manifest(f)
    except StoreError as e:
        assert str(e).startswith(str(f)) or str(f.parent) in str(e)
        return
    for name, rec in read["records"].items():  # what is accepted is consistent
        assert "/" not in name and ".." not in name
        ends = [t.offset + t.nbytes for t in rec.layout.tensors]
        assert max(ends) <= rec.nbytes


def write_yaml(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    return f


@pytest.mark.parametrize("text,match", [
    ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n"
                                                     for p, c in zip("abcdefghijklm", "bcdefghijklmn")) + "model: *n\n",
     r"more than 100 aliases"),  # 9^14 strings, if it were expanded
    ("model: &a [x, x, x, x, x, x, x, x, x]\ndevice: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "dtype: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n", r"model: expected a non-empty string"),
    ("model: x\nkv_cache: {block_size: " + "9" * 5000 + "}\n", r"a value cannot be read|integer from 1 to 65536"),
    ("model: " + "[" * 5000 + "]" * 5000 + "\n", r"a value cannot be read|not valid YAML|expected a non-empty"),
    ("model: x\ntiers: {gpu: {capacity: 1e400}}\n", r"tiers\.gpu\.capacity: a size must be"),
    ("model: x\nprefetch: {depth: 99999999999999999999}\n", r"prefetch\.depth: expected 'auto' or an integer"),
    ("model: x\n" + "# padding\n" * 120000, r"too large for a config file"),
])
def test_hostile_yaml_is_one_clear_error(tmp_path, text, match):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=match) as info:
        OffloadConfig.load(write_yaml(tmp_path, text))
    assert len(str(info.value)) < 600 and time.monotonic() - start < 5


KEYS = {"model": (), "device": (), "dtype": (), "calibration": (), "tiers": ("gpu", "cpu", "disk"),
        "kv_cache": ("block_size", "gpu_blocks", "cpu_blocks", "disk_blocks", "eviction", "idle_seconds",
                     "quantization", "cpu_attention"),
        "prefetch": ("depth",), "activations": ("prefill_chunk", "kv_restore"), "timeline": ("keep_steps",)}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_wrong_types_at_every_key_are_one_clear_error(tiny_llama, data):
    cfg: dict = {"model": str(tiny_llama)}
    section = data.draw(st.sampled_from(sorted(KEYS)))
    value = data.draw(json_values() | st.integers(min_value=-2**80, max_value=2**80))
    if KEYS[section]:
        key = data.draw(st.sampled_from(KEYS[section]))
        cfg[section] = {key: value}
        where = f"{section}.{key}"
    else:
        cfg[section] = value
        where = section
    try:
        OffloadConfig.load(cfg)
    except ConfigError as e:
        assert where.split(".")[0] in str(e) and len(str(e)) < 600
    except OSError:
        raise
    else:
        pass  # some values are valid


# ----------------------------------------------------------------------------- disk full, kill -9
def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_too_full_for_the_kv_slot_file_is_refused_up_front(tmp_path, tiny_llama, monkeypatch):
    cfg = streamed(tiny_llama, tmp_path / "s", disk_blocks=16)
    tokens(cfg, n=1)  # the store exists
    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(StoreError, match="the disk is full"):
        Runner.from_config(cfg)
    assert list((tmp_path / "s" / "kv-scratch").iterdir()) == [] and workers_alive() == []


def test_a_disk_filling_up_during_a_kv_spill_is_an_error_and_the_next_call_is_exact(tmp_path, tiny_llama,
                                                                                      reference, monkeypatch):
    with Runner.from_config(streamed(tiny_llama, tmp_path / "s", disk_blocks=16)) as r:
        real = os.pwrite
        monkeypatch.setattr(os, "pwrite", enospc)
        with pytest.raises(StoreError, match="the disk is full"):
            r.generate([PROMPT], max_new_tokens=40, stop_on_eos=False)
        monkeypatch.setattr(os, "pwrite", real)
        assert not r.kv.seqs
        assert r.generate([PROMPT], max_new_tokens=40, stop_on_eos=False)[0].token_ids == reference


def test_a_disk_full_while_writing_the_trace_leaves_no_half_file(tmp_path, tiny_llama, monkeypatch, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(streamed(tiny_llama, tmp_path / "s")))
    tokens(streamed(tiny_llama, tmp_path / "s"), n=1)  # the store is converted before the disk fills up
    monkeypatch.setattr(os, "fsync", enospc)
    trace = tmp_path / "out" / "run.json"
    trace.parent.mkdir()
    assert main(["run", "--config", str(config), "--prompt", "Hi", "--max-new-tokens", "4", "--trace",
                 str(trace)]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("Hi") and "new tokens" in err  # the run itself went through and was printed
    assert f"{trace}: the disk is full" in err
    assert list(trace.parent.iterdir()) == []


def test_sigkill_mid_decode_then_the_next_run_is_exact(tmp_path, tiny_llama):
    store = tmp_path / "store"
    config = tmp_path / "run.yaml"
    cfg = streamed(tiny_llama, store)
    cfg["kv_cache"] = {"gpu_blocks": 4, "disk_blocks": 8000}  # KV spills to the slot file as it decodes
    config.write_text(yaml.safe_dump(cfg))
    proc = start_run(config)
    wait_for_tokens(proc, 60)
    proc.kill()
    proc.wait(30)
    assert store_state(store) is StoreState.COMPLETE
    [stale] = list((store / "kv-scratch").iterdir())  # the dead run's slot files
    prompt = Runner.from_config(run_config(tiny_llama)).encode("Once upon a time")
    cfg["kv_cache"] = {"gpu_blocks": 4, "disk_blocks": 64}
    assert tokens(cfg, n=40, prompt=prompt) == tokens(run_config(tiny_llama), n=40, prompt=prompt)
    assert not stale.exists()
