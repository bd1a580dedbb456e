"""Reading Hugging Face checkpoints: `config.json` plus safetensors shards. Never unpickles.

Tensors are read by parsing the safetensors header ourselves and `preadv`-ing the bytes
straight into the destination buffer, so loading touches each byte once and maps no files
(which keeps RSS honest). This module knows checkpoint names and model shapes; it knows
nothing about tiers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from offload.errors import CheckpointError
from offload.model import compressed, fp8, generic, mxfp4
from offload.model.config import ModelConfig, quant_method
from offload.model.generic import generic_config, generic_tensors, loaded_names, resolve_impl, text_only
from offload.model.shards import FLOATS, TensorEntry, read_safetensors_header
from storage.io import preadv_into

log = logging.getLogger(__name__)

#: `name[i]`: the i-th slab (along the first dimension) of a stacked tensor, e.g. one expert's weights.
_SLAB = re.compile(r"^(.*)\[(\d+)\]$")
#: `name^T`: stacked experts [E in, out] read as each expert's transpose, [E out, in] (packed so: `_transposed_rows`)
TRANSPOSED = "^T"


class Checkpoint:
    """A Hugging Face checkpoint directory: its `ModelConfig` and where every tensor's bytes are."""

    def __init__(self, path: str | Path, impl: str = "auto") -> None:
        """`impl`: the run's `model_impl`; a model transformers runs gets a config of `offload.model.generic`."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {str(self.path)!r} does not exist")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json; a Hugging Face checkpoint directory needs one")
        try:
            self.config_bytes = cfg_path.read_bytes()
            raw = json.loads(self.config_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e}); fix or re-download it") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{cfg_path}: expected a JSON object of model settings; fix or re-download it")
        native = resolve_impl(impl, raw) == "native"
        self.mxfp4: dict[str, tuple[str, str]] = {}  # an MXFP4 expert matrix: (its blocks, its scales)
        self._expert: tuple[str, int, torch.Tensor] | None = None  # the last expert read whole (`_expert_rows`)
        self.flat: dict[str, tuple[int, int]] = {}  # experts stacked [E, R, k], read as [E R, k] (`stacked_matrices`)
        self.stacks: dict[str, tuple[int, int]] = {}  # MXFP4's and `flat`'s matrices: [E R, k]
        if native:  # its config is checked before any shard is opened
            self.config = ModelConfig.from_dict(raw, str(cfg_path))
        self.files = self._find_files()
        self.entries: dict[str, TensorEntry] = {}
        self._headers: dict[Path, bytes] = {}
        for f in self.files:
            entries, raw_header = read_safetensors_header(f)
            self.entries.update(entries)
            self._headers[f] = raw_header
        # a compressed-tensors checkpoint's quantized matrices: `X.weight` [N, K] read dense from their parts
        self.compressed, taken = compressed.matrices(raw, self.entries, str(cfg_path), self._whole)
        self.parts = {n: self.entries.pop(n) for n in taken}
        for n, m in self.compressed.items():
            codes = self.parts[m.codes]
            self.entries[n] = TensorEntry(codes.file, m.dtype, m.shape, codes.start, m.dtype.itemsize * m.shape[0]
                                          * m.shape[1])
        self.fp8 = fp8.pairs(raw, {n: e.dtype for n, e in self.entries.items()})  # (read dense: `_fp8_rows`)
        self.fp8_block = fp8.block(raw, str(cfg_path)) if self.fp8 else (0, 0)
        if native:
            self._prefix = self._detect_prefix()
        else:  # the parameters' names in transformers' module tree, as it renames and stacks them loading
            fp8_scales = set(self.fp8.values())
            where, shapes = str(self.path), {n: e.shape for n, e in self.entries.items() if n not in fp8_scales}
            self.mxfp4 = mxfp4.pairs(raw, shapes)  # (read dense: `_mxfp4_rows`)
            for target, (blocks, scales) in self.mxfp4.items():
                shapes[target] = mxfp4.dense_shape(shapes.pop(blocks))
                del shapes[scales]
            prequant = generic.prequant_matrices(raw, shapes)
            for target, shape in prequant.items():  # (stored as they are, packed: `offload.weights.gptq`)
                for part in generic.PREQUANT_PARTS:
                    shapes.pop(target.removesuffix("weight") + part, None)
                shapes[target] = shape
            self.flat = generic.stacked_matrices({n: s for n, s in shapes.items() if n not in self.fp8})
            shapes |= self.flat
            self.stacks = {n: shapes[n] for n in [*self.mxfp4, *self.flat]}  # (their [E R, k])
            back = {n: n for n in shapes}  # the model's tensor name -> the checkpoint's
            if (text := text_only(raw, shapes)) is not None:  # a multimodal checkpoint: its language model alone
                raw, back = text
                shapes = {old: shapes[old] for old in back.values()}
            loaded = {t: [back[n] for n in names] for t, names in loaded_names(raw, list(back), where).items()}
            taken = {n for names in loaded.values() for n in names}
            if taken & set(prequant):  # (experts transformers stacks into one parameter)
                raise CheckpointError(f"{self.path}: a {quant_method(raw).upper()} mixture of experts is read by "
                                      "Offload's native families only (transformers stacks its experts, which the "
                                      "checkpoint packs one by one); use its float or compressed-tensors release")
            loaded |= {new: [old] for new, old in back.items() if new != old and old not in taken}
            tensors = generic_tensors(shapes, where, loaded, stacked={*self.mxfp4, *self.flat}, raw=raw)
            self.config = generic_config(raw, tensors, str(cfg_path))
            self._prefix = ""
        if self.compressed and not compressed.covers(self.entries, self.compressed):
            self.config = dataclasses.replace(self.config, codes_kept=False)

    def _find_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index}: not a valid safetensors index (no weight_map)") from None
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(
                    f"{self.path}: the index lists shard {missing[0]!r} which is missing; download every shard"
                )
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickles = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt*")]
        if pickles:
            raise CheckpointError(
                f"{self.path}: only pickle weights ({pickles[0]}) found; Offload never unpickles files, "
                "convert them to safetensors (e.g. save_pretrained(..., safe_serialization=True))"
            )
        raise CheckpointError(f"{self.path}: no *.safetensors weights found; the checkpoint is incomplete")

    def _detect_prefix(self) -> str:
        for prefix in ("model.", "", "language_model.model."):
            if f"{prefix}embed_tokens.weight" in self.entries:
                return prefix
        raise CheckpointError(
            f"{self.path}: no embed_tokens.weight tensor; this is not a Llama-family checkpoint in Hugging Face naming"
        )

    # -- names --------------------------------------------------------------------------------
    def name(self, short: str) -> str:
        """Full checkpoint name of a short one (`layers.3.mlp.up_proj.weight`, `norm.weight`, `lm_head.weight`;
        `layers.0.mlp.experts.down_proj[5]`: the 6th slab of a stacked tensor)."""
        slab = _SLAB.match(short)
        if slab:
            return f"{self.name(slab[1])}[{slab[2]}]"
        if short == "lm_head.weight":
            if "lm_head.weight" in self.entries:
                return "lm_head.weight"
            # a few exporters keep the prefix on the head too
            return f"{self._prefix}lm_head.weight"
        return f"{self._prefix}{short}"

    def entry(self, short: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> TensorEntry:
        """Where a tensor is, checked: present, of `shape`, float (or exactly `dtype` when one is asked for)."""
        slab = _SLAB.match(short)
        if slab:
            if self.name(slab[1]) in self.fp8:
                raise CheckpointError(f"{self.path}: {self.name(slab[1])!r} stacks FP8 experts in one tensor, which "
                                      "Offload does not read; use a checkpoint with a tensor an expert")
            return self._slab(slab[1], int(slab[2]), shape, dtype)
        if short in self.mxfp4:  # its blocks and scales, uint8, of the shapes its dense one implies
            (blocks, scales), (rows, n) = self.mxfp4[short], shape
            e = self.entries[blocks]
            if e.dtype != torch.uint8 or self.entries[scales].dtype != torch.uint8 or len(e.shape) != 4 or \
                    self.entries[scales].shape != e.shape[:3] or mxfp4.dense_shape(e.shape) != (rows, n):
                raise CheckpointError(f"{self.path}: {blocks!r} and {scales!r} are not the uint8 blocks [E, N, G, 16] "
                                      "and scales [E, N, G] of an MXFP4 matrix; the checkpoint does not match its "
                                      "quantization_config")
            return e
        full = self.name(short)
        e = self.entries.get(full)
        if e is None:
            raise CheckpointError(f"{self.path}: tensor {full!r} is missing; the checkpoint does not match its config")
        if self.flat.get(full) == tuple(shape):  # (stacked experts: their rows one after another)
            e = TensorEntry(e.file, e.dtype, tuple(shape), e.start, e.nbytes)
        if e.shape != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {full!r} has shape {list(e.shape)} but config.json implies {list(shape)}; "
                "the weights and config.json do not belong together"
            )
        if full in self.fp8:  # its scales: float32, one a block
            se = self.entries[self.fp8[full]]
            if se.dtype != torch.float32 or se.shape != fp8.grid(e.shape, self.fp8_block):
                raise CheckpointError(f"{self.path}: {self.fp8[full]!r} is not the float32 scales "
                                      f"{list(fp8.grid(e.shape, self.fp8_block))} of {full!r} in blocks of "
                                      f"{list(self.fp8_block)}; the checkpoint does not match its quantization_config")
            return e
        if dtype is not None and not dtype.is_floating_point:
            if e.dtype != dtype:
                raise CheckpointError(f"{self.path}: tensor {full!r} is {e.dtype} but its quantization format "
                                      f"stores {dtype}; the checkpoint does not match its quantization_config")
        elif e.dtype not in FLOATS.values():
            raise CheckpointError(
                f"{self.path}: tensor {full!r} is not a float tensor; a quantized checkpoint needs its "
                "quantization_config (gptq or awq) in config.json"
            )
        return e

    def _slab(self, short: str, i: int, shape: tuple[int, ...], dtype: torch.dtype | None) -> TensorEntry:
        """Slab i of a stacked tensor [n, *shape]: contiguous in the file, so read like a tensor of its own."""
        whole = self.entries.get(self.name(short))
        n = whole.shape[0] if whole is not None and whole.shape[1:] == tuple(shape) else 0
        if i >= n:  # refused with the stacked tensor's own shape, or as missing
            self.entry(short, (i + 1, *shape), dtype)
        e = self.entry(short, (n, *shape), dtype)
        size = e.nbytes // n
        return TensorEntry(e.file, e.dtype, tuple(shape), e.start + i * size, size)

    def read_into(self, short: str, dest: torch.Tensor) -> None:
        """Copy a tensor into `dest` (any dtype/device, same shape), reading its bytes once."""
        self.read_rows_into(short, tuple(dest.shape), 0, dest)

    def read_rows_into(self, short: str, shape: tuple[int, ...], row: int, dest: torch.Tensor) -> None:
        """Copy rows row .. row + len(dest) of a tensor of `shape` into `dest` (any dtype/device): a part of a
        large matrix without its whole bytes in memory."""
        if short in self.mxfp4:
            return self._mxfp4_rows(short, tuple(shape), row, dest)
        if short.endswith(TRANSPOSED):
            return self._transposed_rows(short.removesuffix(TRANSPOSED), tuple(shape), row, dest)
        e, full = self.entry(short, tuple(shape), dest.dtype), self.name(short)
        if full in self.fp8:
            return self._fp8_rows(full, e, row, dest)
        if full in self.compressed:
            return self.compressed[full].read_rows(self._part_rows, row, dest)
        self._pread(e, row, dest)

    def _whole(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        t = torch.empty(e.shape, dtype=e.dtype)
        self._pread(e, 0, t)
        return t

    def _part_rows(self, name: str, shape: tuple[int, ...], row: int, dest: torch.Tensor) -> None:
        """Rows of a compressed-tensors part (`compressed.Matrix`), its bytes read as a tensor of `shape`."""
        e = self.parts[name]
        self._pread(TensorEntry(e.file, e.dtype, tuple(shape), e.start, e.nbytes), row, dest)

    def grid_rows(self, short: str, row: int, n: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The integer grid a compressed-tensors matrix's rows lie on (`compressed.Matrix.grid_rows`), None for any
        other tensor: a quantizer of `bits` keeps them exactly."""
        m = self.compressed.get(self.name(short))
        return None if m is None else m.grid_rows(self._part_rows, row, n, bits)

    def _pread(self, e: TensorEntry, row: int, dest: torch.Tensor) -> None:
        """Rows row .. of the tensor at `e` into `dest`, converted to its dtype."""
        offset = e.start
        if row or tuple(dest.shape) != e.shape:
            if not (dest.dim() and dest.shape[1:] == e.shape[1:] and 0 <= row <= e.shape[0] - dest.shape[0]):
                raise ValueError(f"rows {row}.. of a {list(e.shape)} tensor do not fit {list(dest.shape)}")
            offset += row * (e.nbytes // e.shape[0])
        fd = os.open(e.file, os.O_RDONLY)
        try:
            if e.dtype == dest.dtype and dest.device.type == "cpu" and dest.is_contiguous():
                preadv_into(fd, dest, offset, e.file)
            else:
                tmp = torch.empty(dest.shape, dtype=e.dtype)
                preadv_into(fd, tmp, offset, e.file)
                dest.copy_(tmp)
        finally:
            os.close(fd)

    def _fp8_rows(self, full: str, e: TensorEntry, row: int, dest: torch.Tensor) -> None:
        """`read_rows_into` of an FP8 matrix: its codes and the scales of their blocks of rows, dequantized."""
        n, size, scales = dest.shape[0], self.fp8_block, self.fp8[full]
        codes = torch.empty((n, *e.shape[1:]), dtype=fp8.CODES)
        self._pread(e, row, codes)
        first, last = row // size[0], (row + n - 1) // size[0]
        s = torch.empty((last - first + 1, self.entries[scales].shape[1]), dtype=torch.float32)
        self._pread(self.entries[scales], first, s)
        dest.copy_(fp8.dequantize(codes, s, row - first * size[0], size))

    def _transposed_rows(self, short: str, shape: tuple[int, ...], row: int, dest: torch.Tensor) -> None:
        """`read_rows_into` of stacked experts [E in, out] as each expert's transpose (`shape`: [E out, in])."""
        rows, out = self.stacks[short]
        k = shape[1]

        def load(e: int) -> torch.Tensor:
            w = torch.empty(k, out, dtype=torch.float32)
            self.read_rows_into(short, (rows, out), e * k, w)
            return w.T

        self._expert_rows(short + TRANSPOSED, out, row, dest, load)

    def _mxfp4_rows(self, short: str, shape: tuple[int, ...], row: int, dest: torch.Tensor) -> None:
        """`read_rows_into` of an MXFP4 matrix: each expert's rows dequantized (`offload.model.mxfp4`)."""
        blocks = self.entry(short, shape)  # (checked with its scales)
        scales = self.entries[self.mxfp4[short][1]]

        def load(e: int) -> torch.Tensor:
            qb = torch.empty((1, *blocks.shape[1:]), dtype=torch.uint8)
            qs = torch.empty((1, *scales.shape[1:]), dtype=torch.uint8)
            self._pread(blocks, e, qb)
            self._pread(scales, e, qs)
            return mxfp4.dequantize(qb[0], qs[0])

        self._expert_rows(short, shape[0] // blocks.shape[0], row, dest, load)

    def _expert_rows(self, key: str, k: int, row: int, dest: torch.Tensor, load: Callable[[int], torch.Tensor]
                     ) -> None:
        """Rows row .. of experts' matrices one after another, k rows an expert, each expert's whole matrix made by
        `load(e)` and kept until its last rows are read (a conversion reads a packed format's rows a block at a
        time; not kept beyond: 66 MB a gpt-oss-120b expert). An expert loaded from another's rows (MXFP4 experts
        read transposed) reads all of them at once, so the one slot serves both."""
        r, end = row, row + dest.shape[0]
        while r < end:
            e, k0 = divmod(r, k)
            if self._expert is None or self._expert[:2] != (key, e):
                self._expert = (key, e, load(e))
            k1 = min(k, k0 + end - r)
            dest[r - row : r - row + k1 - k0].copy_(self._expert[2][k0:k1])
            r += k1 - k0
            if k1 == k:
                self._expert = None

    def read(self, short: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.read_into(short, out)
        return out

    # -- identity -----------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A content hash that tells checkpoints apart without reading every byte.

        sha256 over config.json, each shard's size and header, and 16 sampled 4 KiB windows
        of each shard's data: different seeds, fine-tunes or truncations change it.
        """
        h = hashlib.sha256(self.config_bytes)
        for f in self.files:
            size = f.stat().st_size
            h.update(f.name.encode() + struct.pack("<Q", size) + self._headers[f])
            with open(f, "rb") as fh:
                for off in np.linspace(0, max(size - 4096, 0), 16).astype(np.int64):
                    fh.seek(int(off))
                    h.update(fh.read(4096))
        return h.hexdigest()
