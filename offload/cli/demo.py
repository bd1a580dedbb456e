"""`offload demo`: make the `small` model once, write an embedded default config, run a prompt.

Needs no downloads and no arguments. The model and config live in a cache directory
($OFFLOAD_CACHE, else $XDG_CACHE_HOME/offload, else ~/.cache/offload).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from offload.cli.prepare import convert_first
from offload.cli.run import add_generation_args, check_sampling_args, read_prompts, run_prompts
from offload.config import OffloadConfig, cache_dir
from offload.errors import StaleStoreError
from offload.testing.make_model import make_model

log = logging.getLogger(__name__)

DEMO_PROMPT = "The kettle on Larkspur Lane"
DEMO_STORE = "small-llama-store"  # the demo config's disk tier, in the cache directory

#: The embedded default configuration. Its capacities are chosen so the small model (113 MB
#: in bf16: eight 12.6 MB layers, a 6.3 MB embedding and LM head) lives in all three tiers.
DEMO_CONFIG = """\
# Offload demo configuration (written by `offload demo`; edit freely, it is not overwritten)
model: small-llama                 # relative to this file
dtype: bfloat16
tiers:
  gpu:  {capacity: 64MiB}          # 3 ring slots + KV + workspace, then 1 layer and the LM head
  cpu:  {capacity: 32MiB}          # 2 layers
""" + f"  disk: {{path: {DEMO_STORE}}}  # the rest, streamed from a zarr store converted on first run\n" + """\
kv_cache: {block_size: 16, gpu_blocks: 32}
prefetch: {depth: 2}
activations: {prefill_chunk: 64}
"""


def ensure_demo_model(root: Path) -> Path:
    """The demo checkpoint, generated on first use (with a progress bar) into `root`."""
    model = root / "small-llama"
    if (model / "config.json").is_file():
        return model
    tmp = root / "small-llama.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"offload demo: generating a small random Llama checkpoint in {model} (first run only)", file=sys.stderr)
    make_model(tmp, family="llama", size="small", dtype="bfloat16", seed=0, progress=True)
    tmp.rename(model)  # a half-written model is never taken for a finished one
    return model


def ensure_demo_config(root: Path) -> Path:
    path = root / "demo.yaml"
    if not path.is_file():
        path.write_text(DEMO_CONFIG)
    return path


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="generate a small model (first time only) and run it; no downloads")
    demo.add_argument("--cache-dir", type=Path, default=None,
                      help="where the demo model lives (default: $OFFLOAD_CACHE or ~/.cache/offload)")
    add_generation_args(demo)
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    check_sampling_args(args)
    root = (args.cache_dir or cache_dir()).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    ensure_demo_model(root)
    config_path = ensure_demo_config(root)
    print(f"offload demo: config {config_path}", file=sys.stderr)
    prompts = read_prompts(args, default=DEMO_PROMPT)
    config = OffloadConfig.load(config_path)
    try:
        return run_prompts(config, prompts, args)
    except StaleStoreError as e:  # e.g. written by an earlier Offload: the demo's own store is a cache, rebuilt
        store = config.tiers.disk.path if config.tiers is not None and config.tiers.disk is not None else None
        if store is None or Path(store).resolve() != (root / DEMO_STORE).resolve():
            raise  # a store the user pointed the demo at is theirs: the error says how to convert it
        print(f"offload demo: {e}\noffload demo: that store is the demo's own cache; converting it again",
              file=sys.stderr)
        convert_first(config, replace=True)
        return run_prompts(config, prompts, args)
