"""The engine loop: requests join running batches at pass boundaries and leave when done."""

from __future__ import annotations

import json

import pytest
import torch

from offload.errors import CapacityError
from offload.runtime.engine import Engine, Request, Sampling
from offload.runtime.runner import Runner
from offload.runtime.sampling import sample
from offload.serve.files import FileDefaults, run_file
from tests.conftest import run_config

PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41], [1, 8, 2], [1, 400, 33, 12, 19, 250]]


@pytest.fixture(scope="module")
def runner(tiny_llama):
    with Runner.from_config(run_config(tiny_llama, kv_cache={"gpu_blocks": 32},
                                       activations={"prefill_chunk": 8})) as r:
        yield r


def alone(runner, prompt, n=12):
    return runner.generate([prompt], max_new_tokens=n, stop_on_eos=False)[0].token_ids


def test_a_request_that_joins_a_decoding_batch_gets_its_own_tokens(runner):
    engine = Engine(runner)
    first = engine.submit(Request(PROMPTS[0], Sampling(max_new_tokens=12)))
    for _ in range(4):  # prefill (2 passes of 8 + 1 tokens) and a few decode steps
        engine.step()
    assert engine.decoding == [first] and len(first.outputs[0].token_ids) >= 2
    later = [engine.submit(Request(p, Sampling(max_new_tokens=12))) for p in PROMPTS[1:]]
    passes, mixed = 0, 0
    while engine.busy:
        decoding = sum(1 for r in engine.decoding for o in r.outputs if not o.finish_reason)
        prefilling = len(engine.prefilling) + len(engine.waiting)
        mixed += bool(decoding and prefilling)
        engine.step()
        passes += 1
    assert mixed >= 1  # the newcomers' prompts rode in passes that also decoded the first request
    for req, prompt in zip([first, *later], PROMPTS):
        assert req.outputs[0].token_ids == alone(runner, prompt)
        assert req.outputs[0].finish_reason == "length"
    runner.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
    assert runner.kv.pool.num_free == runner.kv.pool.num_blocks  # every block came back


def test_a_pass_never_holds_more_prompt_tokens_than_the_budget(runner):
    seen = []
    original = runner.target.forward
    runner.target.forward = lambda batch, **kw: (seen.append(batch.q_lens), original(batch, **kw))[1]
    try:
        engine = Engine(runner)
        engine.run([Request(p, Sampling(max_new_tokens=4)) for p in PROMPTS])
    finally:
        del runner.target.forward  # the class's method again
    # decode rows are one token each; the prompt chunks of a pass add up to at most the budget
    assert seen and all(sum(n for n in lens if n > 1) <= 8 for lens in seen), seen


def test_abort_frees_the_blocks_at_once(runner):
    engine = Engine(runner)
    keep = engine.submit(Request(PROMPTS[0], Sampling(max_new_tokens=30)))
    drop = engine.submit(Request(PROMPTS[2], Sampling(max_new_tokens=30, n=2, temperature=1.0, seed=1)))
    for _ in range(5):
        engine.step()
    held = runner.kv.pool.num_free
    engine.abort(drop)
    assert [o.finish_reason for o in drop.outputs] == ["abort", "abort"]
    assert runner.kv.pool.num_free > held and drop not in engine.decoding
    while engine.busy:
        engine.step()
    assert keep.outputs[0].token_ids == alone(runner, PROMPTS[0], 30)
    runner.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
    assert runner.kv.pool.num_free == runner.kv.pool.num_blocks


def test_a_request_that_can_never_fit_is_refused_before_anything_runs(runner):
    engine = Engine(runner)
    with pytest.raises(CapacityError, match="big needs .* KV blocks"):
        engine.submit(Request([1] * 600, Sampling(max_new_tokens=1), name="big"))
    assert not engine.busy


def test_greedy_sampling_takes_torch_argmax_first_maximum_and_nan():
    """Greedy picks (numpy's argmax on the CPU) are torch's: the first of equal maxima, a NaN over any number."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 1000, generator=g)
    rows[1, 7] = rows[1, 900] = 50.0
    rows[2, 300] = rows[2, 20] = float("nan")
    rows[3] = float("-inf")
    assert sample(rows, 0.0, 1.0, 0, [None] * 4) == rows.argmax(-1).tolist() == [int(rows[0].argmax()), 7, 20, 0]
    assert sample(rows.to(torch.bfloat16), 0.0, 1.0, 0, [None] * 4)[1:] == [7, 20, 0]


def test_generate_runs_its_prompts_together_in_a_pool_sized_for_them(tiny_llama):
    """`Runner.generate` of several prompts without a planned KV pool sizes one for them all and the engine's
    admission rule (each running output's newest block beside a prefill pass's): they run in the same passes, each
    with its own tokens alone (a pool of their blocks alone had the second wait for the first to finish)."""
    with Runner.from_config(run_config(tiny_llama)) as r:
        seen = []
        original = r.target.forward
        r.target.forward = lambda batch, **kw: (seen.append(len(batch.sids)), original(batch, **kw))[1]
        together = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=6, stop_on_eos=False)]
        del r.target.forward
        assert max(seen) == len(PROMPTS) and len(seen) < 2 * 6
        assert together == [alone(r, p, 6) for p in PROMPTS]


def test_the_throughput_mode_runs_its_batch_in_the_same_passes(tiny_llama, tmp_path):
    """`offload run --input` without a planned KV pool sizes one for its `--batch` largest requests with room for
    the engine's admission rule: the batch runs together (it ran one request at a time), each request with its
    tokens alone."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt": p, "max_tokens": 6, "temperature": 0}) + "\n"
                           for i, p in enumerate(PROMPTS)))
    with Runner.from_config(run_config(tiny_llama)) as r:
        seen = []
        original = r.target.forward
        r.target.forward = lambda batch, **kw: (seen.append(len(batch.sids)), original(batch, **kw))[1]
        assert run_file(r, inp, out, FileDefaults(), max_batch=len(PROMPTS), progress=False).done == len(PROMPTS)
        del r.target.forward
        rows = {row["id"]: row["choices"][0]["token_ids"] for row in map(json.loads, out.read_text().splitlines())}
        assert max(seen) == len(PROMPTS)
        assert [rows[str(i)] for i in range(len(PROMPTS))] == [alone(r, p, 6) for p in PROMPTS]
