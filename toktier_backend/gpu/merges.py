"""BPE merges per pre-token on the GPU: one warp per short pre-token, one block per long one.

Both paths run :func:`tables.bpe_rounds` (the proof is there): per *round*, the smallest merge rank
``r`` among the current pairs is found as a minimum (ties cannot occur across different pairs: a rank
names one pair, and equal pairs go leftmost by the selection below); its occurrences are taken left to
right, every other one inside a run of overlapping occurrences (``A == B``); the round stops after the
first occurrence whose merge creates a pair of rank ``< r``. Merged symbols are compacted by a prefix
count. That equals HF's heap order (minimum ``(rank, position)``, stale entries skipped).

* Warp path (``<= 32`` bytes, one symbol per lane): minimum by ``shfl_xor``, occurrence/selection/
  inversion masks by ``ballot``, compaction through a shared row; every primitive has a shared-memory
  twin for the simulator (``_warp.py``).
* Block path (overflow, any length): the pre-token's symbols stay in global memory, each thread owns a
  contiguous chunk; per round one block-wide min, one exclusive max-scan (run parity), one min (first
  inversion) and one exclusive sum-scan (compaction) — ``O(m / threads)`` per round and ``O(log m)``
  rounds for a repeated-char run (a 1M-char run of one char, spaces, ``=``...), never the ``O(m^2)``
  of repeated single merges. The round count is bounded by the number of distinct merge ranks applied.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int64

from toktier_backend.gpu import _warp as W_
from toktier_backend.gpu.kernels import C_NLONG, C_NSHORT
from toktier_backend.gpu.tables import HASH_A, HASH_B, INF_RANK

WARP_MAX = 32
BIGI = 0x7FFFFFFF
WPB = W_.WARPS_PER_BLOCK  # module globals: compile-time constants for shared-array shapes
BLK = W_.BLOCK


@W_.device
def lookup(mk_a, mk_b, m_rank, m_new, a, b):
    """``(merge rank, new id)`` of the pair ``(a, b)``, ``(INF_RANK, -1)`` when it is not a merge."""
    mask = mk_a.shape[0] - 1
    h = (np.int64(a) * HASH_A) ^ (np.int64(b) * HASH_B)
    s = (h ^ (h >> 17)) & mask
    while True:
        ka = mk_a[s]
        if ka == a and mk_b[s] == b:
            return m_rank[s], m_new[s]
        if ka == -1:
            return INF_RANK, -1
        s = (s + 1) & mask


@cuda.jit
def k_bpe_warp(counts, sym, pt_b0, shortlist, ntok, mk_a, mk_b, m_rank, m_new):
    """One warp per pre-token of the short list (2..32 symbols, one per lane)."""
    scr = cuda.shared.array((WPB, 32), int64)
    tid = cuda.threadIdx.x
    w = tid // 32
    lane = tid % 32
    row = scr[w]
    nshort = counts[C_NSHORT]
    it = cuda.blockIdx.x * WPB + w
    step = cuda.gridDim.x * WPB
    while it < nshort:
        t = shortlist[it]
        b0 = pt_b0[t]
        m = pt_b0[t + 1] - b0
        s = np.int64(-1)
        if lane < m:
            s = np.int64(sym[b0 + lane])
        while True:
            left, nb, right2 = W_.neighbors(row, lane, s)
            r = np.int64(INF_RANK)
            nid = np.int64(-1)
            if lane + 1 < m:
                rr, nn = lookup(mk_a, mk_b, m_rank, m_new, s, nb)
                r = np.int64(rr)
                nid = np.int64(nn)
            rmin = W_.warp_min(row, lane, r)
            if rmin == INF_RANK:
                break
            sm = W_.alternate(W_.ballot(row, lane, r == rmin))
            inv = False
            if ((sm >> lane) & 1) != 0:
                if lane >= 1:
                    lf = left
                    if lane >= 2 and ((sm >> (lane - 2)) & 1) != 0:
                        lf = nid
                    rr, nn = lookup(mk_a, mk_b, m_rank, m_new, lf, nid)
                    if rr < rmin:
                        inv = True
                if lane + 2 < m:
                    rr, nn = lookup(mk_a, mk_b, m_rank, m_new, nid, right2)
                    if rr < rmin:
                        inv = True
            im = W_.ballot(row, lane, inv)
            if im != 0:
                sm &= (np.int64(2) << W_.low_bit(im)) - 1
            mysel = ((sm >> lane) & 1) != 0
            removed = lane >= 1 and ((sm >> (lane - 1)) & 1) != 0
            if mysel:
                s = nid
            newidx = lane - W_.popc64((sm << 1) & ((np.int64(1) << lane) - 1))
            W_.wsync()
            if lane < m and not removed:
                row[newidx] = s
            W_.wsync()
            m -= W_.popc64(sm)
            s = np.int64(-1)
            if lane < m:
                s = row[lane]
            W_.wsync()
        if lane < m:
            sym[b0 + lane] = s
        if lane == 0:
            ntok[0, t] = m
        it += step


@cuda.jit
def k_bpe_block(counts, sym, tmp, rk, nw, sel, pt_b0, longlist, ntok, mk_a, mk_b, m_rank, m_new):
    """One block per pre-token of the long list (the overflow path); see the module docstring."""
    sh = cuda.shared.array(BLK, int64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    nlong = counts[C_NLONG]
    it = cuda.blockIdx.x
    while it < nlong:
        t = longlist[it]
        b0 = pt_b0[t]
        m = pt_b0[t + 1] - b0
        flip = False  # False: symbols live in sym, True: in tmp
        while True:
            src = tmp if flip else sym
            dst = sym if flip else tmp
            k = (m + nt - 1) // nt
            lo = tid * k
            hi = W_.imin(lo + k, m)
            lmin = np.int64(INF_RANK)
            for i in range(lo, hi):
                r = INF_RANK
                nid = -1
                if i + 1 < m:
                    r, nid = lookup(mk_a, mk_b, m_rank, m_new, src[b0 + i], src[b0 + i + 1])
                rk[b0 + i] = r
                nw[b0 + i] = nid
                if r < lmin:
                    lmin = r
            rmin = W_.block_min(sh, tid, nt, lmin)
            if rmin == INF_RANK:
                break
            cmax = np.int64(-1)
            for i in range(lo, hi):
                if rk[b0 + i] == rmin and (i == 0 or rk[b0 + i - 1] != rmin):
                    cmax = i
            rs = W_.block_excl_max(sh, tid, nt, cmax)
            for i in range(lo, hi):
                occ = rk[b0 + i] == rmin
                if occ and (i == 0 or rk[b0 + i - 1] != rmin):
                    rs = i
                sel[b0 + i] = 1 if (occ and (i - rs) % 2 == 0) else 0
            cuda.syncthreads()
            linv = np.int64(BIGI)
            for i in range(lo, hi):
                if sel[b0 + i] != 0 and i < linv:
                    nid = nw[b0 + i]
                    inv = False
                    if i >= 1:
                        lf = src[b0 + i - 1]
                        if i >= 2 and sel[b0 + i - 2] != 0:
                            lf = nid
                        rr, nn = lookup(mk_a, mk_b, m_rank, m_new, lf, nid)
                        if rr < rmin:
                            inv = True
                    if i + 2 < m:
                        rr, nn = lookup(mk_a, mk_b, m_rank, m_new, nid, src[b0 + i + 2])
                        if rr < rmin:
                            inv = True
                    if inv:
                        linv = i
            first = W_.block_min(sh, tid, nt, linv)
            cnt = np.int64(0)
            for i in range(lo, hi):
                if not (i >= 1 and sel[b0 + i - 1] != 0 and i - 1 <= first):
                    cnt += 1
            pos, total = W_.block_excl_sum(sh, tid, nt, cnt)
            for i in range(lo, hi):
                if not (i >= 1 and sel[b0 + i - 1] != 0 and i - 1 <= first):
                    v = src[b0 + i]
                    if sel[b0 + i] != 0 and i <= first:
                        v = nw[b0 + i]
                    dst[b0 + pos] = v
                    pos += 1
            cuda.syncthreads()
            m = total
            flip = not flip
        if flip:
            i = tid
            while i < m:
                sym[b0 + i] = tmp[b0 + i]
                i += nt
        if tid == 0:
            ntok[0, t] = m
        cuda.syncthreads()
        it += cuda.gridDim.x
