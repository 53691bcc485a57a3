"""The numba.cuda kernels on numba's CUDA simulator, compared with HF and with the NumPy predicates.

The simulator must be chosen before numba is imported, so each check runs ``_sim_check.py`` in a
subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (never skipped: numba is in the ``test`` extra). One
subprocess per file, two side by side; inputs are tiny because every simulated CUDA thread is a Python
thread (about 5-15 s per tokenizer file).

Covered per file: ids of a batch (one device pass, each text its own segment) and of a single text,
the kernel predicate's output on the same pass against ``predicates.starts`` (added-token segments
included), the CPU route for texts the GPU does not accept (Qwen: non-NFC). ``synthetic`` is a byte-level
BPE with shuffled merge ranks: its merges create pairs of lower rank than their parts (the round
algorithm's inversion stop) and its long runs take the block (overflow) kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

try:  # never skipped: numba is part of the test extra
    import numba  # noqa: F401
except ImportError as e:  # pragma: no cover
    pytest.fail(f"numba is missing ({e}): pip install -e '.[test]'", pytrace=False)

NAMES = ["gpt2", "llama3_1", "qwen3", "deepseek_v3", "synthetic"]
SCRIPT = Path(__file__).with_name("_sim_check.py")
HANG_S = 240  # seconds before a check is taken as hung (normally 5-15 s per file on 2 cores)


def _run(name: str) -> subprocess.Popen:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", TOKTIER_SIM_HANG_S=str(HANG_S))
    return subprocess.Popen([sys.executable, str(SCRIPT), name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _hung(stderr: str) -> bool:
    return "Timeout (" in stderr  # faulthandler.dump_traceback_later's header: the check hung, not failed


@pytest.fixture(scope="module")
def sim_results() -> dict[str, dict]:
    """One subprocess per file, two at a time (two cores). A check that fails returns its stderr in the
    assertion. A check that *hangs* (the simulator's polling block manager, one Python thread per CUDA
    thread; one CI run hung past 600 s on a file that takes ~6 s here) dumps every thread's stack and
    exits (``_sim_check.HANG_S``); it is rerun once in a fresh process and the dump is reported as a
    warning, so a hang is visible without deciding the run. Mismatches are never retried."""
    out: dict[str, dict] = {}
    pending = list(NAMES)
    running: list[tuple[str, subprocess.Popen, int]] = []
    while pending or running:
        while pending and len(running) < 2:
            name = pending.pop(0)
            running.append((name, _run(name), 0))
        name, proc, tries = running.pop(0)
        stdout, stderr = proc.communicate(timeout=HANG_S + 60)
        if proc.returncode != 0 and _hung(stderr) and tries == 0:
            warnings.warn(f"simulator check {name} hung and was rerun; its stacks:\n{stderr[-6000:]}")
            running.append((name, _run(name), 1))
            continue
        assert proc.returncode == 0, f"simulator check {name} failed (rc {proc.returncode}):\n{stderr[-6000:]}"
        for r in json.loads(stdout.strip().splitlines()[-1]):
            out[r["name"]] = r
    return out


@pytest.mark.parametrize("name", NAMES)
def test_kernels_equal_hf_on_simulator(name, sim_results):
    r = sim_results[name]
    assert r["texts"] >= 6
    assert r["ids_mismatch"] == []
    assert r["single_ok"]
    assert r["rejected_mismatch"] == []


@pytest.mark.parametrize("name", NAMES)
def test_kernel_predicate_equals_numpy(name, sim_results):
    assert sim_results[name]["starts_mismatch_positions"] == []


def test_paths_exercised(sim_results):
    assert all(r["nshort"] > 5 for r in sim_results.values())  # warp kernel
    assert sim_results["synthetic"]["nlong"] >= 3 and sim_results["qwen3"]["nlong"] >= 1  # block kernel
    assert sim_results["qwen3"]["rejected"] >= 1  # "e\u0301" is not NFC: CPU route, counted
    assert sim_results["qwen3"]["stats"]["cpu_not_accepted"] >= 1


def test_no_cross_module_device_function_sees_numba_cuda():
    """The simulator swaps ``numba.cuda`` for its fake module in a device function's globals on every
    call, racily across its Python threads (NVIDIA/numba-cuda#690; it failed one CI run with
    ``module 'numba.cuda' has no attribute 'syncthreads'``). A device function that looks up ``cuda``
    is only safe when that name is not the ``numba.cuda`` module (``_warp._SimCuda``), or when the
    module also holds the kernel that calls it (then the kernel's launch swapped it once, up front).
    Checked over every device function of toktier_backend.gpu, and one simulated launch through them."""
    code = (
        "import numba, numpy as np\n"
        "from numba import cuda, int64\n"
        "from numba.cuda.simulator.kernel import FakeCUDAKernel\n"
        "from toktier_backend.gpu import _warp, kernels, merges\n"
        "mods = [_warp, kernels, merges]\n"
        "racy, n = [], 0\n"
        "for m in mods:\n"
        "    kernel_mod = any(isinstance(v, FakeCUDAKernel) and not v._device for v in vars(m).values())\n"
        "    for k, v in vars(m).items():\n"
        "        if isinstance(v, FakeCUDAKernel) and v._device and v.fn.__module__ == m.__name__:\n"
        "            n += 1\n"
        "            if not kernel_mod and any(v.fn.__globals__.get(c) is numba.cuda for c in v.fn.__code__.co_names):\n"
        "                racy.append(m.__name__ + '.' + k)\n"
        "assert n >= 6, n\n"
        "assert not racy, racy\n"
        "@cuda.jit\n"
        "def k(out):\n"
        "    lane = cuda.threadIdx.x\n"
        "    scr = cuda.shared.array(32, int64)\n"
        "    sh = cuda.shared.array(32, int64)\n"
        "    _warp.wsync()\n"
        "    out[lane, 0] = _warp.shfl_down(scr, lane, lane * 10, 1)\n"
        "    out[lane, 1] = _warp.block_min(sh, lane, 32, 100 - lane)\n"
        "out = np.zeros((32, 2), np.int64)\n"
        "k[1, 32](out)\n"
        "assert out[:, 0].tolist() == [10 * min(i + 1, 31) if i < 31 else 310 for i in range(32)], out[:, 0]\n"
        "assert out[:, 1].tolist() == [69] * 32, out[:, 1]\n"
        "print('OK', n)\n"
    )
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.startswith("OK"), r.stdout
