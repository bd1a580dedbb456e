"""compressed-tensors checkpoints (`quantization_config.quant_method: compressed-tensors`), as llm-compressor writes
them for vLLM (the -FP8, -FP8-dynamic, -quantized.w4a16 / w8a16 / w8a8 releases): each quantized Linear's parts are
read back into its matrix `X.weight` [N, K], a block of rows at a time, as `compressed_tensors` decompresses it, then
stored in the run's dtype or packed by `weights.quantization`. Formats (the config's `format`, or a config group's):

    float-quantized                  FP8 e4m3 codes            X.weight [N, K]
    int-quantized / naive-quantized  int8 codes                X.weight [N, K]
    pack-quantized                   b-bit integers (b 4 or 8) X.weight_packed int32 [N, ceil(K b / 32)], element k at
                                     bits b k of its row, stored + 2^(b-1); X.weight_shape [2] = (N, K)

with `X.weight_scale` by the weights' strategy: tensor [1], channel [N, 1], group [N, K / group_size], block
[ceil(N / b0), ceil(K / b1)]; asymmetric weights add `X.weight_zero_point` (the scale's shape; pack-quantized packs
it along N the same way: [ceil(N b / 32), G]); group weights in activation order may add `X.weight_g_idx` [K]
(column k's group). As `compressed_tensors`' `_dequantize` computes it in the
run's dtype (transformers loads the scales in it):

    W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]          (exact in float32, then rounded once to the run's dtype)

Activations are not quantized here: a W8A8 checkpoint's matrices run dequantized beside activations in the compute
dtype (vLLM multiplies in FP8 / int8, transformers quantizes activations on the fly), so its tokens are the weights'
own, not those engines'. NVFP4, MXFP4 and sparse formats are refused in one sentence. The checkpoint
(`offload.model.checkpoint`) reads the bytes; this module knows the format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from offload.errors import CheckpointError
from offload.model.config import quant_method

METHOD = "compressed-tensors"
#: format -> the dtype its codes are stored in (int32: packed)
FORMATS = {"float-quantized": torch.float8_e4m3fn, "int-quantized": torch.int8, "naive-quantized": torch.int8,
           "pack-quantized": torch.int32}
#: tensors a quantized module carries that reading its weight does not use (activation and KV-cache scales)
UNUSED = re.compile(r"\.(?:input|output)_(?:scale|zero_point|global_scale)$|\.[kv]_scale$")
#: a matrix's parts beside its codes (dropped from the tensors a model binds: they make `X.weight`)
PARTS = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")

Reader = Callable[[str, tuple[int, ...], int, torch.Tensor], None]  # (tensor, the shape read as, first row, into)


@dataclass(frozen=True)
class Matrix:
    """One quantized matrix's parts and how they make W [N, K]."""

    shape: tuple[int, int]
    dtype: torch.dtype  # the scale's: the dequantized weight's
    codes: str  # X.weight (one code an element) or X.weight_packed
    code_dtype: torch.dtype  # float8 e4m3, int8, or int32 (packed)
    bits: int  # of a code
    scale: str
    grid: tuple[int, int]  # the scale's [rows, columns]
    block: tuple[int, int]  # rows and columns one scale covers (g_idx: its map says the columns)
    zero: str | None = None
    zero_packed: bool = False  # the zero points packed along N as the codes are along K (pack-quantized's)
    g_idx: str | None = None

    @property
    def packed(self) -> bool:
        return self.code_dtype == torch.int32

    def read_rows(self, read: Reader, row: int, dest: torch.Tensor) -> None:
        """Rows row .. row + len(dest) of W into `dest`, each part read a block of rows at a time by `read`."""
        n, (rows, k) = dest.shape[0], self.shape
        if self.packed:
            words = torch.empty((n, -(-k * self.bits // 32)), dtype=torch.int32)
            read(self.codes, (rows, words.shape[1]), row, words)
            w = unpack(words, self.bits, k).float()
        else:
            q = torch.empty((n, k), dtype=self.code_dtype)
            read(self.codes, self.shape, row, q)
            w = q.float()
        scale, zero = self._scales(read, row, n)
        if zero is not None:
            w -= zero
        dest.copy_(w.mul_(scale))  # (exact in float32: two short mantissas) rounded once, to the run's dtype, as
        # transformers computes it (it loads the scales in the run's dtype, then multiplies)

    def grid_rows(self, read: Reader, row: int, n: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The integer grid rows row .. row + n lie on: (step, bottom, cols), a run of `cols` columns (a scale column;
        1 under a `g_idx` map: each column its own) lying on bottom + step * (0 .. 2^b - 1) (b: these codes' bits),
        float32 [n, runs] (`quant.group_grid` makes it a quantizer's groups'). None for FP8 codes, or more levels
        than `bits` have."""
        if self.code_dtype == torch.float8_e4m3fn or self.bits > bits:
            return None
        mapped = self.g_idx is not None
        step, zero = self._scales(read, row, n, columns=mapped)
        base = -float(1 << (self.bits - 1)) - (zero if zero is not None else 0)
        return step, base * step, 1 if mapped else self.block[1]

    def _scales(self, read: Reader, row: int, n: int, columns: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scale and zero point (None: symmetric) of each weight of rows row .. row + n, float32 [n, K] (without
        `columns`: of each of their scale columns, [n, G])."""
        b0 = self.block[0]
        first, last = row // b0, (row + n - 1) // b0
        cols = self._columns(read) if columns else None
        s = torch.empty((last - first + 1, self.grid[1]), dtype=torch.float32)
        read(self.scale, self.grid, first, s)
        z = None if self.zero is None else \
            self._spread(self._zeros(read, first, last), row - first * b0, n, cols, columns)
        return self._spread(s, row - first * b0, n, cols, columns), z

    def _columns(self, read: Reader) -> torch.Tensor | None:
        """Each column's group (`X.weight_g_idx`), None where groups are consecutive columns."""
        if self.g_idx is None:
            return None
        cols = torch.empty(self.shape[1], dtype=torch.int32)
        read(self.g_idx, (self.shape[1],), 0, cols)
        if cols.min() < 0 or cols.max() >= self.grid[1]:
            raise CheckpointError(f"{self.g_idx!r} names groups outside 0..{self.grid[1] - 1}; the checkpoint is "
                                  "damaged")
        return cols

    def _zeros(self, read: Reader, first: int, last: int) -> torch.Tensor:
        """Zero points of scale rows first..last, float32 [rows, G] (a packed format packs them along N)."""
        if not self.zero_packed:
            z = torch.empty((last - first + 1, self.grid[1]), dtype=torch.float32)
            read(self.zero, self.grid, first, z)
            return z
        per = 32 // self.bits
        w0, w1 = first // per, last // per
        words = torch.empty((w1 - w0 + 1, self.grid[1]), dtype=torch.int32)
        read(self.zero, (-(-self.grid[0] // per), self.grid[1]), w0, words)
        z = unpack(words.T.contiguous(), self.bits, words.shape[0] * per).T
        return z[first - w0 * per : last - w0 * per + 1].float()

    def _spread(self, t: torch.Tensor, skip: int, n: int, cols: torch.Tensor | None, columns: bool = True) \
            -> torch.Tensor:
        """A scale's (zero point's) rows [rows, G] over the n rows read (the first `skip` of its block before them)
        and, with `columns`, their K columns."""
        b0, b1 = self.block
        t = t.repeat_interleave(b0, 0)[skip : skip + n] if b0 > 1 else t
        if not columns:
            return t
        return t[:, cols.long()] if cols is not None else t.repeat_interleave(b1, 1)[:, : self.shape[1]]


def unpack(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """int32 words [n, W], element j of a row at bits `bits` j, stored + 2^(bits-1) -> int32 [n, k], signed."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    q = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(words.shape[0], -1)[:, :k] - (1 << (bits - 1))


def _targets(group: Mapping[str, Any], module: str) -> bool:
    """Does a config group's `targets` name this module (a regex `re:...`, a module name; a class name names any
    Linear, the only modules with a quantized weight read here)?"""
    for t in group.get("targets") or ():
        t = str(t)
        if t.startswith("re:"):
            if re.match(t[3:], module):
                return True
        elif t == module or module.endswith("." + t) or "." not in t and t[:1].isupper():
            return True
    return False


def matrices(raw: Mapping[str, Any], entries: Mapping[str, Any], where: str,
             small: Callable[[str], torch.Tensor]) -> tuple[dict[str, Matrix], set[str]]:
    """({`X.weight`: its Matrix}, the tensors they and the unused activation / KV scales take) of a compressed-tensors
    checkpoint, ({}, set()) of any other. `entries`: name -> a TensorEntry; `small(name)` reads a tiny tensor whole."""
    if quant_method(raw) != METHOD:
        return {}, set()
    qc = raw["quantization_config"]
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise CheckpointError(f"{where}: quantization_config.config_groups is not a mapping of quantization schemes; "
                              "the checkpoint's config.json is damaged")
    out, taken = {}, {n for n in entries if UNUSED.search(n)}
    for name in entries:
        base, _, leaf = name.rpartition(".")
        if leaf != "weight_scale" or not base:
            continue
        module = base
        group = next((g for g in groups.values() if _targets(g, module)), None)
        if group is None:
            if len(groups) != 1:
                raise CheckpointError(f"{where}: no quantization_config.config_groups entry targets {module!r}, which "
                                      "has a weight_scale; the checkpoint does not match its config.json")
            group = next(iter(groups.values()))
        m = _matrix(qc, group, module, entries, where, small)
        taken |= {f"{module}.{p}" for p in PARTS if f"{module}.{p}" in entries}  # (a dense weight's too)
        if m is not None:
            out[f"{module}.weight"], taken = m, taken | {m.codes}
    return out, taken


def _matrix(qc: Mapping[str, Any], group: Mapping[str, Any], module: str, entries: Mapping[str, Any], where: str,
            small: Callable[[str], torch.Tensor]) -> Matrix | None:
    fmt = str(group.get("format") or qc.get("format") or "").lower()
    args = group.get("weights")
    if fmt == "dense" or not isinstance(args, dict):
        return None  # (a dense weight beside its scales: read as a float checkpoint)
    if fmt not in FORMATS:
        raise CheckpointError(f"{where}: compressed-tensors format {fmt!r} is not read by Offload (it reads "
                              f"{', '.join(FORMATS)}); use a checkpoint in one of those or its float original")
    bits, kind = args.get("num_bits"), str(args.get("type", "int")).lower()
    strategy = str(args.get("strategy") or "tensor").lower()
    ok = (bits == 8 and kind == "float") if fmt == "float-quantized" else (
        kind == "int" and bits in ((4, 8) if fmt == "pack-quantized" else (8,)))
    if not ok or strategy not in ("tensor", "channel", "group", "block"):
        raise CheckpointError(f"{where}: {module!r} is quantized as {bits}-bit {kind} by {strategy} in {fmt}, which "
                              "Offload does not read (FP8 and int8 codes, int4 / int8 packed, by tensor, channel, "
                              "group or block); use the checkpoint's float original")
    packed = fmt == "pack-quantized"
    codes = f"{module}.weight_packed" if packed else f"{module}.weight"
    e, s = entries.get(codes), entries[f"{module}.weight_scale"]
    if e is None or e.dtype != FORMATS[fmt] or len(e.shape) != 2:
        raise CheckpointError(f"{where}: {codes!r} is missing or not a 2-D {FORMATS[fmt]} tensor, as format {fmt} "
                              "stores it; the checkpoint does not match its quantization_config")
    if packed:
        n, k = (int(v) for v in small(f"{module}.weight_shape").tolist()) if f"{module}.weight_shape" in entries \
            else (e.shape[0], e.shape[1] * 32 // bits)
    else:
        n, k = e.shape
    if packed and e.shape != (n, -(-k * bits // 32)):
        raise CheckpointError(f"{where}: {codes!r} is {list(e.shape)}, not the {bits}-bit packing of a [{n}, {k}] "
                              "matrix; the checkpoint is damaged")
    group_size, block = args.get("group_size"), args.get("block_structure") or (128, 128)
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise CheckpointError(f"{where}: weights.group_size {group_size!r} of a group strategy is not a positive "
                              "integer; fix config.json")
    if strategy == "block" and not (isinstance(block, list | tuple) and len(block) == 2
                                    and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: weights.block_structure {block!r} is not two positive block sizes; "
                              "fix config.json")
    g_idx = f"{module}.weight_g_idx" if strategy == "group" and f"{module}.weight_g_idx" in entries else None
    grid, cover = {"tensor": ((1, 1), (n, k)), "channel": ((n, 1), (1, k)),
                   "group": ((n, -(-k // (group_size or 1))), (1, group_size or 1)),
                   "block": ((-(-n // block[0]), -(-k // block[1])), tuple(block))}[strategy]
    if not s.dtype.is_floating_point or s.dtype == torch.float8_e4m3fn or math.prod(s.shape) != math.prod(grid):
        raise CheckpointError(f"{where}: {module}.weight_scale is {list(s.shape)} {s.dtype}, not the float scales "
                              f"{list(grid)} of a [{n}, {k}] matrix quantized by {strategy}; the checkpoint does not "
                              "match its quantization_config")
    zero, zero_packed = None, False
    if not args.get("symmetric", True):
        zero = f"{module}.weight_zero_point"
        z, packing = entries.get(zero), (-(-grid[0] * bits // 32), grid[1])
        zero_packed = z is not None and packed and tuple(z.shape) == packing and z.dtype == torch.int32
        if z is None or kind != "int" or (not zero_packed and (z.dtype.is_floating_point or math.prod(z.shape) !=
                                                               math.prod(grid))):
            raise CheckpointError(f"{where}: {zero!r} is missing or not the integer zero points {list(grid)} "
                                  f"(packed: {list(packing)}) of asymmetric {strategy} weights; the checkpoint does "
                                  "not match its quantization_config")
    return Matrix((n, k), s.dtype, codes, FORMATS[fmt], bits, f"{module}.weight_scale", grid, cover, zero,
                  zero_packed, g_idx)


def kept_format(raw: Mapping[str, Any]) -> tuple[int, int] | None:
    """(bits, group size) of Offload's int4 / int8 format that holds every quantized matrix of this checkpoint with
    the same values (`Matrix.grid_rows`): an integer checkpoint (pack-quantized, or int8 codes) whose every config
    group quantizes weights to one number of bits, 4 or 8, by group (its group size) or channel (64), and leaves no
    Linear of the decoder layers float (`ignore`: the LM head alone). None for any other (read dense)."""
    if quant_method(raw) != METHOD:
        return None
    qc = raw["quantization_config"]
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    args = [g.get("weights") if isinstance(g.get("weights"), dict) else {} for g in groups]
    formats = {str(g.get("format") or qc.get("format") or "").lower() for g in groups}
    kinds = {(a.get("num_bits"), str(a.get("type", "int")).lower(), str(a.get("strategy") or "tensor").lower(),
              a.get("group_size") if str(a.get("strategy")).lower() == "group" else 64) for a in args}
    ignore = [str(i) for i in qc.get("ignore") or ()]
    if not formats <= {"pack-quantized", "int-quantized", "naive-quantized"} or len(kinds) != 1 \
            or not all("lm_head" in i for i in ignore):
        return None
    ((bits, kind, strategy, group),) = kinds
    if kind != "int" or bits not in (4, 8) or strategy not in ("group", "channel") or not isinstance(group, int) \
            or group < 2 or group % 2:
        return None
    return bits, group


#: a decoder block's matrix no format packs: a router (Mixtral's `gate`, gpt-oss's `router`, Qwen2-MoE's
#: `shared_expert_gate`), kept in the compute dtype whatever the checkpoint holds
_ROUTER = re.compile(r"(?:^|\.)(?:gate|router|shared_expert_gate)(?:\.layer)?\.weight$")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.\d+\.")


def covers(entries: Mapping[str, Any], matrices: Mapping[str, Matrix]) -> bool:
    """Are all the decoder blocks' matrices (2-D `.weight`s but the routers', and any stacked experts) among the
    checkpoint's quantized ones? (Else `kept_format` would quantize a matrix it left float.)"""
    return not any(_LAYER.search(n) and n not in matrices and (len(e.shape) == 3 or len(e.shape) == 2 and
                   n.endswith(".weight") and not _ROUTER.search(n)) for n, e in entries.items())
