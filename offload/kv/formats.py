"""Where KV blocks live: a store per tier, and the formats blocks take in each.

A block is `block_size` tokens of every layer. On the device it is full-precision K and V:

    device  kv      [layers, slots, 2 (k|v), block_size, kv_heads, head_dim]   compute dtype
            hidden  [layers, slots, block_size, hidden]                         (kv_restore: recompute only)

Cold blocks (host RAM, disk) take one of three formats, chosen by the config:

    transfer          kv     [layers, slots, 2, block_size, kv_heads, head_dim]   compute dtype
    transfer + int8   kv8    [layers, slots, 2, block_size, kv_heads, head_dim]   int8
                      scale  [layers, slots, 2, kv_heads]                         float32, per block and head
    recompute         hidden [layers, slots, block_size, hidden]                  compute dtype: the layer
                      inputs (after the input norm), from which one projection rebuilds K and V

Stores are plane-major slot arrays (`storage.slots`): one layer of many blocks is one gather,
or a few long disk reads. This module converts between formats; it does not decide which
block goes where (that is `offload.kv.cache` with an eviction policy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.model.config import ModelConfig
from storage.reader import DiskReader
from storage.slots import DiskSlots, MemorySlots, SlotArray

QMAX = 127.0


def quantize_int8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [..., 2, block_size, heads, head_dim] -> int8 values and float32 scales [..., 2, heads]."""
    x = kv.float()
    scale = x.abs().amax(dim=(-3, -1)) / QMAX  # over the block's tokens and the head's channels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale[..., None, :, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None, :, None].float()).to(dtype)


@dataclass
class ColdFormat:
    """How a cold tier stores a block: named slot arrays of given per-plane shapes and dtypes."""

    name: str  # "kv" | "int8" | "hidden"
    arrays: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    @classmethod
    def for_config(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, quantization: str,
                   restore: str) -> ColdFormat:
        kv_shape = (2, block_size, cfg.num_kv_heads, cfg.head_dim)
        if restore == "recompute":
            return cls("hidden", {"hidden": ((block_size, cfg.hidden_size), dtype)})
        if quantization == "int8":
            return cls("int8", {"kv8": (kv_shape, torch.int8), "scale": ((2, cfg.num_kv_heads), torch.float32)})
        return cls("kv", {"kv": (kv_shape, dtype)})

    @classmethod
    def for_device(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, restore: str) -> ColdFormat:
        """The device tier's format: K/V in the compute dtype (and the layer inputs, to restore by recompute)."""
        arrays = {"kv": ((2, block_size, cfg.num_kv_heads, cfg.head_dim), dtype)}
        if restore == "recompute":
            arrays["hidden"] = ((block_size, cfg.hidden_size), dtype)
        return cls("device", arrays)

    def block_nbytes(self, planes: int) -> int:
        """Bytes of one block (every layer) in this format."""
        return sum(planes * math.prod(shape) * dt.itemsize for shape, dt in self.arrays.values())


class TierStore:
    """One tier's slot arrays for one format (the device tier uses the "kv" format, plus "hidden" on recompute)."""

    def __init__(self, tier: str, fmt: ColdFormat, planes: int, slots: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False, disk_dir: Path | None = None, page_cache: bool = False,
                 memory: torch.Tensor | None = None, direct_io: bool = False) -> None:
        """Disk: one slot file per array under `disk_dir`, read through one shared checksummed reader."""
        self.tier, self.fmt, self.slots = tier, fmt, slots
        self.arrays: dict[str, SlotArray] = {}
        self.reader = (DiskReader(4, direct_io=direct_io, page_cache=page_cache, name="kv-disk")
                       if tier == "disk" else None)
        offset = 0
        for name, (shape, dt) in fmt.arrays.items():
            if tier == "disk":
                assert disk_dir is not None
                try:
                    self.arrays[name] = DiskSlots(disk_dir, f"kv-{name}", planes, slots, shape, dt,
                                                  page_cache=page_cache, reader=self.reader)
                except BaseException:
                    self.close()
                    raise
                continue
            region = None
            if memory is not None:  # lay the arrays one after the other over the given region
                n = planes * slots * math.prod(shape) * dt.itemsize
                region = memory[offset : offset + n]
                offset += n
            self.arrays[name] = MemorySlots(planes, slots, shape, dt, device, pin_memory, memory=region)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one block in one layer (every array)."""
        return sum(a.slot_nbytes for a in self.arrays.values())

    def write_block(self, slot: int, parts: dict[str, torch.Tensor]) -> None:
        for name, arr in self.arrays.items():
            arr.write(slot, parts[name])

    def read_block(self, slot: int) -> dict[str, torch.Tensor]:
        return {name: arr.read(slot) for name, arr in self.arrays.items()}

    def read_plane(self, plane: int, slots: list[int], out: dict[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
        """One layer of `slots`, per array [len(slots), *slot_shape]; written into `out` when given."""
        return {name: arr.read_plane(plane, slots, None if out is None else out[name])
                for name, arr in self.arrays.items()}

    def invalidate(self, slot: int) -> None:
        for arr in self.arrays.values():
            arr.invalidate(slot)

    def close(self) -> None:
        for arr in self.arrays.values():
            arr.close()
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def to_cold(fmt: ColdFormat, kv: torch.Tensor, hidden: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A device block ([layers, 2, bs, heads, dim] K/V and maybe [layers, bs, hidden]) in a cold format."""
    if fmt.name == "hidden":
        assert hidden is not None, "kv_restore: recompute needs the layer inputs kept on the device"
        return {"hidden": hidden}
    if fmt.name == "int8":
        q, scale = quantize_int8(kv)
        return {"kv8": q, "scale": scale}
    return {"kv": kv}


def cold_kv(fmt: ColdFormat, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """K/V [n, 2, bs, heads, dim] from a cold format other than "hidden" (which needs the layer's weights)."""
    if fmt.name == "int8":
        return dequantize_int8(parts["kv8"], parts["scale"], dtype)
    return parts["kv"]
