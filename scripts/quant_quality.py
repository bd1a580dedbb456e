"""What int8 / int4 weights cost in quality, on a small *trained* model (SmolLM2-135M-Instruct).

    python -m scripts.quant_quality [--results scripts/results] [--name quant-quality]

For each weight format (none, int8 g64, int4 g32 / g64 / g192; SmolLM2's hidden size 576 is not a
multiple of 128, so g192 stands in for the coarse end), on CPU in float32 so that only the
quantization differs:
  - perplexity of a fixed English text (teacher-forced, every position);
  - top-1 agreement with `none` on that text: the share of positions whose argmax token is the same;
  - greedy agreement: 32 greedy tokens for a few prompts, the share equal to `none`'s position by position,
    and the mean length of the common prefix;
  - the max over layers of the relative error of a layer's output: each layer gets the *same* input (the
    dense model's), and the error is ||update_q - update|| / ||update|| with update = layer(x) - x (the
    residual stream itself would hide it).
The model ties its LM head to the embeddings, so the head stays dense in every format. Writes
RESULTS/NAME.md and NAME.json (`scripts.machine.Result`: the command, the machine, the load).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from offload.kv.cache import PagedKVCache
from offload.model import functional as M
from offload.model.checkpoint import Checkpoint
from offload.runtime.runner import Runner
from offload.weights.groups import WeightFormat, group_layout, weight_views
from offload.weights.quant import Scratch
from offload.weights.reading import fill_group
from scripts.machine import Result
from scripts.trained_model import ensure_trained_model
from storage.units import blocks_for

FORMATS = [("none", 64), ("int8", 64), ("int4", 32), ("int4", 64), ("int4", 192)]
TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for more than a hundred years its keepers "
    "had climbed the same spiral staircase every evening to light the lamp. The work was simple but it could "
    "not be skipped: a ship that missed the light on a stormy night could run onto the reef that lay hidden "
    "just below the surface. In the winter the keeper wrote in a logbook the state of the sea, the direction "
    "of the wind and the names of the ships that passed. Scientists later used these notes to study how the "
    "climate of the coast had changed. Today the lamp is automatic, and the house where the keepers lived has "
    "become a small museum. Visitors can read the old logbooks, climb the staircase, and look out over the "
    "water that so many people watched before them. Many of them say that the view at sunset is the best "
    "reason to make the long walk along the rocks."
)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
           "def fibonacci(n):", "The three primary colors are"]
NEW = 32


def config(path: Path, quantization: str, group: int, dtype: str = "float32", steps: str = "int8") -> dict:
    return {"model": str(path), "device": "cpu", "dtype": dtype,
            "weights": {"quantization": quantization, "group_size": group, "keep": ["lm_head"],
                        "int4_activations": steps, "int8_activations": steps}}


@torch.no_grad()
def layer_errors(path: Path, ids: list[int], fmt: WeightFormat, dtype: torch.dtype = torch.float32) -> list[float]:
    """Per layer: relative error of the quantized layer's update on the dense model's input to that layer."""
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    dev = torch.device("cpu")
    x = ckpt.read("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), dtype)[torch.tensor(ids)]
    rope = M.Rope(cfg, dev, dtype)
    caches = {}
    for name in ("dense", "quant"):
        kv = PagedKVCache(cfg, 16, blocks_for(len(ids), 16), dtype, dev)
        sid = kv.add_sequence()
        caches[name] = (kv, *kv.prepare([sid], [len(ids)]))
    errors = []
    for i in range(cfg.num_layers):
        group = f"layer.{i}"
        outs = {}
        for name, f in (("dense", WeightFormat()), ("quant", fmt)):
            layout = group_layout(cfg, group, dtype, f)
            buf = torch.empty(layout.nbytes, dtype=torch.uint8)
            fill_group(ckpt, layout, buf, f)
            w = M.LayerWeights.from_views(weight_views(cfg, group, layout.views(buf), Scratch(), f))
            kv, layout_, step = caches[name]
            outs[name] = M.decoder_layer(x, w, kv.view(i, layout_, step), layout_, rope(layout_.positions), cfg,
                                         cfg.sliding_windows[i])
        update, update_q = outs["dense"] - x, outs["quant"] - x
        errors.append(float((update_q - update).float().norm() / update.float().norm()))
        x = outs["dense"]
    return errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default="quant-quality", help="the results' file name (without .md / .json)")
    ap.add_argument("--new", type=int, default=NEW, help="greedy tokens per prompt")
    ap.add_argument("--formats", nargs="*", default=[f"{q}:{g}" for q, g in FORMATS],
                    help="QUANTIZATION:GROUP[:int8|int16] (the last: weights.int4_activations and "
                    "int8_activations, the packed products' activation steps in bf16); the first is the reference "
                    "(none)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype (bfloat16: packed products take the activations in integer steps)")
    args = ap.parse_args(argv)
    header = Result()
    formats = [(f.split(":") + ["int8"])[:3] for f in args.formats]
    formats = [(q, int(g), a) for q, g, a in formats]
    dtype = getattr(torch, args.dtype)
    path = ensure_trained_model(dtype=args.dtype)
    rows, ref_logits, ref_tokens = [], None, None
    for quantization, group, steps in formats:
        t0 = time.perf_counter()
        with Runner.from_config(config(path, quantization, group, args.dtype, steps)) as r:
            ids = r.encode(TEXT)
            logits = r.prefill_logits([ids])[0, : len(ids)]  # [T, V]
            greedy = [g.token_ids for g in r.generate(PROMPTS, max_new_tokens=args.new, stop_on_eos=False)]
        logp = torch.log_softmax(logits[:-1].double(), -1)
        nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
        top1 = logits.argmax(-1)
        if ref_logits is None:
            ref_logits, ref_tokens = top1, greedy
        same = [sum(a == b for a, b in zip(g, ref)) for g, ref in zip(greedy, ref_tokens)]
        prefix = [next((k for k, (a, b) in enumerate(zip(g, ref)) if a != b), len(g)) for g, ref in
                  zip(greedy, ref_tokens)]
        errs = [0.0] if quantization == "none" else layer_errors(path, ids, WeightFormat(quantization, group,
                                                                                         ("lm_head",)), dtype)
        rows.append({"weights": quantization, "group_size": group, "dtype": args.dtype,
                     "activations": steps if args.dtype == "bfloat16" and quantization != "none" else None,
                     "perplexity": math.exp(float(nll)),
                     "top1_agreement": float((top1 == ref_logits).float().mean()),
                     "greedy_agreement": sum(same) / sum(map(len, greedy)),
                     "greedy_common_prefix": sum(prefix) / len(prefix),
                     "max_layer_rel_error": max(errs), "layer_rel_errors": errs, "tokens": len(ids),
                     "seconds": time.perf_counter() - t0})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "layer_rel_errors"}), file=sys.stderr)
    lines = [f"Quality of stored weight formats on SmolLM2-135M-Instruct (trained; `scripts/trained_model.py`), "
             f"CPU {args.dtype}, a fixed {rows[0]['tokens']}-token English text and {len(PROMPTS)} prompts x "
             f"{args.new} greedy tokens; agreement is with `none` (the float weights).", "",
             "| weights | group | activations | perplexity | top-1 agreement | greedy tokens equal "
             "| common greedy prefix | max layer rel. error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acts = r["activations"] or "-"
        lines.append(f"| {r['weights']} | {r['group_size'] if r['weights'] != 'none' else '-'} | {acts} | "
                     f"{r['perplexity']:.3f} | {100 * r['top1_agreement']:.1f}% | {100 * r['greedy_agreement']:.1f}% "
                     f"| {r['greedy_common_prefix']:.1f} / {args.new} | {r['max_layer_rel_error']:.4f} |")
    if any(q == "int4" and g == 32 for q, g, _ in formats):
        lines += ["", "This checkpoint was itself dequantized from a Q4_1 GGUF (4-bit, blocks of 32, scale + minimum; "
                  "`scripts/trained_model.py`), so int4 g32 lands back on its own grid and loses next to nothing "
                  "here; on a model trained in bf16 it would not. The other rows show the cost of re-quantizing."]
    print(header.write(args.results, args.name, "\n".join(lines), {"new_tokens": args.new, "rows": rows}).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
