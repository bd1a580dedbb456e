"""A group's tensors read from a checkpoint: checked before a conversion writes anything, then each group
filled into a buffer (converted to the compute dtype, or packed a block of rows at a time) by
`offload.weights.convert` and the tiered store's loader. `offload.weights.groups` says what each group holds."""

from __future__ import annotations

import torch

from offload.errors import CheckpointError
from offload.model.checkpoint import Checkpoint
from offload.weights import quant
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
            quant.quantize_into(CheckpointRows(ckpt, packed_sources(ckpt.config, tensor, sources)),
                                fmt.tensor_bits(tensor), fmt.group_size,
                                views[f"{tensor}.q"], views[f"{tensor}.sz"])
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
        top = 0  # the first row of each source in the fused matrix
        for short, shape in self.sources:
            a, b = max(r0, top), min(r1, top + shape[0])
            if a < b:
                self.ckpt.read_rows_into(short, shape, a - top, out[a - r0 : b - r0])
            top += shape[0]
        return out

    def grid(self, r0: int, r1: int, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The integer grid rows r0 .. r1 lie on, by groups of `group` columns (`Checkpoint.grid_rows`: a
        compressed-tensors checkpoint's int4 / int8 matrices), NaN where they lie on none; None for all of them."""
        step = torch.full((r1 - r0, self.shape[1] // group), float("nan"))
        base, top, found = step.clone(), 0, False
        for short, shape in self.sources:
            a, b = max(r0, top), min(r1, top + shape[0])
            on = self.ckpt.grid_rows(short, a - top, b - a, group, bits) if a < b else None
            if on is not None:
                step[a - r0 : b - r0], base[a - r0 : b - r0], found = on[0], on[1], True
            top += shape[0]
        return (step, base) if found else None


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
            if fmt.prequant is not None and fmt.packs(cfg, tensor):
                for short, (n, k) in sources:
                    fmt.prequant.check_shape(f"{ckpt.path}: {ckpt.name(short)}", n, k)
                for _, name, dtype, shape in prequant_sources(sources, fmt.prequant):
                    if ckpt.entry(name, shape, DTYPES[dtype]).dtype != DTYPES[dtype]:
                        raise CheckpointError(f"{ckpt.path}: {ckpt.name(name)} is not {dtype}, as the "
                                              f"{fmt.prequant.method} format stores it; the checkpoint is not one")
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
