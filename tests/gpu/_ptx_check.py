"""Compile every kernel to PTX for sm_90 *without a GPU*, with the device (non-simulator) intrinsics.

The simulator runs the kernels as Python, so it never types them; this script runs numba's CUDA
front end and NVVM on each kernel with the argument types ``engine.py`` launches it with, which catches
typing errors (e.g. the builtin ``min`` on mixed int32/int64, non-constant shared-array shapes) before a
device does. Needs libnvvm: ``CUDA_HOME`` pointing at a CUDA toolkit, or the ``nvidia-cuda-nvcc-cu12``
wheel (found automatically). numba asks the *current device* for its compute capability when it
compiles a device function; with no driver that lookup is replaced by a fixed (9, 0).

Usage: ``python tests/gpu/_ptx_check.py`` -> one line ``failures N``; 0 expected.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numba.cuda.dispatcher as _D  # noqa: E402
from numba import types as T  # noqa: E402
from numba.cuda import compile_ptx  # noqa: E402


class _Dev:
    compute_capability = (9, 0)


_D.get_current_device = lambda: _Dev()

from toktier_backend.gpu import kernels as K  # noqa: E402
from toktier_backend.gpu import merges as Mg  # noqa: E402

i32, u8, u16, i64 = T.int32[::1], T.uint8[::1], T.uint16[::1], T.int64[::1]
i32_2, I = T.int32[:, ::1], T.int64
SIGS = {  # the argument types of the launches in engine.GpuEngine._launch / _run
    (K, "k_reset"): (i32,),
    (K, "k_decode"): (u8, i32, i32_2, i32, i32),
    (K, "k_scatter"): (u8, i32, i32_2, i32, i32, i32, i32, i32, u16, u8),
    (K, "k_added"): (i32, i32_2, i32_2, i32, i32),
    (K, "k_scan1"): (i32_2, I, i32, I, I, i32_2),
    (K, "k_scan2"): (I, I, I, i32_2),
    (K, "k_scan3"): (i32_2, i32_2, I, i32, I, I, i32_2),
    (K, "k_markers"): (i32, i32, i32, i32_2, i32_2, I),
    (K, "k_starts"): (i32, i32, i32, i32, i32, i32_2, i32_2, I, i32_2),
    (K, "k_pretokens"): (i32, i32_2, i32, i32, i32, i32),
    (K, "k_classify"): (i32, u8, i32, i32, i32, i32_2, i32, i32, I, I, i64, i32, u8, i32, i32, I),
    (K, "k_gather"): (i32, i32, i32, i32_2, i32_2, i32),
    (K, "k_batch_offsets"): (i32, i32, I, i32_2, i32_2, i32_2, i32_2, i32),
    (Mg, "k_bpe_warp"): (i32, i32, i32, i32, i32_2, i32, i32, i32, i32),
    (Mg, "k_bpe_block"): (i32, i32, i32, i32, i32, i32, i32, i32, i32_2, i32, i32, i32, i32),
}

if __name__ == "__main__":
    bad = 0
    for (mod, name), sig in SIGS.items():
        t = time.time()
        try:
            ptx, _ = compile_ptx(getattr(mod, name).py_func, sig, cc=(9, 0))
            print(f"OK   {name:18s} {time.time() - t:5.1f}s  {len(ptx)} bytes of PTX", flush=True)
        except Exception as e:
            bad += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:3000]}", flush=True)
    print("failures", bad)
