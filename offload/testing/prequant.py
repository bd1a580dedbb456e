"""A small GPTQ / AWQ packer for test checkpoints, written from the published formats.

    make_prequantized(float_dir, out_dir, method="gptq", bits=4, group_size=32, act_order=True)

Quantizes every decoder linear of a float Hugging Face checkpoint (round-to-nearest, asymmetric)
and packs it as AutoGPTQ (`qweight` int32 [K / f, N] packed along the input dim, `qzeros` int32
[G, N / f] packed along the output dim holding zero - 1 in the v1 format, fp16 `scales` [G, N],
`g_idx` [K]; with act-order the input rows are assigned to groups in a random order) or AutoAWQ GEMM
(`qweight` int32 [K, N / 8] and `qzeros` [G, N / 8] packed along the output dim in the interleaved
order 0 2 4 6 1 3 5 7, fp16 `scales` [G, N]) would, and writes config.json with its
`quantization_config`. Embeddings, norms and the LM head are copied as they are.

Imports nothing of Offload's.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEAR = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def _as_int32(words: np.ndarray) -> torch.Tensor:
    """uint64 words that hold 32 bits -> int32 with the same bits."""
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def _groups_of(k: int, group_size: int, act_order: bool, rng: np.random.Generator) -> np.ndarray:
    size = k if group_size == -1 else group_size
    if not act_order:
        return np.arange(k) // size
    perm = rng.permutation(k)  # the order GPTQ visits input rows (by Hessian diagonal; random here)
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[perm] = np.arange(k) // size
    return g_idx


def _rtn(w: np.ndarray, g_idx: np.ndarray, bits: int, zero_min: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] -> q [N, K], scales [G, N] (fp16), zeros [G, N] with w ~ (q - zero) * scale."""
    maxq, groups = 2**bits - 1, int(g_idx.max()) + 1
    scales = np.zeros((groups, w.shape[0]), dtype=np.float16)
    zeros = np.zeros((groups, w.shape[0]), dtype=np.int64)
    q = np.zeros(w.shape, dtype=np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols].astype(np.float64)
        lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
        s = np.maximum((hi - lo) / maxq, 1e-8).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float64)), zero_min, maxq).astype(np.int64)
        scales[g], zeros[g] = s, z
        q[:, cols] = np.clip(np.round(block / s.astype(np.float64)[:, None]) + z[:, None], 0, maxq)
    return q, scales, zeros


def pack_gptq(w: torch.Tensor, bits: int, group_size: int, act_order: bool, v1: bool,
              rng: np.random.Generator) -> dict[str, torch.Tensor]:
    n, k = w.shape
    f = 32 // bits
    g_idx = _groups_of(k, group_size, act_order, rng)
    q, scales, zeros = _rtn(w.float().numpy(), g_idx, bits, zero_min=1 if v1 else 0)
    intweight = q.T.astype(np.uint64)  # [K, N]
    qweight = np.zeros((k // f, n), dtype=np.uint64)
    for j in range(f):  # row r holds input rows r*f .. r*f+f-1, the j-th at bits j*b
        qweight |= intweight[j::f] << np.uint64(bits * j)
    stored = (zeros - (1 if v1 else 0)).astype(np.uint64)
    qzeros = np.zeros((zeros.shape[0], n // f), dtype=np.uint64)
    for j in range(f):  # column c holds output columns c*f .. c*f+f-1
        qzeros |= stored[:, j::f] << np.uint64(bits * j)
    return {"qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros), "scales": torch.from_numpy(scales),
            "g_idx": torch.from_numpy(g_idx.astype(np.int32))}


def pack_awq(w: torch.Tensor, group_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g_idx = _groups_of(k, group_size, False, rng)
    q, scales, zeros = _rtn(w.float().numpy(), g_idx, 4, zero_min=0)
    intweight = q.T.astype(np.uint64)  # [K, N]
    qweight = np.zeros((k, n // 8), dtype=np.uint64)
    qzeros = np.zeros((zeros.shape[0], n // 8), dtype=np.uint64)
    for i, col in enumerate(AWQ_ORDER):  # nibble i of word c holds column 8c + order[i]
        qweight |= intweight[:, col::8] << np.uint64(4 * i)
        qzeros |= zeros.astype(np.uint64)[:, col::8] << np.uint64(4 * i)
    return {"qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros), "scales": torch.from_numpy(scales)}


def make_prequantized(src: str | Path, out: str | Path, method: str = "gptq", bits: int = 4, group_size: int = 32,
                      act_order: bool = False, checkpoint_format: str = "gptq", seed: int = 0) -> Path:
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    packed: dict[str, torch.Tensor] = {}
    for name, t in sorted(tensors.items()):
        if not LINEAR.match(name):
            packed[name] = t.contiguous()
            continue
        base = name.removesuffix(".weight")
        parts = (pack_gptq(t, bits, group_size, act_order, checkpoint_format == "gptq", rng) if method == "gptq"
                 else pack_awq(t, group_size, rng))
        for suffix, value in parts.items():
            packed[f"{base}.{suffix}"] = value
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": False,
              "checkpoint_format": checkpoint_format}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group_size, "version": "gemm", "zero_point": True}
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if (src / "tokenizer.json").is_file():
        shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    return out
