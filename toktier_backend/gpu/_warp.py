"""Warp and block primitives, each behind a small device function with a shared-memory twin.

numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) has no ``shfl_*_sync``, ``ballot_sync`` or
``syncwarp``. The twin of each warp primitive goes through a per-warp shared scratch row ``scr``
(``int64[32]``) and ``syncthreads``; it is only correct when a block is exactly one warp, which is how
:mod:`kernels` launches warp kernels under the simulator (:data:`WARPS_PER_BLOCK` = 1). The choice is
made once, at import, from the environment variable. Every primitive takes ``scr`` and ``lane`` so both
variants have one signature; on a device they ignore ``scr``.

Masks are returned as ``int64`` holding 32 bits, so bit tricks read the same in both variants.
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda, int64

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

if SIM:
    from numba.cuda.simulator.kernel import _get_kernel_context

    class _SimCuda:
        """This module's ``cuda`` under the simulator: each attribute comes from the running simulated
        kernel's fake CUDA module (``syncthreads`` and the rest), else from ``numba.cuda`` (``jit``).

        Why: the simulator runs each CUDA thread as a Python thread and, on every device-function call,
        swaps the ``numba.cuda`` module in the function's module globals for the fake one and back
        (``swapped_cuda_module``). For device functions in a module other than the kernel's (all of
        this one) that swap races: thread A restores ``numba.cuda`` while thread B is still inside a
        device function, and B's next ``cuda.syncthreads()`` raises ``AttributeError: module
        'numba.cuda' has no attribute 'syncthreads'`` (it failed one CI run; NVIDIA/numba-cuda#690 fixes
        the swap upstream). With this object bound to ``cuda`` no global here *is* ``numba.cuda``, so
        the simulator never swaps this module's globals and every thread always sees the fake module.
        """

        def __getattr__(self, name: str):
            ctx = _get_kernel_context()
            if ctx is not None:
                try:
                    return getattr(ctx, name)
                except AttributeError:
                    pass
            return getattr(_numba_cuda, name)

    _numba_cuda = cuda
    cuda = _SimCuda()  # noqa: F811 (see _SimCuda)


def _plain(fn):
    return fn


#: Decorator for device functions that use no ``cuda.*`` intrinsic. On a device it is
#: ``cuda.jit(device=True)``; under the simulator the function stays plain Python (the simulator would
#: run the same Python anyway, but wraps every device-function call in a swap of the module's globals,
#: which dominated simulated run time).
device = _plain if SIM else cuda.jit(device=True)
FULL = 0xFFFFFFFF
#: Warps per block in warp kernels, threads per block elsewhere (small under the simulator: every
#: simulated thread is a Python thread).
WARPS_PER_BLOCK = 1 if SIM else 4
BLOCK = 32 if SIM else 256
#: Threads of the single block that scans per-thread aggregates (phase 2 of a scan); one under the
#: simulator, where the 64 aggregates are cheaper to fold sequentially than to synchronize over.
SCAN2_BLOCK = 1 if SIM else 1024

if SIM:

    @cuda.jit(device=True)
    def wsync():
        cuda.syncthreads()

    @cuda.jit(device=True)
    def shfl_down(scr, lane, v, d):
        scr[lane] = v
        cuda.syncthreads()
        r = v
        if lane + d < 32:
            r = scr[lane + d]
        cuda.syncthreads()
        return r

    @cuda.jit(device=True)
    def shfl_up(scr, lane, v, d):
        scr[lane] = v
        cuda.syncthreads()
        r = v
        if lane >= d:
            r = scr[lane - d]
        cuda.syncthreads()
        return r

    @cuda.jit(device=True)
    def neighbors(scr, lane, v):
        """``(v of lane-1, v of lane+1, v of lane+2)``; ``v`` itself where that lane does not exist."""
        scr[lane] = v
        cuda.syncthreads()
        a = v
        b = v
        c = v
        if lane >= 1:
            a = scr[lane - 1]
        if lane + 1 < 32:
            b = scr[lane + 1]
        if lane + 2 < 32:
            c = scr[lane + 2]
        cuda.syncthreads()
        return a, b, c

    @cuda.jit(device=True)
    def ballot(scr, lane, pred):
        scr[lane] = 1 if pred else 0
        cuda.syncthreads()
        m = np.int64(0)
        for i in range(32):
            if scr[i] != 0:
                m |= np.int64(1) << i
        cuda.syncthreads()
        return m

    @cuda.jit(device=True)
    def warp_min(scr, lane, v):
        scr[lane] = v
        cuda.syncthreads()
        r = scr[0]
        for i in range(1, 32):
            if scr[i] < r:
                r = scr[i]
        cuda.syncthreads()
        return r

else:

    @cuda.jit(device=True)
    def wsync():
        cuda.syncwarp(FULL)

    @cuda.jit(device=True)
    def shfl_down(scr, lane, v, d):
        return cuda.shfl_down_sync(FULL, v, d)

    @cuda.jit(device=True)
    def shfl_up(scr, lane, v, d):
        return cuda.shfl_up_sync(FULL, v, d)

    @cuda.jit(device=True)
    def neighbors(scr, lane, v):
        """``(v of lane-1, v of lane+1, v of lane+2)``; ``v`` itself where that lane does not exist."""
        a = cuda.shfl_up_sync(FULL, v, 1)
        b = cuda.shfl_down_sync(FULL, v, 1)
        c = cuda.shfl_down_sync(FULL, v, 2)
        return a, b, c

    @cuda.jit(device=True)
    def ballot(scr, lane, pred):
        return np.int64(cuda.ballot_sync(FULL, pred))

    @cuda.jit(device=True)
    def warp_min(scr, lane, v):
        for off in (16, 8, 4, 2, 1):
            o = cuda.shfl_xor_sync(FULL, v, off)
            if o < v:
                v = o
        return v


@device
def imin(a, b):
    """``min`` for two integers (numba's CUDA target rejects the builtin on mixed int32/int64)."""
    return a if a < b else b


@device
def popc64(x):
    """Set bits of a non-negative int64 < 2**32."""
    c = 0
    while x != 0:
        x &= x - 1
        c += 1
    return c


@device
def low_bit(x):
    """Index of the lowest set bit of ``x`` (> 0)."""
    return popc64((x & -x) - 1)


@device
def high_bit(x):
    """Index of the highest set bit of ``x`` (0 < x < 2**32)."""
    r = 0
    if x >= 65536:
        x >>= 16
        r += 16
    if x >= 256:
        x >>= 8
        r += 8
    if x >= 16:
        x >>= 4
        r += 4
    if x >= 4:
        x >>= 2
        r += 2
    if x >= 2:
        r += 1
    return r


# ------------------------------------------------------------------------------------ block level
@cuda.jit(device=True)
def block_min(sh, tid, nthreads, v):
    """Minimum of ``v`` over the block (``sh``: ``int64[nthreads]`` shared). Ends synchronized."""
    sh[tid] = v
    cuda.syncthreads()
    off = 1
    while off < nthreads:
        x = sh[tid]
        if tid + off < nthreads and sh[tid + off] < x:
            x = sh[tid + off]
        cuda.syncthreads()
        sh[tid] = x
        cuda.syncthreads()
        off *= 2
    r = sh[0]
    cuda.syncthreads()
    return r


@cuda.jit(device=True)
def block_excl_max(sh, tid, nthreads, v):
    """Exclusive prefix max of ``v`` over thread order (``-1`` for thread 0). Ends synchronized."""
    sh[tid] = v
    cuda.syncthreads()
    off = 1
    while off < nthreads:
        x = sh[tid]
        if tid >= off and sh[tid - off] > x:
            x = sh[tid - off]
        cuda.syncthreads()
        sh[tid] = x
        cuda.syncthreads()
        off *= 2
    r = np.int64(-1)
    if tid > 0:
        r = sh[tid - 1]
    cuda.syncthreads()
    return r


@cuda.jit(device=True)
def block_excl_sum(sh, tid, nthreads, v):
    """``(exclusive prefix sum of v, block total)``. Ends synchronized."""
    sh[tid] = v
    cuda.syncthreads()
    off = 1
    while off < nthreads:
        x = sh[tid]
        if tid >= off:
            x += sh[tid - off]
        cuda.syncthreads()
        sh[tid] = x
        cuda.syncthreads()
        off *= 2
    incl = sh[tid]
    total = sh[nthreads - 1]
    cuda.syncthreads()
    return incl - v, total


@device
def alternate(om):
    """Every other bit inside each run of set bits of ``om``, starting with the run's first bit (the
    leftmost non-overlapping occurrences of a pair ``(A, A)``): ``sel[b] = occ[b] and not sel[b-1]``."""
    sm = np.int64(0)
    x = om
    while x != 0:  # one pass per two chars of the longest run (one pass when A != B)
        st = x & ~(x << 1)
        sm |= st
        x &= ~(st | (st << 1))
    return sm


__all__ = ["SIM", "device", "imin", "WARPS_PER_BLOCK", "BLOCK", "SCAN2_BLOCK", "wsync", "shfl_down", "shfl_up", "neighbors",
           "alternate", "ballot",
           "warp_min", "popc64", "low_bit", "high_bit", "block_min", "block_excl_max", "block_excl_sum",
           "int64"]
