"""The safetensors header, parsed and checked by us before any tensor byte is read (`read_safetensors_header`),
and where each tensor's bytes lie (`TensorEntry`). Never unpickles; knows nothing of models."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.errors import CheckpointError

FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
#: Integer tensors, read only where a quantized format expects them (GPTQ/AWQ qweight, qzeros, g_idx).
_ST_INTS = {"I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "I64": torch.int64}
#: FP8 codes, read only as a checkpoint's `quantization_config` says (`offload.model.fp8`)
_ST_FP8 = {"F8_E4M3": torch.float8_e4m3fn}


# ----------------------------------------------------------------------------- safetensors
@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are inside a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


#: Bytes per element of every dtype the safetensors format defines; any other name is refused.
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: The official reader's limit on a header; ours is checked before a byte of it is read.
MAX_HEADER = 100 * 2**20
MAX_DIMS = 8


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorEntry], bytes]:
    """Parse a safetensors header (8-byte little-endian length + JSON) and check every entry before any
    tensor is read: a known dtype, a shape of non-negative integers, offsets inside the file that agree
    with the shape and do not overlap another tensor's. Anything else is a CheckpointError naming the
    file, the tensor and the field."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: file too short to be safetensors; re-download or re-save the shard")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(size - 8, MAX_HEADER):
            raise CheckpointError(
                f"{path}: safetensors header length {hlen} is invalid (the file has {size} bytes, a header at "
                f"most {MAX_HEADER}); the file is corrupt, re-download or re-save it"
            )
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path}: safetensors header is not valid JSON; the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    base = 8 + hlen
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, base, size)
    previous: TensorEntry | None = None
    for e in sorted(entries.values(), key=lambda e: (e.start, e.nbytes)):
        if previous is not None and e.start < previous.start + previous.nbytes:
            raise CheckpointError(f"{path}: two tensors' data_offsets overlap (at byte {e.start - base}); the header "
                                  "is corrupt, re-download or re-save the shard")
        previous = e
    return entries, raw


def _entry(path: Path, name: str, info: object, base: int, size: int) -> TensorEntry:
    where = f"{path}: tensor {name[:200]!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: its header entry is not an object; the file is corrupt")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
        raise CheckpointError(f"{where}: dtype {str(dtype)[:40]!r} is not a safetensors dtype; the file is corrupt")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: shape {str(shape)[:80]} is not a list of at most {MAX_DIMS} "
                              "non-negative integers; the file is corrupt")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {str(offsets)[:80]} is not [start, end] with "
                              "0 <= start <= end; the file is corrupt")
    start, end = offsets
    if base + end > size:
        raise CheckpointError(
            f"{where} ends at byte {base + end} but the file has {size}; "
            "the shard is truncated, re-download or re-save it"
        )
    if math.prod(shape) * _ST_ITEMSIZE[dtype] != end - start:
        raise CheckpointError(f"{where}: data_offsets give {end - start} bytes but shape {shape} of {dtype} "
                              f"needs {math.prod(shape) * _ST_ITEMSIZE[dtype]}; the header is corrupt")
    # integer tensors keep their dtype (quantized formats read them); `Checkpoint.entry` checks every read
    return TensorEntry(path, FLOATS.get(dtype, _ST_INTS.get(dtype, _ST_FP8.get(dtype, torch.uint8))),
                       tuple(shape), base + start, end - start)
