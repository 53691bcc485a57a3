"""numba.cuda kernels of the pre-tokenization half: UTF-8 decode, scans, per-family boundary predicates,
pre-token numbering, the BPE work lists, and the output gather.

Every kernel reads its element count from the device array ``counts`` (never from the host), loops
grid-stride, and is launched with a grid sized by the buffer *capacity*, so the whole pipeline is a
fixed launch sequence per size class (capturable as a CUDA graph, no host sync inside).

The predicate device functions are per-position ports of :mod:`predicates` (same rule names, same
order); ``tests/gpu`` checks them against the NumPy version, which is itself checked against HF.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int64

from toktier_backend.gpu import _warp as W_
from toktier_backend.gpu.unicode_tables import AL, AP, CJK, CRLF, L, M, N, P, S, SPACE, WS

SCAN2 = W_.SCAN2_BLOCK  # module global: a compile-time constant for the shared-array shape
# counts[] slots
C_NBYTES, C_NADDED, C_NCP, C_NPT, C_NSHORT, C_NLONG, C_NTOK = range(7)
N_COUNTS = 8
# scan ops
OP_SUM, OP_MAX, OP_MINREV = 0, 1, 2
BIG = 0x7FFFFFFF
# scan channels: forward max (fwd) and reverse min (rev)
F_WS_START, F_R_POS, F_N_START, F_LM_START, F_AL_START = range(5)
R_WS_END, R_WN_POS = range(2)
N_FWD, N_REV = 5, 2
FOLD_SHIFT = 16
# fold bits (unicode_tables.FOLD_LETTERS = "strevmld")
FS, FT, FR, FE, FV, FM, FL, FD = (1 << k for k in range(8))
# added-span kinds
SPAN_BREAK = -3  # a segment break without a token (batch boundaries)


# ------------------------------------------------------------------------------------------- setup
@cuda.jit
def k_reset(counts):
    i = cuda.grid(1)
    if i == 0:
        counts[C_NCP] = 0
        counts[C_NPT] = 0
        counts[C_NSHORT] = 0
        counts[C_NLONG] = 0
        counts[C_NTOK] = 0


@cuda.jit
def k_decode(bts, counts, lead, byte_ids, sym):
    """``lead[i]`` = 1 where byte ``i`` starts a code point; ``sym[i]`` = the byte's BPE symbol."""
    n = counts[C_NBYTES]
    i = cuda.grid(1)
    while i < n:
        b = bts[i]
        lead[0, i] = 1 if (b & 0xC0) != 0x80 else 0
        sym[i] = byte_ids[b]
        i += cuda.gridsize(1)


@W_.device
def _utf8_at(bts, i):
    b = np.int32(bts[i])
    if b < 0x80:
        return b
    if b < 0xE0:
        return ((b & 0x1F) << 6) | (np.int32(bts[i + 1]) & 0x3F)
    if b < 0xF0:
        return ((b & 0x0F) << 12) | ((np.int32(bts[i + 1]) & 0x3F) << 6) | (np.int32(bts[i + 2]) & 0x3F)
    return (((b & 0x07) << 18) | ((np.int32(bts[i + 1]) & 0x3F) << 12) | ((np.int32(bts[i + 2]) & 0x3F) << 6)
            | (np.int32(bts[i + 3]) & 0x3F))


@cuda.jit
def k_scatter(bts, counts, cpidx, cps, cpbyte, cls, seg, addid, ctab, ftab):
    """Code points, their byte offsets and class bits, compacted by the inclusive scan ``cpidx``."""
    n = counts[C_NBYTES]
    i = cuda.grid(1)
    while i < n:
        if (bts[i] & 0xC0) != 0x80:
            q = cpidx[0, i] - 1
            cp = _utf8_at(bts, i)
            cps[q] = cp
            cpbyte[q] = i
            cls[q] = np.int32(ctab[cp]) | (np.int32(ftab[cp]) << FOLD_SHIFT)
            seg[q] = 1 if q == 0 else 0
            addid[q] = -1
        if i == n - 1:
            counts[C_NCP] = cpidx[0, i]
            cpbyte[cpidx[0, i]] = n
        i += cuda.gridsize(1)


