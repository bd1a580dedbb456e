"""A three-turn chat with a trained chat model, offloaded, checked against transformers token for token.

    python -m scripts.check_chat [--model DIR] [--out scripts/results/chat_parity.json]

The model defaults to SmolLM2-135M-Instruct (float32, from `scripts/trained_model.py`: a real ChatML chat
checkpoint). Offload runs it with its layers streamed from a zarr store through small tiers and the
conversation's KV kept between turns (`offload.runtime.conversation`); transformers renders the same
conversation with `apply_chat_template` and answers with `generate` (greedy, the EOS ids of
generation_config.json). The script records, per turn, whether the prompt ids and the reply ids are equal,
how many prompt tokens Offload took from its cache and how many it computed, and the replies.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers  # a benchmark-only dependency (the test extra)

from offload.runtime.conversation import Conversation
from offload.runtime.engine import Sampling
from offload.runtime.runner import Runner
from scripts.trained_model import ensure_trained_model

TURNS = ["What is the capital of France?", "And how many people live there, roughly?",
         "Name one famous museum in that city."]


def reference(model_dir: Path, new: int) -> list[dict]:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    messages, out = [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=new, do_sample=False)
        reply = gen[0, len(ids):].tolist()
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
        out.append({"prompt_ids": ids, "reply_ids": reply, "reply": messages[-1]["content"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a chat checkpoint directory (float32)")
    ap.add_argument("--new", type=int, default=48, help="max new tokens per reply")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "chat_parity.json")
    args = ap.parse_args()
    if args.model is None:
        args.model = ensure_trained_model(dtype="float32")
    ref = reference(args.model, args.new)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model": str(args.model), "device": "cpu", "dtype": "float32",
               "tiers": {"gpu": {"capacity": "480MiB"}, "cpu": {"capacity": "48MiB"}, "disk": {"path": f"{tmp}/s"}},
               "kv_cache": {"block_size": 16, "gpu_blocks": 64}, "prefetch": {"depth": 2},
               "activations": {"prefill_chunk": 64}}
        turns = []
        with Runner.from_config(cfg) as r:
            conv = Conversation(r, Sampling(args.new, stop_token_ids=frozenset(r.generation.eos_token_ids)))
            for text, want in zip(TURNS, ref):
                ids = conv.prompt_ids(conv.messages + [{"role": "user", "content": text}])
                t0 = time.perf_counter()
                reply = conv.say(text)
                turns.append({"user": text, "prompt_ids_equal": ids == want["prompt_ids"],
                              "reply_ids_equal": reply.token_ids == want["reply_ids"], "reply": reply.text,
                              "transformers_reply": want["reply"], "prompt_tokens": len(ids),
                              "from_cache": reply.cached, "computed": reply.prefilled,
                              "new_tokens": len(reply.token_ids), "finish_reason": reply.finish_reason,
                              "seconds": round(time.perf_counter() - t0, 2)})
            plan = r.plan.describe()
    result = {"model": str(args.model), "cpu": platform.processor() or platform.machine(),
              "all_equal": all(t["prompt_ids_equal"] and t["reply_ids_equal"] for t in turns), "turns": turns,
              "plan": plan}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for t in turns:
        print(f"> {t['user']}\n{t['reply']}\n  [ids equal: prompt {t['prompt_ids_equal']}, reply "
              f"{t['reply_ids_equal']}; {t['from_cache']} prompt tokens from the cache, {t['computed']} computed]")
    print(f"all equal to transformers: {result['all_equal']} -> {args.out}")


if __name__ == "__main__":
    main()
