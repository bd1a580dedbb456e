"""Exact CPU attention, query by query (`offload.model.cpu_attention`: which kernel a pass takes): each (query, head)
on its own over its visible keys in token order, the same bits whatever else is in the pass. Also the lane steps
both kernels share (`cpu_attention_blocks` takes several queries at once with the same steps)."""

from __future__ import annotations

import numpy as np

from offload.model.kernels import numba

#: keys ahead whose K and V rows the attention kernel asks for while it scores one
_AHEAD = 8
#: visible keys whose V rows every head of a work item reads before the next ones (in L1: 4-8 KiB a head)
_CHUNK = 32

if numba is not None:
    from numba import njit, prange

    from offload.model.simd import (
        LANES,
        _bits_f32,
        bits_at,
        fma,
        parts,
        prefetch,
        vfma,
        vload,
        vsplat,
        vstore,
        vsum,
        vsum8,
        vzero,
    )
    from offload.model.simd_math import vdiv64, vexp, vhmax, vmax, vmul, vmul64, vraw

    @njit(forceinline=True, nogil=True)
    def _dots8(qs, qo, keys, c, D, bf16):  # pragma: no cover - compiled
        """The dot products of the query at qs[qo :] with the K rows of keys c .. c + 7 (at addresses keys[c ..]) over
        the head's whole 16s of dimensions, side by side: 16 lanes of fused multiply-adds each, summed by `vsum8`."""
        k0, k1, k2, k3, k4, k5, k6, k7 = (keys[c], keys[c + 1], keys[c + 2], keys[c + 3], keys[c + 4], keys[c + 5],
                                          keys[c + 6], keys[c + 7])
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
        for d in range(0, D - D % LANES, LANES):
            qv = vload(qs, qo + d)
            a0, a1 = vfma(qv, vraw(k0, d, bf16), a0), vfma(qv, vraw(k1, d, bf16), a1)
            a2, a3 = vfma(qv, vraw(k2, d, bf16), a2), vfma(qv, vraw(k3, d, bf16), a3)
            a4, a5 = vfma(qv, vraw(k4, d, bf16), a4), vfma(qv, vraw(k5, d, bf16), a5)
            a6, a7 = vfma(qv, vraw(k6, d, bf16), a6), vfma(qv, vraw(k7, d, bf16), a7)
        return vsum8(a0, a1, a2, a3, a4, a5, a6, a7)

    @njit(forceinline=True, nogil=True)
    def _dot1(qs, qo, k, D, bf16):  # pragma: no cover - compiled
        """One key's `_dots8`: the same lane steps, summed by `vsum`'s tree (`vsum8`'s)."""
        a = vzero()
        for d in range(0, D - D % LANES, LANES):
            a = vfma(vload(qs, qo + d), vraw(k, d, bf16), a)
        return vsum(a)

    @njit(forceinline=True, nogil=True)
    def _raw_at(kv, rows, slot, kind, off, kh, d, shift):  # pragma: no cover - compiled
        """One K (kind 0) or V (1) value's bits widened to float32's: from the pool kv (slot >= 0), or from cold
        block -1 - slot, whose K row of head 0 is at address rows[-1 - slot] (the pool's block layout)."""
        if slot >= 0:
            return np.uint32(kv[slot, kind, off, kh, d]) << shift
        at = rows[-1 - slot] + kind * kv.strides[1] + off * kv.strides[2] + kh * kv.strides[3] + d * kv.itemsize
        return bits_at(at, shift == 0)

    @njit(forceinline=True, nogil=True)
    def _tail(dot, qs, qo, kv, rows, slot, off, kh, kind, D, shift):  # pragma: no cover - compiled
        """dot + the dimensions past the last 16, in order (scalar fused multiply-adds)."""
        for d in range(D - D % LANES, D):
            dot = fma(qs[qo + d], _bits_f32(_raw_at(kv, rows, slot, kind, off, kh, d, shift)), dot)
        return dot

    @njit(forceinline=True, nogil=True)
    def _values(acc, ao, probs, po, vis, keys, kb, c0, c1, s1, D, bf16):  # pragma: no cover - compiled
        """acc [ao : ao + D16] += p * V row for one query's visible keys c0 .. c1 - 1 in order (its lists at kb on;
        from 0 at c0 = 0): 16 lanes, each a chain of fused multiply-adds over the keys (the dimensions past the last
        16 are the caller's), 64 dimensions at a time in registers."""
        D16 = D - D % LANES
        D64 = D16 - D16 % (4 * LANES)
        for d in range(0, D64, 4 * LANES):
            a0 = a1 = a2 = a3 = vzero()
            if c0:
                a0, a1, a2, a3 = (vload(acc, ao + d), vload(acc, ao + d + LANES), vload(acc, ao + d + 2 * LANES),
                                  vload(acc, ao + d + 3 * LANES))
            for c in range(kb + c0, kb + c1):
                pv, va = vsplat(probs[po + vis[c]]), keys[c] + s1
                a0, a1 = vfma(pv, vraw(va, d, bf16), a0), vfma(pv, vraw(va, d + LANES, bf16), a1)
                a2 = vfma(pv, vraw(va, d + 2 * LANES, bf16), a2)
                a3 = vfma(pv, vraw(va, d + 3 * LANES, bf16), a3)
            vstore(acc, ao + d, a0)
            vstore(acc, ao + d + LANES, a1)
            vstore(acc, ao + d + 2 * LANES, a2)
            vstore(acc, ao + d + 3 * LANES, a3)
        for d in range(D64, D16, LANES):
            a0 = vload(acc, ao + d) if c0 else vzero()
            for c in range(kb + c0, kb + c1):
                a0 = vfma(vsplat(probs[po + vis[c]]), vraw(keys[c] + s1, d, bf16), a0)
            vstore(acc, ao + d, a0)

    @njit(forceinline=True, nogil=True)
    def _values4(acc, ao, astep, probs, po, pstep, n, vis, keys, kb, c0, c1, s1, D,
                 bf16):  # pragma: no cover - compiled
        """`_values` for four sums over the same keys (their lists at kb on): sum i's at ao + i astep, its
        probabilities at po + i pstep (the heads of a query, or a head of four queries; n < 4 of them: the last
        again, its same values stored twice): each V row widened once for the four, 32 dimensions at a time (the
        same chain a lane; eight chains in flight, where one sum's four wait on each add)."""
        D16 = D - D % LANES
        a1o, a2o, a3o = ao + min(1, n - 1) * astep, ao + min(2, n - 1) * astep, ao + min(3, n - 1) * astep
        p1o, p2o, p3o = po + min(1, n - 1) * pstep, po + min(2, n - 1) * pstep, po + min(3, n - 1) * pstep
        for d in range(0, D16, 2 * LANES):
            dd = d + LANES
            two = dd < D16
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vzero()
            if c0:
                a0, a1, a2, a3 = vload(acc, ao + d), vload(acc, a1o + d), vload(acc, a2o + d), vload(acc, a3o + d)
                if two:
                    b0, b1 = vload(acc, ao + dd), vload(acc, a1o + dd)
                    b2, b3 = vload(acc, a2o + dd), vload(acc, a3o + dd)
            for c in range(kb + c0, kb + c1):
                j, va = vis[c], keys[c] + s1
                p0, p1 = vsplat(probs[po + j]), vsplat(probs[p1o + j])
                p2, p3 = vsplat(probs[p2o + j]), vsplat(probs[p3o + j])
                v = vraw(va, d, bf16)
                a0, a1, a2, a3 = vfma(p0, v, a0), vfma(p1, v, a1), vfma(p2, v, a2), vfma(p3, v, a3)
                if two:
                    w = vraw(va, dd, bf16)
                    b0, b1, b2, b3 = vfma(p0, w, b0), vfma(p1, w, b1), vfma(p2, w, b2), vfma(p3, w, b3)
            for o, v in ((a3o, a3), (a2o, a2), (a1o, a1), (ao, a0)):
                vstore(acc, o + d, v)
            if two:
                for o, v in ((a3o, b3), (a2o, b2), (a1o, b1), (ao, b0)):
                    vstore(acc, o + dd, v)

    @njit(forceinline=True, nogil=True)
    def _head_values(acc, ao, probs, po, TkP, G, vis, keys, kb, c0, c1, s1, D, bf16):  # pragma: no cover - compiled
        """`_values` of keys c0 .. c1 - 1 for a query's G heads (head g's sums at ao + g D, its probabilities at po +
        g TkP): four heads at a time (`_values4`, three with one again), one or two left one by one."""
        g = 0
        while G - g >= 3:
            _values4(acc, ao + g * D, D, probs, po + g * TkP, TkP, min(4, G - g), vis, keys, kb, c0, c1, s1, D, bf16)
            g += 4
        for h in range(g, G):
            _values(acc, ao + h * D, probs, po + h * TkP, vis, keys, kb, c0, c1, s1, D, bf16)

    @njit(forceinline=True, nogil=True)
    def _row(slot, row0, rows, koff, s0):  # pragma: no cover - compiled
        """A block's K row address at offset 0 for one KV head: slot >= 0 in the pool (row0: its slot 0's), -1 - i
        cold block i (its head 0's at rows[i]; koff the head's offset in a block)."""
        return row0 + slot * s0 if slot >= 0 else rows[-1 - slot] + koff

    @njit(forceinline=True, nogil=True)
    def _visible(mask, b, t, table, bs, row0, rows, koff, s0, s2, keys, vis, kb):  # pragma: no cover - compiled
        """Query (b, t)'s visible keys in token order into keys[kb :] (their K rows' addresses: `_row`'s, row0 the
        KV head's row at slot 0, offset 0) and vis[kb :] (their indices) -> how many. Block by block; each key's
        entry written whether it is seen or not, then counted (the next one writes over an unseen one's; nv <= j:
        within the query's Tk entries): no branch a key. (80 / 1040 keys 300 / 2800-3500 -> 125 / 1600-1900
        cycles.)"""
        nv, m = 0, mask[b, t]
        for c in range(mask.shape[2] // bs):
            row, j0 = _row(table[b, c], row0, rows, koff, s0), c * bs
            for off in range(bs):
                keys[kb + nv], vis[kb + nv] = row + off * s2, j0 + off
                nv += np.int64(m[j0 + off])
        return nv

    @njit(forceinline=True, nogil=True)
    def _scores8(scores, so, TkP, qs, qo, keys, vis, c0, c1, end, G, D, isz, bf16):  # pragma: no cover - compiled
        """One query's scores (head g's at so + g TkP, its query at qo + g D) of keys c0 .. c1 - 1 (eights: `_dots8`),
        eight keys for every head before the next eight (rows in L1), the K rows a few keys on asked for (up to
        end)."""
        for c in range(c0, c1, 8):
            if c + 8 + _AHEAD <= end:
                for u in range(c + _AHEAD, c + 8 + _AHEAD):
                    for e in range(0, D * isz, 64):
                        prefetch(keys[u], e)
            for g in range(G):
                dots = _dots8(qs, qo + g * D, keys, c, D, bf16)
                for u in range(8):
                    scores[so + g * TkP + vis[c + u]] = dots[u]

    @njit(forceinline=True, nogil=True)
    def _softmax(scores, probs, so, TkP, qs, qo, keys, vis, kb, n8, nv, kv, rows, table, b, kh, scale, D, shift,
                 bf16):  # pragma: no cover - compiled
        """One (query, head)'s softmax (its scores at so, their keys at kb): the scores of keys n8 .. nv - 1 one by
        one (`_dot1`; the ones before, the caller's), every score's dimensions past the last 16 and its scale, then
        e^(score - max) into probs, 16 keys at a time (an unseen key's: 0) -> the max (their sum: `_totals`)."""
        bs = kv.shape[2]
        for c in range(kb + n8, kb + nv):
            scores[so + vis[c]] = _dot1(qs, qo, keys[c], D, bf16)
        if D % LANES:
            for c in range(kb, kb + nv):
                j = vis[c]
                scores[so + j] = _tail(scores[so + j], qs, qo, kv, rows, table[b, j // bs], j % bs, kh, 0, D, shift)
        if scale > 0 and np.float64(np.float32(scale)) == scale:  # (16 at a time: an unseen key's -inf stays -inf;
            sv = vsplat(np.float32(scale))  # a float32 scale (1 / 8 at 64 dimensions): float32 products, whose exact
            for j in range(so, so + TkP, LANES):  # product rounds once either way: the same bits)
                vstore(scores, j, vmul(vload(scores, j), sv))
        elif scale > 0:
            for j in range(so, so + TkP, LANES):
                vstore(scores, j, vmul64(vload(scores, j), scale))
        else:
            for c in range(kb, kb + nv):
                scores[so + vis[c]] *= scale
        top = vsplat(np.float32(-np.inf))  # (an unseen key's score is -inf: the visible keys' largest)
        for j in range(so, so + TkP, LANES):
            top = vmax(top, vload(scores, j))
        mg = vhmax(top)
        low, one = vsplat(-mg), vsplat(np.float32(1.0))
        for j in range(so, so + TkP, LANES):
            vstore(probs, j, vexp(vfma(vload(scores, j), one, low)))
        return mg

    @njit(forceinline=True, nogil=True)
    def _totals(probs, so, TkP, vis, kb, nv, G, total, to):  # pragma: no cover - compiled
        """total[to + g] = the sum of head g's probabilities (at so + g TkP) over one query's visible keys (at kb) in
        key order, in float64: four heads' sums side by side (each a chain of adds: one at a time waits on each)."""
        for g in range(0, G, 4):
            o0, o1 = so + g * TkP, so + min(g + 1, G - 1) * TkP
            o2, o3 = so + min(g + 2, G - 1) * TkP, so + min(g + 3, G - 1) * TkP
            t0 = t1 = t2 = t3 = 0.0
            for c in range(kb, kb + nv):
                j = vis[c]
                t0 += probs[o0 + j]
                t1 += probs[o1 + j]
                t2 += probs[o2 + j]
                t3 += probs[o3 + j]
            total[to + g] = t0
            if g + 1 < G:
                total[to + g + 1] = t1
            if g + 2 < G:
                total[to + g + 2] = t2
            if g + 3 < G:
                total[to + g + 3] = t3

    @njit(forceinline=True, nogil=True)
    def _output(acc, ao, probs, po, vis, kb, nv, kv, rows, table, b, kh, D, shift, mg, total, out, lse, t,
                h):  # pragma: no cover - compiled
        """Query (b, t), head h: its value sums' dimensions past the last 16 (in key order; the whole 16s are in acc
        at ao), then out = acc / total and lse = max + log(total), or zeros and -inf where it sees no key."""
        bs = kv.shape[2]
        for d in range(D - D % LANES, D):
            acc[ao + d] = 0.0
        for c in range(kb, kb + nv if D % LANES else kb):
            j = vis[c]
            p = probs[po + j]
            for d in range(D - D % LANES, D):
                raw = _raw_at(kv, rows, table[b, j // bs], 1, j % bs, kh, d, shift)
                acc[ao + d] = fma(p, _bits_f32(raw), acc[ao + d])
        if nv == 0:
            for d in range(D):
                out[b, t, h, d] = 0.0
            lse[b, t, h] = -np.inf
            return
        o = out[b, t, h]
        for d in range(0, D - D % LANES, LANES):
            vstore(o, d, vdiv64(vload(acc, ao + d), total))
        for d in range(D - D % LANES, D):
            o[d] = acc[ao + d] / total
        lse[b, t, h] = mg + np.log(total)

    @njit(parallel=True, cache=True, nogil=True)  # no fast-math: the lanes' operations as written (`simd`)
    def _attend_rows(q, kv, rows, table, mask, scale, shift, out, lse):  # pragma: no cover - compiled
        """q [B, Tq, Hq, D] f32; kv [slots, 2, bs, Hkv, D] paged K and V as raw bits (uint32 float32 with shift 0,
        uint16 bf16 with shift 16), table [B, cols] the slot of each sequence's blocks in token order, or -1 - i for
        the i-th of more blocks of the pool's layout elsewhere (a step's blocks in the cold tiers), rows [n] int64
        the addresses of their first K rows (kept alive by the caller); mask
        [B, Tq, cols * bs] -> out [B, Tq, Hq, D], lse [B, Tq, Hq] (f32; a query that sees no key: zeros and -inf).
        Each (query, head) walks its visible keys in token order, read where they lie in the pool: padding,
        other queries, other sequences and where the blocks sit change nothing in it. A score is 16 lanes of fused
        multiply-adds over the head's dimensions, read in place from the pool, summed by `vsum`'s fixed tree (eight
        keys' side by side, `vsum8`: the same adds; the dimensions past the last 16 added after, in order); the
        softmax's exponentials are `simd_math.vexp`, 16 keys at a time (an unseen key's score is -inf: exactly 0);
        each output lane is a chain of fused multiply-adds over the value rows in key order, 64 dimensions held in
        registers. The same operations for every query, and rows a few keys ahead asked for (the pool is cold
        after a layer's weights went through the caches). One work item is a query and the G query heads of one KV
        head, eight keys' rows scored for every head before the next eight, a chunk of value rows added for every
        head before the next (each row read from memory once for all of them). SmolLM2-135M's shape (9 heads, 3 KV
        heads, 64 dimensions), bf16, against one loop per key and head with a tree sum each and the value sums in
        memory: 9 queries over 73 keys 44 -> 33 us (2 threads), 1 query over 1025 / 2049 keys 86 / 178 -> 65 / 134
        us; one thread 1.28-1.36x. (A work item a head, three times as many, balanced two threads better but cost
        more: 70 / 148 us.) Then the softmax's scale and max 16 keys at a time (float64 products in lanes: the
        scalar's bits), four heads' float64 sums of probabilities and value sums side by side (`_totals`,
        `_values4`: each a chain in key order, one head's alone waits on every add), the outputs divided 16 at a
        time: the same bits; a 2-core Xeon, interleaved: 9 queries over 73 keys 33-34 -> 28-29 us, one over 1025
        63-65 -> 51-53, 9 over 1033 381-385 -> 281."""
        B, Tq, Hq, D = q.shape
        bs, Hkv = kv.shape[2], kv.shape[3]
        Tk = mask.shape[2]
        G = Hq // Hkv
        TkP = Tk + (-Tk) % LANES  # a head's scores padded to whole vectors
        base, bf16 = kv.ctypes.data, shift == 16  # rows read in place, by address
        s0, s1, s2, s3 = kv.strides[0], kv.strides[1], kv.strides[2], kv.strides[3]
        n = B * Tq * Hkv
        share, shares = parts(n, 1)
        for th in prange(shares):  # (a thread's buffers made once)
            scores, probs = np.empty(G * TkP, np.float32), np.empty(G * TkP, np.float32)
            qs, acc = np.empty(G * D, np.float32), np.empty(G * D, np.float32)
            keys, vis = np.empty(Tk, np.int64), np.empty(Tk, np.int64)  # visible keys' K rows' addresses, indices
            m, total = np.empty(G, np.float32), np.empty(G)
            for idx in range(th * share, min(n, th * share + share)):
                b, t, kh = idx // (Tq * Hkv), (idx // Hkv) % Tq, idx % Hkv
                nv = _visible(mask, b, t, table, bs, base + kh * s3, rows, kh * s3, s0, s2, keys, vis, 0)
                if nv == 0:
                    for g in range(G):
                        _output(acc, g * D, probs, g * TkP, vis, 0, 0, kv, rows, table, b, kh, D, shift, m[g], total[g],
                                out, lse, t, kh * G + g)
                    continue
                for g in range(G):
                    for d in range(D):
                        qs[g * D + d] = q[b, t, kh * G + g, d]
                scores[:] = -np.inf
                n8 = nv - nv % 8
                _scores8(scores, 0, TkP, qs, 0, keys, vis, 0, n8, nv, G, D, kv.itemsize, bf16)
                for g in range(G):
                    m[g] = _softmax(scores, probs, g * TkP, TkP, qs, g * D, keys, vis, 0, n8, nv, kv, rows, table, b,
                                    kh, scale, D, shift, bf16)
                _totals(probs, 0, TkP, vis, 0, nv, G, total, 0)
                for c0 in range(0, nv, _CHUNK):  # a chunk of V rows for every head, then the next (rows in L1)
                    c1 = min(nv, c0 + _CHUNK)
                    for c in range(c1, min(nv, c1 + _CHUNK)):  # (the next chunk's asked for)
                        for e in range(0, D * kv.itemsize, 64):
                            prefetch(keys[c] + s1, e)
                    _head_values(acc, 0, probs, 0, TkP, G, vis, keys, 0, c0, c1, s1, D, bf16)
                for g in range(G):
                    _output(acc, g * D, probs, g * TkP, vis, 0, nv, kv, rows, table, b, kh, D, shift, m[g], total[g],
                            out, lse, t, kh * G + g)