@cuda.jit
def k_added(counts, added, cpidx, seg, addid):
    """Mark added-token spans ``(byte_start, byte_end, id)``: a segment starts at each end; ``addid`` is the
    id at the first code point and -2 inside. ``id == SPAN_BREAK`` only starts a segment."""
    n = counts[C_NBYTES]
    ncp = counts[C_NCP]
    k = cuda.grid(1)
    while k < counts[C_NADDED]:
        s = added[k, 0]
        e = added[k, 1]
        tid = added[k, 2]
        qs = cpidx[0, s] - 1
        seg[qs] = 1
        if tid != SPAN_BREAK:
            addid[qs] = tid
            qe = ncp
            if e < n:
                qe = cpidx[0, e] - 1
            for q in range(qs + 1, qe):
                addid[q] = -2
            if qe < ncp:
                seg[qe] = 1
        k += cuda.gridsize(1)


# ------------------------------------------------------------------------------------------- scans
@W_.device
def _ident(op):
    if op == OP_SUM:
        return 0
    if op == OP_MAX:
        return -1
    return BIG


@W_.device
def _comb(op, a, b):
    if op == OP_SUM:
        return a + b
    if op == OP_MAX:
        return a if a > b else b
    return a if a < b else b


@cuda.jit
def k_scan1(a, nch, counts, nidx, op, agg):
    """Phase 1: each thread folds its contiguous chunk of each channel (reversed for ``OP_MINREV``)."""
    t = cuda.grid(1)
    g = cuda.gridsize(1)
    n = counts[nidx]
    k = (n + g - 1) // g
    lo = t * k
    hi = W_.imin(lo + k, n)
    for ch in range(nch):
        acc = _ident(op)
        for i in range(lo, hi):
            acc = _comb(op, acc, a[ch, i])
        agg[ch, t] = acc


