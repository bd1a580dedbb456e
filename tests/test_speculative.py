"""Speculative decoding gives the target's own results: greedy tokens, sampled distributions, KV blocks.

The draft is the target's checkpoint with noise on its weights (`offload.testing.draft`): it agrees
with the target often but not always, so every step both keeps and rejects drafts.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from offload.cli.main import main
from offload.errors import ConfigError
from offload.kv.cache import PagedKVCache
from offload.model import functional as M
from offload.model import fused
from offload.model.checkpoint import Checkpoint
from offload.model.layout import column_groups
from offload.plan.speculative import AUTO_MIN_SPEEDUP, PLAN_ALPHA, SpecGain, choose_tokens, expected_tokens
from offload.runtime.engine import Engine, Request, Sampling
from offload.runtime.executor import ForwardBatch
from offload.runtime.runner import Runner
from offload.runtime.speculative import Speculator
from offload.testing.draft import perturbed_copy
from offload.weights.groups import model_layouts
from schedulers.timeline import Timeline
from tests.conftest import run_config
from tests.test_tiered_runner import tiers_for

transformers = pytest.importorskip("transformers")

NEW = 12


def ragged(vocab: int, lens=(23, 3, 9), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The oracle: transformers, one prompt at a time, full recomputation every token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(ids):])
    return out


@pytest.fixture(scope="module")
def draft_for(model_factory, tmp_path_factory):
    made = {}

    def make(target, noise=0.1):
        if (target, noise) not in made:
            made[target, noise] = perturbed_copy(target, tmp_path_factory.mktemp("draft"), noise)
        return made[target, noise]

    return make


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_greedy_tokens_are_the_targets_for_every_family(model_factory, draft_for, family):
    target = model_factory(family)
    prompts = ragged(512, lens=(23, 3, 9) if family != "mistral" else (29, 3, 9))  # mistral: 29 + 20 > window 32
    expected = hf_greedy(target, prompts, NEW)
    cfg = run_config(target, speculative={"draft": str(draft_for(target)), "tokens": 4},
                     kv_cache={"block_size": 4}, activations={"prefill_chunk": 8})
    with Runner.from_config(cfg) as r:
        out = r.generate(prompts, max_new_tokens=NEW, stop_on_eos=False)
        assert [o.token_ids for o in out] == expected
        stats = out[0].stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts were both kept and rolled back
        assert stats.decode_steps < len(prompts) * (NEW - 1)  # and passes were saved
        r.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
        assert r.kv.pool.num_free == r.kv.pool.num_blocks and r.draft.kv.pool.num_free == r.draft.kv.pool.num_blocks
        spans = r.timeline.on("speculative")  # the trace: a draft and a verify span per pass, what each kept
    verify = [s for s in spans if s.name == "verify"]
    assert len(verify) == stats.decode_steps and any(s.name == "draft" for s in spans)
    assert sum(s.args["accepted"] for s in verify) == stats.accepted_tokens
    assert sum(s.args["proposed"] for s in verify) == stats.draft_tokens


def test_greedy_tokens_are_the_same_when_the_target_streams(model_factory, draft_for, tmp_path):
    placement = "mixed"  # layers homed on the device, in RAM and on disk, streamed through a ring; KV in 2 tiers
    target = model_factory("llama", overrides={"num_hidden_layers": 8})
    prompts = ragged(512)
    with Runner.from_config(run_config(target)) as r:
        plain = [o.token_ids for o in r.generate(prompts, max_new_tokens=NEW, stop_on_eos=False)]
    layer = model_layouts(Checkpoint(target).config, torch.float32)["layer.0"].nbytes
    cfg = run_config(target, tiers=tiers_for(placement, layer, 1, tmp_path / "store"), prefetch={"depth": 1},
                     kv_cache={"gpu_blocks": 8, "cpu_blocks": 16, "block_size": 4},
                     speculative={"draft": str(draft_for(target)), "tokens": 3}, activations={"prefill_chunk": 8})
    alone = run_config(draft_for(target), kv_cache={"block_size": 4}, activations={"prefill_chunk": 8})
    with Runner.from_config(alone) as d:
        cfg["tiers"]["gpu"]["capacity"] += d.plan.used("gpu") + 24 * d.kv_block_bytes  # the resident draft
    cfg["tiers"]["cpu"]["capacity"] += 16 * PagedKVCache.block_nbytes(Checkpoint(target).config, 4, torch.float32)
    with Runner.from_config(cfg) as r:
        assert r.plan.streamed  # the target really streams its layers
        out = r.generate(prompts, max_new_tokens=NEW, stop_on_eos=False)
        assert [o.token_ids for o in out] == plain
        assert 0 < out[0].stats.accepted_tokens < out[0].stats.draft_tokens


def kv_bytes(runner, sid: int) -> torch.Tensor:
    """The bytes of a sequence's KV blocks in token order (every layer), wherever they live on the device."""
    kv = runner.kv
    data = kv.stores["gpu"].arrays["kv"].data  # [L, slots, 2, block_size, Hkv, D]
    return torch.stack([data[:, kv.blocks[b].slot] for b in kv.seqs[sid].blocks], dim=1)


