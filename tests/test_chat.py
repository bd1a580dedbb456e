"""Chat: prompts rendered as transformers renders them, replies as transformers generates them, turn after
turn with the conversation's KV kept; EOS ids from generation_config.json and stop strings end a reply."""

from __future__ import annotations

import io
import json
import re
import shutil
import time

import pytest
import torch
import yaml

from offload.cli.chat import repl
from offload.cli.main import main
from offload.errors import CapacityError
from offload.runtime.conversation import Conversation
from offload.runtime.engine import Engine, Request, Sampling
from offload.runtime.runner import Runner
from tests.conftest import run_config
from tests.test_chat_template import CHATML

transformers = pytest.importorskip("transformers")

TURNS = ["Where is the kettle?", "And the tea, then?", "Thank you, and goodbye."]
NEW = 10


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, model_factory):
    d = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(model_factory("llama"), d)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>"}))
    return d


def hf_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def hf_conversation(d, turns, new, eos):
    """transformers' own three-turn chat: apply_chat_template, then generate (greedy) on the same ids."""
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    messages, out = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = hf_ids(tok, messages)
        gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, eos_token_id=list(eos), pad_token_id=0)
        reply = gen[0, len(ids):].tolist()
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
        out.append((ids, reply, messages[-1]["content"]))
    return out


def greedy(runner, new=NEW, **kw) -> Sampling:
    return Sampling(new, stop_token_ids=frozenset(runner.generation.eos_token_ids), **kw)


def test_three_turns_equal_transformers_and_only_new_tokens_are_prefilled(chat_dir):
    with Runner.from_config(run_config(chat_dir, kv_cache={"block_size": 4})) as r:
        ref = hf_conversation(chat_dir, TURNS, NEW, r.generation.eos_token_ids)
        conv = Conversation(r, greedy(r))
        for i, (text, (ids, tokens, reply_text)) in enumerate(zip(TURNS, ref)):
            assert conv.prompt_ids(conv.messages + [{"role": "user", "content": text}]) == ids
            reply = conv.say(text)
            assert reply.token_ids == tokens, f"turn {i}"
            assert reply.text == reply_text
            assert reply.cached + reply.prefilled == len(ids)
            if i:  # the history came from the kept KV: all it shares with the new prompt is reused
                history = ref[i - 1][0] + ref[i - 1][1][:-1]  # the last reply token was never fed back
                shared = next((j for j, (a, b) in enumerate(zip(history, ids)) if a != b), len(history))
                assert reply.cached == shared >= len(ref[i - 1][0])
        kv = conv.engine.kv
        assert len(kv.seqs) == 1 and kv.length(conv.kept.sid) == len(conv.kept.tokens)
        conv.close()
        kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
        assert not kv.seqs and kv.logical.num_free == kv.logical.num_blocks  # nothing leaked


def test_a_kept_conversation_continues_on_cold_blocks(chat_dir, tmp_path):
    """KV tiers: the kept history is demoted to host blocks between turns and still gives transformers' tokens."""
    cfg = run_config(chat_dir, tiers={"gpu": {"capacity": "1GiB"}, "cpu": {"capacity": "64MiB"},
                                      "disk": {"path": str(tmp_path / "store")}},
                     kv_cache={"block_size": 4, "gpu_blocks": 12, "cpu_blocks": 64},
                     activations={"prefill_chunk": 16})
    with Runner.from_config(cfg) as r:
        ref = hf_conversation(chat_dir, TURNS, NEW, r.generation.eos_token_ids)
        conv = Conversation(r, greedy(r))
        assert [conv.say(t).token_ids for t in TURNS] == [tokens for _, tokens, _ in ref]
        assert r.kv.count("cpu") > 0


