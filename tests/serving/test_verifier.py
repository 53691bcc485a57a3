"""Shadow verifier (no Triton): sampling, bounded queue, mismatch repro, quarantine, operator clear.

A :class:`tests.faulty_engine.FaultyEngine` is installed after admission: it swaps the last id of any text
holding ``FAULTY`` for another id of the same byte length (the splice's offset re-check cannot see that).
Every expected id is the HF reference's, computed here.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import toktier_backend as tt
from toktier_backend.serving.verifier import QuarantineFile, Verifier, build_key
from toktier_backend.faces.triton import Handler

from ..faulty_engine import TRIGGER, install

GPT2 = tt.default_tokenizer_path()


@pytest.fixture
def tok():
    return tt.load_tokenizer(GPT2)  # a fresh one per test: quarantine is per Tokenizer


def ref(tok, text, flag=True):
    return tok.reference.encode(text, add_special_tokens=flag).ids


def test_faulty_engine_is_wrong_and_invisible_to_the_offset_check(tok):
    install(tok)
    s = tok.session()
    s.update("hello there, ")
    got = s.append(f"a {TRIGGER} reply").tolist()
    assert got != ref(tok, s.text)  # the fault reaches the reply: only the verifier can catch it
    assert s.last_repair.route == "append" and s.last_repair.engine == "faulty"


def test_mismatch_quarantines_and_replies_are_exact_after(tok, tmp_path, caplog):
    install(tok)
    v = Verifier(tok, rate=0.0, first_n=1000, quarantine_file=tmp_path / "q.json", name="gpt2-test")
    h = Handler(tok, name="gpt2-test", verifier=v)
    held = h.handle_session("a", b"base text, ", start=True)["INPUT_ID"].tolist()
    other = h.handle_session("b", b"another session ", start=True)["INPUT_ID"].tolist()
    assert other == ref(tok, "another session ")
    text = f"base text, with {TRIGGER} inside"
    with caplog.at_level(logging.ERROR):
        out = h.handle_session("a", f"with {TRIGGER} inside".encode(), mode="delta", reply="full")
        assert v.drain(30)
    assert out["INPUT_ID"].tolist() != ref(tok, text)  # the wrong reply that went out before the check
    assert v.mismatches == 1 and v.samples == 3
    # the engine alone reproduces it on a small window: every fast route is quarantined
    assert set(tok.quarantined) == {"full", "append", "edit"}
    r = v.repros[-1]
    assert r.route == "append" and r.engine == "faulty" and r.engine_window is not None
    assert r.engine_window[1] - r.engine_window[0] <= 64 and r.text_window is None  # redacted
    log = "\n".join(m.getMessage() for m in caplog.records)
    assert "MISMATCH" in log and tok.spec.sha256 in log and "route=append" in log and "text redacted" in log
    assert "inside" not in log  # no text in the log without the debug flag
    assert QuarantineFile(tmp_path / "q.json").load()[build_key(tok)].keys() == {"full", "append", "edit"}
    # after quarantine: every reply is exact, the wrong session is rebuilt from the reference
    for sid, delta in (("a", f" and {TRIGGER} again"), ("b", f"{TRIGGER}!"), ("a", " end")):
        out = h.handle_session(sid, delta.encode(), mode="delta", reply="full")
        whole = h.store.get(sid).session.text
        assert out["INPUT_ID"].tolist() == ref(tok, whole)
    c = h.handle_session("c", f"new {TRIGGER} session".encode(), start=True)
    assert c["INPUT_ID"].tolist() == ref(tok, f"new {TRIGGER} session")
    assert h.handle_encode(f"x {TRIGGER}".encode())["INPUT_ID"].tolist() == ref(tok, f"x {TRIGGER}")
    assert h.store.get("a").session.last_repair.fallback == "quarantined"
    assert v.drain(30) and v.mismatches == 1
    # the operator clears it: the fast route serves again (and, this engine being broken, is caught again)
    assert sorted(v.release()) == ["append", "edit", "full"] and not tok.quarantined
    assert QuarantineFile(tmp_path / "q.json").load() == {}
    h.handle_session("d", f"cleared {TRIGGER}".encode(), start=True)
    assert v.drain(30) and v.mismatches == 2 and tok.quarantined
    v.close()


def test_debug_flag_logs_the_window(tok, caplog):
    install(tok)
    v = Verifier(tok, rate=1.0, first_n=0, debug=True)
    with caplog.at_level(logging.ERROR):
        ids = tok.encode(f"x {TRIGGER}")
        v.submit(f"x {TRIGGER}", ids, add_special_tokens=True, route="encode", engine="faulty")
        assert v.drain(30)
    r = v.repros[-1]
    assert r.text_window and f"x {TRIGGER}".endswith(r.text_window) and r.got_window != r.want_window
    assert repr(r.text_window) in "\n".join(m.getMessage() for m in caplog.records)
    assert set(tok.quarantined) == {"full", "append", "edit"}  # the engine reproduces it alone
    v.close()


def test_cut_suspect_quarantines_only_its_route(tok):
    """A wrong reply the engine does not reproduce alone (a bad splice) quarantines only its route."""
    v = Verifier(tok, rate=1.0, first_n=0)
    text = "one two three"
    ids = np.array(ref(tok, text), dtype=np.int32)
    ids[1], ids[2] = ids[2], ids[1]
    v.submit(text, ids, add_special_tokens=True, route="edit", cut=3, engine="gigatoken")
    assert v.drain(30) and v.mismatches == 1
    assert list(tok.quarantined) == ["edit"] and v.repros[-1].engine_window is None
    v.close()


def test_sampling_first_n_then_rate(tok):
    v = Verifier(tok, rate=0.0, first_n=3)
    assert [v.wants() for _ in range(5)] == [True, True, True, False, False]
    v2 = Verifier(tok, rate=0.5, first_n=0, seed=1)
    hits = sum(v2.wants() for _ in range(2000))
    assert 850 < hits < 1150
    # a new engine build starts its own first N
    install(tok)
    assert v.wants() and v.wants() and v.wants() and not v.wants()
    v.close(), v2.close()


def test_cpu_budget_bounds_random_samples_not_the_first_n(tok, monkeypatch):
    """Beyond the first ``first_n``, a reply the rate picks is sampled only while the checks' busy time is
    within ``cpu_share`` x uptime + ``BURST_S``; the first ``first_n`` are sampled regardless."""
    from toktier_backend.serving import verifier as vmod

    monkeypatch.setattr(vmod, "BURST_S", 0.05)
    v = Verifier(tok, rate=1.0, first_n=1, cpu_share=0.01)
    real = v._check
    v._check = lambda s: (time.sleep(0.3), real(s))  # a check as long as a 100K-char re-encode
    assert v.wants()  # the first one, and within budget anyway
    text = "budgeted checks " * 20
    assert v.submit(text, np.array(ref(tok, text), dtype=np.int32), add_special_tokens=True, route="full")
    assert v.drain(30) and v.samples == 1 and v.mismatches == 0
    assert not any(v.wants() for _ in range(40))  # 0.3 s spent > 0.01 x (< 5 s) + 0.05 s
    assert v.budget_skipped == 40
    unbounded = Verifier(tok, rate=1.0, first_n=0, cpu_share=None)
    unbounded._spent = 1e6  # as if it had checked for days: no budget, so still sampled
    assert all(unbounded.wants() for _ in range(10))
    with pytest.raises(ValueError, match="cpu_share"):
        Verifier(tok, cpu_share=1.5)
    v.close(), unbounded.close()


def test_full_queue_drops_and_never_blocks(tok):
    v = Verifier(tok, rate=1.0, first_n=0, queue_size=2)
    gate = threading.Event()
    real = v._check
    v._check = lambda s: (gate.wait(10), real(s))  # hold the worker on the first sample
    text = "hello world"
    ids = tok.encode(text)
    results = [v.submit(text, ids, add_special_tokens=True, route="encode") for _ in range(6)]
    # one taken by the worker (maybe), two queued, the rest dropped at once
    assert results[:2] == [True, True] and results.count(False) >= 3 and v.dropped == results.count(False)
    gate.set()
    assert v.drain(30) and v.mismatches == 0 and v.samples == results.count(True)
    v.close()


def test_queue_byte_bound_drops(tok):
    v = Verifier(tok, rate=1.0, first_n=0, max_queue_bytes=1000)
    assert not v.submit("x" * 5000, np.zeros(10, np.int32), add_special_tokens=True, route="encode")
    assert v.dropped == 1
    v.close()


def test_quarantine_file_reaches_other_instances_and_operator_clears(tok, tmp_path):
    """Two instances (two Tokenizers, as two processes would have) share the file; an operator's clear
    (``toktier quarantine clear``) reaches both."""
    other = tt.load_tokenizer(GPT2)
    path = tmp_path / "q.json"
    v1 = Verifier(tok, rate=0, first_n=0, quarantine_file=path, poll_s=0)
    v2 = Verifier(other, rate=0, first_n=0, quarantine_file=path, poll_s=0)
    v1.quarantine("append", "test")
    v2.sync()
    assert "append" in other.quarantined
    from toktier_backend.deploy.cli_serve import main

    assert main(["quarantine", "clear", "--file", str(path), "--route", "append"]) == 0
    v1.sync(), v2.sync()
    assert not tok.quarantined and not other.quarantined
    # a restart (a new Verifier on a fresh Tokenizer) picks the file up at once
    v1.quarantine("edit", "test")
    fresh = tt.load_tokenizer(GPT2)
    v3 = Verifier(fresh, rate=0, first_n=0, quarantine_file=path)
    assert list(fresh.quarantined) == ["edit"]
    for v in (v1, v2, v3):
        v.close()


def test_quarantine_rejects_unknown_route(tok):
    with pytest.raises(ValueError, match="fast routes"):
        tok.quarantine("noop", "x")


def test_quarantine_drops_prefix_reuse(tok):
    """Cross-session prefix reuse (``pipeline/prefix_index.py``) may hold ids from the route being
    quarantined: the index is cleared, and skipped while any route is quarantined."""
    assert tok.prefix_index is not None
    install(tok)
    step = tok.prefix_index.step
    head = f"{TRIGGER}" + "".join(f"line {i} of the shared prefix\n" for i in range(3 * step // 28 + 8))
    first = tok.encode(head + "first tail")
    tok.prefix_index.drain()
    assert len(tok.prefix_index) > 0
    assert first.tolist() != ref(tok, head + "first tail")  # the faulty engine's ids, now indexed
    tok.quarantine("full", "test")
    assert len(tok.prefix_index) == 0
    assert tok.encode(head + "second tail").tolist() == ref(tok, head + "second tail")


def test_sample_taken_by_reference_is_the_state_at_reply_time(tok):
    """The core hands a sampled session reply over by reference (its text blocks, its copy-on-write ids
    view): appends, an edit and a truncation of the session after the reply, before the check runs, change
    nothing the sample holds, so every check passes against the HF ids of the text as it was."""
    v = Verifier(tok, rate=1.0, first_n=0)
    gate = threading.Event()
    real = v._check
    checked: list[tuple[str, list[int]]] = []
    v._check = lambda s: (gate.wait(10), checked.append((s.text, s.ids.tolist())), real(s))
    h = Handler(tok, name="gpt2-test", verifier=v)
    h.handle_session("k", b"def pipe", start=True)
    texts = ["def pipe"]
    for delta in ["line(x):", "\n    return x", " + 1\n"]:
        h.handle_session("k", delta.encode(), mode="delta", reply="patch")
        texts.append(texts[-1] + delta)
    for new in [texts[-1].replace("pipe", "pipes"), texts[-1][:10]]:  # an edit, then a truncation
        h.handle_session("k", new.encode(), mode="full", reply="patch")
        texts.append(new)
    gate.set()
    assert v.drain(30)
    assert [t for t, _ in checked] == texts
    assert [ids for _, ids in checked] == [ref(tok, t) for t in texts]
    assert v.samples == len(texts) and v.mismatches == 0
    v.close()