@cuda.jit
def k_scan2(nch, ntot, op, agg):
    """Phase 2 (one block): exclusive scan of the ``ntot`` chunk aggregates, in place (suffix for
    ``OP_MINREV``)."""
    sh = cuda.shared.array(SCAN2, int64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    per = (ntot + nt - 1) // nt
    for ch in range(nch):
        lo = tid * per
        hi = W_.imin(lo + per, ntot)
        acc = _ident(op)
        for r in range(lo, hi):
            i = r if op != OP_MINREV else ntot - 1 - r
            acc = _comb(op, acc, agg[ch, i])
        # exclusive scan of acc over threads (Hillis-Steele on inclusive, then shift)
        sh[tid] = acc
        cuda.syncthreads()
        off = 1
        while off < nt:
            x = sh[tid]
            if tid >= off:
                x = _comb(op, x, sh[tid - off])
            cuda.syncthreads()
            sh[tid] = x
            cuda.syncthreads()
            off *= 2
        carry = _ident(op)
        if tid > 0:
            carry = sh[tid - 1]
        cuda.syncthreads()
        for r in range(lo, hi):
            i = r if op != OP_MINREV else ntot - 1 - r
            v = agg[ch, i]
            agg[ch, i] = carry
            carry = _comb(op, carry, v)
        cuda.syncthreads()


@cuda.jit
def k_scan3(a, out, nch, counts, nidx, op, agg):
    """Phase 3: rescan each chunk from its carry; ``out`` gets the inclusive scan (may alias ``a``)."""
    t = cuda.grid(1)
    g = cuda.gridsize(1)
    n = counts[nidx]
    k = (n + g - 1) // g
    lo = t * k
    hi = W_.imin(lo + k, n)
    for ch in range(nch):
        acc = agg[ch, t]
        if op != OP_MINREV:
            for i in range(lo, hi):
                acc = _comb(op, acc, a[ch, i])
                out[ch, i] = acc
        else:
            for r in range(hi - lo):
                i = hi - 1 - r
                acc = _comb(op, acc, a[ch, i])
                out[ch, i] = acc


# ----------------------------------------------------------------------------------------- markers
@W_.device
def _grp(c):
    if c & N:
        return 1
    if c & CJK:
        return 2
    return 0


@cuda.jit
def k_markers(counts, cls, seg, fwd, rev, family):
    """Run-start / position markers of every scan channel (see the ``F_*`` / ``R_*`` names)."""
    ncp = counts[C_NCP]
    q = cuda.grid(1)
    while q < ncp:
        c = cls[q]
        first = q == 0 or seg[q] != 0
        pc = 0
        if not first:
            pc = cls[q - 1]
        w = (c & WS) != 0
        fwd[F_WS_START, q] = q if (w and (first or (pc & WS) == 0)) else -1
        fwd[F_R_POS, q] = q if (c & CRLF) else -1
        fwd[F_N_START, q] = q if ((c & N) and (first or (pc & N) == 0)) else -1
        lm = (c & (L | M)) != 0
        plm = (pc & (L | M)) != 0
        fwd[F_LM_START, q] = q if (lm and (first or not plm or _grp(c) != _grp(pc))) else -1
        fwd[F_AL_START, q] = q if ((c & AL) and (first or (pc & AL) == 0)) else -1
        last = q + 1 >= ncp or seg[q + 1] != 0 or (cls[q + 1] & WS) == 0
        rev[R_WS_END, q] = q + 1 if (w and last) else BIG
        rev[R_WN_POS, q] = q if (w and (c & CRLF) == 0) else BIG
        q += cuda.gridsize(1)


# ------------------------------------------------------------------------------- gpt2 predicate
@W_.device
def _kind(c):
    if c & WS:
        return 0
    if c & L:
        return 1
    if c & N:
        return 2
    return 3


@W_.device
def gpt2_basic(p, ncp, cls, seg, rev):
    if p == 0 or seg[p] != 0:
        return 1
    c = cls[p]
    pc = cls[p - 1]
    w = (c & WS) != 0
    pw = (pc & WS) != 0
    if w and pw:
        j = rev[R_WS_END, p]
        at_end = j >= ncp or seg[j] != 0
        return 1 if (p == j - 1 and not at_end) else 0
    if w:
        return 1
    if pw:
        return 0 if (pc & SPACE) else 1
    return 1 if _kind(c) != _kind(pc) else 0


@W_.device
def gpt2_contraction(a, ncp, cps, cls, seg, rev):
    """Length (2 or 3) of the contraction starting at ``a``, else 0 (case-sensitive)."""
    if a < 0 or cps[a] != 39:
        return 0
    if gpt2_basic(a, ncp, cls, seg, rev) == 0:
        return 0
    if a + 1 >= ncp or seg[a + 1] != 0:
        return 0
    c1 = cps[a + 1]
    if c1 == 115 or c1 == 116 or c1 == 109 or c1 == 100:  # s t m d
        return 2
    if a + 2 >= ncp or seg[a + 2] != 0:
        return 0
    c2 = cps[a + 2]
    if ((c1 == 114 or c1 == 118) and c2 == 101) or (c1 == 108 and c2 == 108):  # re ve ll
        return 3
    return 0


@W_.device
def gpt2_start(p, ncp, cps, cls, seg, rev):
    if p >= 1 and gpt2_contraction(p - 1, ncp, cps, cls, seg, rev) >= 2:
        return 0
    if p >= 2:
        ln = gpt2_contraction(p - 2, ncp, cps, cls, seg, rev)
        if ln == 3:
            return 0
        if ln == 2:
            return 1
    if p >= 3 and gpt2_contraction(p - 3, ncp, cps, cls, seg, rev) == 3:
        return 1
    return gpt2_basic(p, ncp, cls, seg, rev)


# ----------------------------------------------------------------------------- cl100k predicate
@W_.device
def _is_o(c):
    return (c & (WS | L | N)) == 0


@W_.device
def _brk(q, ncp, cls, seg, fwd, is_ds):
    """Segment start (cl100k) or piece start (DeepSeek split 3)."""
    if is_ds:
        return ds_pstart(q, ncp, cls, seg, fwd)
    return seg[q] != 0


@W_.device
def _ws_ws(p, ncp, cls, seg, fwd, rev, is_ds):
    """The whitespace-run rule shared by cl100k and DeepSeek split 3 (``p-1`` and ``p`` both in the run
    ``[i, j)``): starts at ``e`` (after the R chars eaten by a preceding O / P-or-S match), after the
    last R ``k``, and at ``j-1`` unless ``j`` ends the segment/piece."""
    c = cls[p]
    i = fwd[F_WS_START, p]
    j = rev[R_WS_END, p]
    at_end = j >= ncp or _brk(j, ncp, cls, seg, fwd, is_ds)
    e = i
    if i > 0 and not _brk(i, ncp, cls, seg, fwd, is_ds) and _eats(cls[i - 1], is_ds):
        e = rev[R_WN_POS, i]
        if j < e:
            e = j
    k = fwd[F_R_POS, j - 1]
    if p == e:
        return 1
    if k >= e and p == k + 1:
        return 1
    if p == j - 1 and not at_end and (c & CRLF) == 0:
        return 1
    return 0


@W_.device
def _eats(pc, is_ds):
    if is_ds:  # DeepSeek split 3: P or S
        return (pc & (P | S)) != 0
    return (pc & (WS | L | N)) == 0  # cl100k: O = not (W or L or N)


@W_.device
def cl_basic_nonl(p, ncp, cls, seg, fwd, rev, digits):
    """All cl100k rules except "L after O" and contractions."""
    if p == 0 or seg[p] != 0:
        return 1
    c = cls[p]
    pc = cls[p - 1]
    w = (c & WS) != 0
    pw = (pc & WS) != 0
    if w and pw:
        return _ws_ws(p, ncp, cls, seg, fwd, rev, False)
    if w:
        return 0 if (_is_o(pc) and (c & CRLF)) else 1
    if pw:
        glue = ((pc & CRLF) == 0 and (c & L) != 0) or ((pc & SPACE) != 0 and _is_o(c))
        return 0 if glue else 1
    if (c & L) and (pc & N):
        return 1
    if (c & N) and ((pc & L) or _is_o(pc)):
        return 1
    if _is_o(c) and (pc & (L | N)):
        return 1
    if (c & N) and (pc & N):
        if digits == 1:
            return 1
        return 1 if (p - fwd[F_N_START, p]) % digits == 0 else 0
    return 0


@W_.device
def cl_basic(p, ncp, cls, seg, fwd, rev, digits):
    if p > 0 and seg[p] == 0 and (cls[p] & L) and _is_o(cls[p - 1]):
        return 1 - cl_basic_nonl(p - 1, ncp, cls, seg, fwd, rev, digits)
    return cl_basic_nonl(p, ncp, cls, seg, fwd, rev, digits)


@W_.device
def cl_contraction(a, ncp, cps, cls, seg, fwd, rev, digits):
    """Length of the case-insensitive contraction starting at ``a`` (Oniguruma folding), else 0."""
    if a < 0 or cps[a] != 39:
        return 0
    if cl_basic_nonl(a, ncp, cls, seg, fwd, rev, digits) == 0:
        return 0
    if a + 1 >= ncp or seg[a + 1] != 0:
        return 0
    f1 = cls[a + 1] >> FOLD_SHIFT
    if f1 & (FS | FT | FM | FD):
        return 2
    if a + 2 >= ncp or seg[a + 2] != 0:
        return 0
    f2 = cls[a + 2] >> FOLD_SHIFT
    if ((f1 & (FR | FV)) and (f2 & FE)) or ((f1 & FL) and (f2 & FL)):
        return 3
    return 0


@W_.device
def cl_start(p, ncp, cps, cls, seg, fwd, rev, digits):
    if p >= 1 and cl_contraction(p - 1, ncp, cps, cls, seg, fwd, rev, digits) >= 2:
        return 0
    if p >= 2:
        ln = cl_contraction(p - 2, ncp, cps, cls, seg, fwd, rev, digits)
        if ln == 3:
            return 0
        if ln == 2:
            return 1
    if p >= 3 and cl_contraction(p - 3, ncp, cps, cls, seg, fwd, rev, digits) == 3:
        return 1
    return cl_basic(p, ncp, cls, seg, fwd, rev, digits)


# ------------------------------------------------------------------------ deepseek_v3 predicate
@W_.device
def ds_pstart(q, ncp, cls, seg, fwd):
    """Piece start after splits 1 and 2 (``predicates.pieces_deepseek_v3``)."""
    if q == 0 or seg[q] != 0:
        return True
    c = cls[q]
    if _grp(c) != _grp(cls[q - 1]):
        return True
    return (c & N) != 0 and (q - fwd[F_N_START, q]) % 3 == 0


@W_.device
def _lm(c):
    return (c & (L | M)) != 0


@W_.device
def _ps(c):
    return (c & (P | S)) != 0


@W_.device
def _x(c):
    return (c & (L | M | P | S | WS)) == 0


@W_.device
def ds_basic_nonlm(p, ncp, cls, seg, fwd, rev):
    """All split-3 rules except "LM after PS" and the alt-1 letter-run end."""
    if ds_pstart(p, ncp, cls, seg, fwd):
        return 1
    c = cls[p]
    pc = cls[p - 1]
    w = (c & WS) != 0
    pw = (pc & WS) != 0
    if w and pw:
        return _ws_ws(p, ncp, cls, seg, fwd, rev, True)
    if w:
        return 0 if (_ps(pc) and (c & CRLF)) else 1
    if pw:
        glue = ((pc & CRLF) == 0 and _lm(c)) or ((pc & SPACE) != 0 and _ps(c))
        return 0 if glue else 1
    if (_ps(c) or _x(c)) and _lm(pc):
        return 1
    if _ps(c) and _x(pc):
        return 1
    if _x(c) and _ps(pc):
        return 1
    if _x(c) and _x(pc):
        if p + 1 < ncp and not ds_pstart(p + 1, ncp, cls, seg, fwd) and _lm(cls[p + 1]):
            return 1
        return 0
    return 0


@W_.device
def ds_glue1(s, ncp, cls, seg, fwd, rev):
    """Alt 1 glues the ASCII punctuation at ``s-1`` to the ASCII letter at ``s``."""
    if s <= 0 or ds_pstart(s, ncp, cls, seg, fwd):
        return False
    return (cls[s - 1] & AP) != 0 and (cls[s] & AL) != 0 and ds_basic_nonlm(s - 1, ncp, cls, seg, fwd, rev) == 1


@W_.device
def ds_start(p, ncp, cls, seg, fwd, rev):
    if ds_pstart(p, ncp, cls, seg, fwd):
        return 1
    c = cls[p]
    pc = cls[p - 1]
    if _lm(c) and _ps(pc):
        return 0 if ds_glue1(p, ncp, cls, seg, fwd, rev) else 1
    if _lm(c) and _lm(pc) and (pc & AL) and (c & AL) == 0:
        s = fwd[F_LM_START, p - 1]
        if fwd[F_AL_START, p - 1] == s and ds_glue1(s, ncp, cls, seg, fwd, rev):
            return 1
    return ds_basic_nonlm(p, ncp, cls, seg, fwd, rev)


# ------------------------------------------------------------------------------------- starts
@cuda.jit
def k_starts(counts, cps, cls, seg, addid, fwd, rev, family, start):
    """``start[p]`` (0/1): a pre-token starts at code point ``p``. ``family``: ``tables.FAMILY_CODE``."""
    ncp = counts[C_NCP]
    p = cuda.grid(1)
    while p < ncp:
        a = addid[p]
        if a == -2:
            s = 0
        elif a >= 0:
            s = 1
        elif family == 0:
            s = gpt2_start(p, ncp, cps, cls, seg, rev)
        elif family == 1:
            s = cl_start(p, ncp, cps, cls, seg, fwd, rev, 3)
        elif family == 2:
            s = cl_start(p, ncp, cps, cls, seg, fwd, rev, 1)
        else:
            s = ds_start(p, ncp, cls, seg, fwd, rev)
        start[0, p] = s
        p += cuda.gridsize(1)


@cuda.jit
def k_pretokens(counts, ptidx, cpbyte, addid, pt_b0, pt_aid):
    """Pre-token byte starts from the inclusive scan of ``start`` (``pt_b0[npt]`` = byte count)."""
    ncp = counts[C_NCP]
    p = cuda.grid(1)
    while p < ncp:
        t = ptidx[0, p]
        if p == 0 or ptidx[0, p - 1] != t:
            pt_b0[t - 1] = cpbyte[p]
            pt_aid[t - 1] = addid[p]
        if p == ncp - 1:
            counts[C_NPT] = t
            pt_b0[t] = counts[C_NBYTES]
        p += cuda.gridsize(1)


# ---------------------------------------------------------------------------- ignore_merges hash
@W_.device
def vocab_find(bts, b0, m, vh_key, vh_id, blob, boff):
    """Index into the vocab byte table of the token equal to ``bts[b0:b0+m]``, else -1."""
    h = np.int64(0)
    for i in range(m):
        h = ((h * 1000003) ^ np.int64(bts[b0 + i])) & 0xFFFFFFFFFF
    mask = vh_key.shape[0] - 1
    s = (h ^ (h >> 17)) & mask
    while vh_key[s] != -1:
        if vh_key[s] == h:
            it = vh_id[s]
            o = boff[it]
            if boff[it + 1] - o == m:
                same = True
                for i in range(m):
                    if blob[o + i] != bts[b0 + i]:
                        same = False
                        break
                if same:
                    return it
        s = (s + 1) & mask
    return -1


@cuda.jit
def k_classify(counts, bts, sym, pt_b0, pt_aid, ntok, shortlist, longlist, ignore, maxtok,
               vh_key, vh_id, blob, boff, item_ids, warp_max):
    """Per pre-token: added token or single byte -> done; ``ignore_merges`` vocab hit -> done; else onto
    the warp (``<= warp_max`` bytes) or block work list."""
    npt = counts[C_NPT]
    t = cuda.grid(1)
    while t < npt:
        b0 = pt_b0[t]
        m = pt_b0[t + 1] - b0
        a = pt_aid[t]
        if a >= 0:
            sym[b0] = a
            ntok[0, t] = 1
        elif m == 1:
            ntok[0, t] = 1
        else:
            hit = -1
            if ignore != 0 and m <= maxtok:
                hit = vocab_find(bts, b0, m, vh_key, vh_id, blob, boff)
            if hit >= 0:
                sym[b0] = item_ids[hit]
                ntok[0, t] = 1
            elif m <= warp_max:
                k = cuda.atomic.add(counts, C_NSHORT, 1)
                shortlist[k] = t
            else:
                k = cuda.atomic.add(counts, C_NLONG, 1)
                longlist[k] = t
        t += cuda.gridsize(1)


@cuda.jit
def k_gather(counts, sym, pt_b0, ntok, tokoff, out):
    """One warp per pre-token copies its symbols to ``out`` at the exclusive token offset."""
    npt = counts[C_NPT]
    lane = cuda.threadIdx.x % 32
    w = cuda.grid(1) // 32
    nw = cuda.gridsize(1) // 32
    t = w
    while t < npt:
        c = ntok[0, t]
        o = tokoff[0, t] - c
        b0 = pt_b0[t]
        k = lane
        while k < c:
            out[o + k] = sym[b0 + k]
            k += 32
        if t == npt - 1 and lane == 0:
            counts[C_NTOK] = tokoff[0, t]
        t += nw


@cuda.jit
def k_batch_offsets(counts, bstarts, nb, cpidx, ptidx, ntok, tokoff, res):
    """Token offset where each batch item (its first byte ``bstarts[k]``) begins."""
    k = cuda.grid(1)
    while k < nb:
        b = bstarts[k]
        if b >= counts[C_NBYTES]:
            res[k] = counts[C_NTOK]
        else:
            t = ptidx[0, cpidx[0, b] - 1] - 1
            res[k] = tokoff[0, t] - ntok[0, t]
        k += cuda.gridsize(1)
