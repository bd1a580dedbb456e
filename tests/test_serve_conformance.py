"""The server answers as OpenAI's API does where a client can tell: bad bodies, unknown fields and roles,
wrong methods and URLs, prompts longer than the context, and `created` in streamed chunks.

Driven through the official `openai` client (and raw HTTP where the client cannot send the mistake)
against a real server on a loopback port (`offload.serve.background`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from offload.runtime.runner import Runner
from offload.serve.background import BackgroundServer
from offload.serve.loop import Limits
from tests.conftest import run_config
from tests.test_serve import chat_llama  # noqa: F401 - the module-scoped fixture (a tiny model with a template)

CONTEXT = 4096  # the tiny models' max_position_embeddings


@pytest.fixture(scope="module")
def server(chat_llama):  # noqa: F811
    with Runner.from_config(run_config(chat_llama, kv_cache={"gpu_blocks": 64})) as runner:
        runner.fix_kv_pool(64)
        with BackgroundServer(runner, Limits(max_batch=4, max_queue=8, timeout_s=60), name="tiny") as srv:
            yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def raw(server, path: str, body: bytes | None = None, method: str = "POST") -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one HTTP request, errors included."""
    req = urllib.request.Request(server.base_url.removesuffix("/v1") + path, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def is_openai_error(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_malformed_json_is_an_openai_400_without_a_character_offset_for_param(server):
    status, body, _ = raw(server, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and is_openai_error(body)
    assert body["error"]["param"] is None and body["error"]["type"] == "invalid_request_error"
    assert "could not parse the JSON body" in body["error"]["message"]


def test_unknown_fields_are_refused_as_openai_does(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"frobnicate": 1})
    assert e.value.body["message"] == "Unrecognized request argument supplied: frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"temprature": 0.5})
    assert "temprature" in e.value.body["message"]
    # OpenAI fields that change nothing here are accepted; those that would change the answer are refused by name
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       user="u1", metadata={"k": "v"}, store=False)
    assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and "not supported" in e.value.body["message"]


def test_an_unknown_role_is_refused_naming_the_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}])
    assert e.value.body["param"] == "messages.[1].role" and e.value.body["code"] == "invalid_value"
    assert "'wizard'" in e.value.body["message"] and "'user'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"content": "no role"}])
    assert e.value.body["param"] == "messages.[0].role"


def test_a_wrong_method_or_url_answers_in_openai_shape(server):
    status, body, headers = raw(server, "/v1/chat/completions", method="GET")
    assert status == 405 and is_openai_error(body)
    assert body["error"]["message"] == "Invalid method for URL (GET /v1/chat/completions)"
    assert "POST" in headers.get("allow", headers.get("Allow", ""))
    status, body, _ = raw(server, "/v1/nowhere", method="GET")
    assert status == 404 and is_openai_error(body) and "Invalid URL" in body["error"]["message"]


def test_streamed_chunks_carry_the_request_time_as_created(client, server):
    time.sleep(1.1)  # the server started at least a second ago: its start time differs from now
    before = int(time.time())
    chunks = list(client.completions.create(model="tiny", prompt="the fox", max_tokens=3, stream=True))
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, stream=True))
    after = int(time.time())
    for stream in (chunks, chat):
        assert len({c.created for c in stream}) == 1, "every chunk of a stream has one `created`"
        assert before <= stream[0].created <= after
    assert server.served.created < before


def test_a_prompt_longer_than_the_context_names_the_prompt_not_max_tokens(client):
    long_ids = [5] * (CONTEXT + 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=long_ids, max_tokens=1)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert str(CONTEXT + 1) in err["message"] and str(CONTEXT) in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=1,
                                       messages=[{"role": "user", "content": "fox " * CONTEXT}])
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # a short prompt with too many new tokens: max_tokens
        client.completions.create(model="tiny", prompt="the fox", max_tokens=CONTEXT)
    assert e.value.body["param"] == "max_tokens" and "max_tokens" in e.value.body["message"]