def test_rollback_leaves_the_blocks_of_a_run_that_never_saw_the_rejected_tokens(tiny_llama):
    cfg = run_config(tiny_llama, kv_cache={"gpu_blocks": 16, "block_size": 4})
    prompt, rejected = [1, 17, 99, 23, 5, 61, 7], [300, 41, 42, 43, 44, 45]
    with Runner.from_config(cfg) as spec, Runner.from_config(cfg) as plain:
        a = spec.kv.add_sequence(reserve_tokens=16)
        spec.target.forward(ForwardBatch.last([a], [prompt]))
        spec.target.forward(ForwardBatch.last([a], [[8, *rejected]]))  # 7 tokens: spans two more blocks
        reserved = len(spec.kv.seqs[a].reserved)
        spec.kv.truncate(a, len(prompt) + 1, reserve=True)  # only token 8 is kept (rejected drafts: ids reserved)
        b = plain.kv.add_sequence(reserve_tokens=16)
        plain.target.forward(ForwardBatch.last([b], [prompt]))
        plain.target.forward(ForwardBatch.last([b], [[8]]))
        assert spec.kv.length(a) == plain.kv.length(b) == 8
        assert len(spec.kv.seqs[a].blocks) == len(plain.kv.seqs[b].blocks) == 2
        ka, kb = kv_bytes(spec, a), kv_bytes(plain, b)  # [L, blocks, 2, block_size, Hkv, D]
        assert torch.equal(ka[:, 0], kb[:, 0])  # the prompt's full block, untouched
        assert torch.equal(ka[:, 1, :, 4:], torch.zeros_like(ka[:, 1, :, 4:]))  # past the end: zero again
        assert torch.equal(kb[:, 1, :, 4:], torch.zeros_like(kb[:, 1, :, 4:]))
        # token 8 went through in a pass of 7 rows instead of 1: the same up to the rounding of the matmuls
        torch.testing.assert_close(ka[:, 1], kb[:, 1], rtol=1e-5, atol=1e-5)
        assert spec.kv.pool.num_free == plain.kv.pool.num_free  # the device slots went back to the pool
        assert len(spec.kv.seqs[a].reserved) == reserved + 2  # the logical ids back to the reservation
        # the next token goes where the plain run puts it, and attends over the same context
        torch.testing.assert_close(spec.target.forward(ForwardBatch.last([a], [[42]])),
                                   plain.target.forward(ForwardBatch.last([b], [[42]])), rtol=1e-4, atol=1e-4)


