"""A group's tensors read from a checkpoint: checked before a conversion writes anything, then each group
filled into a buffer (converted to the compute dtype, or packed a block of rows at a time) by
`offload.weights.convert` and the tiered store's loader. `offload.weights.groups` says what each group holds."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from offload.errors import CheckpointError
from offload.model.checkpoint import Checkpoint
from offload.weights import gptq, quant
from offload.weights.groups import (
    DENSE,
    Sources,
    WeightFormat,
    dense_shape,
    group_names,
    group_sources,
    mlp_prefix,
    packed_sources,
    prequant_sources,
    stacked_experts,
    stacked_sources,
)
from storage.layout import DTYPES, GroupLayout


def fill_group(ckpt: Checkpoint, layout: GroupLayout, buf: torch.Tensor, fmt: WeightFormat = DENSE) -> None:
    """Read a group's tensors from the checkpoint into `buf` (1-D uint8, CPU), converting dtype or packing."""
    buf[: layout.nbytes].zero_()
    views = layout.views(buf)
    for tensor, sources in group_sources(ckpt.config, layout.name, stacked_experts(ckpt)):
        if fmt.prequant is not None and fmt.packs(ckpt.config, tensor):  # the checkpoint's bytes, as they are
            for part, name, _, _ in prequant_sources(sources, fmt.prequant):
                ckpt.read_into(name, views[f"{tensor}.{part}"])
            continue
        if fmt.packs(ckpt.config, tensor):  # read a block of rows at a time as it is quantized
            quant.quantize_into(matrix_rows(ckpt, packed_sources(ckpt.config, tensor, sources), fmt),
                                fmt.tensor_bits(tensor), fmt.group_size,
                                views[f"{tensor}.q"], views[f"{tensor}.sz"])
            continue
        if fmt.source is not None and prequantized(ckpt, sources, fmt):  # kept dense: dequantized
            views[tensor].copy_(PrequantRows(ckpt, sources, fmt.source)[0 : dense_shape(sources)[0]])
            continue
        if len(sources) == 1:  # (a scalar has no rows: Apertus's activation parameters)
            ckpt.read_into(sources[0][0], views[tensor])
            continue
        row = 0
        for short, shape in sources:
            ckpt.read_into(short, views[tensor][row : row + shape[0]])
            row += shape[0]


