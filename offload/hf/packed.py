"""int8 / int4 matrices of the modules transformers runs, multiplied as they lie packed (`quant.PackedLinear`: the
packed kernels, no dense copy): a Linear's weight, and the routed experts of a mixture of experts.

The blocks' packed matrices are handed to their modules while the group is bound (`offload_packed`, leaf ->
PackedLinear: set by the module's hook, `hf.model.DenseOnUse`, where `multipliable` says the module can use them;
the hook dequantizes them for any other). Every nn.Linear becomes a `Linear` of this module (`adopt`), which
multiplies by Offload's CPU kernels: its packed weight as it lies, a dense one as the native path's products do.

transformers 5 gives most mixtures of experts one experts module (`use_experts_implementation`): parameters stacked
[E, ...] (`gate_up_proj` [E, 2I, H], or `up_proj` where there is no gate; `down_proj` [E, H, I]; biases [E, ...]),
called with the hidden states [T, H], the routed experts' ids [T, k] and their weights [T, k], and dispatching to an
implementation by its config's `_experts_implementation`. `install` registers one more, `offload_packed`, on every
such module of a model: where the module's int8 / int4 matrices are packed, each routed expert's rows of them are
multiplied as they lie; dense ones (on a CPU, untransposed) by the dense kernels a `Linear` uses; every other call
goes to the implementation transformers chose for the module.

The math follows transformers' eager loop: the routed experts ascending, each over the rows routed to it, its gate
(the module's own `_apply_gate`, or its activation without one), biases, post-expert norm and routing weight, summed
into the output by `index_add_`. A packed run's tokens are then the same in every placement and batch (the kernels'
rows are independent of each other); they are not the float model's (the weights are quantized). Experts a module
holds transposed ([E, H, 2I]: gpt-oss) are packed as each expert's transpose (`GenericTensors.transposed`), so that
an expert's rows are its outputs here too; experts whose rows do not fill whole tiles of 64 are dequantized instead,
the routed experts only (`hf.model.DenseOnUse`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from offload.model import kernels
from offload.weights.quant import TILE_ROWS, PackedLinear

try:  # (transformers 5: its experts interface; none before)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
except ImportError:
    ALL_EXPERTS_FUNCTIONS = None

NAME = "offload_packed"


def install(model: nn.Module) -> None:
    """Route every experts module of `model` through `experts_forward` (falling back to the implementation
    transformers chose for it); nothing where transformers has no experts interface."""
    if ALL_EXPERTS_FUNCTIONS is None:
        return
    ALL_EXPERTS_FUNCTIONS[NAME] = experts_forward
    modules = [m for m in model.modules() if interfaced(m)]
    chosen = {id(m): m.config._experts_implementation for m in modules}  # (before any is switched: shared configs)
    for m in modules:
        m.offload_fallback = chosen[id(m)] if chosen[id(m)] not in (None, NAME) else "eager"
        m.config._experts_implementation_internal = NAME
        m.offload_packed = None


def interfaced(module: nn.Module) -> bool:
    """Is `module` an experts module of transformers' experts interface (one device: no expert parallelism)?"""
    return (hasattr(module, "has_gate") and isinstance(getattr(module, "num_experts", None), int)
            and getattr(module, "config", None) is not None and not getattr(module, "_is_expert_parallel", True))


class Linear(nn.Linear):
    """An nn.Linear that multiplies by Offload's CPU kernels, as the native path does: its packed weight as it lies
    while it is handed one (`offload_packed`), a dense one (float32, bf16, fp16) by `kernels.dense_linear` (the
    weight as it is, accumulated in float32, each row independent of the others: torch's bf16 product of one row
    reads an LM head at a fraction of the memory's speed); elsewhere (CUDA) torch's."""

    offload_packed: dict[str, PackedLinear] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offload_packed is not None:
            return self.offload_packed["weight"].linear(x, self.bias)
        if kernels.dense_supported(x, self.weight):
            return kernels.dense_linear(x, self.weight, self.bias)
        return super().forward(x)


def adopt(model: nn.Module) -> None:
    """Every nn.Linear of the model (exactly: a subclass may compute otherwise) becomes a `Linear`."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear


def multipliable(module: nn.Module, packed: dict[str, Any], flipped: dict[str, bool]) -> bool:
    """Can the module multiply its packed matrices as they lie? A `Linear`; an experts module whose matrices are
    packed with an expert's outputs as its rows (as the module holds them, or `flipped`: each expert transposed
    where the module holds them [E, in, out]), each expert's rows whole tiles of 64."""
    if isinstance(module, Linear):
        return set(packed) == {"weight"}
    if not interfaced(module):
        return False
    names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    return (set(packed) == set(names) and all(flipped.get(n, False) == bool(module.is_transposed) for n in names)
            and all(packed[n].out_features % (module.num_experts * TILE_ROWS) == 0 for n in names))


def routed(module: nn.Module, args: tuple, kwargs: dict) -> list[int] | None:
    """The experts a call of an interfaced experts module routes to (ascending ids of its second argument, the
    routed experts' [T, k]: every implementation indexes the stacked parameters by those alone); None for another
    module, which may read every expert."""
    if not interfaced(module):
        return None
    try:
        values = list(_signature(type(module)).bind(module, *args, **kwargs).arguments.values())
    except TypeError:
        return None
    ids = values[2] if len(values) > 2 else None
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
        return None
    return [e for e in torch.unique(ids).tolist() if 0 <= e < module.num_experts]


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """The original forward's parameters (the interface's wrapper keeps it as `__wrapped__`, which inspect follows)."""
    return inspect.signature(cls.forward)


def expert_rows(w: PackedLinear, e: int, experts: int) -> PackedLinear:
    """Expert e's rows of a stacked packed matrix (whole tiles of 64 rows: a view of its codes and scales)."""
    n = w.out_features // experts
    return w.tile_rows(e * n, (e + 1) * n)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts interface's call: [T, H] -> [T, H] (see the module doc)."""
    E, up_name = self.num_experts, "gate_up_proj" if self.has_gate else "up_proj"
    packed = self.offload_packed
    if packed is not None:
        def weights(e: int) -> tuple[Any, Any]:
            return expert_rows(packed[up_name], e, E), expert_rows(packed["down_proj"], e, E)
    elif not self.is_transposed and kernels.dense_supported(hidden_states, self.down_proj[0]):
        def weights(e: int) -> tuple[Any, Any]:  # (an expert's [out, in] rows of the stacked dense matrices)
            return getattr(self, up_name)[e], self.down_proj[e]
    else:
        original = type(self).forward.__wrapped__
        impl = ALL_EXPERTS_FUNCTIONS.get_interface(self.offload_fallback, original)
        return impl(self, hidden_states, top_k_index, top_k_weights)
    up_bias = getattr(self, f"{up_name}_bias") if self.has_bias else None
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=E + 1).permute(2, 1, 0)  # (ids of E: masked choices)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
    for e in hit:
        if e >= E:
            continue
        pos, rows = torch.where(mask[e])
        up, down = weights(e)
        y = _linear(hidden_states[rows], up, None if up_bias is None else up_bias[e])
        y = self._apply_gate(y) if self.has_gate else self.act_fn(y)
        y = _linear(y, down, self.down_proj_bias[e] if self.has_bias else None)
        if self.has_post_expert_norm:
            y = self.post_expert_norm(y)
        out.index_add_(0, rows, (y * top_k_weights[rows, pos, None]).to(out.dtype))
    return out


def _linear(x: torch.Tensor, w: PackedLinear | torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return kernels.dense_linear(x, w, bias) if isinstance(w, torch.Tensor) else w.linear(x, bias)
