"""The Python API a user expects: a keyword constructor, checked sampling, the checkpoint's defaults from every
entry point, streaming, results grouped per prompt, no network while parsing; and the executor seam."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

import offload
from offload.cli.main import main
from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.runtime.executor import Executor, ForwardBatch, WeightSource
from offload.runtime.runner import Runner
from offload.runtime.sampling import Sampling, SamplingError
from offload.serve.loop import EngineLoop, Job
from offload.serve.schema import CompletionBody, ServedModel
from tests.conftest import run_config

PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41], [1, 8, 2], [1, 400, 33, 12, 19, 250]]


@pytest.fixture(scope="module")
def runner(tiny_llama):
    with Runner(model=str(tiny_llama), device="cpu", dtype="float32") as r:
        yield r


# ----------------------------------------------------------------------------- constructing
def test_the_keyword_constructor_takes_the_yaml_keys(tiny_llama, tmp_path, runner):
    want = [r.token_ids for r in runner.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(tiny_llama, kv_cache={"gpu_blocks": 16})))
    for source in (str(path), path, run_config(tiny_llama, kv_cache={"gpu_blocks": 16})):
        with Runner(source) as r:
            assert r.kv.pool.num_blocks == 16
            assert [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)] == want
    with Runner(model=str(tiny_llama), device="cpu", dtype="float32", kv_cache={"gpu_blocks": 16},
                timeline={"keep_steps": 3}) as r:  # a mapping is the YAML's timeline: section
        assert r.kv.pool.num_blocks == 16 and r.config.timeline.keep_steps == 3
    with pytest.raises(ConfigError, match="not both"):
        Runner(str(path), device="cpu")
    with pytest.raises(ConfigError, match="kv_cach: unknown key; did you mean 'kv_cache'"):
        Runner(model=str(tiny_llama), kv_cach={})
    assert {"Runner", "Sampling", "GenerationResult", "TokenEvent"} <= set(offload.__all__)


# ----------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("kw,field,message", [
    ({"temperature": -1}, "temperature", "temperature must be 0 (greedy) or more, got -1"),
    ({"temperature": float("nan")}, "temperature", "temperature must be 0 (greedy) or more"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"top_k": -5}, "top_k", "top_k must be 0 (off) or more"),
    ({"top_k": 2.5}, "top_k", "top_k must be 0 (off) or more"),
    ({"max_new_tokens": 0}, "max_new_tokens", "max_new_tokens must be at least 1"),
    ({"n": 0}, "n", "n must be at least 1"),
    ({"seed": "7"}, "seed", "seed must be a whole number"),
    ({"logprobs": -1}, "logprobs", "logprobs must be None or 0 or more"),
    ({"stop_strings": [3]}, "stop_strings", "stop_strings must be strings"),
    ({"stop_token_ids": ["eos"]}, "stop_token_ids", "stop_token_ids must be token ids"),
])
def test_a_bad_sampling_value_is_refused_with_one_sentence(kw, field, message):
    with pytest.raises(SamplingError) as e:
        Sampling(**kw)
    assert e.value.field == field and str(e.value).startswith(message) and "\n" not in str(e.value)
    assert isinstance(e.value, ConfigError)


def test_a_sampling_is_normalised_and_hashable():
    s = Sampling(8, stop_token_ids=[2, 2, 5], stop_strings="###")
    assert s.stop_token_ids == frozenset({2, 5}) and s.stop_strings == ("###",)
    assert hash(s) == hash(Sampling(8, stop_token_ids=frozenset({5, 2}), stop_strings=("###",)))
    assert Sampling().stop_token_ids is None  # the engine reads it as the model's EOS ids


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "--temperature: temperature must be 0 (greedy) or more, got -1.0"),
    (["--top-k", "-5"], "--top-k: top_k must be 0 (off) or more (a whole number), got -5"),
    (["--top-p", "0"], "--top-p: top_p must be in (0, 1], got 0.0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: max_new_tokens must be at least 1 (a whole number), got 0"),
])
@pytest.mark.parametrize("command", ["run", "chat"])
def test_the_cli_refuses_a_bad_sampling_flag_before_loading_anything(tmp_path, capsys, command, flags, message):
    missing = str(tmp_path / "nowhere.yaml")  # refused before the config is even read
    assert main([command, "--config", missing, *(["--prompt", "x"] if command == "run" else []), *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"offload: error: {message}\n"


def test_the_checkpoints_defaults_are_the_same_from_python_the_cli_and_the_server(tiny_llama, tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.8, "top_p": 0.9,
                                                          "top_k": 20, "max_new_tokens": 7}))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run_config(d)))
    prompt = "the quick brown fox"
    assert main(["run", "--config", str(cfg), "--prompt", prompt, "--seed", "5", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["results"][0]["token_ids"]
    with Runner(cfg) as r:
        [python] = r.generate(prompt, seed=5)
        want = Sampling(7, 0.8, 0.9, 20, seed=5, stop_token_ids=r.generation.eos_token_ids)
        assert r.sampling(seed=5) == want
        served = ServedModel.from_runner(r, name="m")
        [ids], sampling, _ = served.completion(CompletionBody(model="m", prompt=prompt, seed=5))
        assert sampling == want and ids == python.prompt_ids
        loop, got = EngineLoop(r), []
        loop.submit(Job(ids, sampling, lambda ev: ev.token_id is not None and got.append(ev.token_id)))
        while loop.busy:
            loop.step()
    assert len(python.token_ids) == 7 and python.token_ids == cli == got
    with Runner(run_config(tiny_llama)) as plain:  # without generation_config.json: greedy, 32 new tokens
        [greedy] = plain.generate(prompt, stop_on_eos=False)
        assert greedy.token_ids == plain.generate(prompt, temperature=0, max_new_tokens=32, stop_on_eos=False)[
            0].token_ids and plain.sampling().temperature == 0 and len(greedy.token_ids) == 32


# ----------------------------------------------------------------------------- results and streaming
def test_results_come_one_per_prompt_with_their_samples(runner):
    results = runner.generate(PROMPTS[:2], max_new_tokens=5, temperature=1.0, seed=9, num_samples=3,
                              stop_on_eos=False)
    assert len(results) == 2 and all(len(r.outputs) == 3 for r in results)
    for i, (prompt, r) in enumerate(zip(PROMPTS, results)):
        assert r.prompt_ids == prompt and [o.index for o in r.outputs] == [0, 1, 2]
        assert (r.token_ids, r.text, r.finish_reason) == (r.outputs[0].token_ids, r.outputs[0].text, "length")
        # prompt i's samples are seeded seed + i * n + s: the same as the prompt alone with that seed
        [alone] = runner.generate([prompt], max_new_tokens=5, temperature=1.0, seed=9 + 3 * i, num_samples=3,
                                  stop_on_eos=False)
        assert [o.token_ids for o in r.outputs] == [o.token_ids for o in alone.outputs]
    assert len({tuple(o.token_ids) for r in results for o in r.outputs}) > 1


def test_streamed_tokens_are_the_tokens_generate_returns(runner):
    kw = dict(max_new_tokens=6, temperature=0.9, seed=4, num_samples=2, stop=["zz"])
    results = runner.generate(PROMPTS, **kw)
    got: dict[tuple[int, int], list] = {}
    for ev in runner.stream(PROMPTS, **kw):
        got.setdefault((ev.prompt, ev.sample), []).append(ev)
    assert sorted(got) == [(i, s) for i in range(3) for s in range(2)]
    for (i, s), events in got.items():
        out = results[i].outputs[s]
        assert [e.token_id for e in events] == out.token_ids
        assert "".join(e.text for e in events) == out.text
        assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + [out.finish_reason]
    assert runner.last_stats.generated_tokens == sum(len(o.token_ids) for r in results for o in r.outputs)


def test_leaving_a_stream_early_gives_every_block_back(runner):
    stream = runner.stream(PROMPTS, max_new_tokens=20, stop_on_eos=False)
    first = [next(stream) for _ in range(4)]
    assert all(ev.finish_reason is None for ev in first)
    stream.close()
    runner.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
    assert runner.kv.pool.num_free == runner.kv.pool.num_blocks and not runner.kv.seqs
    assert len(runner.generate(PROMPTS[1], max_new_tokens=3, stop_on_eos=False)[0].token_ids) == 3


def test_sampling_and_knobs_are_one_or_the_other(runner):
    s = Sampling(4, stop_token_ids=frozenset())
    assert runner.generate(PROMPTS[1], sampling=s)[0].token_ids == runner.generate(
        PROMPTS[1], max_new_tokens=4, stop_on_eos=False)[0].token_ids
    with pytest.raises(ConfigError, match="not both"):
        runner.generate(PROMPTS[1], sampling=s, temperature=0.5)


# ----------------------------------------------------------------------------- the Hub
def test_loading_a_config_with_a_hub_id_touches_no_network(monkeypatch, tiny_llama):
    calls = []

    def fetch(value, weights=True, key="model"):
        calls.append((value, weights, key))
        return tiny_llama

    monkeypatch.setattr("offload.model.hub.fetch", lambda *a, **k: pytest.fail("a download while parsing"))
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("a download"))
    cfg = OffloadConfig.load({"model": "org/tiny", "device": "cpu", "dtype": "float32",
                              "speculative": {"draft": "org/draft", "tokens": 2}})
    assert cfg.hub == "org/tiny" and cfg.speculative.hub == "org/draft" and cfg.speculative.path is None
    assert cfg.to_dict()["model"] == "org/tiny"
    monkeypatch.setattr("offload.model.hub.fetch", fetch)
    with Runner(model="org/tiny", device="cpu", dtype="float32") as r:  # the runner fetches when it starts
        assert r.config.model == tiny_llama and r.generate(PROMPTS[1], max_new_tokens=2)[0].token_ids
    assert calls == [("org/tiny", True, "model")]
    assert cfg.fetched(weights=False).speculative.path == tiny_llama
    assert calls[-2:] == [("org/tiny", False, "model"), ("org/draft", False, "speculative.draft")]


# ----------------------------------------------------------------------------- the executor seam
def test_the_weight_source_is_what_the_executor_protocol_says(runner):
    assert isinstance(runner.weights, WeightSource) and runner.target.weights is runner.weights


def test_two_executors_over_halves_of_the_layers_compute_what_one_does(tiny_llama):
    """A pipeline stage is an executor over a slice of layers: hidden states in, hidden states (or logits) out."""
    config = OffloadConfig.load(run_config(tiny_llama))
    whole, first, second = Executor(config), None, None
    try:
        half = whole.cfg.num_layers // 2
        first = Executor(config, layers=range(0, half))
        second = Executor(config, layers=range(half, whole.cfg.num_layers))
        assert not first.has_head and second.has_head
        outs = []
        for ex in (whole, first, second):
            ex.ensure_kv(8)
            outs.append([ex.kv.add_sequence() for _ in PROMPTS])
        assert outs[0] == outs[1] == outs[2]  # the same sequence ids in each stage's own pool
        sids = outs[0]
        for step in (PROMPTS, [[5]] * 3, [[7]] * 3):  # a ragged prefill, then two decode steps
            want = whole.forward(ForwardBatch.last(sids, step))
            hidden = first.forward(ForwardBatch.last(sids, step))
            assert hidden.shape == (sum(map(len, step)), whole.cfg.hidden_size)
            torch.testing.assert_close(second.forward(ForwardBatch.last(sids, step), hidden=hidden), want)
    finally:
        for ex in (whole, first, second):
            if ex is not None:
                ex.close()


@pytest.mark.parametrize("bad", [
    lambda: ForwardBatch((1, 2), ((3,),)),
    lambda: ForwardBatch((1,), ((),)),
    lambda: ForwardBatch.verify([1], [[3, 4]], keep=[3]),
    lambda: ForwardBatch((1,), ((3,),), lanes=(0,)),
])
def test_a_malformed_forward_batch_is_refused(bad):
    with pytest.raises(ValueError):
        bad()
