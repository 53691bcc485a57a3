"""One shared CPU pool for chunk tasks and session repairs, with two priorities.

A session repair is short and never waits behind the chunks of a long request (a plain FIFO pool makes it
wait for all of them): :meth:`CpuPool.call` runs it at once on the caller's own thread (counted in the
pool's stats); one submitted with :meth:`CpuPool.submit` goes to the head of the queue and to an *express*
thread that takes only repairs. What a running repair still shares with a long encode is the GIL and the
cores: a chunked encode converts text to UTF-8 in pieces and releases the GIL between pieces while
:attr:`CpuPool.repairs_active` is non-zero, and the chunk workers run at a higher nice value in serving, so
a running repair keeps a core. :meth:`CpuPool.stats` gives queue depth, tasks in flight, wait and run times
for metrics.

Across processes (each Triton Python-backend model instance is a process with its own pool), the pools
cannot see each other: ``toktier_encode`` runs its chunk workers at a lower OS priority (``nice``, see
``model_repository/README.md``) so that a repair in a ``toktier_session`` process takes a core as soon as
it is runnable. Measurements: ``docs/design/parallel.md``.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterable

import numpy as np


log = logging.getLogger(__name__)

#: Task priorities of :class:`CpuPool` (lower runs first).
REPAIR = 0
CHUNK = 1
_PRIORITY_NAMES = {REPAIR: "repair", CHUNK: "chunk"}


def _allowed_cpus() -> list[int]:
    """The CPUs this process may run on (Linux ``sched_getaffinity``), ``[]`` where that is unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return []


