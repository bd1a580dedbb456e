"""A new user's first hour, as real commands (`python -m offload ...` in a subprocess): what goes to stdout and
stderr, what is refused before any weight loads, and how a command ends when its reader or its user stops it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from offload.cli.main import main
from offload.errors import ContextLengthError
from offload.runtime.conversation import Conversation
from offload.runtime.engine import Sampling
from offload.runtime.runner import Runner
from storage.store import MARKER, StoreState, store_state
from tests.conftest import run_config
from tests.test_chat_template import CHATML

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 4096  # the tiny models' max_position_embeddings


def offload(*args: str, cwd: Path | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "offload", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or REPO, timeout=timeout, **kw)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """A refusal: exit status 2, one line on stderr, no traceback, nothing on stdout."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offload: error: "), proc.stderr
    return lines[0]


def write_yaml(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def streamed(model: Path, store: Path) -> dict:
    """Weights in all three tiers (so a run has a plan to show), the store converted on first run."""
    return run_config(model, tiers={"gpu": {"capacity": "3MiB"}, "cpu": {"capacity": "1MiB"},
                                    "disk": {"path": str(store)}},
                      kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 16})


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_llama, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    return d


# ----------------------------------------------------------------------------- stdout is the text
def test_run_prints_the_text_alone_on_stdout_and_converts_with_a_progress_bar(tmp_path, tiny_llama):
    store = tmp_path / "store"
    cfg = write_yaml(tmp_path / "run.yaml", streamed(tiny_llama, store))
    proc = offload("run", "--config", str(cfg), "--prompt", "Once upon a time", "--max-new-tokens", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    with Runner.from_config(streamed(tiny_llama, store)) as r:
        [ref] = r.generate(["Once upon a time"], max_new_tokens=6)
    assert proc.stdout == "Once upon a time" + ref.text + "\n"  # `> out.txt` holds the text and nothing else
    err = proc.stderr
    assert "converting" in err and "100%" in err  # the first run's conversion shows its bar, even off a terminal
    assert "placement plan" in err and "ms/step" in err.splitlines()[-1]
    assert store_state(store) is StoreState.COMPLETE


def test_run_chat_prints_the_reply_on_its_own_not_glued_to_the_message(tmp_path, chat_model):
    cfg = write_yaml(tmp_path / "run.yaml", run_config(chat_model))
    proc = offload("run", "--config", str(cfg), "--chat", "--prompt", "Where is the kettle?",
                   "--max-new-tokens", "6", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    with Runner.from_config(run_config(chat_model)) as r:
        conv = Conversation(r, Sampling(max_new_tokens=6, stop_token_ids=frozenset(r.generation.eos_token_ids)))
        reply = conv.say("Where is the kettle?")
    assert proc.stdout == reply.text + "\n"


def test_prompt_ids_on_the_command_line_equal_the_python_api(tmp_path, tiny_llama):
    cfg = write_yaml(tmp_path / "run.yaml", run_config(tiny_llama))
    proc = offload("run", "--config", str(cfg), "--prompt-ids", "1,450,49", "--prompt-ids", "[7, 8]",
                   "--max-new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    with Runner.from_config(run_config(tiny_llama)) as r:
        ref = r.generate([[1, 450, 49], [7, 8]], max_new_tokens=4)
    got = json.loads(proc.stdout)["results"]
    assert [g["token_ids"] for g in got] == [x.token_ids for x in ref] and got[0]["prompt"] == [1, 450, 49]
    line = one_error_line(offload("run", "--config", str(cfg), "--prompt-ids", "1,two,3"))
    assert "--prompt-ids '1,two,3'" in line
    line = one_error_line(offload("run", "--config", str(cfg), "--prompt-ids", "1,4996"))
    assert "4996" in line and "vocabulary" in line


# ----------------------------------------------------------------------------- refused before the weights load
def test_prompts_and_max_new_tokens_past_the_context_are_refused_before_anything_loads(tmp_path, tiny_llama,
                                                                                      chat_model):
    store = tmp_path / "store"
    cfg = write_yaml(tmp_path / "run.yaml", streamed(tiny_llama, store))
    line = one_error_line(offload("run", "--config", str(cfg), "--prompt", "hi", "--max-new-tokens", "5000"))
    assert "5000" in line and str(CONTEXT) in line and "--max-new-tokens" in line
    ids = ",".join(["5"] * (CONTEXT + 2))
    line = one_error_line(offload("run", "--config", str(cfg), "--prompt-ids", ids, "--max-new-tokens", "4"))
    assert f"{CONTEXT + 2} prompt tokens" in line and str(CONTEXT) in line
    chat_cfg = write_yaml(tmp_path / "chat.yaml", streamed(chat_model, store))
    line = one_error_line(offload("chat", "--config", str(chat_cfg), "--max-new-tokens", "5000", input=""))
    assert "5000" in line and str(CONTEXT) in line
    assert not store.exists()  # nothing was converted, nothing loaded
    # the throughput mode checks every line (its own max_tokens) before any pass
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"prompt": "a"}\n{"prompt": "b", "max_tokens": 5000}\n')
    line = one_error_line(offload("run", "--config", str(write_yaml(tmp_path / "c.yaml", run_config(tiny_llama))),
                                  "--input", str(requests), "--output", str(tmp_path / "out.jsonl")))
    assert "line 2" in line and "max_tokens" in line and str(CONTEXT) in line
    assert not (tmp_path / "out.jsonl").exists()


def test_generate_and_a_conversation_refuse_past_the_context_before_any_pass(tiny_llama, chat_model):
    with Runner.from_config(run_config(tiny_llama)) as r:
        with pytest.raises(ContextLengthError, match=f"{CONTEXT + 1} prompt tokens.*{CONTEXT}"):
            r.generate([[5] * (CONTEXT + 1)], max_new_tokens=1)
        with pytest.raises(ContextLengthError, match="max_new_tokens asks for 4096 more"):
            r.generate(["Once upon a time"], max_new_tokens=CONTEXT)
        assert r.timeline.step == 0 and r.kv is None  # no pass ran, no KV pool was sized for it
    with Runner.from_config(run_config(chat_model)) as r:
        conv = Conversation(r, Sampling(max_new_tokens=8), context=64)
        with pytest.raises(ContextLengthError, match="--context"):
            conv.say("fox " * 80)
        assert r.timeline.step == 0


def test_chat_without_a_template_is_refused_before_converting_or_loading(tmp_path, tiny_llama):
    store = tmp_path / "store"
    cfg = write_yaml(tmp_path / "chat.yaml", streamed(tiny_llama, store))
    line = one_error_line(offload("chat", "--config", str(cfg), input="hi\n"))
    assert "no chat template" in line and "offload run" in line
    line = one_error_line(offload("chat", "--auto", str(tiny_llama), "--disk", str(tmp_path / "auto"), input=""))
    assert "no chat template" in line
    assert not store.exists() and not (tmp_path / "auto" / "store").exists()


def test_a_store_path_holding_other_files_is_refused_before_converting_and_left_as_it_was(tmp_path, tiny_llama):
    """tiers.disk.path at a non-empty directory that is not a store: one sentence naming it and what to do, no
    "converting ..." before it, the user's files untouched; a half-written store of ours still resumes."""
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(b"\xff\xd8 a photo")
    cfg = write_yaml(tmp_path / "run.yaml", streamed(tiny_llama, photos))
    line = one_error_line(offload("run", "--config", str(cfg), "--prompt", "hi", "--max-new-tokens", "3"))
    assert line == (f"offload: error: tiers.disk.path {photos} is a non-empty directory that is not an Offload "
                    "store; point tiers.disk.path at an empty or new directory (or an existing store)")
    assert [p.name for p in photos.iterdir()] == ["holiday.jpg"]
    assert (photos / "holiday.jpg").read_bytes() == b"\xff\xd8 a photo"
    half = tmp_path / "half"  # an interrupted conversion: our marker and a group directory
    (half / "layer.0").mkdir(parents=True)
    (half / MARKER).write_text("{}")
    cfg = write_yaml(tmp_path / "half.yaml", streamed(tiny_llama, half))
    proc = offload("run", "--config", str(cfg), "--prompt", "hi", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "converting" in proc.stderr and store_state(half) is StoreState.COMPLETE


def test_model_flag_is_a_path_from_here_and_a_miss_names_the_paths_tried(tmp_path, tiny_llama):
    (tmp_path / "configs").mkdir()
    cfg = write_yaml(tmp_path / "configs" / "run.yaml", run_config(tiny_llama))
    shutil.copytree(tiny_llama, tmp_path / "models" / "tiny")
    proc = offload("run", "--config", "configs/run.yaml", "--model", "models/tiny", "--prompt", "hi",
                   "--max-new-tokens", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = one_error_line(offload("run", "--config", str(cfg), "--model", "models/tny", "--prompt", "hi",
                                  cwd=tmp_path))
    assert str(tmp_path / "models" / "tny") in line and str(tmp_path / "configs" / "models" / "tny") in line
    assert "Hub id" in line


# ----------------------------------------------------------------------------- serve: refused before "serving"
def test_serve_refuses_a_bad_or_busy_port_in_one_sentence_before_loading(tmp_path, tiny_llama):
    cfg = write_yaml(tmp_path / "serve.yaml", run_config(tiny_llama))
    line = one_error_line(offload("serve", "--config", str(cfg), "--port", "-1"))
    assert "--port -1" in line
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        line = one_error_line(offload("serve", "--config", str(cfg), "--port", str(port)))
    assert f"port {port}" in line and "already in use" in line
    assert time.monotonic() - t0 < 60


# ----------------------------------------------------------------------------- a reader or a user that stops
def test_a_closed_pipe_ends_the_command_quietly(tmp_path, tiny_llama):
    cfg = write_yaml(tmp_path / "run.yaml", run_config(tiny_llama))
    trace = tmp_path / "t.json"
    assert main(["run", "--config", str(cfg), "--prompt", "hi", "--max-new-tokens", "3", "--trace", str(trace)]) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["trace", "summary", "--json", str(trace)],
                 ["run", "--config", str(cfg), "--prompt", "hi", "--max-new-tokens", "50"]):
        proc = subprocess.Popen([sys.executable, "-m", "offload", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=REPO)
        proc.stdout.close()  # `| head` that already quit
        err = proc.communicate(timeout=300)[1].decode()
        assert proc.returncode == 128 + signal.SIGPIPE and "Traceback" not in err and "Error" not in err, err


def test_an_interrupted_throughput_run_says_how_far_it_got_on_its_own_line(tmp_path, tiny_llama):
    cfg = write_yaml(tmp_path / "run.yaml", run_config(tiny_llama))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "quick", "prompt": "a", "max_tokens": 2}] + [
        {"id": f"long{i}", "prompt": "the fox", "max_tokens": 4000} for i in range(3)]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "offload", "run", "--config", str(cfg), "--input", str(inp),
                             "--output", str(out), "--batch", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=REPO, text=True)
    end = time.monotonic() + 120
    while not (out.is_file() and out.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < end, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert "[interrupted: 1 of 4 requests done, 3 remaining; run the same command again to resume]" in lines, err
    assert lines[-1] == "offload: interrupted"