def test_every_eos_of_generation_config_ends_a_reply(chat_dir, tmp_path):
    with Runner.from_config(run_config(chat_dir)) as r:
        free = Conversation(r, Sampling(NEW, stop_token_ids=frozenset())).say(TURNS[0]).token_ids  # no EOS at all
    d = tmp_path / "m"
    shutil.copytree(chat_dir, d)
    eos = [free[6], free[3]]  # the second EOS id comes first in the reply
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, *eos], "do_sample": False}))
    with Runner.from_config(run_config(d)) as r:
        assert set(r.generation.eos_token_ids) == {2, *eos}
        reply = Conversation(r, greedy(r)).say(TURNS[0])
        [res] = r.generate([reply_prompt := Conversation(r, greedy(r)).prompt_ids(
            [{"role": "user", "content": TURNS[0]}])], max_new_tokens=NEW)
    cut = free.index(free[3]) + 1
    assert reply.token_ids == free[:cut] and reply.finish_reason == "eos"
    assert res.token_ids == free[:cut] and res.finish_reason == "eos"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    gen = model.generate(torch.tensor([reply_prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert gen[0, len(reply_prompt):].tolist() == free[:cut]  # transformers stops there too


def test_a_conversation_stops_at_eos_by_default(chat_dir, tmp_path):
    """`runner.chat()`, `Conversation(runner)` and a hand-made `Sampling` all end a reply at the model's EOS ids
    (generation_config.json / config.json) without being given them."""
    with Runner(run_config(chat_dir)) as r:
        free = Conversation(r, Sampling(NEW, stop_token_ids=frozenset())).say(TURNS[0]).token_ids
    d = tmp_path / "m"
    shutil.copytree(chat_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[4]], "do_sample": False}))
    with Runner(run_config(d)) as r:
        want = free[: next(i for i, t in enumerate(free) if t in r.generation.eos_token_ids) + 1]
        for conv in (r.chat(max_new_tokens=NEW), Conversation(r, Sampling(NEW))):
            reply = conv.say(TURNS[0])
            assert reply.token_ids == want and reply.finish_reason == "eos"
            conv.close()
        reply = Conversation(r).say(TURNS[0])  # the checkpoint's defaults: up to 512 new tokens
        assert reply.token_ids == want and reply.finish_reason == "eos"
        assert r.chat(temperature=0.5, max_new_tokens=3).sampling.temperature == 0.5


def test_a_stop_string_ends_the_reply_and_is_not_shown(chat_dir):
    with Runner.from_config(run_config(chat_dir)) as r:
        full = Conversation(r, Sampling(16)).say(TURNS[0])
        text = full.text
        stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() and
                    text.index(text[i : i + 2]) == i)
        shown = []
        conv = Conversation(r, Sampling(16, stop_strings=("never appears", stop)))
        reply = conv.say(TURNS[0], on_text=shown.append)
        assert reply.text == text[: text.index(stop)] and reply.finish_reason == "stop"
        assert "".join(shown) == reply.text  # half a stop string is never streamed
        assert reply.token_ids == full.token_ids[: len(reply.token_ids)] and len(reply.token_ids) < 16
        assert conv.messages[-1] == {"role": "assistant", "content": reply.text}
        [res] = r.generate([conv.prompt_ids(conv.messages[:1])], max_new_tokens=16, stop=[stop])
        assert res.text == reply.text and res.finish_reason == "stop"


def test_continuing_refuses_what_can_never_fit_and_keeps_the_conversation(chat_dir):
    with Runner.from_config(run_config(chat_dir, kv_cache={"block_size": 4, "gpu_blocks": 24})) as r:
        engine = Engine(r)
        first = engine.submit(Request([1, 5, 9, 13, 17], Sampling(4), keep=True))
        engine.run([])
        kept = first.kept
        assert kept is not None and len(kept.tokens) == 5 + 4 - 1  # the last token's K/V is not computed
        with pytest.raises(CapacityError, match="KV blocks"):
            engine.continue_(kept, list(kept.tokens) + [7] * 200, Sampling(4))
        assert r.kv.length(kept.sid) == len(kept.tokens)  # untouched
        more = engine.continue_(kept, list(kept.tokens) + [3, 4], Sampling(4), keep=False)
        engine.run([])
        assert len(more.context) == len(kept.tokens) and len(more.prompt) == 2
        alone = r.generate([list(kept.tokens) + [3, 4]], max_new_tokens=4, stop_on_eos=False)[0].token_ids
        assert more.outputs[0].token_ids == alone
        r.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
        assert not r.kv.seqs and r.kv.logical.num_free == r.kv.logical.num_blocks


