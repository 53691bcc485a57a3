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


def test_registry_reports_missing_device_at_load():
    """Without a CUDA device (and not on the simulator) the GPU engine fails at load, naming the reason.

    What the machine has is read from numba itself (not from our engine), in the same subprocess: no numba
    -> the registry names the failed import; numba but no device -> the no-device message; a device -> the
    engine loads and its ids are HF's GPT-2 ids of "hello world" ([31373, 995])."""
    code = (
        "import os; os.environ.pop('NUMBA_ENABLE_CUDASIM', None)\n"
        "try:\n"
        "    from numba import cuda; have = 'device' if cuda.is_available() else 'no-device'\n"
        "except ImportError:\n"
        "    have = 'no-numba'\n"
        "from toktier_backend.engines import registry\n"
        "from toktier_backend.errors import EngineUnavailable\n"
        "assert 'gpu' in registry.names()\n"
        "try:\n"
        "    e = registry.create('gpu', 'toktier_backend/data/gpt2/tokenizer.json')\n"
        "    print(have, 'LOADED', e.encode('hello world').tolist())\n"
        "except EngineUnavailable as err:\n"
        "    print(have, 'UNAVAILABLE', err)\n"
    )
    from ..conftest import REPO

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    have, _, out = r.stdout.strip().partition(" ")
    expected = {
        "device": "LOADED [31373, 995]",
        "no-device": "UNAVAILABLE engine 'gpu': no CUDA device is available (numba.cuda.is_available() is False)",
    }
    if have == "no-numba":
        assert out.startswith("UNAVAILABLE engine 'gpu' cannot be imported:") and "numba" in out, out
    else:
        assert out == expected[have], (have, out)
