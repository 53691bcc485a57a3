"""Serving fixtures: real servers on loopback (free ports), HF references computed here.

The ``serving`` marker tags tests that start a tritonserver. A missing ``nvidia-pytriton`` or
``tritonclient`` *fails* them with the install command (``pip install -e '.[serve]'``): a skipped serving
test must never read as a passing one.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import pytest
import tokenizers

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))
BUNDLED = REPO / "toktier_backend" / "data" / "gpt2" / "tokenizer.json"
IDLE_S = 3.0  # sequence batcher idle timeout (= session TTL) of the test servers
MAX_TEXT_BYTES = 4 * 1024 * 1024


def tokenizer_file(name: str) -> Path:
    """``bundled`` -> the package's GPT-2 file; else ``../shared/tokenizers/<name>/tokenizer.json``."""
    p = BUNDLED if name == "bundled" else SHARED / "tokenizers" / name / "tokenizer.json"
    if not p.is_file():
        pytest.fail(f"{p} missing (tests need ../shared beside the repo, or TOKTIER_SHARED)")
    return p


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """A Prometheus text endpoint as ``{(sample name, frozenset(label items)): value}``."""
    from toktier_backend.serving.metrics import scrape as _scrape

    return _scrape(url)


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    from toktier_backend.serving.metrics import metric as _metric

    return _metric(samples, name, **labels)


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory):
    """Quarantine files (``$TOKTIER_STATE_DIR``) of the cores built without an explicit one go to a temp dir,
    never to the user's ``~/.cache``."""
    old = os.environ.get("TOKTIER_STATE_DIR")
    os.environ["TOKTIER_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        os.environ.pop("TOKTIER_STATE_DIR", None)
    else:
        os.environ["TOKTIER_STATE_DIR"] = old


@lru_cache(maxsize=None)
def _reference(path: str) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(path)


def hf_ids(name: str, text: str, add_special_tokens: bool = True) -> list[int]:
    """HF reference ids: ``Tokenizer.from_file(path).encode(text, add_special_tokens=flag).ids``."""
    return _reference(str(tokenizer_file(name))).encode(text, add_special_tokens=add_special_tokens).ids


def require(module: str) -> None:
    """Import ``module`` or fail the test with the install command (never skip)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is not installed ({e}): pip install -e '.[serve]'")


def _need_serving_deps() -> None:
    require("tritonclient.grpc")
    require("tritonclient.http")
    try:
        from toktier_backend.deploy.server import find_triton_dist

        find_triton_dist()
    except FileNotFoundError as e:
        pytest.fail(str(e))


def _start(server, tmp_path_factory):
    try:
        return server.start().wait_ready(240)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def native(tmp_path_factory):
    """``tritonserver`` (from nvidia-pytriton) on loopback with our repository and the bundled GPT-2 file."""
    _need_serving_deps()
    from toktier_backend.deploy.server import TritonServer

    tmp = tmp_path_factory.mktemp("native")
    log = tmp / "tritonserver.log"
    server = TritonServer(
        str(BUNDLED), http_port=0, grpc_port=0, metrics_port=0, session_idle_s=IDLE_S,
        max_text_bytes=MAX_TEXT_BYTES, log_path=log, exit_timeout_s=3, toktier_metrics_port=0,
        parameters={"quarantine_file": str(tmp / "quarantine.json")},
    )
    _start(server, tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture(scope="session", params=["qwen3", "llama3_1"])
def native_family(request, tmp_path_factory):
    """Our repository served with a shared file of another pre-tokenizer family (``.family`` = its name)."""
    _need_serving_deps()
    from toktier_backend.deploy.server import TritonServer

    path = tokenizer_file(request.param)
    log = tmp_path_factory.mktemp(f"native_{request.param}") / "tritonserver.log"
    server = TritonServer(str(path), http_port=0, grpc_port=0, metrics_port=0, session_idle_s=30,
                          log_path=log, exit_timeout_s=3)
    server.family = request.param
    _start(server, tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pytriton_face(tmp_path_factory):
    """The same handler through PyTriton, on loopback, with the shared gpt2 file."""
    _need_serving_deps()
    require("pytriton")
    from toktier_backend.deploy.server import PyTritonServer

    log = tmp_path_factory.mktemp("pytriton") / "tritonserver.log"
    server = PyTritonServer(str(tokenizer_file("gpt2")), http_port=0, grpc_port=0, metrics_port=0,
                            session_idle_s=IDLE_S, max_text_bytes=MAX_TEXT_BYTES, log_path=log)
    _start(server, tmp_path_factory)
    yield server
    server.stop()
