"""Every kernel compiles to PTX with the device intrinsics (no GPU needed, but libnvvm is).

libnvvm comes with the ``test`` extra (``nvidia-cuda-nvcc-cu12``, Linux x86_64) or ``CUDA_HOME``; the test is
skipped only where neither exists (another platform).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba", reason="numba is part of the test extra")


def _cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and list(Path(home).glob("nvvm/lib64/libnvvm.so*")):
        return home
    try:
        import nvidia.cuda_nvcc as nv  # the nvidia-cuda-nvcc-cu12 wheel

        root = Path(next(iter(nv.__path__)))
        if list(root.glob("nvvm/lib64/libnvvm.so*")):
            return str(root)
    except Exception:
        pass
    return None


@pytest.mark.skipif(_cuda_home() is None, reason="no libnvvm (set CUDA_HOME or pip install nvidia-cuda-nvcc-cu12)")
def test_all_kernels_compile_to_ptx():
    env = dict(os.environ, CUDA_HOME=_cuda_home())
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("_ptx_check.py"))], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.stdout.strip().endswith("failures 0"), r.stdout[-3000:] + r.stderr[-3000:]
