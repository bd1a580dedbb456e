"""Ctrl-C and SIGTERM stop `run`, `chat`, `serve` and `convert` promptly wherever they land.

Each command runs as the real `offload` program on a tiny model and gets SIGINT or SIGTERM at a random
moment (seeded): in a prefill or a decode pass, while KV blocks spill to the disk slot file (2 device
blocks), while a conversion writes, while a reply streams, while the server decodes a request. The
process must be gone within `LIMIT` seconds of the signal with the documented status and message:
130 `offload: interrupted` / 143 `offload: terminated`; `serve` drains (here at most 0.5 s) and exits 0
with `offload: server stopped`; `chat` takes Ctrl-C during a reply as "stop this reply" and goes on.
One chat process takes many signals, the others one each; a few run at once to keep the wall time short.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from offload.cli import signals
from offload.runtime.runner import Runner
from storage import interrupts
from storage.store import StoreState, store_state
from tests.conftest import run_config
from tests.test_chat_template import CHATML

REPO = Path(__file__).resolve().parents[1]
#: seconds from the signal to the process's end (twice that on a machine loaded past 2 jobs per core, where
#: a process waits its turn for a core even to exit)
LIMIT = 2.0 * (1 + (os.getloadavg()[0] > 2 * (os.cpu_count() or 1)))
SEED = 17
WORDS = ("the quick brown fox jumps over the lazy dog and then it runs away into the deep dark forest "
         "where nobody can find it again ").split()


class Proc:
    """An `offload` process whose stdout and stderr are read as they come (by two threads)."""

    def __init__(self, *args: str, stdin: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.p = subprocess.Popen([sys.executable, "-m", "offload", *args], cwd=REPO, env=env,
                                  stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err = bytearray(), bytearray()
        self.readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                        for s, b in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream, buf: bytearray) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            buf += chunk

    def wait_for(self, pattern: bytes, stream: str = "out", start: int = 0, timeout: float = 300.0) -> int:
        """Wait until `pattern` appears in the stream past `start`; returns the offset after it."""
        buf = self.out if stream == "out" else self.err
        end = time.monotonic() + timeout
        while (i := bytes(buf).find(pattern, start)) < 0:
            assert self.p.poll() is None or bytes(buf).find(pattern, start) >= 0, self.tail()
            assert time.monotonic() < end, f"no {pattern!r} within {timeout} s: " + self.tail()
            time.sleep(0.01)
        return i + len(pattern)

    def signal(self, sig: int) -> float:
        self.p.send_signal(sig)
        return time.monotonic()

    def exit_within(self, sent: float, limit: float) -> tuple[int, float]:
        try:
            code = self.p.wait(timeout=limit + 30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError("still running 30 s past the limit: " + self.tail()) from None
        took = time.monotonic() - sent
        for t in self.readers:
            t.join(5)
        return code, took

    def tail(self) -> str:
        return bytes(self.err).decode(errors="replace")[-1500:]


def expected(sig: int) -> tuple[int, str]:
    return (130, "offload: interrupted") if sig == signal.SIGINT else (143, "offload: terminated")


# ----------------------------------------------------------------------------- the commands
def run_once(config: Path, prompt_file: Path, sig: int, delay: float) -> dict:
    """`offload run`: a 200-token prompt prefilled 16 tokens a pass, then decoding, KV spilling every block."""
    proc = Proc("run", "--config", str(config), "--prompt-file", str(prompt_file), "--max-new-tokens", "3500")
    proc.wait_for(b"the quick")  # the prompt is echoed as generation starts
    time.sleep(delay)
    code, took = proc.exit_within(proc.signal(sig), LIMIT)
    status, word = expected(sig)
    ok = code == status and word in proc.tail() and "[interrupted after" in proc.tail()  # the account: stderr
    return {"what": f"run {signal.Signals(sig).name} at +{delay:.2f}s", "took": took, "ok": ok, "code": code,
            "tail": proc.tail()}


def convert_once(model: Path, store: Path, sig: int, delay: float) -> dict:
    """`offload convert`: the signal lands while groups are written (or after the last one)."""
    proc = Proc("convert", str(model), str(store), "--dtype", "bfloat16")
    proc.wait_for(b"converting", "err")  # the progress bar: writing has begun
    time.sleep(delay)
    code, took = proc.exit_within(proc.signal(sig), LIMIT)
    status, word = expected(sig)
    state = store_state(store)
    if code == 0:  # it finished before the signal landed: a complete store, as it says
        ok = state is StoreState.COMPLETE and b"wrote" in proc.out
    else:  # what was written stays, journaled, for the next conversion to resume
        ok = code == status and word in proc.tail() and state is StoreState.PARTIAL
    return {"what": f"convert {signal.Signals(sig).name} at +{delay:.2f}s", "took": took, "ok": ok, "code": code,
            "tail": proc.tail()}


def chat_session(config: Path, rng: random.Random, replies: int, last: int) -> list[dict]:
    """`offload chat`: Ctrl-C during each of `replies` replies stops that reply and the chat goes on (a reply
    that ended just before the signal leaves it at the prompt, where Ctrl-C ends the chat: also right); then
    `last` ends it: SIGTERM during a reply, or SIGINT at the prompt."""
    proc = Proc("chat", "--config", str(config), "--max-new-tokens", "2000", stdin=True)
    proc.wait_for(b"ready in", "err")
    rows = []
    for k in range(replies + 1):
        final = k == replies
        err_at = len(proc.err)
        if not (final and last == signal.SIGINT):
            start = len(proc.out)
            proc.p.stdin.write(" ".join(rng.sample(WORDS, 6)).encode() + b"\n")
            proc.p.stdin.flush()
            deadline = time.monotonic() + 120
            while len(proc.out) <= start:  # wait for the reply to stream (bounded: a reply that never starts
                assert proc.p.poll() is None, proc.tail()  # must fail the test, not hang CI)
                assert time.monotonic() < deadline, "no reply within 120 s: " + proc.tail()
                time.sleep(0.01)
        delay = rng.uniform(0.0, 0.4)
        time.sleep(delay)
        sig = last if final else signal.SIGINT
        sent = proc.signal(sig)
        name = f"chat {signal.Signals(sig).name} at +{delay:.2f}s " + (f"into reply {k + 1}" if k < replies
                                                                      or sig == signal.SIGTERM else "at the prompt")
        status, word = expected(sig)
        while not final and proc.p.poll() is None and b"(reply interrupted)" not in proc.err[err_at:]:
            if time.monotonic() > sent + LIMIT + 30:
                raise AssertionError(f"{name}: neither stopped nor ended: " + proc.tail())
            time.sleep(0.01)
        if not final and proc.p.poll() is None:
            rows.append({"what": name, "took": time.monotonic() - sent, "ok": True, "code": None, "tail": ""})
            continue
        code, took = proc.exit_within(sent, LIMIT)  # the last signal, or Ctrl-C at the prompt
        rows.append({"what": name, "took": took, "ok": code == status and word in proc.tail(), "code": code,
                     "tail": proc.tail()})
        break
    return rows


def serve_once(config: Path, sig: int, delay: float) -> dict:
    """`offload serve`: the signal lands while a streamed completion decodes; the server drains for at most
    0.5 s, closes the runner and exits 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = Proc("serve", "--config", str(config), "--port", str(port), "--kv-tokens", "4096", "--drain-timeout",
                "0.5", "--model-name", "x")
    proc.wait_for(b"offload: ready", "err")
    body = json.dumps({"model": "x", "prompt": "the quick brown fox", "max_tokens": 3000, "stream": True})
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    assert b"data:" in client.recv(65536) or b"data:" in client.recv(65536)  # tokens are streaming
    time.sleep(delay)
    code, took = proc.exit_within(proc.signal(sig), LIMIT + 0.5)
    client.close()
    ok = code == 0 and "offload: server stopped" in proc.tail()
    return {"what": f"serve {signal.Signals(sig).name} at +{delay:.2f}s", "took": took - 0.5, "ok": ok,
            "code": code, "tail": proc.tail()}


