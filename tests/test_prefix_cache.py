"""The prefix cache: a prompt prefix computed once serves later requests, and never changes a token.

Every check compares with the cold run: the same prompts through a runner with `prefix_cache: off`
(itself checked against transformers in test_parity), so attaching cached blocks, demoting and
promoting them, persisting them to disk and reading them back must give the same tokens.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat

import openai
import pytest
import yaml

from offload.cli.main import main
from offload.kv import persist
from offload.kv.prefix import chain_keys
from offload.runtime.engine import Engine, Request, Sampling
from offload.runtime.runner import Runner
from offload.serve.background import BackgroundServer
from offload.serve.files import FileDefaults, run_file
from offload.serve.loop import Limits
from offload.testing.draft import perturbed_copy
from tests.conftest import run_config
from tests.test_serve import CHATML

BS = 4
SHARED = [1] + [(37 * i) % 500 + 3 for i in range(22)]  # 23 tokens: 5 full blocks of 4, and 3 more
QUESTIONS = [[7, 8, 9], [300, 41], [5]]
NEW = 10


def config(model, tmp_path=None, **kv):
    cfg = run_config(model, kv_cache={"gpu_blocks": 48, "block_size": BS} | kv, activations={"prefill_chunk": 8})
    if tmp_path is not None:
        cfg["tiers"] = {"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "256MiB"},
                        "disk": {"path": str(tmp_path / "store")}}
    return cfg


def greedy(r: Runner, prompt: list[int], **kw) -> list[int]:
    return r.generate([prompt], max_new_tokens=NEW, stop_on_eos=False, **kw)[0].token_ids


@pytest.fixture(scope="module")
def cold(tiny_llama):
    """Tokens of a runner that never caches a prefix."""
    with Runner.from_config(config(tiny_llama, prefix_cache="off")) as r:
        assert r.kv is None or r.kv.prefix is None
        yield lambda prompt, **kw: greedy(r, prompt, **kw)


def test_a_shared_prefix_is_computed_once_and_later_requests_get_the_cold_tokens(tiny_llama, cold):
    with Runner.from_config(config(tiny_llama)) as r:
        first = SHARED + QUESTIONS[0]
        assert greedy(r, first) == cold(first)
        assert r.last_stats.cached_tokens == 0
        passes = r.last_stats.prefill_passes
        for q in QUESTIONS[1:]:
            assert greedy(r, SHARED + q) == cold(SHARED + q)
            assert r.last_stats.cached_tokens == 20  # the 5 full blocks of the shared prompt
            assert r.last_stats.prefill_passes < passes
        assert greedy(r, first) == cold(first)  # the same prompt again: all but the last token's block
        assert r.last_stats.cached_tokens == 24  # 26 tokens: 6 full blocks, and at least one token computed
        diverged = SHARED[:10] + [2, 2] + SHARED[12:]  # differs inside the third block
        assert greedy(r, diverged) == cold(diverged)
        assert r.last_stats.cached_tokens == 8
        stats = r.kv.prefix.stats
        assert stats.hits == 4 and stats.misses == 1
        counters = [v for name, _, v in r.timeline.counters if name == "prefix-cache"]
        assert counters[-1]["hits"] == 4 and counters[-1]["misses"] == 1  # on the timeline


def test_samples_and_seeds_of_a_cached_prompt_are_the_cold_ones(tiny_llama, cold):
    with Runner.from_config(config(tiny_llama)) as r:
        greedy(r, SHARED + QUESTIONS[0])
        for q, kw in zip(QUESTIONS[1:], ({"num_samples": 3}, {"num_samples": 3, "temperature": 1.0, "seed": 5})):
            prompt = SHARED + q
            out = r.generate([prompt], max_new_tokens=NEW, stop_on_eos=False, **kw)[0]
            assert r.last_stats.cached_tokens == 20
            with Runner.from_config(config(tiny_llama, prefix_cache="off")) as c:
                ref = c.generate([prompt], max_new_tokens=NEW, stop_on_eos=False, **kw)[0]
            assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]


def test_a_request_arriving_while_another_decodes_attaches_its_prompt(tiny_llama, cold):
    with Runner.from_config(config(tiny_llama)) as r:
        r.fix_kv_pool(48)
        engine = Engine(r)
        a = engine.submit(Request(SHARED + QUESTIONS[0], Sampling(max_new_tokens=NEW)))
        for _ in range(5):  # 26 tokens in chunks of 8: 4 passes, then decoding
            engine.step()
        b = engine.submit(Request(SHARED + QUESTIONS[1], Sampling(max_new_tokens=NEW)))
        engine.run([])
        assert a.cached == 0 and b.cached == 20 and engine.stats.cached_tokens == 20
        assert a.outputs[0].token_ids == cold(SHARED + QUESTIONS[0])
        assert b.outputs[0].token_ids == cold(SHARED + QUESTIONS[1])


def test_admission_reserves_only_what_the_cache_does_not_hold(tiny_llama, cold):
    # 26 prompt + 10 new tokens = 9 blocks a request; 16 blocks hold one request's worst case, not two, unless
    # the 5 blocks of the shared prompt come from the cache: then 9 + 4 fit, and both run at once
    with Runner.from_config(config(tiny_llama, gpu_blocks=16)) as r:
        r.fix_kv_pool(16)
        greedy(r, SHARED + QUESTIONS[2])
        engine = Engine(r)
        b, c = (engine.submit(Request(SHARED + q, Sampling(max_new_tokens=NEW))) for q in QUESTIONS[:2])
        engine.step()
        assert not engine.waiting and len(engine.prefilling + engine.decoding) == 2
        engine.run([])
        assert b.cached == c.cached == 20
        assert [b.outputs[0].token_ids, c.outputs[0].token_ids] == [cold(SHARED + q) for q in QUESTIONS[:2]]


def test_a_pool_full_of_cached_blocks_still_admits_new_prompts(tiny_llama, cold):
    with Runner.from_config(config(tiny_llama, gpu_blocks=12)) as r:
        for i in range(5):  # each prompt and its tokens need 9 of the 12 blocks: the cache gives back the rest
            prompt = [1] + [(i * 31 + k * 7) % 400 + 3 for k in range(24)]
            assert greedy(r, prompt) == cold(prompt)
        assert r.kv.prefix.stats.evicted > 0
        assert r.kv.idle_count() == r.kv.prefix.blocks  # no sequence left; the cache holds what it kept


def test_cached_blocks_demoted_to_host_and_disk_come_back_exact(tiny_llama, cold, tmp_path):
    cfg = config(tiny_llama, tmp_path, gpu_blocks=8, cpu_blocks=4, disk_blocks=64)
    with Runner.from_config(cfg) as r:
        greedy(r, SHARED + QUESTIONS[0])
        for i in range(3):  # other prompts push the idle cached blocks down the tiers
            greedy(r, [1] + [(i * 53 + k * 11) % 400 + 3 for k in range(20)])
        cached_cold = sum(1 for bid in r.kv.prefix.keys if r.kv.blocks[bid].tier != "gpu")
        assert cached_cold >= 5
        routes = r.traffic.routes("kv")
        assert routes.get("gpu->cpu", 0) > 0 and routes.get("cpu->disk", 0) > 0
        assert greedy(r, SHARED + QUESTIONS[1]) == cold(SHARED + QUESTIONS[1])
        assert r.last_stats.cached_tokens == 20


def test_int8_cold_kv_keeps_the_format_of_cached_blocks_and_device_hits_are_exact(tiny_llama, cold, tmp_path):
    cfg = config(tiny_llama, tmp_path, gpu_blocks=24, cpu_blocks=8, quantization="int8")
    with Runner.from_config(cfg) as r:
        greedy(r, SHARED + QUESTIONS[0])
        assert greedy(r, SHARED + QUESTIONS[1]) == cold(SHARED + QUESTIONS[1])  # the blocks stayed on the device
        assert r.last_stats.cached_tokens == 20
        for i in range(3):
            greedy(r, [1] + [(i * 53 + k * 11) % 400 + 3 for k in range(30)])
        demoted = [bid for bid in r.kv.prefix.keys if r.kv.blocks[bid].tier == "cpu"]
        assert demoted and r.kv.stores["cpu"].fmt.name == "int8"  # cached blocks live on in the tier's int8
        greedy(r, SHARED + QUESTIONS[2])
        assert r.last_stats.cached_tokens == 20


def test_speculation_with_a_cached_prefix_gives_the_cold_tokens(tiny_llama, cold, tmp_path):
    draft = perturbed_copy(tiny_llama, tmp_path / "draft", 0.1)
    cfg = config(tiny_llama) | {"speculative": {"draft": str(draft), "tokens": 3}}
    with Runner.from_config(cfg) as r:
        for q in QUESTIONS:
            assert greedy(r, SHARED + q) == cold(SHARED + q)
        stats = r.last_stats
        assert stats.cached_tokens == 20 and 0 < stats.accepted_tokens < stats.draft_tokens  # drafts rolled back


def test_persisted_blocks_serve_a_later_process_and_damaged_ones_are_recomputed(tiny_llama, cold, tmp_path, caplog):
    cfg = config(tiny_llama, tmp_path, prefix_cache="persist")
    with Runner.from_config(cfg) as r:
        greedy(r, SHARED + QUESTIONS[0])
        saved = r.kv.prefix.persisted
        saved.flush()
        assert saved.count >= 5 and saved.dir.is_relative_to(tmp_path / "store")
        files = sorted(saved.dir.glob("*.kvb"))
        root, fmt, layers = r.kv.prefix.root, r.kv.device_fmt, r.kv.cfg.num_layers
        third = saved.dir / f"{chain_keys(root, SHARED, BS)[2].hex()}.kvb"  # the shared prompt's 3rd block
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    with Runner.from_config(cfg) as r:  # a new process: nothing in memory, the blocks on disk
        assert greedy(r, SHARED + QUESTIONS[1]) == cold(SHARED + QUESTIONS[1])
        assert r.last_stats.cached_tokens == 20 and r.kv.prefix.stats.loaded == 5
    victim = third
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40
    victim.write_bytes(bytes(data))
    with Runner.from_config(cfg) as r, caplog.at_level(logging.WARNING, logger="offload.kv.persist"):
        assert greedy(r, SHARED + QUESTIONS[2]) == cold(SHARED + QUESTIONS[2])
        assert r.last_stats.cached_tokens == 8 and r.kv.prefix.persisted.damaged == 1  # up to the damaged one
        assert "damaged" in caplog.text
        r.kv.prefix.persisted.flush()
        assert victim.read_bytes() != bytes(data)  # computed and written again
    # another identity (model, weights, dtype, KV format) has its own directory, and a block copied across is refused
    other = persist.PersistedBlocks(tmp_path / "store" / "prefix-cache", "another model", 8)
    key = chain_keys(root, SHARED, BS)[0]
    assert other.dir != third.parent and other.load(key, fmt, layers) is None
    shutil.copy(third.parent / f"{key.hex()}.kvb", other.dir)
    assert other.load(key, fmt, layers) is None and other.damaged == 1


def test_persisting_is_bounded_and_a_full_disk_stops_it_with_one_warning(tiny_llama, cold, tmp_path, monkeypatch,
                                                                      caplog):
    cfg = config(tiny_llama, tmp_path, prefix_cache="persist", prefix_disk_blocks=3)
    with Runner.from_config(cfg) as r:
        greedy(r, SHARED + QUESTIONS[0])
        r.kv.prefix.persisted.flush()
        assert len(list(r.kv.prefix.persisted.dir.glob("*.kvb"))) == 3

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(persist.tempfile, "mkstemp", full)
    with Runner.from_config(cfg) as r, caplog.at_level(logging.WARNING, logger="offload.kv.persist"):
        for q in QUESTIONS:
            assert greedy(r, [1, 2] + SHARED + q) == cold([1, 2] + SHARED + q)
        assert r.last_stats.cached_tokens == 24  # the cache in memory goes on
        r.kv.prefix.persisted.flush()  # the files are written on the store's own thread
        assert caplog.text.count("stopped") == 1 and not r.kv.prefix.persisted.enabled


def test_a_new_conversation_with_the_same_system_prompt_reuses_its_blocks(chat_model):
    with Runner.from_config(config(chat_model, gpu_blocks=96)) as r:
        system = "You are a terse assistant who answers every question in one short sentence."
        conv = r.chat(system=system)
        first = conv.say("Hi", sampling=Sampling(max_new_tokens=4))
        conv.close()  # its kept sequence is gone; the prefix cache still holds the full blocks
        second = r.chat(system=system).say("Hello", sampling=Sampling(max_new_tokens=4))
        assert first.cached == 0 and second.cached >= 8 and second.prefilled < first.prefilled


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_llama, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    return d


def test_the_server_reports_cached_prompt_tokens_in_usage(chat_model):
    with Runner.from_config(config(chat_model)) as runner:
        runner.fix_kv_pool(48)
        with BackgroundServer(runner, Limits(max_batch=4), name="tiny") as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            prompt = "the quick brown fox jumps over a lazy dog while seven tired owls watch"
            first = client.completions.create(model="tiny", prompt=prompt + " one", max_tokens=3, temperature=0)
            second = client.completions.create(model="tiny", prompt=prompt + " two", max_tokens=3, temperature=0)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert second.usage.prompt_tokens_details.cached_tokens >= 8
            assert srv.loop.stats()["kv_prefix_blocks"] > 0


def test_offload_plan_shows_the_prefix_capacity(tiny_llama, tmp_path, capsys):
    cfg = config(tiny_llama, tmp_path, cpu_blocks=8, disk_blocks=32, prefix_cache="persist", prefix_disk_blocks=100)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", "--config", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "prefix cache" in x)
    assert "persist" in line and "gpu 48, cpu 8, disk 32 blocks" in line and "up to 100 blocks" in line
    assert main(["plan", "--config", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["prefix_cache"]
    assert data["mode"] == "persist" and data["persisted_blocks"] == 100 and data["blocks"]["disk"] == 32


def test_the_throughput_mode_reports_cached_prompt_tokens_per_line(tiny_llama, cold, tmp_path):
    """`offload run --input/--output`: a file of requests sharing a prompt; each output line says how many of its
    prompt tokens came from the cache, and the tokens are the cold run's."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "first", "prompt": SHARED + QUESTIONS[0], "max_tokens": NEW}) + "\n")
    with Runner.from_config(config(tiny_llama)) as r:
        run_file(r, inp, out, FileDefaults(), max_batch=1, progress=False)  # one at a time: the first fills it
        inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": SHARED + q, "max_tokens": NEW}) + "\n"
                               for i, q in enumerate(QUESTIONS[1:])))
        run_file(r, inp, out, FileDefaults(), max_batch=4, progress=False)
    got = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert got["first"]["cached_tokens"] == 0
    for i, q in enumerate(QUESTIONS[1:]):
        assert got[f"q{i}"]["cached_tokens"] == 20  # the shared prompt's 5 full blocks
        assert got[f"q{i}"]["choices"][0]["token_ids"] == cold(SHARED + q)