def test_rollback_never_touches_blocks_shared_with_other_samples(tiny_llama):
    cfg = run_config(tiny_llama, kv_cache={"gpu_blocks": 16, "block_size": 4})
    with Runner.from_config(cfg) as r:
        kv = r.kv
        parent = kv.add_sequence(reserve_tokens=16)
        r.target.forward(ForwardBatch.last([parent], [[1, 17, 99, 23, 5, 61]]))  # a full block, a partial (shared) one
        child = kv.fork(parent, 16)
        before = kv_bytes(r, parent).clone()
        shared = list(kv.seqs[parent].blocks)
        r.target.forward(ForwardBatch.last([child], [[7, 8, 9, 10, 11]]))  # copy-on-write of the partial block, 2 more
        kv.truncate(child, 7)
        assert kv.seqs[child].blocks[0] == shared[0] and kv.seqs[child].blocks[1] != shared[1]
        assert [kv.logical.refcount(b) for b in shared] == [2, 1]
        assert torch.equal(kv_bytes(r, parent), before)
        kv.truncate(child, 6)
        assert kv.seqs[child].blocks[0] == shared[0] and kv.length(parent) == 6
        kv.free_sequence(child)
        kv.free_sequence(parent)
        kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
        assert kv.pool.num_free == kv.pool.num_blocks and kv.logical.num_free == kv.logical.num_blocks


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Pearson's test, cells with expected counts under 5 pooled; the p-value (Wilson-Hilferty)."""
    cells, pool_o, pool_e = [], 0, 0.0
    for o, e in zip(observed, expected):
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            cells.append((o, e))
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    stat, dof = sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_follow_the_targets_distribution(tiny_llama, draft_for):
    """Joint frequencies of (t1, t2, t3) from 800 samples against the target's exact probabilities.

    t1 comes from the prompt's pass; t2 and t3 from verifying a chain of two drafts (kept, or resampled)."""
    prompt, n, k, temp, top_k = [1, 17, 99, 23, 5], 800, 2, 1.0, 4
    draft = draft_for(tiny_llama, 0.3)
    cfg = run_config(tiny_llama, speculative={"draft": str(draft), "tokens": k})
    with Runner.from_config(cfg) as r:
        out = r.generate([prompt], max_new_tokens=4, temperature=temp, top_k=top_k, seed=11, num_samples=n,
                         stop_on_eos=False)
        stats = out[0].stats
    assert 0.1 < stats.acceptance < 0.9 and stats.draft_tokens >= 2 * n  # each sample: a chain of 2, then more

    with Runner.from_config(run_config(tiny_llama)) as plain:
        def dist(prefixes):  # the target's next-token distribution after each prefix (temperature, top-k)
            logits = plain.prefill_logits([prompt + p for p in prefixes])
            rows = torch.stack([logits[i, len(prompt) + len(p) - 1] for i, p in enumerate(prefixes)]) / temp
            kth = rows.topk(top_k, dim=-1).values[:, -1:]
            return torch.softmax(rows.masked_fill(rows < kth, float("-inf")), dim=-1)

        p1 = dist([[]])[0]
        firsts = p1.nonzero().flatten().tolist()
        p2 = dict(zip(firsts, dist([[a] for a in firsts])))
        pairs = [(a, b) for a in firsts for b in p2[a].nonzero().flatten().tolist()]
        p3 = dict(zip(pairs, dist([list(ab) for ab in pairs])))
    cells = [(a, b, c) for a, b in pairs for c in p3[a, b].nonzero().flatten().tolist()]
    expected = [n * float(p1[a] * p2[a][b] * p3[a, b][c]) for a, b, c in cells]
    counts = {c: 0 for c in cells}
    assert len(out) == 1 and len(out[0].outputs) == n  # one result for the prompt, its n samples
    for o in out[0].outputs:
        counts[tuple(o.token_ids[:3])] += 1  # a KeyError here: a token the target could never draw
    assert chi_square_p([counts[c] for c in cells], expected) > 1e-3


def test_auto_tokens_follow_the_measured_acceptance():
    flat = lambda k: 1.0  # noqa: E731 - a streamed target: a pass costs the same for 1 or k+1 tokens
    assert choose_tokens(0.9, 0.02, flat, 1.0).tokens >= 8
    assert choose_tokens(0.5, 0.05, flat, 1.0).tokens in (2, 3, 4)
    assert choose_tokens(0.1, 0.2, flat, 1.0).tokens == 0  # a draft that costs more than it saves: off
    assert choose_tokens(0.9, 0.02, flat, 1.0).speedup > 4
    # the mean tokens per pass against a simulation of the acceptance process
    g = torch.Generator().manual_seed(0)
    kept = (torch.rand(20000, 5, generator=g) < 0.7).int().cumprod(dim=1).sum(dim=1) + 1
    assert abs(float(kept.float().mean()) - expected_tokens(0.7, 5)) < 0.03


