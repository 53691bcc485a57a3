"""The CPU pool (``toktier_backend.runtime.pool``): repairs before queued chunks, the express thread, inline
calls, FIFO baseline, errors, nice and CPU pinning of workers, one shared pool per process.

Where a chunked encode runs on the pool its ids are compared with the HF reference (``tests/conftest.py``
``reference(name)``) in ``tests/pipeline/test_chunked.py``; here the subject is scheduling.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from toktier_backend import corpus
from toktier_backend.runtime import pool as runtime_pool
from toktier_backend.runtime.pool import CHUNK, REPAIR, CpuPool

from ..conftest import load
from ..pipeline.chunked_helpers import make


def test_pool_runs_repairs_before_queued_chunks():
    p = CpuPool(1, name="test-order")
    gate = threading.Event()
    order: list[str] = []
    first = p.submit(gate.wait, priority=CHUNK)  # occupies the only worker
    while p.in_flight == 0:
        time.sleep(0.001)
    futs = [p.submit(order.append, f"c{i}", priority=CHUNK) for i in range(3)]
    futs.append(p.submit(order.append, "r0", priority=REPAIR))
    futs.append(p.submit(order.append, "c3", priority=CHUNK))
    futs.append(p.submit(order.append, "r1", priority=REPAIR))
    st = p.stats()
    assert st["queue_depth"] == 6 and st["in_flight"] == 1
    assert st["by_priority"]["repair"]["queued"] == 2 and st["by_priority"]["chunk"]["queued"] == 4
    gate.set()
    for f in [first, *futs]:
        f.result(timeout=10)
    assert order == ["r0", "r1", "c0", "c1", "c2", "c3"]
    st = p.stats()
    assert st["queue_depth"] == 0 and st["in_flight"] == 0
    assert st["by_priority"]["chunk"]["completed"] == 5 and st["by_priority"]["repair"]["completed"] == 2
    assert st["by_priority"]["repair"]["wait_ms_max"] > 0
    p.shutdown()


def test_express_thread_runs_a_repair_while_every_worker_is_busy():
    p = CpuPool(1, express=1, nice=5, name="test-express")
    gate = threading.Event()
    chunk = p.submit(gate.wait, 10, priority=CHUNK)  # the only general worker is busy
    while p.in_flight == 0:
        time.sleep(0.001)
    queued = p.submit(lambda: threading.current_thread().name, priority=REPAIR)  # a queued repair
    assert queued.result(timeout=10).startswith("test-express-express")
    assert not chunk.done()
    with pytest.raises(TimeoutError):  # an express thread never takes a chunk
        p.submit(lambda: None, priority=CHUNK).result(timeout=0.2)
    gate.set()
    assert chunk.result(timeout=10) is True
    st = p.stats()
    assert st["express"] == 1 and st["by_priority"]["repair"]["completed"] == 1
    assert CpuPool(1, express=1, fifo=True).express == 0  # the FIFO baseline has none
    p.shutdown()


def test_call_runs_a_repair_on_the_callers_thread_and_counts_it():
    """``CpuPool.call`` runs a repair inline (no hand-off to a pool thread), visible to ``repairs_active``
    while it runs and in the stats after; a FIFO pool queues it like any task."""
    p = CpuPool(1, express=1, name="test-inline")
    seen = p.call(lambda: (threading.current_thread(), p.repairs_active, p.in_flight), priority=REPAIR)
    assert seen == (threading.current_thread(), 1, 1)
    assert p.repairs_active == 0 and p.in_flight == 0
    st = p.stats()["by_priority"]["repair"]
    assert st["submitted"] == st["completed"] == 1 and st["wait_ms_max"] == 0.0
    with pytest.raises(KeyError):
        p.call(lambda: {}["x"])
    assert p.repairs_active == 0 and p.stats()["by_priority"]["repair"]["completed"] == 2
    # a queued repair counts while it waits
    gate = threading.Event()
    p2 = CpuPool(1, fifo=True, name="test-inline-fifo")
    blocker = p2.submit(gate.wait, 10)
    while p2.in_flight == 0:
        time.sleep(0.001)
    fut = p2.submit(threading.current_thread, priority=REPAIR)
    assert p2.repairs_active == 1
    gate.set()
    assert fut.result(timeout=10) is not threading.current_thread() and blocker.result(timeout=10)
    assert p2.call(threading.current_thread, priority=REPAIR) is not threading.current_thread()  # FIFO: queued
    p.shutdown(), p2.shutdown()


def test_fifo_pool_ignores_priority():
    p = CpuPool(1, fifo=True, name="test-fifo")
    gate = threading.Event()
    order: list[str] = []
    p.submit(gate.wait)
    while p.in_flight == 0:
        time.sleep(0.001)
    futs = [p.submit(order.append, "c0"), p.submit(order.append, "r0", priority=REPAIR)]
    gate.set()
    for f in futs:
        f.result(timeout=10)
    assert order == ["c0", "r0"]
    p.shutdown()


def test_pool_errors_and_nested_map_do_not_deadlock():
    p = CpuPool(1, name="test-nested")
    with pytest.raises(ZeroDivisionError):
        p.call(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        p.submit(lambda: 1 / 0, priority=REPAIR).result(timeout=10)
    # a repair on the only worker that needs a chunked encode: it runs its own chunks
    nested = p.submit(lambda: p.map(lambda x: x * x, list(range(20))), priority=REPAIR)
    assert nested.result(timeout=10) == [x * x for x in range(20)]
    with pytest.raises(ValueError):
        p.submit(print, priority=7)
    p.shutdown()
    with pytest.raises(RuntimeError):
        p.submit(print)


@pytest.mark.parametrize("express", [0, 1])
def test_repair_submitted_during_long_encode_finishes_first(corpus_texts, express):
    """The Delta Tokenizer property: a session repair submitted while a long full encode is running
    finishes before it, waiting at most about one chunk (here a chunk is ~20K chars, ~0.1 ms of the
    engine; the bound is loose for a loaded CI machine)."""
    tok = load("qwen3")
    p = CpuPool(2, express=express, name="test-delta")
    enc = make(tok, p, chunk_chars=20_000, min_chars=0)
    enc.prepare()  # (its warm-up is one chunk task per worker)
    warm = p.stats()["by_priority"]["chunk"]["completed"]
    text = corpus.long_session_text(3_000_000)
    n_chunks = len(enc.bounds(text)) - 1
    assert n_chunks >= 100
    s = tok.session(add_special_tokens=False)
    s.update("".join(corpus_texts)[:50_000])
    done: dict[str, float] = {}

    def long_encode():
        enc.encode(text)
        done["encode"] = time.perf_counter()

    t = threading.Thread(target=long_encode)
    t.start()
    while p.stats()["by_priority"]["chunk"]["completed"] < warm + 4:  # the encode is under way
        time.sleep(0.0005)
    t0 = time.perf_counter()
    ids = p.call(s.append, "\n<|im_start|>user\nnext turn, please<|im_end|>\n", priority=REPAIR)
    done["repair"] = time.perf_counter()
    t.join()
    assert s.last_repair.route == "append" and len(ids) > 0
    assert done["repair"] < done["encode"], "the repair waited for the whole encode"
    st = p.stats()
    assert st["by_priority"]["repair"]["completed"] == 1
    assert st["by_priority"]["chunk"]["completed"] == warm + n_chunks
    # it overtook the queued chunks: far fewer than all of them ran before it
    assert st["by_priority"]["repair"]["wait_ms_max"] < (done["encode"] - t0) * 1e3
    p.shutdown()


def test_shared_pool_is_one_per_process():
    assert runtime_pool.shared_pool() is runtime_pool.shared_pool()
    assert make(load("gpt2")).pool is runtime_pool.shared_pool()


def test_pool_nice_lowers_only_worker_threads():
    import os

    p = CpuPool(1, nice=5, name="test-nice")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    worker_nice = p.call(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), priority=CHUNK)
    assert worker_nice == min(19, base + 5)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
    p.shutdown()


def test_pin_holds_chunk_workers_on_distinct_cpus_only_while_they_run_chunks():
    """With two or more CPUs allowed, chunk workers are pinned to distinct CPUs while they run a chunk;
    with one (or no ``sched_getaffinity``), pinning is off and the same chunks still run."""
    cpus = sorted(getattr(os, "sched_getaffinity", lambda _: ())(0))
    p = CpuPool(2, express=1, pin=True, name="test-pin")
    if len(cpus) < 2:
        assert not p.pin
        assert p.map(lambda x: x + 1, [0, 1], priority=CHUNK) == [1, 2]
        p.shutdown()
        return
    assert p.pin
    seen: dict[str, set[int]] = {}
    barrier = threading.Barrier(2)

    def chunk_task(_):
        barrier.wait(timeout=10)  # both workers hold a chunk at once
        seen[threading.current_thread().name] = os.sched_getaffinity(0)
        return True

    p.map(chunk_task, [0, 1], priority=CHUNK)
    assert sorted(seen.values(), key=min) == [{cpus[0]}, {cpus[1]}]  # one CPU each, distinct
    # a repair is never pinned (the express thread, or a general worker); after a chunk, the whole set again
    for _ in range(4):
        assert p.submit(lambda: os.sched_getaffinity(0), priority=REPAIR).result(timeout=10) == set(cpus)
    assert os.sched_getaffinity(0) == set(cpus)  # the caller's own affinity is untouched
    p.shutdown()
    assert not CpuPool(2).pin and not CpuPool(1, pin=True).pin


def test_run_on_each_worker_runs_once_on_every_worker():
    p = CpuPool(3, express=1, name="test-each")
    try:
        names = p.run_on_each_worker(lambda: threading.current_thread().name)
        assert sorted(names) == [f"test-each-worker-{i}" for i in range(3)]
        with pytest.raises(RuntimeError, match="from one of its workers"):
            p.call(lambda: p.run_on_each_worker(lambda: None), priority=CHUNK)
    finally:
        p.shutdown()