# ----------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama, model_factory):
    d = tmp_path_factory.mktemp("signals")
    model = d / "tiny-chat"
    shutil.copytree(tiny_llama, model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    cfg = run_config(model, tiers={"gpu": {"capacity": "3MiB"}, "cpu": {"capacity": "1MiB"},
                                   "disk": {"path": str(d / "store")}},
                     prefetch={"depth": 2}, kv_cache={"gpu_blocks": 2, "cpu_blocks": 0, "disk_blocks": 8000},
                     activations={"prefill_chunk": 16})
    with Runner.from_config(cfg):  # converts the store once; every process reads it (shared)
        pass
    config = d / "streamed.yaml"
    config.write_text(yaml.safe_dump(cfg))
    served = d / "served.yaml"  # the server sizes its own KV pool (--kv-tokens)
    served.write_text(yaml.safe_dump(run_config(model)))
    prompt = d / "prompt.txt"
    prompt.write_text(" ".join(WORDS * 5))  # ~200 tokens: 13 prefill passes
    return config, served, prompt, model_factory("llama", "small"), d


def test_sigint_and_sigterm_stop_every_command_within_the_limit_wherever_they_land(setup):
    config, served, prompt, small, d = setup
    rng = random.Random(SEED)
    INT, TERM = signal.SIGINT, signal.SIGTERM
    jobs = [(chat_session, (config, random.Random(SEED + 1), 10, TERM)),
            (chat_session, (config, random.Random(SEED + 2), 10, INT))]
    jobs += [(run_once, (config, prompt, sig, rng.uniform(0.0, 1.5))) for sig in (INT, TERM) * 3]
    jobs += [(convert_once, (small, d / f"convert-{i}", sig, rng.uniform(0.0, 0.5)))
             for i, sig in enumerate((INT, TERM))]
    jobs += [(serve_once, (served, sig, rng.uniform(0.0, 0.5))) for sig in (INT, TERM)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(f, *a) for f, a in jobs]
        rows = []
        for fut in futures:
            got = fut.result()
            rows += got if isinstance(got, list) else [got]
    assert len(rows) >= 30
    report = "\n".join(f"{r['what']}: exit {r['code']} in {r['took']:.2f}s" for r in rows)
    print(report)
    bad = [r for r in rows if not r["ok"] or r["took"] > LIMIT]
    assert not bad, f"limit {LIMIT} s:\n{report}\n\n" + "\n\n".join(f"{r['what']}:\n{r['tail']}" for r in bad)


# ----------------------------------------------------------------------------- an interrupt swallowed in C
class _SwallowsCtrlC:
    """Ctrl-C landing in code whose exceptions Python drops ("Exception ignored in ..."): here a `__del__`;
    in the wild a ctypes callback during numba's compilation, where a run went on for its 3500 tokens."""

    def __del__(self) -> None:
        signals._interrupt(signal.SIGINT, None)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_swallowed_by_a_callback_still_stops_the_generation_at_the_next_layer_or_step(tiny_llama):
    previous = signals.install()
    try:
        with Runner.from_config(run_config(tiny_llama)) as r:
            seen: list[int] = []

            def swallow_at_third(i: int, token: int, text: str) -> None:
                seen.append(token)
                if len(seen) == 3:
                    _SwallowsCtrlC()  # dropped at once: its KeyboardInterrupt is printed and lost

            with pytest.raises(KeyboardInterrupt):
                r.generate([[1, 5, 9]], max_new_tokens=40, stop_on_eos=False, on_token=swallow_at_third)
            assert len(seen) == 3  # stopped within the next pass, not after 40 tokens
            # one delivered normally and handled (chat's "stop this reply") leaves nothing pending behind it
            with pytest.raises(KeyboardInterrupt):
                signals._interrupt(signal.SIGINT, None)
            interrupts.delivered()
            out = r.generate([[1, 5, 9]], max_new_tokens=8, stop_on_eos=False)
            assert len(out[0].outputs[0].token_ids) == 8
    finally:
        signals.restore(previous)
        interrupts.delivered()


def test_an_interrupt_inside_the_schedulers_locks_waits_for_their_end_and_a_blocked_wait_still_stops():
    """Ctrl-C landing while compute is inside a critical section (the scheduler's locks, conditions, futures)
    is raised as the section ends; one landing in a blocking wait there stops the wait within a poll, and the
    lock behind the wait stays free for the thread that sets it."""
    previous = signals.install()
    try:
        left = []
        with pytest.raises(KeyboardInterrupt):
            with interrupts.critical:
                signals._interrupt(signal.SIGINT, None)  # deferred: nothing raised here
                left.append("still inside")
        assert left == ["still inside"]
        interrupts.delivered()

        never = threading.Event()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            interrupts.wait(never)
        assert time.monotonic() - t0 < 0.2 + 1.0
        interrupts.delivered()
        setter = threading.Thread(target=never.set)
        setter.start()
        setter.join(2)
        assert not setter.is_alive() and never.is_set()  # its lock was not left held
    finally:
        signals.restore(previous)


def test_settle_heap_freezes_the_commands_own_process_only(monkeypatch):
    """A command's own process (`program`) freezes its heap once the model is loaded; a test or an embedder calling
    `main` keeps its collector as it was."""
    before = gc.get_freeze_count()
    signals.settle_heap()
    assert gc.get_freeze_count() == before
    monkeypatch.setitem(signals._OWN, "process", True)
    try:
        signals.settle_heap()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_restart_runs_the_command_again_in_its_place_once_with_its_arguments_and_stdin(tmp_path):
    """`restart` (memory a first start's calibration left the process holding) execs the same command line in the
    process's place: the same arguments, stdin still unread; the command it starts does not restart again, and a
    process that is not the command's own (a test's, an embedder's) is never replaced."""
    script = tmp_path / "again.py"
    script.write_text("import os, sys\n"
                      "from offload.cli import signals\n"
                      "print('run', os.environ.get(signals.RESTARTED), sys.argv[1:], flush=True)\n"
                      "signals.restart('not the command process')\n"
                      "signals.own_process()\n"
                      "signals.restart('starting again')\n"
                      "print('read', sys.stdin.readline().strip(), flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != signals.RESTARTED}
    got = subprocess.run([sys.executable, str(script), "a", "--b"], input="hello\n", capture_output=True, text=True,
                         timeout=60, env=env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == ["run None ['a', '--b']", "run 1 ['a', '--b']", "read hello"]
    assert got.stderr.count("starting again") == 1 and "not the command process" not in got.stderr
