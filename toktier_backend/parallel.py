"""Chunked full encode at stable cuts, and one shared CPU pool for chunk tasks and session repairs.

**Chunked encode.** A request with no session state (first turn, rebuild after eviction or restart, a
stateless caller) carries the whole text. :class:`ChunkedEncoder` splits it at stable cuts about
``chunk_chars`` apart (``CutFinder.last_cut`` near each grid point: the family predicates of
``pipeline/cuts``), encodes every chunk on its own on the shared pool, and concatenates the body ids. By
the definition of a stable cut (``finder.py``)::

    encode(text) == encode(text[:c1]) + encode(text[c1:c2]) + ... + encode(text[ck:])     (body ids)

so the result equals HF ``encode(text, add_special_tokens=False).ids``; the post-processor is applied once,
to the whole text, by ``Tokenizer.encode``. Each chunk is checked on its own: a chunk holding a guarded code
point (``admission.py``) goes to the reference, the others stay on the admitted engine.

**Why threads.** gigatoken 0.10.0 ``Tokenizer.encode`` holds the GIL for the whole call and runs on the
calling thread: it does *not* parallelize one document (no worker thread appears, CPU time equals wall
time), and any other Python thread waits a full 4M-char encode. ``GigatokenEngine.encode`` therefore calls
``encode_batch_padded([text], parallel=False)``: the same encoder, GIL released, and a shared borrow of the
Rust object (``Tokenizer.encode`` takes a mutable one: a second thread got ``Already borrowed``). gigatoken
also serializes concurrent calls on one Rust object (two threads encoding 2M chars each on one object take
as long as one thread doing both; on two objects, half), so the engine keeps one object per concurrent
caller (:meth:`ChunkedEncoder.prepare`). Each chunk is encoded to UTF-8 once under the GIL (that also
rejects lone surrogates and feeds the guard check); the rest of a chunk runs GIL-free. Engines without a
GIL-free encode (HF ``tokenizers`` holds the GIL in ``encode``) are not chunked: threads would only take
turns.

**gigatoken's own parallel path, and which is kept.** gigatoken's ``encode_batch(parallel=True)`` *does*
parallelize: it encodes a list of documents on its Rust thread pool (rayon, one thread per core) with the
GIL released once, grouping consecutive documents into work units of at least 2 MiB and splitting a single
document larger than that at its own "pretoken-safe" boundaries. We measured both (issue #4 asks for it):
chunks on our pool vs all our chunks (cut at our stable cuts, ~512K chars each, below gigatoken's unit, so
gigatoken only groups them and never cuts inside one) in one ``GigatokenEngine.encode_many`` call. The
batch call was faster at 2M, 3M and 4M chars in the same runs (:data:`BATCH_MIN_CHARS`: 4M chars, qwen3,
loaded machine, 21.2 vs 24.2 ms; the pool path pays one GIL hand-off per chunk start and end and keeps a
word cache per Rust object, each seeing a fraction of the text), so **texts from BATCH_MIN_CHARS up take
the batch path**; engines without ``encode_many``, and 1M-2M-char texts, keep the pool path. Each chunk is
still encoded to UTF-8 once on the calling thread and guard-checked on its own: a chunk with a guarded code
point is left out of the batch and encoded by the reference. The batch call runs outside the pool: session
repairs on the pool's express thread never wait for it, they only share the cores with gigatoken's threads
(``bench/full_encode.py --only mixed``, ``priority`` vs ``fifo``).

**Which is faster, per size** (``bench/full_encode.py``, same run, 2 cores): the whole-text encode below
:data:`MIN_CHARS` (1M chars: per-chunk overhead and GIL hand-offs eat the second core's gain), chunked
above it; the measured tables are in ``bench/README.md``.

**The shared pool** (the Delta Tokenizer design): :class:`CpuPool` runs chunk tasks and session repairs
from one queue with two priorities, on one worker thread per core plus an *express* thread that takes only
repairs. A repair is short and goes to the head of the queue: it never waits behind the chunks of a long
request (a plain FIFO pool makes it wait for all of them), and with the express thread it does not even
wait for the running chunk to end (without it, at most one chunk: ``chunk_chars`` chars, ~2 ms). Serving
also lowers the general workers' OS priority (``nice``), so a running repair keeps a core while chunks
wait. :meth:`CpuPool.stats` gives queue depth, tasks in flight, wait and run times for metrics.

Across processes (each Triton Python-backend model instance is a process with its own pool), the pools
cannot see each other: ``toktier_encode`` runs its chunk workers at a lower OS priority (``nice``, see
``model_repository/README.md``) so that a repair in a ``toktier_session`` process takes a core as soon as it
is runnable.
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
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .errors import InvalidRequest

if TYPE_CHECKING:  # pragma: no cover
    from .api import Tokenizer

log = logging.getLogger(__name__)

#: Task priorities of :class:`CpuPool` (lower runs first).
REPAIR = 0
CHUNK = 1
_PRIORITY_NAMES = {REPAIR: "repair", CHUNK: "chunk"}

#: Target chunk size (chars). Two measurements on 2 cores (quiet machine, p50, 4M chars of agent text):
#: ``--only tune`` (``ChunkedEncoder`` alone): qwen3 whole 20.4 ms, chunks of 16K/32K/64K/128K/256K/512K
#: 30.1/21.9/17.9/14.0/16.1/13.1 ms; gpt2 whole 17.7, chunks 27.1/21.0/15.0/12.2/11.8/12.0 ms. In the
#: fresh-encode run (``Tokenizer.encode``, after the other systems ran in the process), gpt2 128K/512K/1M/2M:
#: 19.6/13.6/12.5/13.4 ms, qwen3 23.8/20.1/22.9/19.1 ms: every chunk costs GIL hand-offs between the
#: workers. 512K keeps 4 chunks per worker at 4M chars for balance. A repair does not wait for a chunk on a
#: pool with an express thread; without one it waits at most one chunk (~2 ms at 512K).
CHUNK_CHARS = 512 * 1024
#: Texts shorter than this (chars) are encoded whole, on the calling thread. Same run, 1M chars: qwen3 whole
#: 5.4 ms vs best chunked 5.8 ms, gpt2 4.6 vs 4.2; at 512K whole wins (3.0 vs 3.4, 2.5 vs 2.8): per-chunk
#: overhead and GIL hand-offs eat the second core's gain below ~1M chars.
MIN_CHARS = 1024 * 1024
#: Texts at least this long (chars) give all their chunks to the engine's own parallel batch encode
#: (``encode_many``: gigatoken's Rust threads, one GIL release) instead of the pool. Same runs, qwen3, fresh
#: texts, ``Tokenizer.encode``, 2 cores shared with another user's load (load average ~2.5), p50 of 10,
#: batch vs pool: 4M chars 21.2 vs 24.2 ms, 3M 18.0 vs 20.9, 2M 13.9 vs 16.4 (identical ids). gigatoken
#: puts at least 2 MiB in one work unit, so below ~4 MB the batch runs on fewer threads than cores; 1M-2M
#: chars stay on the pool (not remeasured).
BATCH_MIN_CHARS = 2 * 1024 * 1024
#: How far before each multiple of ``chunk_chars`` to look for a stable cut (chars). Agent text has one
#: every few chars; a window with none (a 1M-char run of one letter, of spaces, of digits) merges two
#: chunks, and the search stays O(chunks * SEARCH_CHARS) instead of O(len(text)) on text with no cut.
SEARCH_CHARS = 1024


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
        express: extra threads that run only repairs (default 0; the shared pool has 1). A repair then
            starts at once instead of after the running chunk, and, with ``nice``, takes a core from the
            chunk workers.
        fifo: ignore priorities, run tasks in submission order, no express threads: the plain FIFO pool the
            benchmark compares with.
        nice: raise the general workers' nice value by this much (Linux, per thread; 0 = unchanged; express
            threads keep the process's). ``toktier_encode`` sets 10 so its chunks yield the cores to
            ``toktier_session`` processes; the shared pool of a session process, 5, so its own chunks yield
            to its express (repair) thread. Linux weighs a nice-0 thread ~3x a nice-5 one, ~9x a nice-10 one.
        name: thread name prefix.
        window: how many recent tasks per priority :meth:`stats` computes percentiles over.

    Tasks run in priority order (:data:`REPAIR` before :data:`CHUNK`), FIFO within a priority. A task is
    never interrupted: without express threads, a repair submitted while every worker runs a chunk starts
    when the first of them ends. Workers start on first use and are daemon threads.

    Invariant: ``queue_depth + in_flight`` equals the tasks submitted and not yet finished.
    """

    def __init__(self, workers: int | None = None, *, express: int = 0, fifo: bool = False, nice: int = 0,
                 name: str = "toktier-cpu", window: int = 4096):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        if express < 0:
            raise ValueError(f"express must be >= 0, got {express!r}")
        self.workers = int(workers or default_workers())
        self.fifo = bool(fifo)
        self.express = 0 if self.fifo else int(express)
        self.nice = int(nice)
        self.name = name
        self._lock = threading.Lock()
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
        #: Tasks running now (on workers, or on a worker's behalf by a helping caller).
        self.in_flight = 0
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
        """Run ``fn(*args)`` on the pool and return its result (re-raises its exception).

        Called from a pool worker, it runs inline: the caller already holds a worker.
        """
        if self.in_worker():
            return fn(*args)
        return self.submit(fn, *args, priority=priority).result()

    def map(self, fn: Callable[..., Any], items: list, *, priority: int = CHUNK) -> list:
        """``[fn(x) for x in items]``, run on the pool; results in order, first exception re-raised.

        A pool worker that calls this (a session repair whose text needs a full encode) runs its own
        not-yet-started tasks itself while it waits, so the pool cannot deadlock on nested waits.
        """
        tasks = [self._push(_Task(fn, (x,), priority)) for x in items]
        if self.in_worker():
            for task in tasks:
                if self._claim(task):
                    self._run(task, helped=True)
        return [t.future.result() for t in tasks]

    def in_worker(self) -> bool:
        """Is the calling thread one of this pool's workers?"""
        return getattr(self._local, "worker", False)

    # -------------------------------------------------------------- running
    def _start_worker(self, express: bool = False) -> None:
        kind = "express" if express else "worker"
        t = threading.Thread(target=self._worker, args=(express,), name=f"{self.name}-{kind}-{len(self._threads)}",
                             daemon=True)
        self._threads.append(t)
        t.start()

    def _claim(self, task: _Task) -> bool:
        with self._cv:
            if task.claimed:
                return False
            task.claimed = True
            self._queued[task.priority] -= 1
            self.in_flight += 1
            return True

    def _worker(self, express: bool = False) -> None:
        self._local.worker = True
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
                        break
                    if self._closed and not self._heap:
                        return  # closed and drained
                    if express:  # only repairs; a repair is always at the top of the heap when queued
                        self._idle_express += 1
                        self._cv_express.wait()
                        self._idle_express -= 1
                    else:
                        self._cv.wait()
            self._run(task)

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
            self.completed[p] += 1
            self._wait_sum_ms[p] += wait_ms
            self._wait_max_ms[p] = max(self._wait_max_ms[p], wait_ms)
            self._waits[p].append(wait_ms)
            self._runs[p].append(run_ms)
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
    """The process-wide pool (created on first use: :func:`default_workers` general workers and one express
    thread for repairs, nice unchanged). Every :class:`ChunkedEncoder` without a pool of its own, and the
    serving handler, use it."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CpuPool(express=1, name="toktier-shared")
        return _shared


def configure_shared_pool(workers: int | None = None, *, express: int = 1, nice: int = 0) -> CpuPool:
    """Replace the process-wide pool (a serving process sets its size, express threads and nice value at
    startup; see :class:`CpuPool`). The old pool, if any, finishes its queue in the background."""
    global _shared
    with _shared_lock:
        old, _shared = _shared, CpuPool(workers, express=express, nice=nice, name="toktier-shared")
    if old is not None:
        old.shutdown(wait=False)
    return _shared


# ---------------------------------------------------------------------------------------------- chunks


class ChunkedEncoder:
    """Chunked full encode for one tokenizer (``Tokenizer.chunked``).

    Args:
        tok: the tokenizer (its cut finder, admitted engine, guard set and reference).
        pool: the pool chunk tasks run on (default: :func:`shared_pool`, looked up per call).
        chunk_chars: target chunk size (chars).
        min_chars: texts shorter than this (chars) are not chunked.
        search_chars: how far past each multiple of ``chunk_chars`` to search for a stable cut (chars).

    Attributes:
        stats: counters: ``encodes`` (chunked encodes), ``chunks``, ``reference_chunks`` (a guarded code
            point or an engine error sent the chunk to the reference), ``engine_errors``.
    """

    def __init__(self, tok: "Tokenizer", *, pool: CpuPool | None = None, chunk_chars: int = CHUNK_CHARS,
                 min_chars: int = MIN_CHARS, search_chars: int = SEARCH_CHARS,
                 batch_min_chars: int = BATCH_MIN_CHARS):
        if chunk_chars < 1 or search_chars < 1:
            raise ValueError(f"chunk_chars and search_chars must be >= 1, got {chunk_chars!r}, {search_chars!r}")
        self.tok = tok
        self._pool = pool
        self.chunk_chars = int(chunk_chars)
        self.min_chars = int(min_chars)
        self.search_chars = int(search_chars)
        self.batch_min_chars = int(batch_min_chars)
        self._prepared = False
        self.stats = {"encodes": 0, "chunks": 0, "reference_chunks": 0, "engine_errors": 0, "batch_encodes": 0}
        self._stats_lock = threading.Lock()

    @property
    def pool(self) -> CpuPool:
        return self._pool if self._pool is not None else shared_pool()

    @pool.setter
    def pool(self, pool: CpuPool | None) -> None:
        self._pool = pool

    def prepare(self) -> None:
        """Load what parallel chunks need, once: an engine object per pool worker, plus one for the calling
        thread (``GigatokenEngine.reserve``: gigatoken serializes concurrent calls on one object). Serving
        calls it at model load; otherwise the first chunked encode does (0.1-0.8 s per object)."""
        reserve = getattr(self.tok.engine, "reserve", None)
        if reserve is not None and self.available:
            reserve(self.pool.workers + 1)
        self._prepared = True

    @property
    def _encode(self):
        """The tokenizer's *current* engine's GIL-free encode (looked up per call: an engine swapped after
        load, e.g. a test's faulty engine, must serve every path or none), ``None`` if it has none. Tests
        may set it (a spy or a failing engine)."""
        return self.__dict__.get("_encode_set") or getattr(self.tok.engine, "encode_nogil", None)

    @_encode.setter
    def _encode(self, fn) -> None:
        self.__dict__["_encode_set"] = fn

    @property
    def _encode_many(self):
        """The current engine's ``encode_many`` (one parallel call for many chunks), ``None`` if it has none."""
        return self.__dict__.get("_encode_many_set") or getattr(self.tok.engine, "encode_many", None)

    @_encode_many.setter
    def _encode_many(self, fn) -> None:
        self.__dict__["_encode_many_set"] = fn

    @property
    def available(self) -> bool:
        """Can this tokenizer chunk at all? Needs a cut family and an engine with a GIL-free encode."""
        return self._encode is not None and self.tok.cuts.supported

    def wants(self, text: str) -> bool:
        """Should ``text`` be chunked (long enough, and :attr:`available`)?"""
        return len(text) >= self.min_chars and self.available

    def bounds(self, text: str) -> list[int]:
        """Chunk boundaries ``[0, c1, ..., ck, len(text)]`` (chars, ascending).

        ``ci`` is the last stable cut (``CutFinder.last_cut``: the family predicates, proven in
        ``pipeline/cuts``) in the ``search_chars`` chars up to the grid point ``i * chunk_chars``. A grid
        point with no cut that close adds no boundary (its neighbours' chunks merge), so the search costs
        O(len(text) / chunk_chars * search_chars) even on text with no cut at all: 1M chars of one letter,
        of spaces, of newlines (where, for Gemma 3, every char is a candidate that fails the predicate).
        """
        finder = self.tok.cuts
        n = len(text)
        out = [0]
        for g in range(self.chunk_chars, n, self.chunk_chars):
            c = finder.last_cut(text, max(out[-1] + 1, g - self.search_chars + 1), g, n)
            if c is not None:
                out.append(c)
        out.append(n)
        return out

    def encode_body(self, text: str) -> tuple[np.ndarray, str]:
        """Body ids of ``text`` (no post-processor), chunked at stable cuts, chunks on the pool.

        Returns:
            ``(ids, engine)``: ``ids`` is ``np.ndarray[int32] (n_tokens,)`` and equals HF
            ``encode(text, add_special_tokens=False).ids``; ``engine`` is the engine's name,
            ``"hf"`` when every chunk went to the reference, or ``"<engine>+hf"`` when some did.

        Raises:
            InvalidRequest: ``text`` holds a lone surrogate (names its char index).
        """
        b = self.bounds(text)
        spans = list(zip(b[:-1], b[1:]))
        if not self._prepared and len(spans) > 1:
            self.prepare()
        batch = None
        if len(spans) == 1:  # no cut found: one chunk, on this thread
            parts = [self._encode_chunk(text, spans[0])]
        elif self._encode_many is not None and len(text) >= self.batch_min_chars:
            batch = self._encode_batch(text, spans)  # None: the engine failed; the pool path isolates the chunk
        if batch is not None:
            ids, refs = batch
        else:
            if len(spans) > 1:
                parts = self.pool.map(lambda span: self._encode_chunk(text, span), spans, priority=CHUNK)
            ids = np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
            refs = sum(1 for _, ref in parts if ref)
        with self._stats_lock:
            self.stats["encodes"] += 1
            self.stats["batch_encodes"] += batch is not None
            self.stats["chunks"] += len(spans)
            self.stats["reference_chunks"] += refs
        name = self.tok.engine.name
        return ids, name if refs == 0 else "hf" if refs == len(spans) else f"{name}+hf"

    def encode_span(self, text: str, a: int, b: int) -> tuple[np.ndarray, str]:
        """Body ids of ``text[a:b]`` on the calling thread, as one chunk: one UTF-8 encode serves the lone
        surrogate check, the guard check and the engine's input, and the engine runs without the GIL
        (a 60K-char tail: ~0.30 ms, vs ~0.38 ms through ``Tokenizer.encode_body``). ``text[a:b]`` must
        start at a stable cut and be wanted as a whole (not :meth:`wants`-long).

        Returns:
            ``(ids, engine)``: ``np.ndarray[int32] (n_tokens,)`` equal to HF
            ``encode(text[a:b], add_special_tokens=False).ids``, and the engine's name or ``"hf"``.

        Raises:
            InvalidRequest: a lone surrogate (names its char index in ``text``).
        """
        ids, ref = self._encode_chunk(text, (a, b))
        return ids, "hf" if ref else self.tok.engine.name

    def _encode_batch(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, int] | None:
        """Body ids of ``text`` cut at ``spans``, the engine's chunks in one ``encode_many`` call (its own
        threads, GIL released once), and how many chunks the reference encoded; ``None`` when the engine
        raised (nothing is answered approximately: the caller reruns the chunks on the pool, where each
        chunk that fails goes to the reference on its own).

        Each chunk is encoded to UTF-8 once on this thread (that rejects lone surrogates and feeds the guard
        check); a chunk with a guarded code point is left out of the batch and encoded by the reference.
        """
        adm = self.tok.admission
        ascii_guarded = adm._ascii_guarded
        datas: list[bytes] = []
        engine_at: list[int] = []
        ref_at: list[int] = []
        for i, (a, b) in enumerate(spans):
            chunk = text[a:b]
            data = _utf8(chunk, a)
            if (len(data) != len(chunk) or ascii_guarded) and adm.has_guarded_utf8(data):
                ref_at.append(i)
            else:
                datas.append(data)
                engine_at.append(i)
        if datas:
            try:
                ids, offsets = self._encode_many(datas)
            except Exception as e:  # never answer approximately
                log.warning("engine %s failed on a batch of %d chunks (%s); chunks rerun one by one",
                            self.tok.engine.name, len(datas), e)
                with self._stats_lock:
                    self.stats["engine_errors"] += 1
                return None
            if not ref_at:
                return ids, 0
        parts: list[np.ndarray] = [None] * len(spans)  # type: ignore[list-item]
        for j, i in enumerate(engine_at):
            parts[i] = ids[offsets[j]:offsets[j + 1]]
        for i in ref_at:
            a, b = spans[i]
            parts[i] = self.tok._hf.encode(text[a:b])
        return np.concatenate(parts), len(ref_at)

    def _encode_chunk(self, text: str, span: tuple[int, int]) -> tuple[np.ndarray, bool]:
        """Body ids of ``text[a:b]`` and whether the reference produced them.

        The chunk is encoded to UTF-8 once, under the GIL (~0.6 ns/char): that rejects lone surrogates,
        the guard check reads the bytes in numpy, and the engine takes the bytes (gigatoken would
        otherwise convert the ``str`` itself, under the GIL: ~0.8 ns/char more).
        """
        a, b = span
        chunk = text[a:b]
        data = _utf8(chunk, a)
        adm = self.tok.admission
        guarded = (len(data) != len(chunk) or adm._ascii_guarded) and adm.has_guarded_utf8(data)
        if not guarded:
            try:
                return self._encode(data), False
            except Exception as e:  # never answer approximately: the reference takes this chunk
                log.warning("engine %s failed on a chunk (%s); reference used", self.tok.engine.name, e)
                with self._stats_lock:
                    self.stats["engine_errors"] += 1
        return self.tok._hf.encode(chunk), True


def _utf8(chunk: str, at: int) -> bytes:
    """``chunk`` as UTF-8; a lone surrogate is an :class:`InvalidRequest` naming its char index (``at`` is
    the chunk's start in the text)."""
    try:
        return chunk.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"text holds a lone surrogate {chunk[e.start]!r} at char {at + e.start}: not a Unicode scalar "
            "value; send valid UTF-8 text"
        ) from None


__all__ = ["BATCH_MIN_CHARS", "CHUNK", "CHUNK_CHARS", "MIN_CHARS", "REPAIR", "SEARCH_CHARS", "ChunkedEncoder", "CpuPool",
           "configure_shared_pool", "default_workers", "shared_pool"]
