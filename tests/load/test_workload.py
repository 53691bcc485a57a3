"""Unit tests of load/workload.py (no server, no locust): sessions, pacing, exact stats, reference checks."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "load"))

import workload  # noqa: E402
from workload import Pacer, Recorder, ReferenceChecker, Sample, StepStats, Workload  # noqa: E402

BUNDLED = REPO / "toktier_backend" / "data" / "gpt2" / "tokenizer.json"


@pytest.fixture(scope="module")
def wl() -> Workload:
    folder = workload.default_corpus()
    if folder is None:
        pytest.fail("../shared/corpus/swe-agent missing (tests need ../shared beside the repo)")
    return Workload(folder, context_chars=100_000)


def test_base_context_is_whole_messages_near_the_target(wl):
    for k in range(3):
        base = wl.base(k)
        assert 90_000 <= len(base) <= 100_000  # cut back to a message end, never past the target
        assert base.endswith("<|im_end|>\n") and base.startswith("<|im_start|>")
    assert wl.base(0) != wl.base(1)  # rotated per session
    assert Workload(wl.folder, context_chars=0).base(0) == ""


def test_session_turns_grow_by_their_deltas(wl):
    s = wl.session(2)
    assert s.position == 0 and s.delta() == s.text(0) and s.text(0).startswith(s.base)
    n = len(s.trajectory.turns)
    texts = [s.text(0)]
    for i in range(1, n):
        s.position = i
        assert s.text() == texts[-1] + s.delta()  # delta mode sends exactly what full mode adds
        texts.append(s.text())
    assert s.last and not s.done
    s.position = n
    assert s.done


def test_open_loop_pacer_offers_the_rate_whatever_the_latency():
    rate, users = 200.0, 50
    p = Pacer(rate, users, seed=1)
    rng = random.Random(2)
    arrivals = []
    for _ in range(users):
        t = p.first(0.0)
        for _ in range(400):
            arrivals.append(t)
            t = p.next_after(t, t + rng.uniform(0, 5))  # replies up to 5 s late: the schedule ignores them
    arrivals = sorted(arrivals)
    horizon = 60.0
    measured = sum(1 for t in arrivals if t < horizon) / horizon
    assert measured == pytest.approx(rate, rel=0.05)


def test_closed_loop_waits_for_the_reply():
    p = Pacer(None, 1, think_s=0.0)
    assert p.next_after(1.0, 3.5) == 3.5


def test_exact_percentiles_and_unfinished_count_as_misses():
    samples = [Sample("session", "turn", i, i, i + ms / 1e3, True, 10) for i, ms in enumerate([1.234, 2.5, 3.75, 4.0])]
    st = StepStats.of(samples, due=4, seconds=2.0)
    assert st.p50_ms == pytest.approx(float(np.percentile([1.234, 2.5, 3.75, 4.0], 50)))  # not rounded to 1 ms
    assert st.unfinished == 0 and st.achieved_rps == 2.0
    st = StepStats.of(samples, due=5, seconds=2.0)
    assert st.unfinished == 1 and math.isinf(st.p99_ms) and math.isinf(st.max_ms)


def test_recorder_window_counts_due_arrivals():
    rec = Recorder()
    for t in (0.5, 1.5, 2.5):
        rec.due(t)
    rec.add(Sample("stateless", "encode", 1.5, 1.5, 1.502, True, 100))
    rec.add(Sample("stateless", "encode", 0.5, 0.5, 0.501, True, 100))
    st = rec.window("stateless", 1.0, 3.0)
    assert (st.n, st.due, st.unfinished) == (1, 2, 1)
    rec.add(Sample("stateless", "encode", 2.5, 2.5, 3.5, True, 100))  # due inside, answered after the window
    st = rec.window("stateless", 1.0, 3.0)
    assert (st.n, st.unfinished, st.answered) == (2, 0, 1)
    assert st.achieved_rps == 0.5  # throughput counts replies within the window
    assert st.p99_ms == pytest.approx(float(np.percentile([2.0, 1000.0], 99)))  # the late one sets the tail


def test_reference_checker_catches_a_wrong_reply():
    ref = tokenizers.Tokenizer.from_file(str(BUNDLED))
    c = ReferenceChecker(BUNDLED, fraction=1.0, max_pending=10)
    good = np.asarray(ref.encode("hello world").ids, dtype=np.int32)
    assert good.tolist() == [31373, 995]
    c.offer("session", "hello world", True, good)
    assert c.check() == (1, 0)
    c.offer("session", "hello world", True, np.array([31373, 996], dtype=np.int32))
    assert c.check() == (1, 1) and "first difference at id 1" in c.first_mismatch
    c.fraction = 0.0
    c.offer("session", "x", True, good)
    assert c.check() == (0, 0)
