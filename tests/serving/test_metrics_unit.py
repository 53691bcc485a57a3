"""``toktier_*`` metrics recorded by the Triton face's serving core, on a private registry (no Triton): exact counts per route,
fallback reason, token kind, error code and eviction cause."""

from __future__ import annotations

import pytest

import toktier_backend as tt
from toktier_backend.faces.triton import Handler
from toktier_backend.serving.metrics import Metrics

from .conftest import BUNDLED


@pytest.fixture
def setup():
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    tok = tt.load_tokenizer(BUNDLED, engine="gigatoken")  # (fastokens guards no code point: nothing to count)
    h = Handler(tok, metrics=Metrics(reg, pool_stats=lambda: {
        "queue_depth": 3, "by_priority": {"repair": {"wait_ms_p99": 2.0, "wait_ms_mean": 1.0}}}),
        session_budget_bytes=12_000)
    # every series carries the face that served it (exact label sets: get_sample_value matches all labels)
    return h, tok, (lambda name, **labels: reg.get_sample_value(name, {"face": "triton", **labels}) or 0.0)


def test_handler_counts(setup):
    h, tok, value = setup
    guarded = chr(tok.admission.guarded[0])  # a code point the fast engine is not trusted with
    h.handle_session(1, b"hello world", start=True)
    h.handle_session(1, b" and more", mode="delta")
    h.handle_session(1, f" {guarded}".encode(), mode="delta")
    h.handle_session(1, b"", mode="delta")
    with pytest.raises(tt.UnknownSession):
        h.handle_session(2, b"x", mode="delta")
    with pytest.raises(tt.InvalidRequest):
        h.handle_encode(b"\xff")
    h.handle_encode(b"hello")
    m = "toktier_session"
    assert value("toktier_requests_total", model=m, route="full", mode="full") == 1
    assert value("toktier_requests_total", model=m, route="append", mode="delta") == 2
    assert value("toktier_requests_total", model=m, route="noop", mode="delta") == 1
    assert value("toktier_requests_total", model="toktier_encode", route="encode", mode="encode") == 1
    assert value("toktier_request_duration_seconds_count", model=m, route="append") == 2
    assert value("toktier_fallbacks_total", model=m, reason="guarded") == 1
    assert value("toktier_repair_window_widenings_count", model=m) == 2
    assert value("toktier_tokens_total", model=m, kind="reused") > 0
    assert value("toktier_request_errors_total", model=m, code="NOT_FOUND") == 1
    assert value("toktier_request_errors_total", model="toktier_encode", code="INVALID_ARG") == 1
    assert value("toktier_sessions", model=m) == 1
    assert value("toktier_session_memory_bytes", model=m) == h.store.nbytes > 0
    assert value("toktier_session_budget_bytes", model=m) == 12_000
    assert value("toktier_cpu_pool_queue_depth", model=m) == 3
    assert value("toktier_cpu_pool_wait_seconds", model=m, priority="repair", stat="p99") == 0.002
    for k in range(2, 8):  # over the budget: least recently used sessions go
        h.handle_session(100 + k, b"a session of its own " * 20, start=True)
    h.handle_session(1, b"restart", start=True)
    assert value("toktier_session_evictions_total", model=m, cause="budget") >= 1
    assert value("toktier_session_evictions_total", model=m, cause="budget") == h.store.evictions["budget"]


def test_state_gauges_follow_the_last_state_from_two_threads():
    """``set_state`` skips writing a gauge whose value this process already wrote: the exported value is
    still the last state passed, also when a value comes back and when two threads (a request's and the
    verifier's) write the same gauges at once."""
    import threading
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from toktier_backend.serving.metrics import Origin

    reg = CollectorRegistry()
    m = Metrics(reg, pool_stats=lambda: None)
    o = Origin("triton", "toktier_session")

    def gauge(name):
        return reg.get_sample_value(name, {"face": "triton", "model": "toktier_session"})

    class Store:
        def __init__(self, n):
            self.nbytes, self.max_bytes, self.n = n, 0, n

        def __len__(self):
            return self.n

    for n in (5, 7, 5, 5):
        m.set_state(o, store=Store(n), verifier=SimpleNamespace(queue_depth=n))
        assert gauge("toktier_session_memory_bytes") == gauge("toktier_sessions") == n
        assert gauge("toktier_verifier_queue_depth") == n

    def writer(values):
        for n in values:
            m.set_state(o, store=Store(n), verifier=SimpleNamespace(queue_depth=n))

    threads = [threading.Thread(target=writer, args=(range(k, 3000, 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in (2999, 11, 2999):
        m.set_state(o, store=Store(n), verifier=SimpleNamespace(queue_depth=n))
        assert gauge("toktier_session_memory_bytes") == gauge("toktier_sessions") == n
        assert gauge("toktier_verifier_queue_depth") == n
