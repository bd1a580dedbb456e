"""Microbenchmark: one weight matrix at batch 1, 4 and 9 through each CPU product, against memory bandwidth.

    python -m scripts.bench_kernels [--rows 8192 --cols 2048] [--repeat 9]

For a [rows, cols] matrix (default [8192, 2048]: a 1.7B-shape MLP matrix) and activation batches of 1, 4
and 9 rows, the best and median time of each product, with all threads (wall clock) and with one thread
(CPU time of the thread, which a shared machine's other processes disturb less), and the weight bytes per
second it reaches. The bound is this machine's read bandwidth (a parallel numba sum over 512 MiB). The
activations are bf16 by default (`--dtype`), as a bf16 model's run computes: the bf16 product then multiplies bf16
pairs, not the widening kernel float32 activations take, and the int8 error column is the bf16 output's rounding
(~4e-3). The matrix is timed again and again: where it is not much larger than the last-level cache (the default's
int8 and int4 codes are 18 and 9 MB), much of it is read from there, so its GB/s say what the kernel's arithmetic
allows rather than the memory.

    int8              offload's int8 kernel on its 64-row tiles: float32 activations, each byte converted in the
                      loop, the group's scale applied once a group
    int8 x int8 (i32) the alternative: activations quantized per row to int8 on the fly, int32 products, the
                      same group scales applied after (kept here, not in Offload: it is not faster enough to pay
                      for the activations' rounding error, see the results)
    int4              the int4 tile layout's numba kernel (torch's where it packs alike)
    bf16              offload's dense kernel over bf16 weights; F.linear bf16 / float32 for reference (not
                      row-invariant)

Writes scripts/results/bench-kernels.{md,json} with the command, the machine and the load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch
from numba import njit, prange

from offload.model import kernels
from offload.weights import quant
from scripts.machine import Result, load


@njit(parallel=True, nogil=True)
def _read(a):  # pragma: no cover - compiled
    chunks = 64
    n = a.shape[0] // chunks
    out = np.zeros(chunks, np.uint64)
    for c in prange(chunks):
        t = np.uint64(0)
        for i in range(c * n, c * n + n):
            t += a[i]
        out[c] = t
    return out.sum()


@njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, nogil=True)
def _i8i8(xq, xscale, q, sz, out):  # pragma: no cover - compiled
    """xq int8 [R, K] (per-row symmetric), xscale [R]; q uint8 [rows, K] codes; sz f32 [rows, G, 2] (scale, min):
    sum_k (xq * xscale) * (code * scale + min) = xscale * (scale * sum(xq * code) + min * sum(xq)) per group."""
    R, K = xq.shape
    rows, G = q.shape[0], sz.shape[1]
    gs = K // G
    for n in prange(rows):
        for r in range(R):
            acc = np.float32(0.0)
            for gi in range(G):
                d = np.int32(0)
                t = np.int32(0)
                for k in range(gs):
                    v = np.int32(xq[r, gi * gs + k])
                    d += v * np.int32(q[n, gi * gs + k])
                    t += v
                acc += sz[n, gi, 0] * np.float32(d) + sz[n, gi, 1] * np.float32(t)
            out[r, n] = acc * xscale[r]


def i8i8_linear(x: torch.Tensor, q: torch.Tensor, sz32: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(dim=1).clamp_min(1e-12)
    xscale = (amax / 127).float()
    xq = torch.round(x / xscale[:, None]).to(torch.int8)
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    _i8i8(xq.numpy(), xscale.numpy(), q.numpy(), sz32.numpy(), out.numpy())
    return out


def timed(f, clock, repeat: int) -> tuple[float, float]:
    f()
    ts = []
    for _ in range(repeat):
        t0 = clock()
        f()
        ts.append(clock() - t0)
    return min(ts), statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the activations' dtype: a bf16 model's run computes in bf16, whose products multiply bf16 "
                         "pairs (float32 activations take the widening kernels instead)")
    ap.add_argument("--out", default="scripts/results")
    args = ap.parse_args()
    result = Result()
    N, K = args.rows, args.cols
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) / K**0.5
    big = np.ones(512 << 20, np.uint8).view(np.uint64)  # summed as 64-bit words: byte by byte it measured the adds
    _read(big)  # (2.8 GB/s on a machine whose kernels read 20+)
    t0 = time.perf_counter()
    _read(big)
    bandwidth = big.nbytes / (time.perf_counter() - t0)
    del big
    i8, i4 = quant.quantize(w, 8, 64, torch.bfloat16), quant.quantize(w, 4, 64, torch.bfloat16)
    sz32 = i8["sz"].float()
    codes = quant.int8_codes(i8["q"], torch.empty(i8["q"].shape[0] * 64, K, dtype=torch.uint8))  # by row (untiled)
    pairs = sz32.transpose(0, 1).contiguous()
    l8, l4 = (quant.PackedLinear(p["q"], p["sz"], N, None) for p in (i8, i4))
    wb = w.bfloat16()
    products = {
        "int8": (lambda x: l8.linear(x), i8["q"].numel() + i8["sz"].numel() * 2),
        "int8 x int8 (i32)": (lambda x: i8i8_linear(x.float(), codes, pairs), i8["q"].numel() + i8["sz"].numel() * 2),
        "int4": (lambda x: l4.linear(x), i4["q"].numel() + i4["sz"].numel() * 2),
        "bf16 (offload)": (lambda x: kernels.dense_linear(x, wb), wb.numel() * 2),
        "F.linear bf16": (lambda x: torch.nn.functional.linear(x.bfloat16(), wb), wb.numel() * 2),
        "F.linear float32": (lambda x: torch.nn.functional.linear(x.float(), w), w.numel() * 4),
    }
    rows, threads = [], torch.get_num_threads()
    for batch in (1, 4, 9):
        x = torch.randn(batch, K, generator=g).to(getattr(torch, args.dtype))
        ref = x.double() @ quant.dequantize(i8["q"], sz32)[:N].double().T
        for name, (f, nbytes) in products.items():
            row = {"product": name, "batch": batch, "weight_bytes": nbytes}
            if name.startswith("int8"):  # against the exact product of the stored int8 weights
                row["max_rel_err"] = float((f(x).double() - ref).abs().max() / ref.abs().max())
            for label, clock, nt in (("all", time.perf_counter, threads), ("one", time.thread_time, 1)):
                numba.set_num_threads(nt)
                torch.set_num_threads(nt)
                kernels.PARALLEL_WORK = (1 << 22) if nt > 1 else (1 << 62)
                best, med = timed(lambda f=f, x=x: f(x), clock, args.repeat)
                row[label] = {"best_ms": 1000 * best, "median_ms": 1000 * med, "GB_s": nbytes / best / 1e9}
            row["load"] = load()
            rows.append(row)
            print(row, flush=True)
        torch.set_num_threads(threads)
        numba.set_num_threads(threads)
    md = [f"[{N}, {K}] weights; read bandwidth (all threads, parallel sum over 512 MiB): {bandwidth / 1e9:.1f} GB/s; "
          f"{threads} threads.\n",
          "| product | batch | all threads: best / median ms | GB/s | one thread (CPU time): best / median ms | GB/s "
          "| int8 rel. error | load |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else ""
        md.append(f"| {r['product']} | {r['batch']} | {r['all']['best_ms']:.2f} / {r['all']['median_ms']:.2f} | "
                  f"{r['all']['GB_s']:.1f} | {r['one']['best_ms']:.2f} / {r['one']['median_ms']:.2f} | "
                  f"{r['one']['GB_s']:.1f} | {err} | {r['load']} |")
    print(result.write(args.out, "bench-kernels", "\n".join(md), {"bandwidth_B_s": bandwidth, "rows": rows}))


if __name__ == "__main__":
    main()
