"""The OpenAI-compatible server, driven by the official `openai` client on loopback.

Every greedy reply is checked against the same prompt run alone through a separate Runner's
`generate` (itself checked against transformers in test_parity), so batching, streaming and
the HTTP layer must not change a token.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from offload.cli.main import main
from offload.model.chat import ChatTemplate
from offload.runtime.runner import Runner
from offload.runtime.stops import StopMatcher
from offload.serve.background import BackgroundServer
from offload.serve.files import FileDefaults, run_file
from offload.serve.loop import Limits
from tests.conftest import run_config

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls watch from an old oak tree".split()


@pytest.fixture(scope="module")
def chat_llama(tiny_llama, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_llama, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    return d


@pytest.fixture(scope="module")
def reference(chat_llama):
    with Runner.from_config(run_config(chat_llama)) as r:
        yield r


def alone(runner: Runner, ids: list[int] | str, n: int) -> tuple[list[int], str]:
    [res] = runner.generate([ids], max_new_tokens=n)
    return res.token_ids, res.text


@pytest.fixture(scope="module")
def server(chat_llama):
    with Runner.from_config(run_config(chat_llama, kv_cache={"gpu_blocks": 96},
                                       activations={"prefill_chunk": 32})) as runner:
        runner.fix_kv_pool(96)
        with BackgroundServer(runner, Limits(max_batch=16, max_queue=64, timeout_s=120), name="tiny") as srv:
            yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def settle(server, timeout: float = 10.0) -> dict:
    """/stats once nothing runs (the loop frees blocks at the step after a cancel)."""
    end = time.monotonic() + timeout
    while True:
        s = server.loop.stats()
        if (s["running"] == 0 and s["queued"] == 0) or time.monotonic() > end:
            return s
        time.sleep(0.02)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_streamed_and_not_equals_the_prompt_run_alone(client, reference):
    ids, text = alone(reference, "Once upon a time", 10)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                  logprobs=2)
    [c] = r.choices
    assert c.text == text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(reference.encode("Once upon a time"))
    assert len(c.logprobs.token_logprobs) == 10 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    # greedy: the chosen token is the likeliest, so its logprob tops the alternatives
    assert all(lp >= max(top.values()) - 1e-5 for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs))
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_streamed_and_not_uses_the_checkpoint_template(client, reference, chat_llama):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the kettle?"}]
    prompt = ChatTemplate.from_checkpoint(chat_llama).render(messages, add_generation_prompt=True)
    ids, text = alone(reference, reference.tokenizer.encode(prompt, add_special_tokens=False), 12)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_sixteen_concurrent_clients_each_get_their_reply_alone(client, reference, server):
    jobs = [(" ".join(WORDS[: 2 + i % 13]), 3 + (7 * i) % 17) for i in range(16)]
    expected = [alone(reference, p, n)[1] for p, n in jobs]
    steps = server.loop.steps
    start = threading.Barrier(16)

    def ask(job: tuple[str, int]) -> str:
        prompt, n = job
        start.wait()
        if len(prompt) % 2:  # half stream, half do not
            parts = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True)
            return "".join(ch.choices[0].text for ch in parts)
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, jobs))
    assert got == expected
    # they shared passes: far fewer steps than tokens generated
    assert server.loop.steps - steps < sum(n for _, n in jobs) / 2
    s = settle(server)
    assert s["kv_blocks_free"] == s["kv_blocks"] and s["kv_sequences"] == 0


def test_a_client_that_disconnects_frees_its_blocks(client, server):
    stream = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=1000, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert server.loop.stats()["kv_blocks_free"] < server.loop.stats()["kv_blocks"]
    stream.close()
    s = settle(server)
    assert s["running"] == 0 and s["kv_blocks_free"] == s["kv_blocks"] and s["kv_logical_free"] == s["kv_blocks"]


def test_a_non_streamed_client_that_disconnects_is_cancelled_too(server):
    body = json.dumps({"model": "tiny", "prompt": "the lazy dog", "max_tokens": 1000}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        end = time.monotonic() + 10
        while server.loop.stats()["running"] == 0 and time.monotonic() < end:
            time.sleep(0.01)
    s = settle(server)
    assert s["running"] == 0 and s["kv_blocks_free"] == s["kv_blocks"]


def test_stop_strings_n_and_seed(client, reference):
    _, text = alone(reference, "the quick brown", 12)
    stop = text[3:6]
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model="tiny", prompt="the quick brown", max_tokens=8, temperature=1.0, n=3,
                                      seed=7) for _ in range(2))
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # three samples, not one copied


def test_errors_have_the_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", top_p=2.0)
    assert e.value.body["param"] == "top_p" and "top_p" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # can never fit the KV pool: NEVER is a 400 with the reason
        client.completions.create(model="tiny", prompt="x", max_tokens=2000)
    assert "KV blocks" in e.value.body["message"] and "kv_cache.gpu_blocks" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[])
    assert e.value.body["param"] == "messages"
    assert settle(server)["kv_blocks_free"] == server.loop.stats()["kv_blocks"]


def test_a_full_queue_answers_429_with_retry_after_and_late_requests_time_out(chat_llama):
    with Runner.from_config(run_config(chat_llama, kv_cache={"gpu_blocks": 300})) as runner:
        runner.fix_kv_pool(300)
        with BackgroundServer(runner, Limits(max_batch=1, max_queue=1, timeout_s=1.5), name="tiny") as srv:
            c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=30)
            running = iter(c.completions.create(model="tiny", prompt="the fox", max_tokens=4000, stream=True))
            next(running)  # it runs; the next one waits in the queue (max_batch 1)
            with ThreadPoolExecutor(1) as pool:
                queued = pool.submit(c.completions.create, model="tiny", prompt="the dog", max_tokens=4000)
                end = time.monotonic() + 10
                while srv.loop.stats()["queued"] < 1 and time.monotonic() < end:
                    time.sleep(0.01)
                with pytest.raises(openai.RateLimitError) as e:
                    c.completions.create(model="tiny", prompt="one too many", max_tokens=4)
                assert int(e.value.response.headers["retry-after"]) >= 1
                assert e.value.body["code"] == "queue_full"
                with pytest.raises(openai.APIError, match="timed out"):  # the stream ends with an error event
                    for _ in running:
                        pass
                with pytest.raises(openai.APIStatusError) as late:  # 1.5 s were not enough for 4000 tokens
                    queued.result()
                assert late.value.status_code == 504 and late.value.body["code"] == "timeout"
            s = settle(srv)
            assert s["kv_blocks_free"] == s["kv_blocks"]


def test_sigterm_drains_running_requests_and_exits(chat_llama, tmp_path, reference):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {chat_llama}\ndevice: cpu\ndtype: float32\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "offload", "serve", "--config", str(cfg), "--port", str(port),
                             "--kv-tokens", "512", "--model-name", "tiny"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        end = time.monotonic() + 60
        while True:
            try:
                c.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < end, proc.stdout.read()
                time.sleep(0.2)
        stream = iter(c.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=300,
                                           temperature=0, stream=True))
        text = next(stream).choices[0].text
        proc.send_signal(signal.SIGTERM)
        text += "".join(ch.choices[0].text for ch in stream)
        assert text == alone(reference, "the quick brown fox", 300)[1]  # the running request finished whole
        assert proc.wait(timeout=60) == 0
        assert "server stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_stop_text_holds_back_a_possible_stop_prefix():
    s = StopMatcher(("END", "\n\n"))
    assert s.push("Hello EN") == ("Hello ", False)
    assert s.push("ough\n") == ("ENough", False)
    assert s.push("\nmore") == ("", True) and s.stopped
    t = StopMatcher(("END",))
    assert t.push("abE") == ("ab", False) and t.flush() == "E"


def test_throughput_mode_writes_results_as_they_finish_and_resumes(chat_llama, reference, tmp_path):
    rows = [{"id": f"r{i}", "prompt": " ".join(WORDS[: 1 + i]), "max_tokens": 2 + i % 5} for i in range(7)]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.write_text(json.dumps({"id": "r0", "prompt_tokens": 1, "choices": []}) + "\n" + '{"id": "r1", "pro')
    with Runner.from_config(run_config(chat_llama)) as runner:
        report = run_file(runner, inp, out, FileDefaults(), max_batch=4, progress=False)
    assert (report.done, report.skipped) == (7, 1)
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {r["id"] for r in rows}
    for r in rows[1:7]:
        ids, text = alone(reference, r["prompt"], r["max_tokens"])
        assert got[r["id"]]["choices"][0]["token_ids"] == ids and got[r["id"]]["choices"][0]["text"] == text
    with Runner.from_config(run_config(chat_llama)) as runner:  # a rerun finds nothing left to do
        assert run_file(runner, inp, out, FileDefaults(), progress=False).done == 0


def test_offload_run_input_output_from_the_command_line(chat_llama, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {chat_llama}\ndevice: cpu\ndtype: float32\n")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "the fox"}\n{"prompt": [1, 5, 9], "max_tokens": 3}\n')
    assert main(["run", "--config", str(cfg), "--input", str(inp), "--output", str(out),
                 "--max-new-tokens", "4"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in got) == ["1", "2"]
    assert {r["id"]: len(r["choices"][0]["token_ids"]) for r in got} == {"1": 4, "2": 3}
    assert "2 requests done, 0 already in" in capsys.readouterr().err  # stdout stays free: results are in the file
    assert main(["run", "--config", str(cfg), "--input", str(inp)]) == 2  # --output missing: one clear error
    assert "--output" in capsys.readouterr().err


def test_a_speculating_server_gives_concurrent_clients_their_replies_alone(chat_llama, reference):
    """Speculative decoding (a tree over a self-int4 draft) behind the OpenAI API: eight concurrent greedy
    clients each get the text a non-speculative run gives, and every block of both pools comes back."""
    jobs = [(" ".join(WORDS[: 3 + i % 9]), 4 + (5 * i) % 11) for i in range(8)]
    expected = [alone(reference, p, n)[1] for p, n in jobs]
    cfg = run_config(chat_llama, kv_cache={"gpu_blocks": 160}, activations={"prefill_chunk": 32},
                     speculative={"draft": "self-int4", "tokens": 3, "tree": True})
    with Runner.from_config(cfg) as runner:
        runner.fix_kv_pool(160)
        with BackgroundServer(runner, Limits(max_batch=8, max_queue=16, timeout_s=120), name="tiny") as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            start = threading.Barrier(len(jobs))

            def ask(job: tuple[str, int]) -> str:
                start.wait()
                return client.completions.create(model="tiny", prompt=job[0], max_tokens=job[1],
                                                 temperature=0).choices[0].text

            with ThreadPoolExecutor(len(jobs)) as pool:
                got = list(pool.map(ask, jobs))
            s = settle(srv)
        assert got == expected
        assert s["kv_blocks_free"] == s["kv_blocks"] and s["kv_sequences"] == 0
        assert runner.speculator.accepted > 0
        verify = [sp for sp in runner.timeline.on("speculative") if sp.name == "verify"]
        assert any(sp.args["branches"] > sp.args["rows"] for sp in verify)  # trees were verified
        assert runner.draft.kv.pool.num_free == runner.draft.kv.pool.num_blocks
