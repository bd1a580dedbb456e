"""Exact CPU attention, four queries of a sequence at a time (`offload.model.cpu_attention`: which kernel a pass
takes): the keys all four see are read and widened once for them, every query's own operations the ones
`cpu_attention_rows` gives it alone, so the same bits."""

from __future__ import annotations

import numpy as np

from offload.model.kernels import numba

#: queries of a sequence in one work item: the keys they all see are read and widened once for them
_QUERIES = 4

if numba is not None:
    from numba import njit, prange

    from offload.model.cpu_attention_rows import (
        _AHEAD,
        _CHUNK,
        _head_values,
        _output,
        _scores8,
        _softmax,
        _totals,
        _values4,
        _visible,
    )
    from offload.model.simd import LANES, parts, prefetch, vfma, vload, vsum8, vzero
    from offload.model.simd_math import vraw

    @njit(forceinline=True, nogil=True)
    def _dots4x4(qs, qo, qstep, keys, c, D, bf16):  # pragma: no cover - compiled
        """`_dots8`'s sums for four queries (at qs[qo + i qstep :]) and keys c .. c + 3: each K row widened once for
        the four; (query 0's four keys, query 1's), (query 2's, query 3's)."""
        k0, k1, k2, k3 = keys[c], keys[c + 1], keys[c + 2], keys[c + 3]
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzero()
        a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = vzero()
        for d in range(0, D - D % LANES, LANES):
            w0, w1, w2, w3 = vraw(k0, d, bf16), vraw(k1, d, bf16), vraw(k2, d, bf16), vraw(k3, d, bf16)
            q0 = vload(qs, qo + d)
            a00, a01, a02, a03 = vfma(q0, w0, a00), vfma(q0, w1, a01), vfma(q0, w2, a02), vfma(q0, w3, a03)
            q1 = vload(qs, qo + qstep + d)
            a10, a11, a12, a13 = vfma(q1, w0, a10), vfma(q1, w1, a11), vfma(q1, w2, a12), vfma(q1, w3, a13)
            q2 = vload(qs, qo + 2 * qstep + d)
            a20, a21, a22, a23 = vfma(q2, w0, a20), vfma(q2, w1, a21), vfma(q2, w2, a22), vfma(q2, w3, a23)
            q3 = vload(qs, qo + 3 * qstep + d)
            a30, a31, a32, a33 = vfma(q3, w0, a30), vfma(q3, w1, a31), vfma(q3, w2, a32), vfma(q3, w3, a33)
        return vsum8(a00, a01, a02, a03, a10, a11, a12, a13), vsum8(a20, a21, a22, a23, a30, a31, a32, a33)

    @njit(parallel=True, cache=True, nogil=True)  # no fast-math: the lanes' operations as written (`simd`)
    def _attend_blocks(q, kv, rows, table, mask, scale, shift, out, lse):  # pragma: no cover - compiled
        """`cpu_attention_rows._attend_rows` (its arguments, results and every query's operations), a work item a
        block of `_QUERIES` queries of a sequence and the G query heads of one KV head: the keys all four see (a
        causal block: the first one's) are scored four keys for the four queries at a time (`_dots4x4`) and added
        for the four together (`_values4`), each row widened once for them; the rest, and a block of fewer, query by
        query (eight keys side by side). Items go to the threads in turn (a block of fewer queries beside full ones).
        SmolLM2-135M's shape, bf16, 2 threads, against the rows kernel: 256 queries over 1280 keys 12.9 -> 10.4 ms,
        9 over 1033 keys 391 -> 374 us; one query 0.86-0.89x (left to the rows kernel)."""
        B, Tq, Hq, D = q.shape
        bs, Hkv = kv.shape[2], kv.shape[3]
        Tk = mask.shape[2]
        G = Hq // Hkv
        TkP = Tk + (-Tk) % LANES  # a head's scores padded to whole vectors
        GD, GT, QB = G * D, G * TkP, _QUERIES
        base, bf16 = kv.ctypes.data, shift == 16  # rows read in place, by address
        s0, s1, s2, s3 = kv.strides[0], kv.strides[1], kv.strides[2], kv.strides[3]
        blocks = (Tq + QB - 1) // QB
        n = B * blocks * Hkv
        _, shares = parts(n, 1)
        for th in prange(shares):  # (a thread's buffers made once; query i of a block at i GD, i GT, i Tk, i G)
            scores, probs = np.empty(QB * GT, np.float32), np.empty(QB * GT, np.float32)
            qs, acc = np.empty(QB * GD, np.float32), np.empty(QB * GD, np.float32)
            keys, vis = np.empty(QB * Tk, np.int64), np.empty(QB * Tk, np.int64)  # visible keys' K rows, indices
            nvs, m, total = np.empty(QB, np.int64), np.empty(QB * G, np.float32), np.empty(QB * G)
            for idx in range(th, n, shares):  # (every shares-th item: blocks of fewer queries spread over threads)
                b, kh = idx // (blocks * Hkv), idx % Hkv
                t0 = (idx // Hkv) % blocks * QB
                nq = min(QB, Tq - t0)
                for i in range(nq):
                    nvs[i] = _visible(mask, b, t0 + i, table, bs, base + kh * s3, rows, kh * s3, s0, s2, keys, vis,
                                      i * Tk)
                    for g in range(G):
                        for d in range(D):
                            qs[i * GD + g * D + d] = q[b, t0 + i, kh * G + g, d]
                shared = 0  # keys every query of a full block sees, from the first on
                if nq == QB:
                    shared = min(nvs[0], nvs[1], nvs[2], nvs[3])
                    for c in range(shared):
                        if vis[Tk + c] != vis[c] or vis[2 * Tk + c] != vis[c] or vis[3 * Tk + c] != vis[c]:
                            shared = c
                            break
                scores[: nq * GT] = -np.inf
                n4 = shared - shared % 4
                for c in range(0, n4, 4):  # four keys for four queries and every head, then the next four
                    if c + 4 + _AHEAD <= shared:  # the K rows a few keys on
                        for u in range(c + _AHEAD, c + 4 + _AHEAD):
                            for e in range(0, D * kv.itemsize, 64):
                                prefetch(keys[u], e)
                    for g in range(G):
                        first, second = _dots4x4(qs, g * D, GD, keys, c, D, bf16)
                        for u in range(4):
                            j = g * TkP + vis[c + u]
                            scores[j], scores[GT + j] = first[u], first[4 + u]
                            scores[2 * GT + j], scores[3 * GT + j] = second[u], second[4 + u]
                for i in range(nq):
                    kb, nv = i * Tk, nvs[i]
                    n8 = nv - (nv - n4) % 8
                    _scores8(scores, i * GT, TkP, qs, i * GD, keys, vis, kb + n4, kb + n8, kb + nv, G, D, kv.itemsize,
                             bf16)  # this query's other keys
                    for g in range(G):
                        qo, so = i * GD + g * D, i * GT + g * TkP
                        m[i * G + g] = _softmax(scores, probs, so, TkP, qs, qo, keys, vis, kb, n8, nv, kv, rows, table,
                                                b, kh, scale, D, shift, bf16)
                    _totals(probs, i * GT, TkP, vis, kb, nv, G, total, i * G)
                for c0 in range(0, shared, _CHUNK):  # a chunk of V rows for four queries and every head, then the next
                    c1 = min(shared, c0 + _CHUNK)
                    for c in range(c1, min(shared, c1 + _CHUNK)):  # (the next chunk's asked for)
                        for e in range(0, D * kv.itemsize, 64):
                            prefetch(keys[c] + s1, e)
                    for g in range(G):
                        _values4(acc, g * D, GD, probs, g * TkP, GT, 4, vis, keys, 0, c0, c1, s1, D, bf16)
                for i in range(nq):
                    kb, nv = i * Tk, nvs[i]
                    for c0 in range(shared, nv, _CHUNK):  # this query's other V rows, on from the shared ones' sums
                        c1 = min(nv, c0 + _CHUNK)
                        for c in range(kb + c1, kb + min(nv, c1 + _CHUNK)):
                            for e in range(0, D * kv.itemsize, 64):
                                prefetch(keys[c] + s1, e)
                        _head_values(acc, i * GD, probs, i * GT, TkP, G, vis, keys, kb, c0, c1, s1, D, bf16)
                    for g in range(G):
                        _output(acc, i * GD + g * D, probs, i * GT + g * TkP, vis, kb, nv, kv, rows, table, b, kh, D,
                                shift, m[i * G + g], total[i * G + g], out, lse, t0 + i, kh * G + g)
