"""``bench/gpu_device_check.sh --dry-run``: the device check end to end without a GPU.

Every stage runs on numba's CUDA simulator at tiny sizes, and the served stage's CPU-only arm on a real
tritonserver on loopback (hence the ``serving`` marker); the GPU-instance arm is recorded as skipped with
its reason. Checked here: the one JSON under ``$OUT``, its stages and fields, that every stage finished
within its budget, and that the exactness checks the script ran passed. The script's own checks compare
with HF ``tokenizers``; this test also recomputes one reply per family (``sample``) with HF itself.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ..conftest import reference

pytestmark = pytest.mark.serving

REPO = Path(__file__).resolve().parents[2]
STAGES = ["exactness", "single_1m", "batches", "crossover", "served"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    from ..serving.conftest import _need_serving_deps

    _need_serving_deps()  # the served stage's tritonserver: fail (never skip) when it is missing
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out))
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the script sets it for --dry-run itself
    r = subprocess.run(["bash", "bench/gpu_device_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-6000:]
    path = out / "gpu_device_check.json"
    assert r.stdout.strip().splitlines()[-1] == str(path)
    return json.loads(path.read_text())


def test_structure_and_every_stage_ran(report):
    assert report["kind"] == "gpu_device_check" and report["dry_run"] is True and report["device"] == "simulator"
    assert "killed" not in report and report["finished"]
    assert list(report["stages"]) == STAGES
    for name in STAGES:
        st = report["stages"][name]
        assert st["status"] == "ok", (name, st.get("reason"), st.get("traceback"))
        assert st["seconds"] <= report["budgets_s"][name] + 30  # a budget is checked between measurements
    single = report["stages"]["single_1m"]["rows"][0]
    assert single["direct_n"] == 1 and single["direct_wall_p50_ms"] > 0 and single["graph_reason"] == "simulator"
    rows = report["stages"]["batches"]["rows"]
    assert [r["batch"] for r in rows] == [2, 3] and all(r["mb_per_s"] > 0 for r in rows)
    assert isinstance(report["stages"]["crossover"]["crossover_chars"], int)


def test_exactness_passed_for_every_family(report):
    ex = report["stages"]["exactness"]
    assert report["exact"] is True and ex["exact"] is True
    assert sorted(ex["families"]) == ["deepseek_v3", "gpt2", "llama3_1", "qwen3"]
    for name, fam in ex["families"].items():
        assert fam["exact"] and fam["router_mismatch"] == [] and fam["texts"] == 3, name
        sample = fam["sample"]  # recomputed here with HF, not taken from the script's verdict
        assert sample["route"] == "gpu"
        assert sample["ids"] == reference(name).encode(sample["text"], add_special_tokens=False).ids, name


def test_served_cpu_arm_ran_and_gpu_arm_skipped_with_reason(report):
    arms = report["stages"]["served"]["arms"]
    cpu = arms["cpu_only"]
    assert cpu["status"] == "ok" and cpu["exact"] is True and cpu["gpu_instances"] == 0
    assert cpu["requests"] == 8 and cpu["p50_ms"] > 0 and cpu["p90_ms"] >= cpu["p50_ms"]
    gpu = arms["gpu_instances_1"]
    assert gpu["status"] == "skipped" and "dry run" in gpu["reason"]
