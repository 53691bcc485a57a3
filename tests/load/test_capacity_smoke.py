"""L1 smoke: ``load/capacity.py`` end to end in about a minute — starts tritonserver, probes and steps the
session route and the stateless baseline (Locust users, Poisson arrivals, replayed SWE-agent sessions),
checks every sampled reply against HF, writes capacity.json, steps.csv and the plots.

The SLO is loose here (1 s): this proves the tooling, not the capacity (see README "Load tests").
Runs in a subprocess: Locust monkey-patches the standard library for gevent on import.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = "pip install -e '.[test,serve]' (or '.[load,serve]')"


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed, so the load tests cannot run: {INSTALL}")


@pytest.mark.serving
def test_capacity_smoke(tmp_path):
    for module in ("locust", "gevent", "matplotlib", "psutil", "tritonclient.grpc"):
        _require(module)
    from toktier_backend.deploy.server import find_triton_dist

    try:
        find_triton_dist()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    cmd = [
        sys.executable, str(REPO / "load" / "capacity.py"), "--out", str(tmp_path), "--routes", "session,stateless,stateless_fast,noop",
        "--rates", "20", "--step-s", "3", "--warmup-s", "1.5", "--probe-s", "1.5", "--drain-s", "10",
        "--context-chars", "20000", "--check-fraction", "1", "--check-max", "24", "--slo-p99-ms", "1000", "--min-samples", "0",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    took = time.monotonic() - t0
    log = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert took < 240, f"smoke run took {took:.0f} s\n{log}"

    result = json.loads((tmp_path / "capacity.json").read_text())
    assert result["slo_p99_ms"] == 1000
    assert set(result["routes"]) == {"session", "stateless", "stateless_fast", "noop"}
    for route, c in result["routes"].items():
        assert c["max_rps"] == 20, (route, c, log)  # 20 req/s of 20K-char sessions under a 1 s P99
        assert c["unloaded_p50_ms"] > 0
        if route == "noop":  # constant replies: counted, never offered to the reference checker
            assert c["checked"] == 0 and c["mismatches"] == 0, (route, c)
        else:
            assert c["checked"] >= 10 and c["mismatches"] == 0, (route, c)
    assert result["ratio"] == pytest.approx(1.0)  # the same offered rate passed on every route
    assert result["ratios"]["stateless_fast"] == pytest.approx(1.0)
    assert result["of_floor"] == pytest.approx(1.0)  # session / noop
    assert "noop" not in result["ratios"]

    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert [(r["route"], float(r["offered_rps"])) for r in rows] == [
        ("session", 0.0), ("session", 20.0), ("stateless", 0.0), ("stateless", 20.0),
        ("stateless_fast", 0.0), ("stateless_fast", 20.0), ("noop", 0.0), ("noop", 20.0),
    ]  # the unloaded probe (offered 0), then the rate step
    for r in rows:
        assert int(r["n"]) > 0 and int(r["errors"]) == 0 and int(r["unfinished"]) == 0, r
        assert float(r["p99_ms"]) != round(float(r["p99_ms"]))  # exact floats, not Locust's rounded buckets
    def kinds(*steps) -> set:
        return set().union(*(json.loads(r["kinds"]) for r in steps))

    # sessions were opened and then sent delta turns: over the route's probe and step (a 3 s step of ~50
    # requests holds no open in about one run of ten: about one request in 22 opens a session here)
    assert {"open", "turn"} <= kinds(rows[0], rows[1]) and "turn" in kinds(rows[1]), rows[:2]
    assert kinds(rows[1]) <= {"open", "turn"}, rows[1]
    assert float(rows[3]["mean_chars_sent"]) > 20_000  # stateless: the whole context every time
    assert float(rows[1]["mean_chars_sent"]) < float(rows[3]["mean_chars_sent"])
    assert float(rows[5]["mean_chars_sent"]) > 20_000  # stateless_fast: the whole context too
    # noop: the session traffic, same shape
    assert {"open", "turn"} <= kinds(rows[6], rows[7]) and "turn" in kinds(rows[7]), rows[6:]
    assert kinds(rows[7]) <= {"open", "turn"}, rows[7]

    for name in ("p99_vs_offered.png", "throughput_vs_offered.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    md = (tmp_path / "capacity.md").read_text()
    assert "| session | toktier_session | 20.0 |" in md and "| noop | toktier_session_noop | 20.0 |" in md
    assert "session / noop (the serving floor, toktier_session_noop): 1.00" in md


@pytest.mark.parametrize("folder, like", [
    (REPO / "load" / "models" / "toktier_encode_hf", "toktier_encode"),
    (REPO / "toktier_backend" / "data" / "models" / "toktier_encode_fast", "toktier_encode"),
    (REPO / "load" / "models" / "toktier_session_noop", "toktier_session"),
], ids=lambda x: getattr(x, "name", x))
def test_baseline_model_config_parses(folder, like):
    """The load tests' baseline models: the same tensors as the model they stand beside, their own name, a
    tokenizer parameter that ``prepare_repository`` substitutes; the floor keeps the sequence batcher."""
    _require("tritonclient.grpc")
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    cfg = text_format.Parse((folder / "config.pbtxt").read_text(), pb.ModelConfig())
    ref = text_format.Parse((REPO / "model_repository" / like / "config.pbtxt").read_text(), pb.ModelConfig())
    assert cfg.name == folder.name and cfg.backend == "python" and (folder / "1" / "model.py").is_file()
    assert cfg.HasField("sequence_batching") == ref.HasField("sequence_batching")
    assert cfg.max_batch_size == ref.max_batch_size
    assert [(i.name, i.data_type) for i in cfg.input] == [(i.name, i.data_type) for i in ref.input]
    assert [(o.name, o.data_type) for o in cfg.output] == [(o.name, o.data_type) for o in ref.output]
    assert cfg.parameters["tokenizer"].string_value == "default"
