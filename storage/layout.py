"""Layer-packed byte layouts: many named tensors in one contiguous, aligned byte range.

A *group* (one decoder layer, the embeddings, the head) is packed so that it moves as one
disk read and one host->device copy; its tensors are views into the slot it lands in. This
module knows names, dtypes, shapes and offsets; it does not know what the names mean.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

#: Byte alignment of each tensor inside a group (CUDA-friendly, covers every dtype).
TENSOR_ALIGN = 256
#: Groups are padded to whole pages so slots can be read with O_DIRECT-sized requests.
GROUP_ALIGN = 4096

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no storage name")


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lives inside its group's byte range."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the group, a multiple of TENSOR_ALIGN

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """The packed layout of one group; `nbytes` includes the padding to GROUP_ALIGN."""

    name: str
    tensors: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def build(cls, name: str, entries: Iterable[tuple[str, str, tuple[int, ...]]]) -> GroupLayout:
        """Lay out `(tensor name, dtype name, shape)` entries in the given order."""
        specs, offset = [], 0
        for tname, dtype, shape in entries:
            spec = TensorSpec(tname, dtype, tuple(int(s) for s in shape), offset)
            specs.append(spec)
            offset = round_up(offset + spec.nbytes, TENSOR_ALIGN)
        return cls(name, tuple(specs), round_up(max(offset, 1), GROUP_ALIGN))

    def spec(self, tensor_name: str) -> TensorSpec:
        for spec in self.tensors:
            if spec.name == tensor_name:
                return spec
        raise KeyError(f"group {self.name!r} has no tensor {tensor_name!r}")

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of every tensor into `buf`, a 1-D uint8 tensor of >= nbytes."""
        assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() >= self.nbytes, (buf.shape, self)
        return {
            s.name: buf[s.offset : s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape) for s in self.tensors
        }

    def to_json(self) -> dict:
        return {
            "nbytes": self.nbytes,
            "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset}
                        for s in self.tensors],
        }

    @classmethod
    def from_json(cls, name: str, data: Mapping) -> GroupLayout:
        """Read a layout written by `to_json`, checking every field (a manifest may have been edited by
        hand): ValueError saying which field is wrong, before anything is allocated from it."""
        if not isinstance(data, Mapping):
            raise ValueError("is not an object")
        nbytes, raw = data.get("nbytes"), data.get("tensors")
        if not _is_int(nbytes) or not 0 < nbytes <= MAX_GROUP_BYTES or nbytes % GROUP_ALIGN:
            raise ValueError(f"nbytes {str(nbytes)[:40]} is not a positive multiple of {GROUP_ALIGN}")
        if not isinstance(raw, list) or not raw:
            raise ValueError("tensors is not a non-empty list")
        tensors, end = [], 0
        for i, t in enumerate(raw):
            if not isinstance(t, Mapping):
                raise ValueError(f"tensors[{i}] is not an object")
            tname, dtype, shape, offset = t.get("name"), t.get("dtype"), t.get("shape"), t.get("offset")
            check_name(tname, f"tensors[{i}].name")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise ValueError(f"tensors[{i}].dtype {str(dtype)[:40]!r} is not one of {', '.join(DTYPES)}")
            if not isinstance(shape, list) or len(shape) > 8 or not all(_is_int(d) and d >= 0 for d in shape):
                raise ValueError(f"tensors[{i}].shape {str(shape)[:60]} is not a list of non-negative integers")
            if not _is_int(offset) or offset < end or offset % TENSOR_ALIGN:
                raise ValueError(f"tensors[{i}].offset {str(offset)[:40]} is not aligned to {TENSOR_ALIGN} after the "
                                 f"previous tensor's end ({end}): tensors overlap or are out of order")
            spec = TensorSpec(tname, dtype, tuple(shape), offset)
            end = offset + spec.nbytes
            if end > nbytes:
                raise ValueError(f"tensors[{i}] ends at byte {end}, past the group size {nbytes}")
            tensors.append(spec)
        return cls(name, tuple(tensors), nbytes)


#: No group is larger than this (a layer of the largest models is a few GiB).
MAX_GROUP_BYTES = 2**40

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_name(name: object, what: str) -> str:
    """A group or tensor name: letters, digits, `_ . -`, not starting with a dot, no `..` (ValueError otherwise),
    so that no name read from a file can reach outside the store's directory."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{what} {str(name)[:80]!r} is not allowed (letters, digits, '_', '.', '-'; "
                         "no '/', '..' or NUL)")
    return name
