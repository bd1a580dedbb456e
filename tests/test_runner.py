"""Runner behaviour: batching, chunked prefill, admission, sampling, streaming, stopping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from offload.errors import CapacityError, ConfigError
from offload.runtime.runner import Runner
from tests.conftest import run_config

PROMPTS = [[1, 17, 99, 23, 5, 61, 7, 300, 41], [1, 8, 2], [1, 400, 33, 12, 19, 250]]


@pytest.fixture(scope="module")
def runner(tiny_llama):
    with Runner.from_config(run_config(tiny_llama)) as r:
        yield r


def test_ragged_batch_equals_each_prompt_alone(runner):
    batch = runner.generate(PROMPTS, max_new_tokens=20, stop_on_eos=False)
    for p, res in zip(PROMPTS, batch):
        assert res.token_ids == runner.generate([p], max_new_tokens=20, stop_on_eos=False)[0].token_ids
        assert res.prompt_ids == p and res.finish_reason == "length"


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunked_prefill_equals_unchunked(tiny_llama, runner, chunk):
    ref = runner.prefill_logits(PROMPTS)
    with Runner.from_config(run_config(tiny_llama, activations={"prefill_chunk": chunk})) as r:
        got = r.prefill_logits(PROMPTS)
        tokens = [res.token_ids for res in r.generate(PROMPTS, max_new_tokens=12, stop_on_eos=False)]
    assert (got - ref).abs().max() < 1e-5
    assert tokens == [res.token_ids for res in runner.generate(PROMPTS, max_new_tokens=12, stop_on_eos=False)]


def test_prefill_is_split_into_passes_of_at_most_the_chunk(tiny_llama):
    with Runner.from_config(run_config(tiny_llama, activations={"prefill_chunk": 4})) as r:
        seen = []
        original = r.target.forward
        r.target.forward = lambda batch, **kw: (seen.append(sum(batch.q_lens)), original(batch, **kw))[1]
        r.generate(PROMPTS, max_new_tokens=1)
    prefill = seen  # max_new_tokens=1: every pass is a prefill pass
    assert max(prefill) <= 4 and sum(prefill) == sum(map(len, PROMPTS))


def test_small_block_pool_queues_prompts_and_keeps_tokens(tiny_llama, runner):
    ref = [r.token_ids for r in runner.generate(PROMPTS, max_new_tokens=16, stop_on_eos=False)]
    # each prompt needs 2 blocks of 16 for (<=9 + 16) tokens; 3 blocks admit one prompt at a time
    with Runner.from_config(run_config(tiny_llama, kv_cache={"block_size": 16, "gpu_blocks": 3})) as r:
        got = [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=16, stop_on_eos=False)]
        r.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
        assert r.kv.pool.num_free == 3  # every block came back
    assert got == ref


def test_prompt_that_can_never_fit_is_refused(tiny_llama):
    with Runner.from_config(run_config(tiny_llama, kv_cache={"block_size": 4, "gpu_blocks": 2})) as r:
        with pytest.raises(CapacityError, match=r"prompt 0 needs \d+ KV blocks .* holds 2"):
            r.generate([PROMPTS[0]], max_new_tokens=8)


def test_seeded_sampling_is_reproducible_and_per_prompt(runner):
    kw = dict(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7, stop_on_eos=False)
    a = runner.generate(PROMPTS, **kw)
    b = runner.generate(PROMPTS, **kw)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    first_alone = runner.generate(PROMPTS[:1], **kw)[0].token_ids
    assert first_alone == a[0].token_ids  # prompt 0 draws from generator seed + 0 either way
    other = runner.generate(PROMPTS, **{**kw, "seed": 8})
    assert [x.token_ids for x in other] != [x.token_ids for x in a]


def test_top_k_one_is_greedy(runner):
    greedy = runner.generate(PROMPTS, max_new_tokens=10, stop_on_eos=False)
    top1 = runner.generate(PROMPTS, max_new_tokens=10, temperature=1.5, top_k=1, seed=0, stop_on_eos=False)
    assert [x.token_ids for x in top1] == [x.token_ids for x in greedy]


def test_stops_at_eos(tiny_llama, runner):
    ref = runner.generate([PROMPTS[0]], max_new_tokens=10, stop_on_eos=False)[0].token_ids
    runner_eos = Runner.from_config(run_config(tiny_llama))
    runner_eos.generation = dataclasses.replace(runner_eos.generation, eos_token_ids=(ref[3],))  # 4th token: EOS
    res = runner_eos.generate([PROMPTS[0]], max_new_tokens=10)[0]
    assert res.token_ids == ref[: ref.index(ref[3]) + 1] and res.finish_reason == "eos"


def test_text_prompts_stream_the_same_text(runner):
    pieces = []
    [res] = runner.generate(["The kettle on Larkspur Lane"], max_new_tokens=12,
                            on_token=lambda i, tok, text: pieces.append((i, tok, text)))
    assert [tok for _, tok, _ in pieces] == res.token_ids
    assert "".join(text for _, _, text in pieces) == res.text
    assert res.prompt_ids[0] == 1  # the tokenizer prepends <s>
    assert res.stats.generated_tokens == len(res.token_ids) and res.stats.decode_steps >= 1


def test_prefill_logits_accepts_one_prompt_and_pads_with_zeros(runner):
    one = runner.prefill_logits(PROMPTS[1])
    assert one.shape == (1, 3, runner.cfg.vocab_size)
    batch = runner.prefill_logits(PROMPTS)
    assert batch.shape == (3, 9, runner.cfg.vocab_size) and torch.all(batch[1, 3:] == 0)
    runner.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
    assert runner.kv.pool.num_free == runner.kv.pool.num_blocks


@pytest.mark.parametrize("call,match", [
    (lambda r: r.generate([[1, 10**6]]), r"token id 1000000 is outside the model's vocabulary"),
    (lambda r: r.generate([[]]), r"a prompt is empty"),
    (lambda r: r.generate([[1, 2]], max_new_tokens=0), r"max_new_tokens must be at least 1"),
    (lambda r: r.generate([[1, 2]], top_p=0), r"top_p must be in \(0, 1\]"),
])
def test_bad_requests_are_config_errors(runner, call, match):
    with pytest.raises(ConfigError, match=match):
        call(runner)


def test_cuda_device_without_cuda_is_refused(tiny_llama):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"CUDA is not available here; use device: cpu"):
        Runner.from_config(run_config(tiny_llama, device="cuda"))


def test_text_prompt_without_tokenizer(tmp_path, tiny_llama):
    import shutil
    dst = tmp_path / "notok"
    shutil.copytree(tiny_llama, dst)
    (dst / "tokenizer.json").unlink()
    with Runner.from_config(run_config(dst)) as r:
        assert len(r.generate([[1, 2, 3]], max_new_tokens=2)[0].token_ids) >= 1
        with pytest.raises(ConfigError, match=r"no tokenizer.json, so prompts must be lists of token ids"):
            r.generate(["hello"])


def test_garbage_in_fresh_kv_memory_never_reaches_the_tokens(tiny_llama, runner):
    """A pool laid over uninitialised tier memory may hold NaN bit patterns; blocks are zeroed when handed out."""
    ref = [r.token_ids for r in runner.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)]
    with Runner.from_config(run_config(tiny_llama, kv_cache={"gpu_blocks": 16})) as r:
        r.kv.stores["gpu"].arrays["kv"].data.fill_(float("nan"))
        assert [x.token_ids for x in r.generate(PROMPTS, max_new_tokens=8, stop_on_eos=False)] == ref
