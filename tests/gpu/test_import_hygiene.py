"""Importing toktier_backend (and the NumPy half of toktier_backend.gpu) must not import numba or cupy."""

from __future__ import annotations

import subprocess
import sys


def test_no_numba_or_cupy_on_import():
    code = (
        "import sys, toktier_backend, toktier_backend.gpu, toktier_backend.gpu.predicates, "
        "toktier_backend.gpu.tables, toktier_backend.gpu.routing, toktier_backend.engines.registry\n"
        "bad = [m for m in ('numba', 'cupy', 'llvmlite') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_registry_reports_missing_device_at_load(tmp_path):
    """Without a CUDA device (and not on the simulator) the engine fails at load, with the reason."""
    code = (
        "import os; os.environ.pop('NUMBA_ENABLE_CUDASIM', None)\n"
        "from toktier_backend.engines import registry\n"
        "from toktier_backend.errors import EngineUnavailable\n"
        "assert 'gpu' in registry.names()\n"
        "try:\n"
        "    e = registry.create('gpu', 'toktier_backend/data/gpt2/tokenizer.json')\n"
        "    print('LOADED', e.encode('hello world').tolist())\n"
        "except EngineUnavailable as err:\n"
        "    print('UNAVAILABLE', err)\n"
    )
    from ..conftest import REPO

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out == "LOADED [31373, 995]" or (out.startswith("UNAVAILABLE") and "gpu" in out), out