def test_auto_tokens_follow_what_the_run_measures():
    spec = Speculator(draft=None, tokens=None, timeline=Timeline(enabled=False))
    assert spec.tokens() == 1  # nothing measured yet: one draft token to measure both passes
    spec.draft_s, spec.draft_passes, spec.verify_s, spec.verify_passes = 0.1, 10, 10.0, 10  # draft 100x cheaper
    spec.proposed, spec.accepted, spec.cut = 1000, 900, 10
    assert spec.tokens() >= 8 and spec.choice.speedup > 4
    spec.accepted, spec.cut = 100, 400  # the draft is rarely right
    spec.verify_passes = 11
    assert spec.tokens() in (1, 2)
    spec.draft_s = 8.0  # ... and costs most of a target pass: drafting is off, but probed every 16 passes
    assert spec.tokens() == 0 and spec.choice.speedup == 1.0
    spec.verify_s, spec.verify_passes = 16.0, 16  # (a target pass still 1 s)
    assert spec.tokens() == 1


def test_auto_tokens_time_a_draft_token_not_a_prompt_a_catching_up_or_a_first_use(tiny_llama, tmp_path):
    """The draft's pass time `tokens: auto` weighs is a draft token's: a prompt's prefill (SmolLM2-135M's 64 tokens
    took 270-560 ms, 30-60 draft passes' worth, and auto stayed plain from it) and a catching up on more than a step's
    own two tokens are not timed, nor the first pass (its kernels' first use); nor the target's first verify pass."""
    cfg = run_config(tiny_llama, kv_cache={"gpu_blocks": 32}, calibration=calibration(tmp_path / "fast.json", 20.0),
                     speculative={"draft": "self-int8", "tokens": "auto"})  # (a draft the plan keeps)
    with Runner.from_config(cfg) as r:
        spec = r.speculator
        passes, forward = [], spec.draft.forward

        def counted(batch):
            passes.append(max(len(t) for t in batch.tokens))
            return forward(batch)
        spec.draft.forward = counted
        verified = []
        timed_verify = spec.timed_verify
        spec.timed_verify = lambda seconds, k: (verified.append(k), timed_verify(seconds, k))
        r.generate([list(range(1, 40))], max_new_tokens=12, stop_on_eos=False)
    assert passes[0] >= 30 and spec.draft_passes == sum(n <= 2 for n in passes) - 1 > 0
    assert spec.verify_passes == len(verified) - 1 > 0


def test_auto_tokens_never_probe_a_draft_slower_than_the_target():
    spec = Speculator(draft=None, tokens=None, timeline=Timeline(enabled=False))
    spec.draft_s, spec.draft_passes, spec.verify_s, spec.verify_passes = 12.0, 10, 10.0, 16  # draft 1.2x a pass
    spec.accepted, spec.cut = 1000, 0  # even a draft the target always agrees with cannot pay
    assert spec.tokens() == 0


def calibration(path, int8_speed: float):
    """A calibration file whose packed int8 kernels go `int8_speed` times the dense ones."""
    dense = [4e9, 4e9, 3e9, 0.6e9]
    path.write_text(json.dumps({"links": {"memcpy": 4e9}, "compute": {
        "cpu": {"tokens": [1, 8, 64, 512], "weight_bytes_per_s": dense},
        "cpu/int8": {"tokens": [1, 8, 64], "weight_bytes_per_s": [int8_speed * d for d in dense[:3]]}}}))
    return str(path)


