"""Check that Offload runs the trained SmolLM2-135M-Instruct checkpoint as transformers does.

    python scripts/check_trained.py [--dtype float32] [--new 24] [--out scripts/results/trained_parity.json]

Builds (or reuses) the checkpoint with `scripts/trained_model.py`, then for a few prompts (plain text and
chat-templated) compares, on CPU in float32:
  - tokenizer: Offload's token ids vs transformers' tokenizer on the same text;
  - logits: Offload's `prefill_logits` (a ragged batch) vs a transformers forward pass, max |diff|;
  - greedy tokens: Offload's `generate` (temperature 0) vs transformers greedy decoding with full
    recomputation (no cache), so nothing of ours leaks into the reference.
Prints the numbers and the generated text, writes them as JSON. Not a unit test: the model is 540 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offload.runtime.runner import Runner
from scripts.trained_model import ensure_trained_model

TEXT = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
]
CHAT = [
    "What is the capital of Japan?",
    "Write a haiku about the ocean.",
]


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(nxt)
        if nxt in eos:
            break
    return seq[len(ids):]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("float32",), default="float32", help="checkpoint and compute dtype")
    p.add_argument("--new", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--out", type=Path, default=Path("scripts/results/trained_parity.json"))
    args = p.parse_args(argv)

    path = ensure_trained_model(dtype=args.dtype)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in CHAT]
    texts = TEXT + chat
    hf_ids = [tok(t, add_special_tokens=False).input_ids for t in texts]

    t0 = time.perf_counter()
    with Runner.from_config({"model": str(path), "device": "cpu", "dtype": args.dtype}) as r:
        our_ids = [r.encode(t) for t in texts]
        ours = r.prefill_logits(hf_ids)
        eos = set(r.cfg.eos_token_ids)
        gen = r.generate(hf_ids, max_new_tokens=args.new, temperature=0.0)
    offload_s = time.perf_counter() - t0

    rows, worst, agree, total = [], 0.0, 0, 0
    with torch.no_grad():
        for b, (text, ids) in enumerate(zip(texts, hf_ids)):
            ref = hf(torch.tensor([ids])).logits[0].float()
            diff = (ours[b, : len(ids)] - ref).abs().max().item()
            worst = max(worst, diff)
            want = hf_greedy(hf, ids, args.new, eos)
            got = gen[b].token_ids
            same = sum(1 for a, c in zip(got, want) if a == c)
            first_diff = next((i for i, (a, c) in enumerate(zip(got, want)) if a != c), None)
            agree += same
            total += max(len(got), len(want))
            rows.append({"prompt": text, "prompt_tokens": len(ids), "tokenizer_same": our_ids[b] == ids,
                         "max_abs_logit_diff": diff, "logit_scale": ref.abs().max().item(),
                         "greedy_same": got == want, "first_divergence": first_diff,
                         "offload_text": tok.decode(got), "transformers_text": tok.decode(want)})
            print(f"[{b}] diff={diff:.2e} tokenizer_same={our_ids[b] == ids} greedy_same={got == want} "
                  f"({same}/{max(len(got), len(want))})  {text!r} -> {tok.decode(got)!r}")

    result = {"checkpoint": str(path), "dtype": args.dtype, "max_abs_logit_diff": worst,
              "greedy_tokens_agree": agree, "greedy_tokens_total": total,
              "prompts_identical": sum(r["greedy_same"] for r in rows), "prompts": len(rows),
              "offload_seconds": round(offload_s, 2), "load_avg_1m_at_end": os.getloadavg()[0],
              "torch": torch.__version__,
              "cpu": platform.processor() or platform.machine(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"max |logit diff| = {worst:.2e}; greedy tokens agree {agree}/{total}; "
          f"identical continuations {result['prompts_identical']}/{len(rows)}; wrote {args.out}")


if __name__ == "__main__":
    main()
