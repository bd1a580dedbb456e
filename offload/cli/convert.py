"""`offload convert CHECKPOINT_DIR STORE_DIR [--weights int8|int4]`: pack a checkpoint into a zarr store by hand.

`run` converts on first use; this command is for converting ahead of time or elsewhere.
CHECKPOINT_DIR may be a Hub id (org/name[@revision]), fetched into the Hugging Face cache first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from offload.config import WeightsConfig
from offload.model import hub
from offload.model.checkpoint import Checkpoint
from offload.runtime.device import resolve_dtype
from offload.weights.convert import convert
from offload.weights.groups import LINEARS, WeightFormat
from storage.units import fmt_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="convert a checkpoint into a zarr store for the disk tier")
    conv.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint directory or a Hub id")
    conv.add_argument("store", type=Path, metavar="STORE_DIR")
    conv.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "auto"), default="auto",
                      help="dtype of the stored weights (default: the checkpoint's own; must match the run's dtype)")
    conv.add_argument("--weights", choices=("none", "int8", "int4"), default="none",
                      help="store the weight matrices group-wise quantized (must match the run's weights.quantization)")
    conv.add_argument("--group-size", type=int, default=64, help="input columns per scale/zero (weights.group_size)")
    conv.add_argument("--keep", nargs="*", choices=LINEARS, default=[],
                      help="matrices kept in the compute dtype (weights.keep; a packed LM head is int8)")
    conv.add_argument("--model-impl", choices=("auto", "native", "transformers"), default="auto",
                      help="the run's model_impl: its groups are laid out for it (must match the run's)")
    conv.add_argument("--force", action="store_true", help="replace a complete store")
    conv.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    ckpt = Checkpoint(hub.fetch(args.checkpoint) if hub.is_hub_id(args.checkpoint) else Path(args.checkpoint),
                      args.model_impl)
    dtype = resolve_dtype(args.dtype, ckpt.config.torch_dtype)
    # (a GPTQ / AWQ checkpoint's own packing, an int4 / int8 compressed-tensors one's codes: as a run reads them)
    fmt = WeightFormat.from_config(WeightsConfig(args.weights, args.group_size, tuple(args.keep)), ckpt.config)
    store = convert(ckpt, args.store, dtype, force=args.force, progress=True, fmt=fmt)
    scheme = "" if fmt.quantization == "none" else f", weights {fmt.quantization} g{fmt.group_size}"
    print(f"wrote {store.path}: {len(store.groups)} groups, {fmt_bytes(store.total_bytes, 'GiB')} "
          f"({str(dtype).removeprefix('torch.')}{scheme})")
    store.close()
    return 0