class CheckpointRows:
    """A fused matrix (`Sources`) whose rows are read from the checkpoint as float32 when sliced (`rows[a:b]`):
    what `quant.quantize_into` reads, so a conversion holds a block of a large matrix (an LM head: 49152 x 576 is
    113 MB in float32), not all of it (a 400 MiB machine was killed converting SmolLM2 to int4)."""

    def __init__(self, ckpt: Checkpoint, sources: Sources) -> None:
        self.ckpt, self.sources, self.shape = ckpt, sources, dense_shape(sources)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        r0, r1, _ = rows.indices(self.shape[0])
        out = torch.empty(max(r1 - r0, 0), *self.shape[1:], dtype=torch.float32)
        for short, a, b, at in in_sources(self.sources, r0, r1):
            self.ckpt.read_rows_into(short, dict(self.sources)[short], a, out[at : at + b - a])
        return out

    def grid(self, r0: int, r1: int, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The integer grid rows r0 .. r1 lie on, by groups of `group` columns (`Checkpoint.grid_rows`: a
        compressed-tensors checkpoint's int4 / int8 matrices), NaN where they lie on none; None for all of them."""
        if self.shape[1] % group:
            return None
        step = torch.full((r1 - r0, self.shape[1] // group), float("nan"))
        base, found = step.clone(), False
        for short, a, b, at in in_sources(self.sources, r0, r1):
            if (on := self.ckpt.grid_rows(short, a, b - a, bits)) is not None:
                step[at : at + b - a], base[at : at + b - a] = quant.group_grid(*on, group, self.shape[1])
                found = True
        return (step, base) if found else None


def in_sources(sources: Sources, r0: int, r1: int) -> Iterator[tuple[str, int, int, int]]:
    """Rows r0 .. r1 of a fused matrix by source: (its name, its rows a .. b, where they start in the slice)."""
    top = 0  # the first row of each source in the fused matrix
    for short, shape in sources:
        a, b = max(r0, top), min(r1, top + shape[0])
        if a < b:
            yield short, a - top, b - top, a - r0
        top += shape[0]


def prequantized(ckpt: Checkpoint, sources: Sources, fmt: WeightFormat) -> bool:
    """Are these sources a GPTQ/AWQ checkpoint's packed linears (`fmt.source`): a `.qweight` for each weight?"""
    return fmt.source is not None and all(
        ckpt.name(short.removesuffix(".weight") + ".qweight") in ckpt.entries for short, _ in sources)


def matrix_rows(ckpt: Checkpoint, sources: Sources, fmt: WeightFormat) -> CheckpointRows | PrequantRows:
    """What `quant.quantize_into` reads a matrix from: the checkpoint's rows, or a GPTQ/AWQ one's dequantized."""
    if prequantized(ckpt, sources, fmt):
        return PrequantRows(ckpt, sources, fmt.source)
    return CheckpointRows(ckpt, sources)


class PrequantRows:
    """A fused matrix of GPTQ/AWQ linears (`Sources`) read as float32 rows when sliced, dequantized as the format's
    reference kernel does (`gptq.dequantize`, the sliced rows' packed columns), one linear's packed tensors held at a
    time; and the integer grid each group of its rows lies on (`grid`): what `quant.quantize_into` packs anew, each
    group with one scale keeping the checkpoint's codes and scale."""

    def __init__(self, ckpt: Checkpoint, sources: Sources, pre: gptq.PrequantFormat) -> None:
        self.ckpt, self.sources, self.pre, self.shape = ckpt, sources, pre, dense_shape(sources)
        self._held: tuple[str, dict[str, torch.Tensor]] | None = None

    def _parts(self, short: str, a: int, b: int) -> dict[str, torch.Tensor]:
        """Rows a .. b of one linear [n, k] (multiples of 32 / bits: whole int32 words): its packed tensors' slices."""
        n, k = dict(self.sources)[short]
        if self._held is None or self._held[0] != short:
            base, parts = short.removesuffix(".weight"), {}
            for suffix, (dtype, shape) in self.pre.tensors(n, k).items():
                parts[suffix] = torch.empty(shape, dtype=DTYPES[dtype])
                self.ckpt.read_into(f"{base}.{suffix}", parts[suffix])
            self._held = (short, parts)
        t, f = self._held[1], self.pre.per_int
        sliced = {"scales": t["scales"][:, a:b], "qzeros": t["qzeros"][:, a // f : -(-b // f)]}
        sliced["qweight"] = t["qweight"][:, a:b] if self.pre.method == "gptq" else t["qweight"][:, a // f : -(-b // f)]
        return sliced | ({"g_idx": t["g_idx"]} if "g_idx" in t else {})

    def __getitem__(self, rows: slice) -> torch.Tensor:
        r0, r1, _ = rows.indices(self.shape[0])
        out = torch.empty(max(r1 - r0, 0), self.shape[1], dtype=torch.float32)
        for short, a, b, at in in_sources(self.sources, r0, r1):
            out[at : at + b - a] = gptq.dequantize(self.pre, self._parts(short, a, b))
        return out

    def grid(self, r0: int, r1: int, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(step, bottom) [r1 - r0, K / group] of each group whose columns share one (scale, zero): its values are
        bottom + step * (0 .. 2^b - 1); NaN for the others (act-order maps); None where b > `bits`."""
        if self.pre.bits > bits:
            return None
        step = torch.full((r1 - r0, self.shape[1] // group), float("nan"))
        base = step.clone()
        for short, a, b, at in in_sources(self.sources, r0, r1):
            parts = self._parts(short, a, b)
            # by group where its groups are consecutive columns, else each column's own (an act-order map)
            s, z, cols = gptq.group_scales(self.pre, parts) or (*gptq.scales_zeros(self.pre, parts), 1)
            step[at : at + b - a], base[at : at + b - a] = quant.group_grid(s, -z * s, cols, group, self.shape[1])
        return step, base


def check_tensors(ckpt: Checkpoint, fmt: WeightFormat) -> None:
    """Every tensor a conversion will read exists with its shape and dtype: checked before anything is written."""
    cfg = ckpt.config
    stacked = stacked_experts(ckpt)
    if stacked:  # the whole stacks first: an expert count that disagrees is named on the stacked tensor
        for layer in (i for i, sparse in enumerate(cfg.moe_layers) if sparse):
            for short, shape in stacked_sources(cfg, layer):
                ckpt.entry(short, shape)
    _check_routing(ckpt, stacked)
    for group in group_names(cfg, fmt):
        for tensor, sources in group_sources(cfg, group, stacked):
            pre = fmt.prequant if fmt.prequant is not None and fmt.packs(cfg, tensor) else (
                fmt.source if prequantized(ckpt, sources, fmt) else None)
            if pre is not None:
                for short, (n, k) in sources:
                    pre.check_shape(f"{ckpt.path}: {ckpt.name(short)}", n, k)
                for _, name, dtype, shape in prequant_sources(sources, pre):
                    if ckpt.entry(name, shape, DTYPES[dtype]).dtype != DTYPES[dtype]:
                        raise CheckpointError(f"{ckpt.path}: {ckpt.name(name)} is not {dtype}, as the "
                                              f"{pre.method} format stores it; the checkpoint is not one")
            else:
                for short, shape in sources:
                    ckpt.entry(short, shape)


def _check_routing(ckpt: Checkpoint, stacked: bool) -> None:
    """A layer the config makes dense must not have a router in the checkpoint, nor a sparse one a dense MLP."""
    cfg = ckpt.config
    if not cfg.is_moe:
        return
    for i, sparse in enumerate(cfg.moe_layers):
        mlp = mlp_prefix(cfg, i, stacked)
        found = ckpt.name(mlp + ("gate_proj.weight" if sparse else "gate.weight"))
        if found in ckpt.entries:
            kind, want = ("a dense MLP", "a mixture of experts") if sparse else ("a router", "dense")
            raise CheckpointError(f"{ckpt.path}: tensor {found!r} is {kind} but config.json makes layer {i} {want} "
                                  "(decoder_sparse_step / mlp_only_layers); the weights and config.json do not "
                                  "belong together")