def default_workers() -> int:
    """Cores this process may run on (``sched_getaffinity``; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------- pool


class _Task:
    __slots__ = ("fn", "args", "future", "priority", "enqueued_ns", "claimed")

    def __init__(self, fn, args, priority: int):
        self.fn, self.args, self.priority = fn, args, priority
        self.future: Future = Future()
        self.enqueued_ns = time.perf_counter_ns()
        self.claimed = False


class CpuPool:
    """Worker threads for chunk encodes and session repairs, with repairs first.

    Args:
        workers: general worker threads (default :func:`default_workers`, one per core): they run every
            task, repairs first.
        express: extra threads that run only submitted repairs (default 0; the shared pool has 1). A
            submitted repair then starts at once instead of after the running chunk, and, with ``nice``,
            takes a core from the chunk workers. (:meth:`call` runs a repair on the caller's thread.)
        fifo: ignore priorities, run tasks in submission order, no express threads: the plain FIFO pool the
            benchmark compares with.
        nice: raise the general workers' nice value by this much (Linux, per thread; 0 = unchanged; express
            threads keep the process's). ``toktier_encode`` sets 10 so its chunks yield the cores to
            ``toktier_session`` processes; the shared pool of a session process, 5, so its own chunks yield
            to its repairs. Linux weighs a nice-0 thread ~3x a nice-5 one, ~9x a nice-10 one.
        name: thread name prefix.
        window: how many recent tasks per priority :meth:`stats` computes percentiles over.
        pin: while a general worker runs a :data:`CHUNK` task, pin it to a CPU of its own (worker ``i`` to the
            ``i``-th CPU this process may use, modulo their number; Linux ``sched_setaffinity`` on the thread),
            and give it back the whole set after. Why: the scheduler, waking two chunk workers from a busy
            thread, may put both on one core and keep them there for most of a long encode
            (``docs/design/parallel.md``). Repairs are never pinned. Off where the process may use one CPU or there is no
            ``sched_setaffinity``; an ``OSError`` (the allowed set changed) leaves the worker unpinned. A
            thread started inside a pinned task inherits the pin, so chunk tasks must start none (gigatoken's
            ``encode_batch_padded(parallel=False)`` starts none; a Rust pool created lazily there, as
            fastokens' is, would stay on one CPU).

    Tasks run in priority order (:data:`REPAIR` before :data:`CHUNK`), FIFO within a priority. A task is
    never interrupted: without express threads, a repair submitted while every worker runs a chunk starts
    when the first of them ends. Workers start on first use and are daemon threads.

    Invariant: ``queue_depth + in_flight`` equals the tasks submitted and not yet finished.
    """

    def __init__(self, workers: int | None = None, *, express: int = 0, fifo: bool = False, nice: int = 0,
                 name: str = "toktier-cpu", window: int = 4096, pin: bool = False):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        if express < 0:
            raise ValueError(f"express must be >= 0, got {express!r}")
        self.workers = int(workers or default_workers())
        self.fifo = bool(fifo)
        self.express = 0 if self.fifo else int(express)
        self.nice = int(nice)
        self.name = name
        self._cpus = _allowed_cpus() if pin else []
        self.pin = len(self._cpus) > 1 and self.workers > 1
        self._lock = threading.Lock()
        self._each_lock = threading.Lock()  # run_on_each_worker
        self._cv = threading.Condition(self._lock)  # general workers wait here
        self._cv_express = threading.Condition(self._lock)  # express threads wait here
        self._idle_express = 0
        self._heap: list[tuple[int, int, _Task]] = []
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._local = threading.local()
        #: Tasks waiting in the queue, by priority name.
        self._queued = {REPAIR: 0, CHUNK: 0}
        #: Tasks running now (on workers, or on a worker's behalf by a helping caller, or inline repairs).
        self.in_flight = 0
        self._repairs_running = 0
        #: Set while no CHUNK task is queued or running (:meth:`wait_chunks_idle`).
        self._chunks_active = 0
        self._chunks_idle = threading.Event()
        self._chunks_idle.set()
        self.submitted = {REPAIR: 0, CHUNK: 0}
        self.completed = {REPAIR: 0, CHUNK: 0}
        self._wait_sum_ms = {REPAIR: 0.0, CHUNK: 0.0}
        self._wait_max_ms = {REPAIR: 0.0, CHUNK: 0.0}
        self._waits = {REPAIR: deque(maxlen=window), CHUNK: deque(maxlen=window)}
        self._runs = {REPAIR: deque(maxlen=window), CHUNK: deque(maxlen=window)}

    # -------------------------------------------------------------- submitting
    def submit(self, fn: Callable[..., Any], /, *args: Any, priority: int = CHUNK) -> Future:
        """Queue ``fn(*args)``; its :class:`~concurrent.futures.Future` holds the result or the exception.

        Raises:
            ValueError: unknown ``priority``.
            RuntimeError: the pool was shut down.
        """
        return self._push(_Task(fn, args, priority)).future

    def _push(self, task: _Task) -> _Task:
        if task.priority not in _PRIORITY_NAMES:
            raise ValueError(f"priority must be REPAIR ({REPAIR}) or CHUNK ({CHUNK}), got {task.priority!r}")
        key = 0 if self.fifo else task.priority
        with self._cv:
            if self._closed:
                raise RuntimeError(f"pool {self.name!r} is shut down")
            heapq.heappush(self._heap, (key, next(self._seq), task))
            self._queued[task.priority] += 1
            if task.priority == CHUNK:
                self._chunks_active += 1
                self._chunks_idle.clear()
            self.submitted[task.priority] += 1
            if not self._threads:
                for i in range(self.workers + self.express):
                    self._start_worker(express=i >= self.workers)
            if task.priority == REPAIR and self._idle_express:
                self._cv_express.notify()
            else:
                self._cv.notify()
        return task

    def call(self, fn: Callable[..., Any], /, *args: Any, priority: int = REPAIR) -> Any:
        """Run ``fn(*args)`` for the caller and return its result (re-raises its exception).

        A :data:`REPAIR` runs at once on the calling thread (not in a FIFO pool), counted in :meth:`stats`
        with a wait of 0 and seen by :attr:`repairs_active` (chunk conversions yield the GIL to it): the
        caller's thread is already running, and handing the repair to a pool thread costs a wake-up and two
        GIL hand-offs (``docs/design/parallel.md``).
        In a FIFO pool, and for :data:`CHUNK`, it is queued like :meth:`submit`. Called from a pool worker it
        runs inline: the caller already holds a worker.
        """
        if self.in_worker():
            return fn(*args)
        if priority == REPAIR and not self.fifo:
            return self._run_inline(fn, args)
        return self.submit(fn, *args, priority=priority).result()

    @property
    def repairs_active(self) -> int:
        """Repairs queued or running now (inline ones included). A chunked encode's UTF-8 conversion checks
        it between pieces and releases the GIL while it is non-zero (``ChunkedEncoder``)."""
        return self._queued[REPAIR] + self._repairs_running

    def wait_chunks_idle(self, timeout: float | None = None) -> bool:
        """Block until no :data:`CHUNK` task is queued or running (at most ``timeout`` seconds); ``True``
        if none is. Background work that would take a core and GIL turns from a chunked encode's pinned
        workers (the prefix index's inserts, ``pipeline/prefix_index.py``) waits here between steps."""
        return self._chunks_idle.wait(timeout)

    def _run_inline(self, fn: Callable[..., Any], args: tuple) -> Any:
        with self._cv:
            self.submitted[REPAIR] += 1
            self.in_flight += 1
            self._repairs_running += 1
        start = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            run_ms = (time.perf_counter_ns() - start) / 1e6
            with self._cv:
                self.in_flight -= 1
                self._repairs_running -= 1
                self.completed[REPAIR] += 1
                self._waits[REPAIR].append(0.0)  # (wait sum and max: unchanged by a wait of 0)
                self._runs[REPAIR].append(run_ms)

    def map(self, fn: Callable[..., Any], items: Iterable, *, priority: int = CHUNK) -> list:
        """``[fn(x) for x in items]``, run on the pool; results in order, first exception re-raised.

        Each task is queued as soon as ``items`` yields its item, so a generator that prepares items on the
        calling thread overlaps that work with the tasks already queued.

        A pool worker that calls this (a session repair whose text needs a full encode) runs its own
        not-yet-started tasks itself while it waits, so the pool cannot deadlock on nested waits.
        """
        tasks = [self._push(_Task(fn, (x,), priority)) for x in items]
        if self.in_worker():
            for task in tasks:
                if self._claim(task):
                    self._run(task, helped=True)
        return [t.future.result() for t in tasks]

    def run_on_each_worker(self, fn: Callable[[], Any], *, timeout: float = 30.0) -> list:
        """``fn()`` once on every general worker thread, all at once (each task waits at a barrier until
        every worker holds one, so no worker takes two), as :data:`CHUNK` tasks (pinned where the pool pins);
        results in task order. For per-thread warm-up at load (``ChunkedEncoder.prepare``).

        Raises:
            RuntimeError: called from one of this pool's workers (it would wait for itself).
            threading.BrokenBarrierError: the workers were not all free within ``timeout`` seconds.
            Whatever ``fn`` raises.
        """
        if self.in_worker():
            raise RuntimeError(f"pool {self.name!r}: run_on_each_worker called from one of its workers")
        barrier = threading.Barrier(self.workers)

        def task():
            barrier.wait(timeout)
            return fn()

        with self._each_lock:  # one set at a time: two interleaved sets would each hold a worker at a barrier
            return [f.result() for f in [self.submit(task, priority=CHUNK) for _ in range(self.workers)]]

    def in_worker(self) -> bool:
        """Is the calling thread one of this pool's workers?"""
        return getattr(self._local, "worker", False)

    # -------------------------------------------------------------- running
    def _start_worker(self, express: bool = False) -> None:
        kind = "express" if express else "worker"
        t = threading.Thread(target=self._worker, args=(express, len(self._threads)),
                             name=f"{self.name}-{kind}-{len(self._threads)}", daemon=True)
        self._threads.append(t)
        t.start()

    def _claim(self, task: _Task) -> bool:
        with self._cv:
            if task.claimed:
                return False
            task.claimed = True
            self._queued[task.priority] -= 1
            self.in_flight += 1
            self._repairs_running += task.priority == REPAIR
            return True

    def _worker(self, express: bool = False, index: int = 0) -> None:
        self._local.worker = True
        cpu = self._cpus[index % len(self._cpus)] if self.pin and not express else None
        if self.nice > 0 and not express:
            try:  # Linux: PRIO_PROCESS with a thread id sets that thread's nice value
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
            except (AttributeError, OSError) as e:  # pragma: no cover - non-Linux
                log.warning("pool %s: cannot lower worker priority: %s", self.name, e)
        while True:
            with self._lock:
                while True:
                    while self._heap and self._heap[0][2].claimed:  # run by a helping caller already
                        heapq.heappop(self._heap)
                    if self._heap and (not express or self._heap[0][2].priority == REPAIR):
                        _, _, task = heapq.heappop(self._heap)
                        task.claimed = True
                        self._queued[task.priority] -= 1
                        self.in_flight += 1
                        self._repairs_running += task.priority == REPAIR
                        break
                    if self._closed and not self._heap:
                        return  # closed and drained
                    if express:  # only repairs; a repair is always at the top of the heap when queued
                        self._idle_express += 1
                        self._cv_express.wait()
                        self._idle_express -= 1
                    else:
                        self._cv.wait()
            if cpu is not None and task.priority == CHUNK:
                cpu = self._run_pinned(task, cpu)
            else:
                self._run(task)

    def _run_pinned(self, task: _Task, cpu: int) -> int | None:
        """Run a chunk task pinned to ``cpu`` (see ``pin``); the CPU to pin to next time, ``None`` once
        pinning failed (the worker then stays unpinned)."""
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError as e:
            log.warning("pool %s: cannot pin a worker to CPU %d (%s); it runs unpinned", self.name, cpu, e)
            self._run(task)
            return None
        try:
            self._run(task)
        finally:
            try:
                os.sched_setaffinity(0, self._cpus)
            except OSError:  # pragma: no cover - the allowed set shrank under us: take what is allowed now
                os.sched_setaffinity(0, _allowed_cpus() or self._cpus)
        return cpu

    def _run(self, task: _Task, helped: bool = False) -> None:
        start = time.perf_counter_ns()
        wait_ms = (start - task.enqueued_ns) / 1e6
        if not task.future.set_running_or_notify_cancel():
            result, exc = None, None
        else:
            try:
                result, exc = task.fn(*task.args), None
            except BaseException as e:  # handed to the caller
                result, exc = None, e
        run_ms = (time.perf_counter_ns() - start) / 1e6
        with self._cv:
            self.in_flight -= 1
            p = task.priority
            self._repairs_running -= p == REPAIR
            self.completed[p] += 1
            self._wait_sum_ms[p] += wait_ms
            self._wait_max_ms[p] = max(self._wait_max_ms[p], wait_ms)
            self._waits[p].append(wait_ms)
            self._runs[p].append(run_ms)
            if p == CHUNK:
                self._chunks_active -= 1
                if not self._chunks_active:
                    self._chunks_idle.set()
        if task.future.cancelled():
            return
        if exc is not None:
            task.future.set_exception(exc)
        else:
            task.future.set_result(result)

    # -------------------------------------------------------------- metrics
    @property
    def queue_depth(self) -> int:
        """Tasks queued and not started."""
        return self._queued[REPAIR] + self._queued[CHUNK]

    def stats(self) -> dict:
        """A snapshot for metrics.

        Returns:
            ``{"workers", "express", "fifo", "nice", "queue_depth", "in_flight", "by_priority": {"repair"|"chunk":
            {"queued", "submitted", "completed", "wait_ms_mean", "wait_ms_max", "wait_ms_p50",
            "wait_ms_p99", "run_ms_p50", "run_ms_p99"}}}``. Wait = submission to start, run = start to end,
            in milliseconds; percentiles over the last ``window`` tasks of that priority (``None`` before
            the first).
        """
        with self._cv:
            out = {"workers": self.workers, "express": self.express, "fifo": self.fifo, "nice": self.nice,
                   "queue_depth": self.queue_depth, "in_flight": self.in_flight, "by_priority": {}}
            for p, name in _PRIORITY_NAMES.items():
                waits = np.asarray(self._waits[p], dtype=float)
                runs = np.asarray(self._runs[p], dtype=float)
                done = self.completed[p]
                out["by_priority"][name] = {
                    "queued": self._queued[p], "submitted": self.submitted[p], "completed": done,
                    "wait_ms_mean": self._wait_sum_ms[p] / done if done else None,
                    "wait_ms_max": self._wait_max_ms[p] if done else None,
                    "wait_ms_p50": float(np.percentile(waits, 50)) if len(waits) else None,
                    "wait_ms_p99": float(np.percentile(waits, 99)) if len(waits) else None,
                    "run_ms_p50": float(np.percentile(runs, 50)) if len(runs) else None,
                    "run_ms_p99": float(np.percentile(runs, 99)) if len(runs) else None,
                }
        return out

    def shutdown(self, wait: bool = True) -> None:
        """Stop accepting tasks; workers finish the queue and exit."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()
            self._cv_express.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


_shared: CpuPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> CpuPool:
    """The process-wide pool (created on first use: :func:`default_workers` general workers, pinned while they
    run chunks, and one express thread for repairs, nice unchanged). Every :class:`ChunkedEncoder` without a pool of its own, and the
    serving handler, use it."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CpuPool(express=1, name="toktier-shared", pin=True)
        return _shared


def shared_pool_if_started() -> CpuPool | None:
    """The process-wide pool if :func:`shared_pool` or :func:`configure_shared_pool` created one, else ``None``
    (never creates one: metrics read its stats without starting threads)."""
    with _shared_lock:
        return _shared


def configure_shared_pool(workers: int | None = None, *, express: int = 1, nice: int = 0,
                          pin: bool = True) -> CpuPool:
    """Replace the process-wide pool (a serving process sets its size, express threads, nice value and pinning at
    startup; see :class:`CpuPool`). The old pool, if any, finishes its queue in the background."""
    global _shared
    with _shared_lock:
        old, _shared = _shared, CpuPool(workers, express=express, nice=nice, name="toktier-shared", pin=pin)
    if old is not None:
        old.shutdown(wait=False)
    return _shared


__all__ = ["CHUNK", "REPAIR", "CpuPool", "configure_shared_pool", "default_workers", "shared_pool",
           "shared_pool_if_started"]
