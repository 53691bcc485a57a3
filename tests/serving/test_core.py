"""The serving core itself (no Triton, no network): keyed steps, whole-text encodes by key or prompt prefix,
stateless encodes, one store and budget for all of them, busy sessions, errors, metrics labels per origin,
and the configuration parsed from model parameters.

Every id is checked against the HF reference computed here (``hf_ids``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import toktier_backend as tt
from toktier_backend.corpus import load_turns, trajectory_files
from toktier_backend.serving.core import CoreConfig, ServingCore
from toktier_backend.serving.metrics import Metrics, Origin
from toktier_backend.serving.session_store import PrefixKey
from toktier_backend.serving.verifier import Verifier

from .conftest import BUNDLED, hf_ids

A = Origin("triton", "toktier_session")
B = Origin("proxy", "completions")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def core(registry):
    tok = tt.load_tokenizer(BUNDLED)
    c = ServingCore(tok, name="gpt2", max_text_bytes=1 << 20, min_prefix_chars=64, checkpoint_chars=16,
                    metrics=Metrics(registry))
    c.register(A, sessions=True)
    c.register(B, sessions=True)
    yield c
    c.close()


def value(registry, name, **labels):
    want = set(labels.items())
    return sum(s.value for fam in registry.collect() for s in fam.samples
               if s.name == name and want <= set(s.labels.items()))


@pytest.fixture(scope="module")
def turns():
    return [t for t in load_turns(trajectory_files(None)[0]) if t.isascii()][:5]


# ---------------------------------------------------------------- keyed steps


def test_step_full_delta_patch_and_literal_ids(core):
    # provenance: HF tokenizers, openai-community/gpt2 tokenizer.json (bundled)
    r = core.step(A, 7, b"hello", start=True)
    assert r.ids.tolist() == [31373] and r.n == 1 and r.keep == 0 and r.fresh and r.session == "key"
    r = core.step(A, 7, b" world", mode="delta", reply="patch")
    assert [31373][: r.keep] + r.ids.tolist() == hf_ids("bundled", "hello world") == [31373, 995]
    assert r.n == 2 and r.keep == 1 and not r.fresh and r.ids.dtype == np.int32
    r = core.step(A, 7, b"hello there", reply="full", end=True)  # an edit in full mode, then END
    assert r.ids.tolist() == hf_ids("bundled", "hello there") and 7 not in core.store
    with pytest.raises(tt.UnknownSession, match="MODE='full'"):
        core.step(A, 7, b"!", mode="delta")


def test_returned_ids_are_never_changed_by_a_later_call(core):
    first = core.step(A, "k", b"x = pipe", start=True).ids
    kept = first.copy()
    core.step(A, "k", b"line(1)", mode="delta")
    core.step(A, "k", b"y = 2")
    assert first.tolist() == kept.tolist()


def test_step_waits_for_a_session_in_use(core):
    """A sequence's requests are served in order: a step finding its session in use waits for it."""
    core.step(A, "seq", b"start:", start=True)
    entry = core.store.get("seq")
    entry.lock.acquire()  # another request is using it
    got = []
    t = threading.Thread(target=lambda: got.append(core.step(A, "seq", b" more", mode="delta")))
    t.start()
    time.sleep(0.2)
    assert not got  # still waiting
    entry.lock.release()
    t.join(10)
    assert got[0].ids.tolist() == hf_ids("bundled", "start: more") and not got[0].fresh


def test_start_is_honoured_even_when_the_request_is_refused(core, registry):
    core.step(A, 5, b"old text", start=True)
    with pytest.raises(tt.InvalidRequest, match="START"):
        core.step(A, 5, b"x", mode="delta", start=True)
    assert 5 not in core.store
    core.step(A, 6, b"old text", start=True)
    core.refuse(A, tt.InvalidRequest("bad tensors"), key=6, start=True)  # a face could not parse the request
    assert 6 not in core.store
    assert value(registry, "toktier_session_evictions_total", face="triton", cause="start") == 2
    assert value(registry, "toktier_request_errors_total", face="triton", code="INVALID_ARG") == 2


# ---------------------------------------------------------------- whole texts: by key, by prefix, stateless


