"""The numba.cuda kernels on numba's CUDA simulator, compared with HF and with the NumPy predicates.

The simulator must be chosen before numba is imported, so each check runs ``_sim_check.py`` in a
subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (never skipped: numba is in the ``test`` extra). The
subprocesses start together and run side by side; inputs are tiny because every simulated CUDA thread
is a Python thread (about 10 s per tokenizer file).

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
from pathlib import Path

import pytest

try:  # never skipped: numba is part of the test extra
    import numba  # noqa: F401
except ImportError as e:  # pragma: no cover
    pytest.fail(f"numba is missing ({e}): pip install -e '.[test]'", pytrace=False)

NAMES = ["gpt2", "llama3_1", "qwen3", "deepseek_v3", "synthetic"]
SCRIPT = Path(__file__).with_name("_sim_check.py")


@pytest.fixture(scope="module")
def sim_results() -> dict[str, dict]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    groups = [["gpt2", "synthetic", "qwen3"], ["llama3_1", "deepseek_v3"]]  # two processes for two cores
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *g], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for g in groups]
    out: dict[str, dict] = {}
    for p, g in zip(procs, groups):
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, f"simulator check {g} failed:\n{stderr[-4000:]}"
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
