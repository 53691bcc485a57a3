"""L0 faults and bad input on a real tritonserver (from nvidia-pytriton) on loopback. No mocks of Triton.

Servers here serve a copy of ``toktier_session`` + ``toktier_encode`` only, with the ``toktier_*`` metrics
exporter on a free port. Every id is compared with the HF reference computed in the test.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from toktier_backend.client import SessionClient

from ..faulty_engine import TRIGGER
from .conftest import BUNDLED, MAX_TEXT_BYTES, REPO, _need_serving_deps, hf_ids, metric, scrape
from .test_served import _get, _inputs, _mod, _status

pytestmark = pytest.mark.serving

BUDGET = 300_000  # bytes per instance: ~80 small sessions each
IDLE = 20.0


def _repository(dest: Path, *, faulty: bool = False) -> Path:
    """Our two models only (not whatever else the checkout's repository holds); with ``faulty``, the
    session model installs :class:`tests.faulty_engine.FaultyEngine` after admission."""
    from toktier_backend.deploy.server import DEFAULT_MODEL_REPOSITORY

    dest.mkdir(parents=True)
    for name in ("toktier_session", "toktier_encode"):
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    if faulty:
        model = dest / "toktier_session" / "1" / "model.py"
        model.write_text(model.read_text() + (
            "\n\n# test only: a faulty engine installed after admission (tests/faulty_engine.py)\n"
            "_Model = TritonPythonModel\n\n\n"
            "class TritonPythonModel(_Model):\n"
            "    def initialize(self, args):\n"
            "        super().initialize(args)\n"
            "        from tests.faulty_engine import install\n\n"
            "        install(self.handler.tokenizer)\n"
        ))
    return dest


def _server(tmp: Path, *, tokenizer=BUNDLED, faulty=False, params=None, ports=None, idle=IDLE):
    from toktier_backend.deploy.server import TritonServer

    p, h, g, m = ports or (0, 0, 0, 0)
    return TritonServer(
        str(tokenizer), model_repository=_repository(tmp / f"repo-{time.monotonic_ns()}", faulty=faulty),
        http_port=h, grpc_port=g, metrics_port=m, toktier_metrics_port=p, session_idle_s=idle,
        max_text_bytes=MAX_TEXT_BYTES, log_path=tmp / "tritonserver.log", exit_timeout_s=2,
        parameters={"quarantine_file": str(tmp / "quarantine.json"), **(params or {})},
    )


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """GPT-2, a small session budget, every reply verified."""
    _need_serving_deps()
    tmp = tmp_path_factory.mktemp("faults")
    server = _server(tmp, params={"session_budget_bytes": str(BUDGET), "verifier_rate": "1.0"})
    try:
        server.start().wait_ready(240)
    except RuntimeError as e:
        pytest.fail(str(e))
    yield server
    server.stop()


def _wait(cond, timeout_s=20.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# ---------------------------------------------------------------- metrics after real traffic


def test_metrics_move_after_real_traffic(faults):
    mod = _mod("grpc")
    before = scrape(faults.toktier_metrics_url)
    with SessionClient(faults.grpc_url, session_id="metrics-1") as c:
        c.open("def pipe")
        for delta in ["line(x):\n", "    return x\n", "\n# done", " pipeline"]:
            assert c.append(delta).tolist() == hf_ids("bundled", c.text)
        assert c.update(c.text.replace("return x", "return 2 * x")).tolist() == hf_ids("bundled", c.text)
    raw = mod.InferenceServerClient(faults.grpc_url)
    raw.infer("toktier_encode", _inputs(mod, "hello world"))
    with pytest.raises(Exception):
        raw.infer("toktier_encode", _inputs(mod, b"\xff"))
    with pytest.raises(Exception):
        raw.infer("toktier_session", _inputs(mod, b"\xff"), sequence_id="metrics-2", sequence_start=True)
    with pytest.raises(Exception, match="UnknownSession"):
        raw.infer("toktier_session", _inputs(mod, "x", mode="delta"), sequence_id="metrics-2", sequence_end=True)
    raw.close()
    checked = 6 + 1 + 1  # session replies (open, 4 appends, update; END's reply too) + encode
    _wait(lambda: metric(scrape(faults.toktier_metrics_url), "toktier_verifier_samples_total")
          - metric(before, "toktier_verifier_samples_total") >= checked, what="verifier samples")
    after = scrape(faults.toktier_metrics_url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("toktier_requests_total", model="toktier_session", mode="delta", route="append") == 4
    assert delta("toktier_requests_total", model="toktier_session", mode="full", route="full") == 1
    assert delta("toktier_requests_total", model="toktier_session", mode="full", route="edit") == 1
    assert delta("toktier_requests_total", model="toktier_encode", route="encode") == 1
    assert delta("toktier_request_duration_seconds_count", model="toktier_session", route="append") == 4
    assert delta("toktier_request_duration_seconds_sum", model="toktier_session") > 0
    assert delta("toktier_repair_window_widenings_count", model="toktier_session") == 5
    assert delta("toktier_tokens_total", kind="reused") > 0 and delta("toktier_tokens_total", kind="reencoded") > 0
    assert delta("toktier_request_errors_total", model="toktier_encode", code="INVALID_ARG") == 1
    assert delta("toktier_request_errors_total", model="toktier_session", code="INVALID_ARG") == 1
    assert delta("toktier_request_errors_total", model="toktier_session", code="NOT_FOUND") == 1
    assert delta("toktier_verifier_samples_total", result="match") >= checked
    assert metric(after, "toktier_verifier_samples_total", result="mismatch") == 0
    assert metric(after, "toktier_quarantined_routes") == 0
    assert metric(after, "toktier_session_budget_bytes") == 2 * BUDGET  # two instances
    for name in ("toktier_sessions", "toktier_session_memory_bytes", "toktier_verifier_dropped_total",
                 "toktier_verifier_queue_depth"):
        assert any(n == name for n, _ in after), name
    assert metric(after, "toktier_session_memory_bytes") <= 2 * BUDGET


# ---------------------------------------------------------------- memory pressure


def test_thousand_concurrent_sessions_under_a_small_budget(faults):
    """1,000 live sessions against ~160 sessions' worth of budget: most are evicted between their
    requests; each is rebuilt exactly from the whole text (NOT_FOUND -> MODE=full) and no reply is wrong."""
    import tritonclient.grpc as grpcclient

    shared = grpcclient.InferenceServerClient(faults.grpc_url)
    before = scrape(faults.toktier_metrics_url)
    n = 1000
    clients = [SessionClient(faults.grpc_url, client=shared, session_id=f"k{i}") for i in range(n)]
    texts = [f"session {i}: hello world" for i in range(n)]

    def step(i, phase):
        c = clients[i]
        if phase == 0:
            got = c.open(texts[i])
        elif phase == 1:
            got = c.append(f" turn {i} two")
        else:
            got = c.append(" three")
            c.close()
        return got.tolist() == hf_ids("bundled", c.text)

    with cf.ThreadPoolExecutor(32) as pool:
        for phase in range(3):  # all 1,000 are open (live sequences) between phases
            assert all(pool.map(lambda i: step(i, phase), range(n))), phase
    shared.close()
    after = scrape(faults.toktier_metrics_url)
    evicted = metric(after, "toktier_session_evictions_total", cause="budget") - \
        metric(before, "toktier_session_evictions_total", cause="budget")
    reopened = sum(c.reopens for c in clients)
    assert evicted > 500 and reopened > 500, (evicted, reopened)
    assert metric(after, "toktier_session_memory_bytes") <= 2 * BUDGET
    assert metric(after, "toktier_request_errors_total", code="NOT_FOUND") >= reopened


# ---------------------------------------------------------------- correlation IDs, concurrency


def test_correlation_id_edge_cases(faults):
    mod = _mod("grpc")
    client = mod.InferenceServerClient(faults.grpc_url)
    # zero: Triton itself refuses a sequence request without a correlation ID
    with pytest.raises(Exception, match="correlation ID"):
        client.infer("toktier_session", _inputs(mod, "x"), sequence_id=0, sequence_start=True)
    # unknown (never started): Triton asks for START
    with pytest.raises(Exception, match="START flag"):
        client.infer("toktier_session", _inputs(mod, "x", mode="delta"), sequence_id="never-started")
    # START on a live ID replaces the session (counted as an eviction, KEEP 0)
    before = scrape(faults.toktier_metrics_url)
    client.infer("toktier_session", _inputs(mod, "first life"), sequence_id=8801, sequence_start=True)
    r = client.infer("toktier_session", _inputs(mod, "second life", reply="patch"), sequence_id=8801,
                     sequence_start=True)
    assert _get(r, "KEEP").tolist() == [0] and _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "second life")
    r = client.infer("toktier_session", _inputs(mod, "!", mode="delta"), sequence_id=8801, sequence_end=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "second life!")
    # reused after END: a fresh session
    r = client.infer("toktier_session", _inputs(mod, "third"), sequence_id=8801, sequence_start=True, sequence_end=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "third") and _get(r, "KEEP").tolist() == [0]
    after = scrape(faults.toktier_metrics_url)
    assert metric(after, "toktier_session_evictions_total", cause="start") - \
        metric(before, "toktier_session_evictions_total", cause="start") == 1
    client.close()


def test_concurrent_requests_on_one_session_are_serialized(faults):
    """16 threads append to one session at once (arrival order unknown): the sequence batcher and the
    handler serialize them. Each full reply is the exact encoding of some text; the texts form one chain of
    appends holding every delta exactly once: nothing lost, nothing interleaved."""
    import tritonclient.grpc as grpcclient

    mod = _mod("grpc")
    client = grpcclient.InferenceServerClient(faults.grpc_url)
    sid = "one-session-many-threads"
    client.infer("toktier_session", _inputs(mod, "start:"), sequence_id=sid, sequence_start=True)
    deltas = [f" w{i:02d}" for i in range(16)]
    barrier = threading.Barrier(16)

    def send(d):
        barrier.wait()
        r = client.infer("toktier_session", _inputs(mod, d, mode="delta", reply="full"), sequence_id=sid)
        return _get(r, "INPUT_ID").tolist()

    with cf.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(send, deltas))
    from .conftest import _reference, tokenizer_file

    ref = _reference(str(tokenizer_file("bundled")))
    texts = sorted((ref.decode(ids) for ids in replies), key=len)
    for ids, text in zip(sorted(replies, key=len), texts):
        assert ids == hf_ids("bundled", text)
    for a, b in zip(["start:"] + texts, texts):
        assert b.startswith(a) and b[len(a):] in deltas
    assert sorted(texts[-1][len("start:"):].split()) == sorted(d.strip() for d in deltas)
    # a stale whole text arriving late (an older version): the session follows it, exactly
    r = client.infer("toktier_session", _inputs(mod, texts[3], reply="full"), sequence_id=sid, sequence_end=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", texts[3])
    client.close()


# ---------------------------------------------------------------- bad and odd input


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_odd_texts(faults, protocol):
    mod = _mod(protocol)
    url = faults.grpc_url if protocol == "grpc" else faults.http_url
    client = mod.InferenceServerClient(url)
    sid = f"odd-{protocol}"
    r = client.infer("toktier_session", _inputs(mod, ""), sequence_id=sid, sequence_start=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "") == [] and _get(r, "REQUEST_INPUT_LEN").tolist() == [0]
    text = ""
    for delta in ["", "nul\x00inside", "\x00", " tail \x00\x00 end", "", "🙂 e\u0301"]:
        text += delta
        r = client.infer("toktier_session", _inputs(mod, delta, mode="delta", reply="full"), sequence_id=sid)
        assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", text), repr(delta)
    r = client.infer("toktier_encode", _inputs(mod, "a\x00b"))
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "a\x00b")
    # 50 MB: refused per request with the limit named, the session and the instance survive
    big = b"x" * (50 * 1024 * 1024)
    for model, kw in (("toktier_session", dict(sequence_id=sid)), ("toktier_encode", {})):
        with pytest.raises(Exception) as e:
            client.infer(model, _inputs(mod, big, mode="delta") if model == "toktier_session" else _inputs(mod, big), **kw)
        assert _status(e.value) in ("StatusCode.INVALID_ARGUMENT", "400") and "max_text_bytes" in str(e.value)
    del big
    r = client.infer("toktier_session", _inputs(mod, "!", mode="delta"), sequence_id=sid, sequence_end=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", text + "!")
    client.close()


# ---------------------------------------------------------------- restart, idle timeout


def test_restart_mid_session_client_reopens_exactly(tmp_path):
    _need_serving_deps()
    first = _server(tmp_path / "a")
    (tmp_path / "a").mkdir(exist_ok=True)
    first.start().wait_ready(240)
    ports = (0, first.http_port, first.grpc_port, first.metrics_port)
    c = SessionClient(first.grpc_url, session_id="survives-restart", timeout_s=10)
    c.open("before the restart")
    assert c.append(", one turn").tolist() == hf_ids("bundled", c.text)
    first.stop()
    with pytest.raises(Exception):  # server down: a transport failure, the client marks itself dirty
        c.append(" lost in transit")
    (tmp_path / "b").mkdir()
    second = _server(tmp_path / "b", ports=ports)
    try:
        second.start().wait_ready(240)
        deadline = time.monotonic() + 30
        while True:  # the caller retries transport failures (the gRPC channel reconnects with backoff)
            try:
                ids = c.append(" after")
                break
            except Exception as e:
                if "UNAVAILABLE" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert ids.tolist() == hf_ids("bundled", "before the restart, one turn after")
        assert c.reopens == 1 and c.last.reopened
        assert c.append("!").tolist() == hf_ids("bundled", c.text) and c.last.route == "append"
        c.close()
    finally:
        second.stop()


def test_idle_timeout_evicts_and_client_reopens(native):
    """``native`` idles sequences out after 3 s: Triton forgets the sequence, the store drops the session
    (cause ``idle``), the client re-opens with START and gets exact ids."""
    c = SessionClient(native.grpc_url, session_id="idle-metrics")
    c.open("idle text")
    before = scrape(native.toktier_metrics_url)
    time.sleep(4.5)
    assert c.append(" more").tolist() == hf_ids("bundled", "idle text more") and c.reopens == 1
    after = scrape(native.toktier_metrics_url)
    assert metric(after, "toktier_session_evictions_total", cause="idle") > \
        metric(before, "toktier_session_evictions_total", cause="idle")
    c.close()


# ---------------------------------------------------------------- the shadow verifier, served


def test_faulty_engine_is_quarantined_and_replies_are_exact_after(tmp_path):
    """A faulty engine build in both ``toktier_session`` instances: the first wrong reply goes out, the
    verifier catches it, quarantines the fast routes in the shared file; from then on both instances answer
    exactly. The operator's clear (``toktier quarantine clear``) puts the fast route back (and this broken
    engine is caught again)."""
    _need_serving_deps()
    qfile = tmp_path / "quarantine.json"
    server = _server(tmp_path, faulty=True, params={"verifier_rate": "1.0"})
    server.start().wait_ready(240)
    try:
        mod = _mod("grpc")
        client = mod.InferenceServerClient(server.grpc_url)
        client.infer("toktier_session", _inputs(mod, "hello "), sequence_id="bad-1", sequence_start=True)
        r = client.infer("toktier_session", _inputs(mod, f"{TRIGGER} world", mode="delta", reply="full"),
                         sequence_id="bad-1")
        assert _get(r, "INPUT_ID").tolist() != hf_ids("bundled", f"hello {TRIGGER} world")  # the fault is real
        _wait(lambda: metric(scrape(server.toktier_metrics_url), "toktier_quarantined_routes",
                             model="toktier_session") == 3, what="quarantine")
        m = scrape(server.toktier_metrics_url)
        assert metric(m, "toktier_verifier_mismatches_total", model="toktier_session", route="append") == 1
        import json

        listed = json.loads(qfile.read_text())
        assert len(listed) == 1 and set(next(iter(listed.values()))) == {"full", "append", "edit"}
        time.sleep(1.5)  # the other instance re-reads the file within a second
        # every session now, on either instance, is exact; the wrong one is rebuilt from the reference
        r = client.infer("toktier_session", _inputs(mod, "!", mode="delta", reply="full"), sequence_id="bad-1")
        assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", f"hello {TRIGGER} world!")
        for k in range(8):
            sid = f"after-{k}"
            client.infer("toktier_session", _inputs(mod, f"turn {k} "), sequence_id=sid, sequence_start=True)
            r = client.infer("toktier_session", _inputs(mod, f"{TRIGGER} {k}", mode="delta", reply="full"),
                             sequence_id=sid, sequence_end=True)
            assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", f"turn {k} {TRIGGER} {k}"), k
        # the operator clears it
        out = subprocess.run([sys.executable, "-m", "toktier_backend.deploy.cli_serve", "quarantine", "clear",
                              "--file", str(qfile)], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 0 and "3 route(s) released" in out.stdout, out.stderr
        time.sleep(1.5)
        client.infer("toktier_session", _inputs(mod, "cleared "), sequence_id="bad-2", sequence_start=True)
        r = client.infer("toktier_session", _inputs(mod, TRIGGER, mode="delta", reply="full"), sequence_id="bad-2")
        assert _get(r, "INPUT_ID").tolist() != hf_ids("bundled", f"cleared {TRIGGER}")  # fast route is back
        _wait(lambda: qfile.exists() and json.loads(qfile.read_text()), what="re-quarantine")
        client.close()
    finally:
        server.stop()


# ---------------------------------------------------------------- tokenizer files the server refuses


@pytest.mark.parametrize("case", ["malformed", "sha256-pin"])
def test_server_refuses_a_bad_tokenizer(tmp_path, case):
    _need_serving_deps()
    if case == "malformed":
        bad = tmp_path / "tokenizer.json"
        bad.write_text(BUNDLED.read_text()[:5000])  # truncated JSON
        server, want = _server(tmp_path, tokenizer=bad), "malformed JSON at line 1"
    else:
        server, want = _server(tmp_path, params={"tokenizer_sha256": "0" * 64}), "is not the pinned"
    with pytest.raises(RuntimeError, match="exited with code|not ready") as e:
        server.start().wait_ready(120)
    log = (tmp_path / "tritonserver.log").read_text(errors="replace")
    assert "UnsupportedTokenizer" in log and want in log, str(e.value)[-2000:]
    server.stop()