def test_auto_tokens_run_plain_when_the_plan_predicts_the_draft_does_not_pay(tiny_llama, tmp_path, capsys, caplog):
    """A self-int8 draft whose passes cost as much as the target's cannot pay (issue 22 item 4: SmolLM2 ran at
    0.59x with one): `tokens: auto` runs plain decoding, says so once (a warning, and in `offload plan`), and
    gives plain decoding's tokens; a draft 20x faster than the target is kept."""
    base = run_config(tiny_llama, kv_cache={"gpu_blocks": 32}, calibration=calibration(tmp_path / "same.json", 1.0))
    prompts = [[1, 17, 99, 23, 5, 61, 7, 300, 41], [1, 8, 2]]
    with Runner.from_config(base) as r:
        want = [x.token_ids for x in r.generate(prompts, max_new_tokens=8, stop_on_eos=False)]
    auto = base | {"speculative": {"draft": "self-int8", "tokens": "auto"}}
    with caplog.at_level("WARNING"), Runner.from_config(auto) as r:
        assert r.draft is None and r.speculator is None and r.config.speculative.draft == "none"
        assert [x.token_ids for x in r.generate(prompts, max_new_tokens=8, stop_on_eos=False)] == want
        note = r.speculation_note
    assert note and "runs plain decoding" in note and "x0." in note
    assert [rec.getMessage() for rec in caplog.records if "speculative" in rec.getMessage()] == [note]
    yaml = tmp_path / "auto.yaml"
    yaml.write_text(json.dumps(auto))
    assert main(["plan", "--config", str(yaml)]) == 0
    out = capsys.readouterr().out
    assert note in out and "per draft pass" not in out  # the plan shows the draft-less run the runner makes
    fast = auto | {"calibration": calibration(tmp_path / "fast.json", 20.0)}
    with Runner.from_config(fast) as r:
        assert r.draft is not None and r.speculation_note is None


def test_auto_tokens_take_a_draft_only_for_a_predicted_gain_beyond_the_plans_error():
    """A draft the plan predicts at a small gain over plain decoding (x1.0-1.2) can be a loss, the plan being within
    ~20% of a run: `tokens: auto` runs plain and says why, naming the margin; a draft predicted past it is taken."""
    verify = lambda k: 1.0 + 0.05 * k  # noqa: E731 - a CPU: a pass over k+1 tokens costs a little more than one

    def drafted(t_draft: float) -> tuple[float, str | None]:
        g = SpecGain(t_draft=t_draft, t_plain=0.010, t_alone=0.010, verify=verify)
        return max(g.at(PLAN_ALPHA, k).speedup for k in range(1, 9)), g.plain_note()  # the best chain's

    (slow, slow_note), (near, near_note), (fast, fast_note) = drafted(0.012), drafted(0.005), drafted(0.001)
    assert slow < 1 and "x0." in slow_note and "outlast" not in slow_note
    assert 1.0 < near < AUTO_MIN_SPEEDUP and near_note is not None
    assert f"x{near:.2f} of plain decoding" in near_note and f"under the x{AUTO_MIN_SPEEDUP:.1f}" in near_note
    assert fast >= AUTO_MIN_SPEEDUP and fast_note is None


def test_the_measured_acceptance_is_per_token_given_the_ones_before():
    """Chains of 4 drafts, each kept with probability 0.7 while the ones before were: the estimate is 0.7,
    not the fraction of drafts kept (about 0.53), which would choose chains too short."""
    g = torch.Generator().manual_seed(1)
    kept = (torch.rand(5000, 4, generator=g) < 0.7).int().cumprod(dim=1).sum(dim=1)
    spec = Speculator(draft=None, tokens=4, timeline=Timeline(enabled=False))
    spec.proposed, spec.accepted, spec.cut = 4 * len(kept), int(kept.sum()), int((kept < 4).sum())
    assert abs(spec.alpha - 0.7) < 0.02
    assert spec.accepted / spec.proposed < 0.6


