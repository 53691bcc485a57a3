"""The GPU router wired into ``toktier_encode``: model.py loaded as a Triton GPU instance, without a GPU.

* On numba's CUDA simulator (a subprocess per file, ``_wiring_check.py``): gpt2 and llama3_1 as a GPU
  instance with a small crossover; every reply equals HF ``encode(text, add_special_tokens=flag).ids`` for
  both flags (the post-processor stays on the CPU side), and ``toktier_encode_route_total`` shows ``gpu``.
* In process, no simulator: the GPU engine unavailable (no CUDA, no numba), refused by the canary, or
  raising, and a quarantined ``full`` route: every reply still exact, each route counted.
* Config: the shipped ``config.pbtxt`` stays CPU-only; ``toktier serve --encode-gpu-instances N`` renders
  the GPU + CPU instance groups.

Expected ids always come from the HF reference (``tests/conftest.reference``), never from our output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from toktier_backend.errors import EngineUnavailable
from toktier_backend.gpu import routing

from ..conftest import reference
from ..serving.fake_pb_utils import MODEL_REPOSITORY, encode_request, load_model

SCRIPT = Path(__file__).with_name("_wiring_check.py")
REPO = Path(__file__).resolve().parents[2]
SIM_NAMES = ["gpt2", "llama3_1"]
CROSSOVER = 8
#: Tiny on purpose (each simulated encode is ~1 s); both flags of each; one text under the crossover.
SIM_TEXTS = ["It's 12345 ok\n\n  x<|endoftext|>", 'def f():\n\treturn "café" # 中文<|eot_id|>']
SMALL = "hi"


def hf(name: str, text: str, flag: bool) -> list[int]:
    return reference(name).encode(text, add_special_tokens=flag).ids


# ---------------------------------------------------------------- on the simulator


@pytest.fixture(scope="module", autouse=True)
def sim_procs():
    """The simulator subprocesses, started before this module's first test so that they run while the
    in-process tests below do (their simulated threads mostly wait on each other: ~4 s CPU in ~9 s)."""
    procs = {name: _start(name) for name in SIM_NAMES}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _start(name: str) -> subprocess.Popen:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", TOKTIER_SIM_HANG_S="240")
    texts = [[t, flag] for t in SIM_TEXTS for flag in (True, False)] + [[SMALL, True]]
    return subprocess.Popen([sys.executable, str(SCRIPT), name, str(CROSSOVER), json.dumps(texts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def sim_results(sim_procs) -> dict[str, dict]:
    """A check that hangs in the simulator (faulthandler's "Timeout (" dump, as in test_simulator.py) is
    rerun once, with the dump as a warning; a failing one is never rerun."""
    out = {}
    for name, p in sim_procs.items():
        stdout, stderr = p.communicate(timeout=300)
        if p.returncode != 0 and "Timeout (" in stderr:
            warnings.warn(f"wiring check {name} hung and was rerun; its stacks:\n{stderr[-6000:]}")
            p = _start(name)
            stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"wiring check {name} failed:\n{stderr[-4000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


# ---------------------------------------------------------------- fallbacks, in process

NAME = "gpt2"
TEXTS = ["hello world", "It's 1234567 pipeline<|endoftext|>\r\n\r\n  x", "e\u0301 中文 👍🏽" * 3]


def counter(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"face": "triton", "model": "toktier_encode", **labels}) or 0.0


def route_count(route: str) -> float:
    return counter("toktier_encode_route_total", route=route)


class RefGpu:
    """A stand-in GPU engine: HF body ids (so it passes the canary), optionally raising once ``armed``."""

    name = "gpu"

    def __init__(self, *, raise_when_armed=False, wrong=False):
        self.raise_when_armed, self.wrong, self.armed, self.calls = raise_when_armed, wrong, False, 0

    def accepts(self, text):
        return True

    def encode(self, text):
        self.calls += 1
        if self.armed and self.raise_when_armed:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED (injected)")
        ids = reference(NAME).encode(text, add_special_tokens=False).ids
        if self.wrong and ids:
            ids = ids[:-1]  # one id short: the canary must refuse it
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


def gpu_model(tmp_path, *, kind="GPU", **params):
    # engine "hf": the CPU side's fast engine is not what these tests are about, and gigatoken's load is
    # ~0.5 s of each model load here
    # gpu_max_queue 16: run()'s one batch of 6 fits the queue, so every GPU-sized request shares the pass
    base = {"tokenizer": str(reference_path(NAME)), "engine": "hf", "gpu_crossover_chars": "4", "gpu_max_queue": "16",
            "verifier_rate": "0",
            "verifier_first_n": "0", "quarantine_file": str(tmp_path / "q.json"),
            "pool_workers": "0", "pool_express": "1", "pool_nice": "0"}  # = the default shared pool
    return load_model("toktier_encode", kind=kind, device_id=0, parameters={**base, **params})


def reference_path(name):
    from ..conftest import tokenizer_path

    return tokenizer_path(name)


def run(model, flags=(True, False)):
    """Every text with every flag through ``execute`` (one batch); asserts each reply equals HF."""
    cases = [(t, f) for t in TEXTS for f in flags]
    for (text, flag), resp in zip(cases, model.execute([encode_request(t, f) for t, f in cases])):
        assert not resp.has_error(), resp.error.message()
        assert resp.output("INPUT_ID").reshape(-1).tolist() == hf(NAME, text, flag), (text, flag)
    return len(cases)


def with_factory(monkeypatch, factory):
    monkeypatch.setattr(routing, "_new_gpu_engine", factory)


@pytest.mark.parametrize("error", [EngineUnavailable("engine 'gpu': no CUDA device is available"),
                                   ImportError("No module named 'numba'"), None])
def test_gpu_engine_unavailable_serves_from_cpu(tmp_path, monkeypatch, caplog, error):
    if error is not None:
        def factory(path, device_id):
            raise error
        with_factory(monkeypatch, factory)
    else:  # the real factory: this machine has no CUDA device (numba is in the test extra)
        from numba import cuda

        if cuda.is_available():
            pytest.skip("a CUDA device is present: the simulator and device tests cover the GPU route")
    before, loads = route_count("cpu_no_gpu"), counter("toktier_gpu_engine_loads_total", result="unavailable")
    with caplog.at_level("WARNING", logger="toktier_backend.gpu.routing"):
        model = gpu_model(tmp_path)
    router = model.handler.router
    assert router.gpu is None and router.gpu_status == "unavailable"
    lines = [r.getMessage() for r in caplog.records if r.name == "toktier_backend.gpu.routing"]
    assert len(lines) == 1 and "serves from the CPU engine" in lines[0]  # one clear line
    if error is not None:
        assert str(error) in router.gpu_reason
    n = run(model)
    assert route_count("cpu_no_gpu") - before == n
    assert counter("toktier_gpu_engine_loads_total", result="unavailable") - loads == 1
    model.finalize()


def test_gpu_error_falls_back_exact_and_counted(tmp_path, monkeypatch):
    gpu = RefGpu(raise_when_armed=True)
    with_factory(monkeypatch, lambda path, device_id: gpu)
    model = gpu_model(tmp_path)
    router = model.handler.router
    assert router.gpu is gpu and router.gpu_status == "ok"  # passed the canary
    gpu.armed = True
    before, small = route_count("cpu_gpu_error"), route_count("cpu_small")
    n = run(model)
    big = sum(len(t) >= 4 for t in TEXTS) * 2
    assert route_count("cpu_gpu_error") - before == big and route_count("cpu_small") - small == n - big
    assert "LAUNCH_FAILED" in router.last_error
    model.finalize()


def test_gpu_route_taken_when_engine_works(tmp_path, monkeypatch):
    gpu = RefGpu()
    with_factory(monkeypatch, lambda path, device_id: gpu)
    model = gpu_model(tmp_path, gpu_crossover_chars="0")
    calls, before = gpu.calls, route_count("gpu")
    n = run(model)
    assert route_count("gpu") - before == n and gpu.calls - calls == n
    model.finalize()


def test_canary_failure_keeps_gpu_off(tmp_path, monkeypatch, caplog):
    gpu = RefGpu(wrong=True)
    with_factory(monkeypatch, lambda path, device_id: gpu)
    loads, before = counter("toktier_gpu_engine_loads_total", result="canary_failed"), route_count("cpu_no_gpu")
    with caplog.at_level("ERROR", logger="toktier_backend.gpu.routing"):
        model = gpu_model(tmp_path, gpu_crossover_chars="0")
    router = model.handler.router
    assert router.gpu is None and router.gpu_status == "canary_failed" and "canary mismatch" in router.gpu_reason
    assert "GPU engine refused" in caplog.text
    assert counter("toktier_gpu_engine_loads_total", result="canary_failed") - loads == 1
    calls = gpu.calls
    n = run(model)
    assert gpu.calls == calls and route_count("cpu_no_gpu") - before == n
    model.finalize()


def test_quarantined_full_route_keeps_texts_off_the_gpu(tmp_path, monkeypatch):
    gpu = RefGpu()
    with_factory(monkeypatch, lambda path, device_id: gpu)
    model = gpu_model(tmp_path, gpu_crossover_chars="0")
    model.handler.tokenizer.quarantine("full", "test: a stateless reply disagreed")
    calls, before = gpu.calls, route_count("cpu_quarantined")
    n = run(model)
    assert gpu.calls == calls and route_count("cpu_quarantined") - before == n
    model.finalize()


def test_cpu_instance_and_gpu_engine_off_have_no_router(tmp_path, monkeypatch):
    def factory(path, device_id):
        raise AssertionError("a CPU instance (or gpu_engine off) must not build a GPU engine")

    with_factory(monkeypatch, factory)
    before, off = route_count("cpu_instance"), counter("toktier_gpu_engine_loads_total", result="off")
    cpu = gpu_model(tmp_path, kind="CPU")
    assert cpu.handler.router is None
    n = run(cpu)
    cpu.finalize()
    gpu_off = gpu_model(tmp_path, gpu_engine="off")
    assert gpu_off.handler.router is None
    n += run(gpu_off, flags=(True,))
    gpu_off.finalize()
    assert route_count("cpu_instance") - before == n
    assert counter("toktier_gpu_engine_loads_total", result="off") - off == 1
    with pytest.raises(ValueError, match="gpu_engine"):
        gpu_model(tmp_path, gpu_engine="always")


# ---------------------------------------------------------------- config


def _parse(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    return text_format.Parse(path.read_text(), pb.ModelConfig())


def test_shipped_config_is_cpu_only_with_gpu_parameters():
    cfg = _parse(MODEL_REPOSITORY / "toktier_encode" / "config.pbtxt")
    from tritonclient.grpc import model_config_pb2 as pb

    assert [g.kind for g in cfg.instance_group] == [pb.ModelInstanceGroup.KIND_CPU]
    assert cfg.parameters["gpu_engine"].string_value == "auto"
    assert int(cfg.parameters["gpu_crossover_chars"].string_value) == routing.DEFAULT_CROSSOVER_CHARS
    assert int(cfg.parameters["gpu_max_queue"].string_value) > 0


def test_serve_renders_gpu_and_cpu_instance_groups(tmp_path):
    from tritonclient.grpc import model_config_pb2 as pb

    from toktier_backend.deploy.cli_serve import _parameters, add_serve_parser
    from toktier_backend.deploy.server import prepare_repository

    dst = prepare_repository(tmp_path / "models", tokenizer="default", encode_gpu_instances=2,
                             parameters={"gpu_crossover_chars": "1000"})
    cfg = _parse(dst / "toktier_encode" / "config.pbtxt")
    groups = [(g.kind, g.count) for g in cfg.instance_group]
    assert groups == [(pb.ModelInstanceGroup.KIND_GPU, 2), (pb.ModelInstanceGroup.KIND_CPU, 1)]
    assert cfg.parameters["gpu_crossover_chars"].string_value == "1000"
    session = _parse(dst / "toktier_session" / "config.pbtxt")
    assert all(g.kind == pb.ModelInstanceGroup.KIND_CPU for g in session.instance_group)

    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--tokenizer", "default", "--encode-gpu-instances", "1", "--gpu-engine",
                              "off", "--gpu-crossover-chars", "4096", "--gpu-max-queue", "2"])
    assert args.encode_gpu_instances == 1
    assert _parameters(args) == {"gpu_engine": "off", "gpu_crossover_chars": "4096", "gpu_max_queue": "2"}


# ---------------------------------------------------------------- on the simulator (started first, checked last)


@pytest.mark.parametrize("name", SIM_NAMES)
def test_gpu_instance_exact_on_simulator(name, sim_results):
    r = sim_results[name]
    assert r["gpu_status"] == "ok", r["gpu_reason"]
    assert len(r["replies"]) == 2 * len(SIM_TEXTS) + 1
    for text, flag, got in r["replies"]:
        assert got == hf(name, text, flag), (text, flag)
    # the flag changes the reply where the file has a post-processor (llama3_1: <|begin_of_text|>)
    if name == "llama3_1":
        assert r["replies"][0][2][0] == reference(name).token_to_id("<|begin_of_text|>")
    assert r["routes"]["gpu"] == 2 * len(SIM_TEXTS) and r["routes"]["cpu_small"] == 1
    assert r["routes"]["cpu_gpu_error"] == 0 and r["routes"]["cpu_no_gpu"] == 0
    assert r["router_counts"] == {"gpu": 2 * len(SIM_TEXTS), "cpu_small": 1}
    assert r["loads"] == {"ok": 1.0}