def test_encode_by_key_repairs_and_replaces_on_a_new_flag(core, turns):
    text = turns[0]
    r = core.encode(B, text, key="conv-1")
    assert r.ids.tolist() == hf_ids("bundled", text) and r.shown_route == "new" and r.session == "key"
    r = core.encode(B, text + "\nuser: one more", key="conv-1")
    assert r.ids.tolist() == hf_ids("bundled", text + "\nuser: one more") and r.route == "append" and r.keep > 0
    assert r.shown_route == "append"
    r = core.encode(B, text, key="conv-1", add_special_tokens=False)
    assert r.ids.tolist() == hf_ids("bundled", text, False) and r.fresh


def test_encode_finds_a_session_by_prefix_and_forks_get_their_own(core, turns):
    text = turns[0] * 3
    r = core.encode(B, text)
    assert r.session == "prefix" and r.fresh and r.ids.tolist() == hf_ids("bundled", text)
    grown = text + "\nuser: and one more turn"
    r = core.encode(B, grown)
    assert r.session == "prefix" and r.route == "append" and r.keep > 0 and r.ids.tolist() == hf_ids("bundled", grown)
    assert len(core.store) == 1 and isinstance(next(iter(core.store._entries)), PrefixKey)
    fork = text[:40] + " a different conversation " * 10  # shares only the first checkpoints
    r = core.encode(B, fork)
    assert r.fresh and r.ids.tolist() == hf_ids("bundled", fork) and len(core.store) == 2
    short = "hi"  # under min_prefix_chars: no session
    r = core.encode(B, short)
    assert r.route == "encode" and r.session is None and r.ids.tolist() == hf_ids("bundled", short)
    assert len(core.store) == 2


def test_a_busy_session_is_not_waited_for_by_whole_text_encodes(core, turns):
    text = turns[1] * 2
    core.encode(B, text, key="busy")
    core.encode(B, text + " prefix twin")
    for key in ("busy", None):
        entry = core.store.get("busy") if key else core.store.find_prefix(core.store.checkpoints(text, True)[0])[1]
        with entry.lock:  # another request holds it
            r = core.encode(B, text + " again", key=key)
        assert r.route == "busy" and r.keep == 0 and r.ids.tolist() == hf_ids("bundled", text + " again")


def test_keyed_and_prefix_sessions_share_one_lru_and_budget(turns, registry):
    tok = tt.load_tokenizer(BUNDLED)
    clock = Clock()
    core = ServingCore(tok, min_prefix_chars=64, checkpoint_chars=16, max_sessions=3, clock=clock,
                       metrics=Metrics(registry))
    core.register(B, sessions=True)
    texts = [f"{i}: " + turns[2] for i in range(4)]
    clock.t += 1
    core.encode(B, texts[0], key="k0")
    clock.t += 1
    core.encode(B, texts[1])  # by prefix
    clock.t += 1
    core.encode(B, texts[2], key="k2")
    clock.t += 1
    core.encode(B, texts[0] + " touched", key="k0")  # k0 is now the most recently used
    clock.t += 1
    core.encode(B, texts[3])  # a fourth session: the prefix one (least recently used) goes
    keys = list(core.store._entries)
    assert len(keys) == 3 and "k0" in keys and "k2" in keys and not any(k == "k1" for k in keys)
    assert sum(isinstance(k, PrefixKey) for k in keys) == 1
    assert core.store.find_prefix(core.store.checkpoints(texts[1], True)[0]) is None  # unindexed with it
    assert value(registry, "toktier_session_evictions_total", face="proxy", cause="budget") == 1
    assert value(registry, "toktier_sessions", face="proxy", model="completions") == 3
    core.close()


def test_ttl_drops_prefix_sessions_too(turns):
    clock = Clock()
    core = ServingCore(tt.load_tokenizer(BUNDLED), min_prefix_chars=64, checkpoint_chars=16, session_ttl_s=10,
                       clock=clock)
    text = turns[3]
    core.encode(B, text)
    clock.t += 11
    r = core.encode(B, text + " later")
    assert r.fresh and core.store.evictions["idle"] == 1 and r.ids.tolist() == hf_ids("bundled", text + " later")


def test_stateless_encode_and_bad_input(core, registry):
    assert core.encode_stateless(A, b"hello world").ids.tolist() == [31373, 995]
    for raw, why in ((b"\xff", "UTF-8"), ("lone \ud800", "surrogate"), (b"a" * ((1 << 20) + 1), "max_text_bytes"),
                     (12, "must be a string")):
        with pytest.raises(tt.InvalidRequest, match=why):
            core.encode(B, raw, what="prompt")
    assert value(registry, "toktier_request_errors_total", face="proxy", model="completions", code="INVALID_ARG") == 4
    assert value(registry, "toktier_requests_total", face="triton", model="toktier_session", route="encode") == 1