def test_bad_drafts_are_refused_with_the_knob_to_change(tiny_llama, model_factory, tmp_path):
    base = run_config(tiny_llama)
    with pytest.raises(ConfigError, match="speculative.draft.*neither none"):
        Runner.from_config({**base, "speculative": {"draft": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="vocabulary of 640 tokens"):
        bigger = model_factory("llama", overrides={"vocab_size": 640})
        Runner.from_config({**base, "speculative": {"draft": str(bigger)}})
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="another tokenizer"):
        Runner.from_config({**base, "speculative": {"draft": str(other)}})


def test_offload_plan_places_the_draft_first_and_predicts(tiny_llama, draft_for, tmp_path, capsys, caplog):
    cfg = run_config(tiny_llama, tiers={"gpu": {"capacity": "7MiB"}, "cpu": {"capacity": 0},
                                        "disk": {"path": str(tmp_path / "store")}},
                     kv_cache={"gpu_blocks": 8}, activations={"prefill_chunk": 16})
    alone = tmp_path / "alone.yaml"
    alone.write_text(json.dumps(cfg))
    with_draft = tmp_path / "spec.yaml"
    with_draft.write_text(json.dumps(cfg | {"speculative": {"draft": str(draft_for(tiny_llama)), "tokens": 4}}))
    assert main(["plan", "--config", str(alone), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["homes"].values()) == {"gpu"}  # alone, the target fits
    assert main(["plan", "--config", str(with_draft), "--json"]) == 0
    assert "disk" in json.loads(capsys.readouterr().out)["homes"].values()  # beside the draft, it streams
    assert main(["plan", "--config", str(with_draft)]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding" in out and "acceptance 0.9: tokens 4" in out
    # what the draft's memory costs: the plan compares with the draft-less step, a run warns once
    assert "without a draft:" in out and "speculation pays only above x" in out
    with caplog.at_level("WARNING"), Runner.from_config(json.loads(with_draft.read_text())):
        pass
    assert sum("streamed groups instead of 0" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("draft", ["self-int8", "self-int4"])
def test_a_self_draft_is_the_target_packed_and_gives_its_greedy_tokens(tiny_llama, draft):
    base = run_config(tiny_llama, kv_cache={"gpu_blocks": 32})
    prompts = [[1, 17, 99, 23, 5, 61, 7, 300, 41], [1, 8, 2]]
    with Runner.from_config(base) as r:
        want = [x.token_ids for x in r.generate(prompts, max_new_tokens=16, stop_on_eos=False)]
    with Runner.from_config(base | {"speculative": {"draft": draft, "tokens": 4}}) as r:
        out = r.generate(prompts, max_new_tokens=16, stop_on_eos=False)
        fmt = r.draft.config.weights
        assert r.draft.config.model == r.config.model and fmt.quantization == draft.removeprefix("self-")
        assert r.cfg.intermediate_size % fmt.group_size == 0  # a group size the tiny model's matrices allow
    assert [x.token_ids for x in out] == want
    assert 0 < out[0].stats.accepted_tokens <= out[0].stats.draft_tokens


# bf16 matrices wide enough that the CPU's GEMM splits its reduction differently for 1 row and for several
WIDE = {"hidden_size": 512, "intermediate_size": 4096, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_hidden_layers": 4}


@torch.inference_mode()
def test_a_verify_pass_gives_each_token_the_bits_of_a_plain_decode_step(model_factory):
    """The target's logits (and KV) for a chain of 9 tokens checked in one pass equal, bit for bit, those of
    9 plain decode steps, in bf16, with the chain crossing KV blocks: what makes greedy speculation exact."""
    target = model_factory("llama", overrides=WIDE)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 512, (27,), generator=g).tolist()
    chain = torch.randint(3, 512, (9,), generator=g).tolist()
    with Runner.from_config(run_config(target, dtype="bfloat16", kv_cache={"block_size": 4})) as r:
        kv = r.ensure_kv(32)
        a, b = kv.add_sequence(), kv.add_sequence()
        r.target.forward(ForwardBatch.last([a], [prompt]))
        r.target.forward(ForwardBatch.last([b], [prompt]))
        steps = torch.cat([r.target.forward(ForwardBatch.last([a], [[t]])) for t in chain])
        verify = r.target.forward(ForwardBatch.verify([b], [chain], keep=[len(chain)]))
        assert torch.equal(verify, steps)
        assert torch.equal(kv_bytes(r, b), kv_bytes(r, a))


def test_greedy_speculation_is_exact_in_bf16(model_factory):
    target = model_factory("llama", overrides=WIDE)
    prompts = ragged(512, lens=(21, 6))
    base = run_config(target, dtype="bfloat16", kv_cache={"block_size": 4})
    with Runner.from_config(base) as r:
        want = [x.token_ids for x in r.generate(prompts, max_new_tokens=40, stop_on_eos=False)]
    with Runner.from_config(base | {"speculative": {"draft": "self-int4", "tokens": 6}}) as r:
        out = r.generate(prompts, max_new_tokens=40, stop_on_eos=False)
    assert [x.token_ids for x in out] == want
    assert 0 < out[0].stats.accepted_tokens < out[0].stats.draft_tokens


def test_a_tree_verifies_the_drafts_top_first_tokens_and_keeps_the_longest_branch(model_factory, draft_for):
    """tree: true: greedy outputs branch on the draft's top first tokens, each branch verified in a fork of the
    output's sequence in the same pass; the tokens are still the target's, some steps keep a branch other than
    the draft's first choice, the forks' blocks all come back, and a pass yields at least a chain's tokens."""
    target = model_factory("llama")
    prompts = ragged(512)
    expected = hf_greedy(target, prompts, NEW)
    per_pass = {}
    for tree in (False, True):
        cfg = run_config(target, speculative={"draft": str(draft_for(target, 0.3)), "tokens": 3, "tree": tree},
                         kv_cache={"block_size": 4}, activations={"prefill_chunk": 8})
        with Runner.from_config(cfg) as r:
            out = r.generate(prompts, max_new_tokens=NEW, stop_on_eos=False)
            assert [o.token_ids for o in out] == expected
            r.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
            assert r.kv.pool.num_free == r.kv.pool.num_blocks and r.draft.kv.pool.num_free == r.draft.kv.pool.num_blocks
            verify = [s for s in r.timeline.on("speculative") if s.name == "verify"]
            per_pass[tree] = out[0].stats.tokens_per_decode_pass
            if tree:
                assert r.speculator.tree_wins > 0
                assert any(s.args["branches"] > s.args["rows"] for s in verify)
    assert per_pass[True] >= per_pass[False]


def test_a_tree_is_exact_in_bf16_and_sampled_outputs_keep_one_chain(model_factory):
    target = model_factory("llama", overrides=WIDE)
    prompt = ragged(512, lens=(21,))
    base = run_config(target, dtype="bfloat16", kv_cache={"block_size": 4})
    with Runner.from_config(base) as r:
        want = r.generate(prompt, max_new_tokens=40, stop_on_eos=False)[0].token_ids
    tree = base | {"speculative": {"draft": "self-int4", "tokens": 6, "tree": True}}
    with Runner.from_config(tree) as r:
        assert r.generate(prompt, max_new_tokens=40, stop_on_eos=False)[0].token_ids == want
        r.timeline.clear()
        r.generate(prompt, max_new_tokens=12, temperature=0.8, seed=1, stop_on_eos=False)
        verify = [s for s in r.timeline.on("speculative") if s.name == "verify"][-3:]
        assert verify and all(s.args["branches"] == s.args["rows"] for s in verify)  # sampling: one chain


@pytest.mark.cuda
@torch.inference_mode()
def test_on_cuda_a_verify_pass_gives_the_bits_of_plain_decode_steps_and_greedy_is_exact(model_factory):
    """The same on cuBLAS and the fused attention kernel: a chain checked in one pass equals single steps bit
    for bit in bf16, and greedy speculation (chain and tree, self-int4) gives the plain run's tokens."""
    target = model_factory("llama", overrides=WIDE)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 512, (27,), generator=g).tolist()
    chain = torch.randint(3, 512, (9,), generator=g).tolist()
    base = run_config(target, device="cuda", dtype="bfloat16", kv_cache={"block_size": 4})
    with Runner.from_config(base) as r:
        kv = r.ensure_kv(32)
        a, b = kv.add_sequence(), kv.add_sequence()
        r.target.forward(ForwardBatch.last([a], [prompt]))
        r.target.forward(ForwardBatch.last([b], [prompt]))
        steps = torch.cat([r.target.forward(ForwardBatch.last([a], [[t]])) for t in chain])
        assert torch.equal(r.target.forward(ForwardBatch.verify([b], [chain], keep=[len(chain)])), steps)
        kv.free_sequence(a)
        kv.free_sequence(b)
        want = r.generate([prompt], max_new_tokens=40, stop_on_eos=False)[0].token_ids
    for tree in (False, True):
        with Runner.from_config(base | {"speculative": {"draft": "self-int4", "tokens": 6, "tree": tree}}) as r:
            assert r.generate([prompt], max_new_tokens=40, stop_on_eos=False)[0].token_ids == want


def test_a_prompt_chunk_riding_in_a_verify_pass_is_one_product_and_changes_no_token(tiny_llama, draft_for,
                                                                                    monkeypatch):
    """A request joins while others speculate: its prompt chunk shares their verify pass. The chunk is
    multiplied as one product and attended in one call (not one per token: 64 tokens would be 64 products
    per matrix), and every request still gets the tokens it gets alone without a draft."""
    assert [len(g) for g in column_groups([5, 64, 3], lanes=[0, -1, 0])] == [2, 2, 2, 1, 1, 64]
    prompts = [[1, 17, 99, 23, 5, 61, 7, 300, 41], [1, *range(40, 100)]]
    with Runner.from_config(run_config(tiny_llama, kv_cache={"gpu_blocks": 64})) as r:
        want = [r.generate([p], max_new_tokens=12, stop_on_eos=False)[0].token_ids for p in prompts]
    cfg = run_config(tiny_llama, kv_cache={"gpu_blocks": 64}, activations={"prefill_chunk": 64},
                     speculative={"draft": str(draft_for(tiny_llama)), "tokens": 4})
    groups = []
    linear = M.linear
    monkeypatch.setattr(M, "linear",
                        lambda x, w, b=None, g=None, **kw: (groups.append(len(g or [0])), linear(x, w, b, g, **kw))[1])
    # (the compiled layer and head multiply once inside: seen op by op here)
    monkeypatch.setattr(fused, "layer_supported", lambda *a: False)
    monkeypatch.setattr(fused, "head_supported", lambda *a: False)
    with Runner.from_config(cfg) as r:
        engine = Engine(r)
        first = engine.submit(Request(prompts[0], Sampling(max_new_tokens=12)))
        for _ in range(3):
            engine.step()
        assert engine.decoding == [first]
        later = engine.submit(Request(prompts[1], Sampling(max_new_tokens=12)))
        groups.clear()
        engine.step()  # the first request's chain verified, the newcomer's 61-token prompt in the same pass
        assert max(groups) <= 4 + 1 + 1  # the chain's columns and one for the prompt
        while engine.busy:
            engine.step()
    assert [first.outputs[0].token_ids, later.outputs[0].token_ids] == want


def test_a_pass_that_fails_mid_tree_leaves_every_block_free(tiny_llama, draft_for, monkeypatch):
    """Forks of a tree (target and draft) live for one pass; when the pass raises (a full disk, Ctrl-C) the
    run's clean-up still gets every block of both pools back, and the runner serves the next request."""
    cfg = run_config(tiny_llama, kv_cache={"block_size": 4, "gpu_blocks": 64},
                     speculative={"draft": str(draft_for(tiny_llama, 0.3)), "tokens": 3, "tree": True})
    with Runner.from_config(cfg) as r:
        forward, calls = r.target.forward, []

        def failing(batch, hidden=None):
            calls.append(batch.lanes)
            if batch.lanes and max(batch.lanes) > 0 and len(calls) > 3:
                raise OSError(28, "No space left on device")
            return forward(batch, hidden)

        monkeypatch.setattr(r.target, "forward", failing)
        with pytest.raises(OSError):
            r.generate(ragged(512), max_new_tokens=NEW, stop_on_eos=False)
        assert any(lanes and max(lanes) > 0 for lanes in calls)  # it failed in a pass that verified a tree
        r.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
        assert r.kv.pool.num_free == r.kv.pool.num_blocks and r.kv.logical.num_free == r.kv.logical.num_blocks
        assert r.draft.kv.pool.num_free == r.draft.kv.pool.num_blocks
        assert r.draft.kv.logical.num_free == r.draft.kv.logical.num_blocks
        monkeypatch.setattr(r.target, "forward", forward)
        assert len(r.generate([[1, 5, 9]], max_new_tokens=4, stop_on_eos=False)[0].token_ids) == 4