def test_chat_repl_through_stdin(chat_dir, tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "chat.yaml"
    cfg.write_text(yaml.safe_dump(run_config(chat_dir)))
    with Runner.from_config(cfg) as r:
        conv = Conversation(r, greedy(r, 6))
        expected = [conv.say(t).text for t in TURNS]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TURNS) + "\n/exit\nnot read\n"))
    assert main(["chat", "--config", str(cfg), "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out == "".join(t + "\n" for t in expected)
    cached = [int(n) for n in re.findall(r"\[turn \d: (\d+) prompt tokens from the cache", err)]
    assert len(cached) == 3 and cached[0] == 0 and 0 < cached[1] < cached[2]  # turns 2 and 3 reuse the KV


def test_while_the_user_is_away_the_conversations_idle_kv_leaves_the_device(chat_dir, tmp_path):
    cfg = run_config(chat_dir, tiers={"gpu": {"capacity": "256MiB"}, "cpu": {"capacity": "64MiB"}},
                     kv_cache={"block_size": 4, "gpu_blocks": 64, "cpu_blocks": 64, "eviction": "idle",
                               "idle_seconds": 0.2})
    with Runner.from_config(cfg) as r:
        alone = Conversation(r, greedy(r, 6))
        expected = alone.say(TURNS[0]).text
        alone.close()
        conv = Conversation(r, greedy(r, 6))
        seen = []

        class SlowUser(io.StringIO):  # answers the second prompt only after a while, as a person would
            def readline(self, *a):
                if seen:
                    while conv.kept is None:  # the reply is being written
                        time.sleep(0.05)
                    time.sleep(1.0)
                    seen.append((r.kv.count("gpu"), r.kv.count("cpu")))
                    return ""
                seen.append(None)
                return TURNS[0] + "\n"

        out, err = io.StringIO(), io.StringIO()
        assert repl(conv, SlowUser(), out, err) == 1
        conv.close()
    assert out.getvalue() == expected + "\n"
    gpu, cpu = seen[1]
    assert cpu > 0 and gpu == 1  # all but the newest, partly written block left the device while nobody spoke


def test_run_chat_renders_the_prompt_as_one_user_message(chat_dir, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run_config(chat_dir)))
    assert main(["run", "--config", str(cfg), "--chat", "--prompt", TURNS[0], "--max-new-tokens", "5",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    tok = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    ids = hf_ids(tok, [{"role": "user", "content": TURNS[0]}])
    assert data["stats"]["prompt_tokens"] == len(ids)
    with Runner.from_config(cfg) as r:
        assert data["results"][0]["token_ids"] == r.generate([ids], max_new_tokens=5)[0].token_ids


def test_kept_conversations_give_their_blocks_back_oldest_first_when_nothing_else_can_run(chat_dir):
    cfg = run_config(chat_dir, kv_cache={"block_size": 4, "gpu_blocks": 12}, activations={"prefill_chunk": 8})
    with Runner.from_config(cfg) as r:
        def alone(ids, n):
            return r.generate([ids], max_new_tokens=n, stop_on_eos=False)[0].token_ids

        engine = Engine(r)
        old = engine.submit(Request([1, 5, 9, 13, 17], Sampling(4), keep=True))
        engine.run([])
        young = engine.submit(Request([1, 6, 10, 14], Sampling(4), keep=True))
        engine.run([])
        big_prompt = list(range(3, 33))  # 30 + 6 tokens: 9 blocks of 4, and the two kept hold 4 of 12
        big = engine.submit(Request(big_prompt, Sampling(6)))
        engine.run([])
        assert big.outputs[0].token_ids == alone(big_prompt, 6)
        assert old.kept.sid not in r.kv.seqs and r.kv.length(young.kept.sid) == len(young.kept.tokens)
        again = engine.continue_(old.kept, list(old.kept.tokens) + [3, 4], Sampling(4), keep=False)
        engine.run([])  # the dropped conversation is computed again from its start
        assert again.context == [] and again.outputs[0].token_ids == alone(list(old.kept.tokens) + [3, 4], 4)
        engine.drop(young.kept)
        r.kv.prefix.clear()  # the prefix cache lets its blocks go: then every block is free
        assert not r.kv.seqs and r.kv.logical.num_free == r.kv.logical.num_blocks


def test_sampling_defaults_come_from_generation_config_unless_flags_override(chat_dir, tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(chat_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 3.0, "top_k": 50,
                                                          "max_new_tokens": 7}))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run_config(d)))

    def run(*flags):
        assert main(["run", "--config", str(cfg), "--prompt", "Hello", "--seed", "3", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["results"][0]["token_ids"]

    with Runner.from_config(cfg) as r:
        hot = r.generate(["Hello"], max_new_tokens=7, temperature=3.0, top_k=50, seed=3)[0].token_ids
        greedy_ids = r.generate(["Hello"], max_new_tokens=5, temperature=0)[0].token_ids
        assert r.generate(["Hello"], seed=3)[0].token_ids == hot  # Python applies the same defaults
    assert run() == hot and len(hot) == 7
    assert run("--temperature", "0", "--max-new-tokens", "5") == greedy_ids != hot[:5]


def test_a_turn_that_outgrows_the_context_is_an_error_line_and_reset_starts_over(chat_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    cfg = tmp_path / "chat.yaml"
    cfg.write_text(yaml.safe_dump(run_config(chat_dir)))
    lines = [TURNS[0], TURNS[1], "/reset", TURNS[1]]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "--config", str(cfg), "--max-new-tokens", "4", "--context", "64"]) == 0
    out, err = capsys.readouterr()
    # both numbers and the limit that binds: the conversation's --context, before any pass of that turn
    assert re.search(r"offload: error: the conversation has \d{3} prompt tokens, which leaves no room for a new token "
                     r"in the conversation's context \(chat --context\) of 64 tokens", err)
    assert "(conversation cleared)" in err
    turns = re.findall(r"\[turn (\d): (\d+) prompt tokens from the cache", err)
    assert turns == [("1", "0"), ("2", "0")]  # the second message, alone after /reset, was answered