# ---------------------------------------------------------------- verifier and metrics per origin


def test_verifier_samples_are_counted_under_their_origin(registry):
    tok = tt.load_tokenizer(BUNDLED)
    v = Verifier(tok, rate=1.0, first_n=0)
    core = ServingCore(tok, verifier=v, metrics=Metrics(registry))
    core.register(A, sessions=True)
    core.register(B, sessions=True)
    core.step(A, 1, b"a session", start=True)
    core.step(A, 1, b" grows", mode="delta")
    core.encode(B, "a prompt", key="x")
    core.encode_stateless(B, b"stateless")
    assert v.drain(30) and v.mismatches == 0
    assert value(registry, "toktier_verifier_samples_total", face="triton", result="match") == 2
    assert value(registry, "toktier_verifier_samples_total", face="proxy", result="match") == 2
    assert value(registry, "toktier_requests_total", face="triton", mode="delta") == 1
    assert value(registry, "toktier_requests_total", face="proxy", mode="full") == 1
    core.close()


def test_from_config_builds_a_serving_core(tmp_path):
    cfg = CoreConfig.from_parameters({
        "tokenizer": "default", "max_text_bytes": "1000", "session_budget_bytes": "50000", "max_sessions": "9",
        "verifier_rate": "0.5", "verifier_first_n": "0", "verifier_debug": "yes",
        "quarantine_file": str(tmp_path / "q.json"),
        "chunk_chars": "0", "parallel_min_chars": "${parallel_min_chars}", "pool_workers": "",
    })
    assert cfg.pool_workers is None and cfg.chunk_chars is None and cfg.parallel_min_chars is None
    core = ServingCore.from_config(cfg, sweeper=False)
    try:
        assert core.max_text_bytes == 1000 and core.store.max_bytes == 50_000 and core.store.max_sessions == 9
        assert core.verifier.rate == 0.5 and core.verifier.debug and core.verifier.file.path == tmp_path / "q.json"
        assert core.router is None and core.gpu_status is None
        assert core.encode_stateless(A, b"hello world").ids.tolist() == [31373, 995]
    finally:
        core.close()
    off = CoreConfig.from_parameters({"verifier_rate": "0", "verifier_first_n": "0"})
    core = ServingCore.from_config(off, sweeper=False)
    assert core.verifier is None
    core.close()


@pytest.mark.parametrize("params, name", [({"max_text_bytes": "lots"}, "max_text_bytes"),
                                          ({"verifier_rate": "often"}, "verifier_rate"),
                                          ({"verifier_debug": "maybe"}, "verifier_debug"),
                                          ({"gpu_engine": "fast"}, "gpu_engine")])
def test_bad_parameters_name_themselves(params, name):
    with pytest.raises(ValueError, match=name):
        CoreConfig.from_parameters(params)


def test_concurrent_faces_on_one_core_are_exact(core, turns):
    """Threads of several faces at once on one core (keyed steps, keyed and prefix encodes, stateless): every
    reply equals the HF reference; the store's bookkeeping stays consistent."""
    import concurrent.futures as cf

    def worker(i):
        ok = True
        text = f"worker {i}: " + turns[i % len(turns)]
        r = core.step(A, f"s{i}", text.encode(), start=True)
        ok &= r.ids.tolist() == hf_ids("bundled", text)
        for k in range(4):
            delta = f" turn {k} of {i}"
            text += delta
            r = core.step(A, f"s{i}", delta.encode(), mode="delta")
            ok &= r.ids.tolist() == hf_ids("bundled", text)
            prompt = f"agent {i % 3} " + text
            ok &= core.encode(B, prompt).ids.tolist() == hf_ids("bundled", prompt)
            ok &= core.encode(B, prompt, key=f"c{i % 2}").ids.tolist() == hf_ids("bundled", prompt)
            ok &= core.encode_stateless(B, delta.encode()).ids.tolist() == hf_ids("bundled", delta)
        core.step(A, f"s{i}", b"", mode="delta", end=True)
        return ok

    with cf.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(worker, range(16)))
    assert not any(f"s{i}" in core.store for i in range(16))
    assert core.store.nbytes == sum(e.nbytes for e in core.store._entries.values())
