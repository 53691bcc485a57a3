"""A dynamic batch through ``GpuRouter.encode_many`` and the real ``GpuEngine`` on numba's CUDA simulator.

Per family (gpt2, llama3_1, qwen3, deepseek_v3; two subprocesses side by side, ``_batch_check.py``):

* batches of 1, 5 and 16 requests of mixed sizes (some under the crossover: CPU) and scripts, added tokens
  of each family, one lone surrogate in the 16: each GPU-sized request's ids equal HF
  ``encode(text, add_special_tokens=False).ids`` computed here, the whole GPU share is one device pass
  (``encode_batch`` call), the bad request gets ``InvalidRequest`` and the others their exact ids;
* backpressure mid-batch: ``max_queue=2`` (3 slots) in a batch of 6 GPU-sized requests: 3 share the pass,
  3 go to the CPU (``cpu_queue_full``), all exact.

Texts are tiny (a simulated pass is ~1-3 s whatever the batch: one Python thread per CUDA thread).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
import warnings
from pathlib import Path

import pytest

from ..conftest import reference

SCRIPT = Path(__file__).with_name("_batch_check.py")
REPO = Path(__file__).resolve().parents[2]
GROUPS = [["gpt2", "qwen3"], ["llama3_1", "deepseek_v3"]]
CROSSOVER = 6
SMALL = ["hi", "ok.", "", "é"]
BIG = ["It's 12345 x", "def f():\n\treturn 2", "中文字符测试，日本語", "  \n\n  z'll",
       "<|endoftext|>a<|im_end|>", "<|begin_of_text|>b<｜User｜>", "👍🏽 «»$ .aé", "cafe\u0301 naïve",
       "a.b ..c\t.d", "x" * 9]
SURROGATE = "bad \ud800 x"
BATCHES = [
    [32, [BIG[0]]],
    [32, [SMALL[0], BIG[1], BIG[2], SMALL[1], BIG[3]]],
    [32, [BIG[4], SMALL[2], BIG[5], BIG[6], SURROGATE, BIG[7], SMALL[3], BIG[8], BIG[9], BIG[0], SMALL[0], BIG[1],
          BIG[2], BIG[3], SMALL[1], BIG[6]]],
    [2, [BIG[0], BIG[2], BIG[4], BIG[5], BIG[8], BIG[9]]],
]


def _start(names):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", TOKTIER_SIM_HANG_S="240")
    # json.dumps escapes the lone surrogate (\ud800), and json.loads gives it back as one
    return subprocess.Popen([sys.executable, str(SCRIPT), str(CROSSOVER), json.dumps(BATCHES), *names],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    """A run that hangs in the simulator is rerun once (its stacks as a warning; see test_simulator.py)."""
    procs = [(names, _start(names)) for names in GROUPS]
    out = {}
    for names, p in procs:
        stdout, stderr = p.communicate(timeout=300)
        if p.returncode != 0 and "Timeout (" in stderr:
            warnings.warn(f"batch check {names} hung and was rerun; its stacks:\n{stderr[-6000:]}")
            p = _start(names)
            stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"batch check {names} failed:\n{stderr[-4000:]}"
        for r in json.loads(stdout.strip().splitlines()[-1]):
            out[r["name"]] = r
    return out


@pytest.mark.parametrize("name", [n for g in GROUPS for n in g])
def test_batches_exact_one_pass_per_batch(name, results):
    ref = reference(name)
    r = results[name]
    assert len(r["batches"]) == len(BATCHES)
    for (max_queue, texts), b in zip(BATCHES, r["batches"]):
        assert b["texts"] == texts and len(b["results"]) == len(texts)
        slots = max_queue + 1
        n_gpu = 0
        for text, got in zip(texts, b["results"]):
            if text == SURROGATE:
                assert got.startswith("error: InvalidRequest") and "lone surrogate" in got
                continue
            ids, route = got
            assert ids == ref.encode(text, add_special_tokens=False).ids, (text, route)
            if len(text) < CROSSOVER:
                assert route == "cpu_small"
            elif name == "qwen3" and unicodedata.normalize("NFC", text) != text:
                assert route == "cpu_not_accepted"  # Qwen's normalizer is NFC: not the identity here
            elif n_gpu < slots:
                n_gpu += 1
                assert route == "gpu", text
            else:
                assert route == "cpu_queue_full", text
        assert n_gpu >= 1 and b["passes"] == 1  # the batch's whole GPU share: one encode_batch call
    # backpressure mid-batch: 3 slots, 6 GPU-sized requests
    assert [g[1] for g in r["batches"][3]["results"]].count("cpu_queue_full") == 3
