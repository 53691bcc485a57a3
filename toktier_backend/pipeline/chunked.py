"""Chunked full encode at stable cuts, and one shared CPU pool for chunk tasks and session repairs.

**Chunked encode.** A request with no session state (first turn, rebuild after eviction or restart, a
stateless caller) carries the whole text. :class:`ChunkedEncoder` splits it at stable cuts about
:meth:`~ChunkedEncoder.step` chars apart (``CutFinder.last_cut`` near each grid point: the family predicates of
``pipeline/cuts``), encodes every chunk on its own on the shared pool, and concatenates the body ids. By
the definition of a stable cut (``finder.py``)::

    encode(text) == encode(text[:c1]) + encode(text[c1:c2]) + ... + encode(text[ck:])     (body ids)

so the result equals HF ``encode(text, add_special_tokens=False).ids``; the post-processor is applied once,
to the whole text, by ``Tokenizer.encode``. Each chunk is checked on its own: a chunk holding a guarded code
point (``engines/admission.py``) goes to the reference, the others stay on the admitted engine.

**Why threads.** Both fast engines release the GIL while Rust runs, so chunks on threads run on all
cores. Engines without a GIL-free encode (HF ``tokenizers`` holds the GIL in ``encode``) are not chunked:
threads would only take turns.

- **fastokens** (the default engine, ``engines/fastokens.py``) takes a ``str`` and converts it to UTF-8
  itself, under the GIL (~0.7-1.5 ns/char of agent text: a quarter of a 2M-char call). The text is cut at
  stable cuts into pieces of about :data:`PIECE_CHARS`, and every piece is a pool task of its own
  (:meth:`ChunkedEncoder.step`), taken by whichever worker is free: one worker's conversion overlaps the
  other's GIL-free encode, the GIL is held ~0.2-0.4 ms at a time, the work balances to within a piece,
  and a repair can run between any two pieces. The engine's ``UnicodeEncodeError`` is the lone surrogate
  check. One fastokens object serves all threads at once.
- **gigatoken** (cl100k_base / o200k_base, which fastokens cannot load). ``Tokenizer.encode`` holds the GIL
  for the whole call and takes a mutable borrow of the Rust object (a second thread got ``Already
  borrowed``); ``GigatokenEngine.encode`` calls ``encode_batch_padded([text], parallel=False)`` instead:
  the same encoder, GIL released, a shared borrow. gigatoken serializes concurrent calls on one Rust object,
  so the engine keeps one object per concurrent caller (:meth:`ChunkedEncoder.prepare`). It takes UTF-8
  ``bytes``: the calling thread converts each chunk once (that also rejects lone surrogates and feeds the
  guard check) and queues it as soon as it is converted (a generator consumed by :meth:`CpuPool.map`).
  Tried and dropped: 256K-char pieces as pool tasks, each converted by its worker (as fastokens does): no
  gain (each system in its own process, interleaved, n=30, p50 ms, pieces vs chunks: o200k_base 4M 13.79
  vs 13.58, cl100k_base 4M 12.61 vs 13.35, 1M 4.62 vs 4.15).

**How a chunked encode runs.** Pieces of :data:`PIECE_CHARS` for fastokens, one chunk per pool worker for
gigatoken (:meth:`ChunkedEncoder.step`; at most :data:`CHUNK_CHARS` each), run by workers pinned to
distinct CPUs while they do (``CpuPool(pin=...)``).
The caller never encodes a chunk itself: the scheduler stacked a caller that did on the worker's core in
most runs. Tried and dropped (gigatoken, same alternating runs, n=24): making the caller wait until a
worker has started chunk ``i`` before converting chunk ``i + 1``, with the first chunk larger to balance:
qwen3 4M 14.8 vs 12.8 ms, gpt2 14.3 vs 11.6 (the woken worker pinned itself to the caller's core, and the
caller then shared it).

**The engines' own parallel paths, and which is kept** (issue #4: "measure both and keep the faster").
fastokens 0.3.5 can hand part of one call's work to a helper thread of its own (``FASTOKENS_BPE_THREADS``,
read once per process; on gpt2, llama3_1, deepseek_v3, never on qwen3, whose normalizer is NFC), and only
when the scheduler runs that thread on the other core: after an idle gap it woke on the caller's core in
most calls (gpt2 4M chars: 14.2 ms p50, CPU time = wall time); pinned to distinct CPUs for the call
(:func:`_pinned_call`), the same call took 9.9 ms. Measured against our pieces, the helper lost: each
256K-char piece also handed work to the one helper, which spins after a call on the core the other pool
worker needs. Each system in its own process, interleaved, 0.2 s gaps, 4M chars of agent text, n=30, p50
ms, pieces with the helper off / the best with it on (pieces, or one whole call with the helper pinned):
gpt2 11.77 / 13.01, llama3_1 10.79 / 11.14, deepseek_v3 11.28 / 11.62, qwen3 12.10 / 12.81. So importing
our fastokens engine turns the helper off (``FASTOKENS_BPE_THREADS=1`` unless the process set it:
``engines/fastokens.py``), and the pool runs all of a long text's work, under its priorities and nice
value. Where a process turns the helper on, or its fastokens encoded before our import, a long text is
encoded one of two ways, the *strategy*:

- ``"chunks"``: cut at stable cuts, the pieces or chunks on the pool (above); the only one without helpers;
- ``"whole"``: one engine call on the calling thread, the caller and the engine's helper threads pinned to
  distinct CPUs (:meth:`ChunkedEncoder._encode_whole`; from :data:`WHOLE_PIN_MIN_CHARS`).

Which is faster then depends on the file and on whether the text is ASCII (CPython keeps an ASCII ``str``
as its own UTF-8, so only there is the engine's conversion free), so :meth:`ChunkedEncoder.calibrate`
measures both at load, on an ASCII and a non-ASCII sample, and each request takes the faster for its kind.
Interleaved per sample (0.2 s idle gaps, 4M chars of agent text, n=24, two processes, helper on, p50 ms,
whole / chunks / the fastokens anchor; before the chunks became piece tasks): gpt2 14.2 / 15.4 / 18.0 and
12.7 / 13.5 / 17.1, deepseek_v3 16.1 / 16.6 / 18.1 and 13.0 / 16.5 / 16.3, llama3_1 12.8 / 16.6 / 16.1 and
12.2 / 15.1 / 16.9; qwen3 (no helper work) whole 18.6 vs chunks 11.6. With ``"whole"`` the engine's
helper threads do part of the work outside the pool: the pool's priorities and nice value do not reach
them (mixed load, gpt2: repair p99 0.56 ms while 4M-char encodes ran back to back, 0.50 idle). Handing
fastokens the whole text in 256K-char pieces in one thread was slower than one call (gpt2 4M 11.3 vs 10.2
ms), so ``"whole"`` is one call.
gigatoken's ``encode_batch(parallel=True)`` encodes a list of documents on its rayon pool, grouping
consecutive documents into work units of at least 2 MiB (two 2.0 MB documents make one unit, on one
thread) and splitting a single larger document at its own "pretoken-safe" boundaries, which we have not
proven; with our chunks as the documents it was slower than the pool path (qwen3 4M chars 17.9 vs 12.9
ms, llama3_1 15.2 vs 11.5, qwen3 2M 10.8 vs 7.5), and was removed.

**Which is faster, per size** (``bench/full_encode.py``, same run, 2 cores): the whole-text encode below
:data:`MIN_CHARS` (per-chunk overhead, the workers' wake-up and a migration eat the second core's gain),
chunked above it; the measured tables are in ``bench/README.md``.

**The shared pool** (the Delta Tokenizer design): :class:`CpuPool` runs chunk tasks and session repairs
with two priorities. A repair is short and never waits behind the chunks of a long request (a plain FIFO
pool makes it wait for all of them): :meth:`CpuPool.call` runs it at once on the caller's own thread
(counted in the pool's stats); one submitted with :meth:`CpuPool.submit` goes to the head of the queue and
an *express* thread that takes only repairs. What a running repair still shares with a long encode is the
GIL and the cores: the encode's UTF-8 conversion is done in pieces of :data:`PIECE_CHARS` and releases the
GIL between pieces while :attr:`CpuPool.repairs_active` (mixed load, 2 cores, 4M-char encodes, 800
repairs: repair p99 1.8 ms with it, 5.6 ms without; FIFO 13.4 ms), and the chunk workers run at a higher
nice value in serving, so a running repair keeps a core. :meth:`CpuPool.stats` gives queue depth, tasks
in flight, wait and run times for metrics.

Across processes (each Triton Python-backend model instance is a process with its own pool), the pools
cannot see each other: ``toktier_encode`` runs its chunk workers at a lower OS priority (``nice``, see
``model_repository/README.md``) so that a repair in a ``toktier_session`` process takes a core as soon as it
is runnable.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from toktier_backend.errors import InvalidRequest
from toktier_backend.runtime.pool import CHUNK, CpuPool, _allowed_cpus, _pinned_call, shared_pool

if TYPE_CHECKING:  # pragma: no cover
    from toktier_backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Largest chunk (chars) when ``chunk_chars`` is not set: a text gets one chunk per pool worker, more only
#: past this size. Measured (qwen3, 4M chars of agent text, 2 workers, alternating with the anchors on the
#: same fresh texts, n=24, p50): 2 chunks 12.9 ms, 4 chunks of 1M 14.1, 8 of 512K 14.5, whole on one
#: thread 17.9: each further chunk costs a wake-up, a GIL hand-off and a migration, and balance comes from
#: equal halves. A repair never waits for a chunk (``CpuPool.call`` runs it on the caller's thread; a
#: submitted one takes an express thread where the pool has one, else waits up to one chunk, ~7 ms).
CHUNK_CHARS = 2 * 1024 * 1024
#: Texts shorter than this (chars) are encoded whole, on the calling thread. fastokens, whole vs two chunks
#: (same runs, 0.2 s idle gaps, n=16, p50): qwen3 500K 2.50 vs 2.19 ms, 1M 4.72 vs 4.51; gpt2 500K 2.06 vs
#: 2.47, 1M 4.07 vs 3.68; deepseek_v3 500K 2.17 vs 2.12, 1M 4.10 vs 3.82. gigatoken (earlier runs): qwen3 1M
#: 5.49 vs 5.82, 1.5M 7.91 vs 6.28; gpt2 1M 4.45 vs 4.35.
MIN_CHARS = 1_000_000
#: With the ``"whole"`` strategy (:meth:`ChunkedEncoder.calibrate`), texts of at least this many chars are
#: encoded in one engine call with the caller and the engine's helper threads pinned to distinct CPUs;
#: shorter ones take the same call unpinned. ``bench/full_encode.py`` (two runs, n=16, p50, pinned vs
#: unpinned): at 1M chars pinning lost (llama3_1 3.82 vs 3.42 ms, deepseek_v3 4.13 vs 3.55 and 5.05 vs 4.61,
#: gpt2 4.82 vs 4.36), at 4M it tied or won (llama3_1 11.45 vs 11.38 and 14.01 vs 17.48, deepseek_v3 14.55
#: vs 15.16, gpt2 17.04 vs 17.80): moving the caller to another CPU costs more than a short call gains.
WHOLE_PIN_MIN_CHARS = 2_000_000
#: Chars of the bundled sample sessions (``corpus.long_session_text``) that :meth:`ChunkedEncoder.calibrate`
#: encodes both ways, as is (ASCII) and made non-ASCII, :data:`CALIBRATE_REPS` times each, alternating
#: (~0.2 s at load; five, not three: the margins on this sample were 4-15%, within the noise of three).
CALIBRATE_CHARS = 2_000_000
CALIBRATE_REPS = 5
#: ``"whole"`` is only a candidate when one whole-text call keeps more than this many cores busy (process
#: CPU time / wall time, median of the calibration's whole calls): otherwise the engine did not split the
#: call and the chunks win by construction (fastokens on qwen3: ~1.0; on gpt2 / llama3_1 / deepseek_v3
#: ~1.5). Without this check a noisy calibration once chose ``"whole"`` for qwen3 (6.03 vs 6.41 ms), and
#: its 4M-char encodes ran on one core (0.97x of serial).
WHOLE_MIN_CORES = 1.2
#: ``"whole"`` is chosen only when its median is at least this much faster than the chunks' (ratio): the
#: chunks balance to within a piece whatever the text holds, the engine's own split of one call does not.
#: On real agent text (the SWE-agent corpus, 4M chars, non-ASCII here and there; p50 ms, whole / chunks)
#: whole's edge over chunks was smaller than on the calibration samples or reversed: llama3_1 12.0 / 13.8,
#: deepseek_v3 15.4 / 15.9, gpt2 21.2 / 13.5 (the same text made ASCII: 8.8 / 13.0).
WHOLE_MIN_GAIN = 1.15
#: Non-ASCII chars sprinkled, in turn, one per 1000 chars into the non-ASCII calibration sample: box
#: drawing and block (tree and progress output), accented Latin, CJK, a syllabic script, an ellipsis.
_NON_ASCII = "\u2502\u2588\u00e9\u4e2d\u1660\u2026"
#: Chunks are converted to UTF-8 in pieces of this many chars (~0.2-0.4 ms of C holding the GIL each); between
#: pieces the converting thread releases the GIL while a repair is active (``ChunkedEncoder._utf8_chunks``).
#: For an engine that takes ``str`` (fastokens) each piece is also a pool task of its own
#: (:meth:`ChunkedEncoder.step`). Measured against two equal halves (4M chars of agent text, 2 cores, every
#: system in its own process, interleaved, 0.2 s gaps, n=16, p50 ms): qwen3 17.09 vs 17.41, llama3_1 15.03
#: vs 15.84; 512K-char pieces were no better than 256K (qwen3 16.42 vs 16.44, fastokens on one thread).
PIECE_CHARS = 256 * 1024
#: How far before each grid point (:meth:`ChunkedEncoder.step`) to look for a stable cut (chars). Agent
#: text has one every few chars; a window with none (a 1M-char run of one letter, of spaces, of digits)
#: merges two chunks, and the search stays O(chunks * SEARCH_CHARS) instead of O(len(text)) on text with
#: no cut.
SEARCH_CHARS = 1024


class ChunkedEncoder:
    """Chunked full encode for one tokenizer (``Tokenizer.chunked``).

    Args:
        tok: the tokenizer (its cut finder, admitted engine, guard set and reference).
        pool: the pool chunk tasks run on (default: :func:`shared_pool`, looked up per call).
        chunk_chars: fixed chunk size (chars); ``None`` (default): :meth:`step` (fastokens: pieces of
            :data:`PIECE_CHARS`; gigatoken: one chunk per pool worker, at most :data:`CHUNK_CHARS` each).
        min_chars: texts shorter than this (chars) are not chunked.
        search_chars: how far before each grid point to search for a stable cut (chars).
        strategy: how long texts use the cores: ``"chunks"`` (chunks on the pool), ``"whole"`` (one engine
            call that uses the engine's own helper threads, pinned: :meth:`calibrate`), or ``None``
            (default): measure both at :meth:`prepare`, for ASCII and for non-ASCII text, and keep the
            faster; the attribute then holds ``"chunks"``, ``"whole"`` or ``"by_kind"`` (each request by
            its text's kind).

    Attributes:
        stats: counters: ``encodes`` (long-text encodes), ``chunks``, ``reference_chunks`` (a guarded code
            point or an engine error sent the chunk to the reference), ``engine_errors``.
        calibration: what :meth:`calibrate` measured and chose (``None`` before).
    """

    def __init__(self, tok: "Tokenizer", *, pool: CpuPool | None = None, chunk_chars: int | None = None,
                 min_chars: int = MIN_CHARS, search_chars: int = SEARCH_CHARS, strategy: str | None = None):
        if (chunk_chars is not None and chunk_chars < 1) or search_chars < 1:
            raise ValueError(f"chunk_chars and search_chars must be >= 1, got {chunk_chars!r}, {search_chars!r}")
        if strategy not in (None, "chunks", "whole"):
            raise ValueError(f"strategy must be None, 'chunks' or 'whole', got {strategy!r}")
        self.strategy = strategy
        self.calibration: dict | None = None
        self.tok = tok
        self._pool = pool
        self.chunk_chars = None if chunk_chars is None else int(chunk_chars)
        self.min_chars = int(min_chars)
        self.search_chars = int(search_chars)
        self._prepared = False
        self.stats = {"encodes": 0, "chunks": 0, "reference_chunks": 0, "engine_errors": 0}
        self._stats_lock = threading.Lock()

    @property
    def pool(self) -> CpuPool:
        return self._pool if self._pool is not None else shared_pool()

    @pool.setter
    def pool(self, pool: CpuPool | None) -> None:
        self._pool = pool

    def prepare(self) -> None:
        """Load what parallel chunks need, once: an engine object per pool worker, plus one for the calling
        thread (``GigatokenEngine.reserve``: gigatoken serializes concurrent calls on one object), and choose
        the strategy (:meth:`calibrate`) unless one was given. Serving calls it at model load; otherwise the
        first long encode does (0.1-0.8 s per gigatoken object; ~0.1 s of calibration)."""
        reserve = getattr(self.tok.engine, "reserve", None)
        if reserve is not None and self.available:
            reserve(self.pool.workers + 1)
        if self.strategy is None:
            self.strategy = self.calibrate()
        self._prepared = True

    def calibrate(self) -> str:
        """Measure the two ways of using the cores for one long text, for ASCII and for non-ASCII text, and
        return the strategy: ``"whole"`` or ``"chunks"`` when both kinds of text agree, else ``"by_kind"``
        (each request by its text's kind). What was measured is kept in :attr:`calibration`.

        Why measure: where the process turned fastokens' helper thread on (it is off by default, see the
        module docstring), fastokens 0.3.5 splits one call's work with it on some files (gpt2, llama3_1,
        deepseek_v3) and not on others (qwen3), and which is faster differs per file. With
        the caller and the helper pinned to distinct CPUs, one call beat two chunks on llama3_1 (4M chars,
        2 cores, interleaved, p50, n=24: 12.2 vs 15.1 ms) and lost on qwen3 (18.6 vs 11.6; the module
        docstring has the rest). Both are exact by construction. ``"chunks"`` without measuring when the
        engine has no helper threads (gigatoken: one thread per call), or the process may use one CPU.

        Why by kind: CPython keeps an all-ASCII ``str`` as its own UTF-8, so the engine's conversion, which a
        whole call does serially and chunks overlap with each other's encoding, is free only there, and
        fastokens' split itself did worse on non-ASCII text for gpt2. Real agent text (4M chars, the corpus,
        non-ASCII in every 256K chars; p50 ms, whole / chunks, two runs): gpt2 28.6 / 15.6 and 21.2 / 13.5,
        the same text made ASCII 10.1 / 14.2 and 8.8 / 13.0; llama3_1 13.3 / 15.7 and 8.4 / 11.6.
        ``str.isascii()`` is O(1), so each request takes the strategy measured for its kind.

        The samples are :data:`CALIBRATE_CHARS` chars of the bundled sample sessions (ASCII) and the same
        with one non-ASCII char (:data:`_NON_ASCII`, in turn) every 1000 chars, each encoded
        :data:`CALIBRATE_REPS` times each way, alternating, a new ``str`` each time. ``"whole"`` needs a
        median :data:`WHOLE_MIN_GAIN` times faster than the chunks', and one whole call to keep at least
        :data:`WHOLE_MIN_CORES` cores busy (else the engine did not split it); otherwise ``"chunks"``.
        """
        helpers = getattr(self.tok.engine, "helper_threads", None)
        reason = ("no GIL-free engine or cut family" if not self.available else
                  "the engine starts no helper threads" if helpers is None or not helpers() else
                  "the process may use one CPU" if len(_allowed_cpus()) < 2 else "")
        if reason:
            self.calibration = {"chosen": "chunks", "reason": reason}
            return "chunks"
        from toktier_backend.corpus import long_session_text

        ascii_sample = long_session_text(CALIBRATE_CHARS)
        other = "".join(ascii_sample[i:i + 999] + _NON_ASCII[(i // 1000) % len(_NON_ASCII)]
                        for i in range(0, len(ascii_sample), 1000))
        kinds = {"ascii": self._calibrate_on(ascii_sample), "non_ascii": self._calibrate_on(other[:CALIBRATE_CHARS])}
        a, b = kinds["ascii"]["chosen"], kinds["non_ascii"]["chosen"]
        chosen = a if a == b else "by_kind"
        self.calibration = {"chosen": chosen, **kinds, "sample_chars": CALIBRATE_CHARS, "reps": CALIBRATE_REPS}
        log.info("%s: long texts take %s (%s)", self.tok.engine.name, chosen, self.calibration)
        return chosen

    def _calibrate_on(self, sample: str) -> dict:
        """``whole`` vs ``chunks`` on ``sample`` (see :meth:`calibrate`): the choice, why, and the numbers."""
        ways = {"whole": lambda t: self._encode_whole(t, 0, len(t)), "chunks": self._chunks}
        ms: dict[str, list[float]] = {k: [] for k in ways}
        cores: list[float] = []  # process CPU time / wall time of each whole call
        for _ in range(CALIBRATE_REPS):
            for k, fn in ways.items():
                text = (sample + " ")[:-1]  # a new str each call: CPython caches a str's UTF-8 once an engine
                c0, t0 = time.process_time_ns(), time.perf_counter_ns()  # reads it, which would favour "whole"
                fn(text)
                wall = time.perf_counter_ns() - t0
                ms[k].append(wall / 1e6)
                if k == "whole":
                    cores.append((time.process_time_ns() - c0) / max(wall, 1))
        p50 = {k: float(np.median(v)) for k, v in ms.items()}
        used = float(np.median(cores))
        if used < WHOLE_MIN_CORES:  # the engine did not split the call (fastokens on qwen3): nothing to win
            chosen, why = "chunks", f"one call used {used:.2f} cores"
        elif p50["whole"] * WHOLE_MIN_GAIN <= p50["chunks"]:
            chosen, why = "whole", "faster"
        else:
            chosen, why = "chunks", "whole not clearly faster"
        return {"chosen": chosen, "why": why, "whole_ms_p50": round(p50["whole"], 3),
                "chunks_ms_p50": round(p50["chunks"], 3), "whole_cores": round(used, 2)}

    def _whole_for(self, text: str) -> bool:
        """Does ``text`` take one whole engine call (else chunks)? The strategy, or with ``"by_kind"`` the
        calibrated choice for the text's kind (``str.isascii()``: O(1) in CPython)."""
        if self.strategy == "by_kind":
            return self.calibration["ascii" if text.isascii() else "non_ascii"]["chosen"] == "whole"
        return self.strategy == "whole"

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
    def accepts_utf8(self) -> bool:
        """Does the engine's GIL-free encode take UTF-8 ``bytes`` (gigatoken)? Else it takes ``str`` and
        converts it itself (fastokens)."""
        return bool(getattr(self.tok.engine, "accepts_utf8", False))

    @property
    def available(self) -> bool:
        """Can this tokenizer chunk at all? Needs a cut family and an engine with a GIL-free encode."""
        return self._encode is not None and self.tok.cuts.supported

    def wants(self, text: str) -> bool:
        """Should ``text`` be chunked (long enough, and :attr:`available`)?"""
        return len(text) >= self.min_chars and self.available

    def step(self, n: int) -> int:
        """Grid step (chars) for a text of ``n`` chars: ``chunk_chars`` when set; else, for an engine that
        takes ``str`` (fastokens), :data:`PIECE_CHARS`: every piece is a pool task of its own, taken by
        whichever worker is free (the halves of a text differ in cost; see :data:`PIECE_CHARS`); else (an
        engine that takes UTF-8, converted by the caller) one chunk per pool worker, at most
        :data:`CHUNK_CHARS` each: ``ceil(n / max(workers, ceil(n / CHUNK_CHARS)))``."""
        if self.chunk_chars is not None:
            return self.chunk_chars
        if not self.accepts_utf8:
            return PIECE_CHARS
        chunks = max(self.pool.workers, -(-n // CHUNK_CHARS))
        return max(1, -(-n // chunks))

    def bounds(self, text: str) -> list[int]:
        """Chunk boundaries ``[0, c1, ..., ck, len(text)]`` (chars, ascending): :meth:`grid` at :meth:`step`."""
        return self.grid(text, 0, len(text), self.step(len(text)))

    def grid(self, text: str, a: int, b: int, step: int) -> list[int]:
        """Stable cuts about ``step`` chars apart in ``text[a:b]``: ``[a, c1, ..., b]`` (chars, ascending).

        ``ci`` is the last stable cut of ``text`` (``CutFinder.last_cut``: the family predicates, proven in
        ``pipeline/cuts``, looking at the whole text) in the ``search_chars`` chars up to the grid point
        ``a + i * step``. ``a`` and ``b`` must be stable cuts (or 0 and ``len(text)``), so every piece
        ``text[ci:ci+1]`` encodes on its own to its share of the whole text's ids. A grid point with no cut
        that close adds no boundary (its neighbours merge), so the search costs O((b - a) / step *
        search_chars) even on text with no cut at all: 1M chars of one letter, of spaces, of newlines
        (where, for Gemma 3, every char is a candidate that fails the predicate).
        """
        finder = self.tok.cuts
        n = len(text)
        out = [a]
        for g in range(a + step, b, step):
            c = finder.last_cut(text, max(out[-1] + 1, g - self.search_chars + 1), g, n)
            if c is not None:
                out.append(c)
        out.append(b)
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
        if not self._prepared:
            self.prepare()
        if self._whole_for(text):
            parts, n_spans = [self._encode_whole(text, 0, len(text))], 1
        else:
            parts, n_spans = self._chunks(text)
        ids = np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
        refs = sum(1 for _, ref in parts if ref)
        with self._stats_lock:
            self.stats["encodes"] += 1
            self.stats["chunks"] += n_spans
            self.stats["reference_chunks"] += refs
        name = self.tok.engine.name
        return ids, name if refs == 0 else "hf" if refs == n_spans else f"{name}+hf"

    def _chunks(self, text: str) -> tuple[list[tuple[np.ndarray, bool]], int]:
        """``text`` cut at :meth:`bounds`, each chunk encoded on the pool: ``([(ids, by reference)] per
        chunk, number of chunks)``."""
        b = self.bounds(text)
        spans = list(zip(b[:-1], b[1:]))
        pool = self.pool
        if len(spans) == 1:  # no cut found: one chunk, on this thread
            parts = [self._encode_chunk(text, spans[0])]
        elif self.accepts_utf8:  # a generator: each chunk is queued as soon as this thread has its UTF-8
            parts = pool.map(lambda item: self._encode_utf8(item, text), self._utf8_chunks(text, spans, pool),
                             priority=CHUNK)
        else:  # the engine converts each piece itself, on the worker (see _encode_pieces)
            parts = pool.map(lambda span: self._encode_pieces(text, span, pool), spans, priority=CHUNK)
        return parts, len(spans)

    def _encode_whole(self, text: str, a: int, b: int) -> tuple[np.ndarray, bool]:
        """Body ids of ``text[a:b]`` in one engine call on the calling thread, and whether the reference
        produced them. From :data:`WHOLE_PIN_MIN_CHARS` chars the caller is pinned to one CPU and the
        engine's helper threads to the others while the call runs (``_pinned_call``). The GIL is held while
        the engine converts the text (~0.6 ns/char)."""
        if b - a < WHOLE_PIN_MIN_CHARS:
            return self._encode_pieces(text, (a, b), None)
        helpers = getattr(self.tok.engine, "helper_threads", list)()  # (an engine with none runs unpinned)
        return _pinned_call(lambda: self._encode_pieces(text, (a, b), None), helpers)

    def encode_span(self, text: str, a: int, b: int) -> tuple[np.ndarray, str]:
        """Body ids of ``text[a:b]`` on the calling thread, as one chunk, in one engine call without the GIL:
        the engine's UTF-8 conversion (or, for an engine that takes bytes, one ``str.encode``) is also the
        lone surrogate check (gigatoken, a 60K-char tail: ~0.30 ms, vs ~0.38 ms through
        ``Tokenizer.encode_body``). ``text[a:b]`` must start at a stable cut and be wanted as a whole (not
        :meth:`wants`-long).

        Returns:
            ``(ids, engine)``: ``np.ndarray[int32] (n_tokens,)`` equal to HF
            ``encode(text[a:b], add_special_tokens=False).ids``, and the engine's name or ``"hf"``.

        Raises:
            InvalidRequest: a lone surrogate (names its char index in ``text``).
        """
        whole = self._whole_for(text)  # (pins from WHOLE_PIN_MIN_CHARS: only when min_chars is above it)
        ids, ref = self._encode_whole(text, a, b) if whole else self._encode_chunk(text, (a, b))
        return ids, "hf" if ref else self.tok.engine.name

    def _utf8_chunks(self, text: str, spans: list[tuple[int, int]], pool: CpuPool):
        """Yield ``(a, b, UTF-8 of text[a:b])`` for each span, converting on the calling thread.

        Why here and not in the chunk tasks: the conversion holds the GIL (~0.6 ns/char), so the workers
        would take turns at it anyway, and a worker that wakes up needs the GIL before it can start. Done
        on the calling thread as a generator that ``CpuPool.map`` consumes, chunk ``i`` is queued (and a
        worker starts on it, GIL-free in the engine) while this thread converts chunk ``i + 1``; the
        caller's own thread never runs an engine call, so the engine work lands on the pool's threads,
        which the scheduler keeps on separate cores (on this 2-core VM, a caller thread that encoded a
        half itself shared one core with the worker in most runs: 18 ms vs 13 ms at 4M chars).

        Each chunk is converted in pieces of :data:`PIECE_CHARS` and, while the pool has a repair queued or
        running (:attr:`CpuPool.repairs_active`), this thread sleeps 0 s between pieces, which releases the
        GIL: one 2M-char conversion is ~1.5 ms of C that a repair's Python code would otherwise wait out
        (mixed load, 2 cores: repair p99 3.5 ms without the release, 1.6 ms with it).
        """
        for a, b in spans:
            pieces = []
            for x in range(a, b, PIECE_CHARS):
                if pool.repairs_active:
                    time.sleep(0)
                pieces.append(_utf8(text[x:min(b, x + PIECE_CHARS)], x))
            yield a, b, pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _encode_chunk(self, text: str, span: tuple[int, int]) -> tuple[np.ndarray, bool]:
        """Body ids of ``text[a:b]`` on the calling thread, in one engine call, and whether the reference
        produced them.

        An engine that takes UTF-8 gets the chunk encoded to UTF-8 once, under the GIL (~0.6 ns/char): that
        rejects lone surrogates, the guard check reads the bytes in numpy, and the engine takes the bytes
        (gigatoken would otherwise convert the ``str`` itself, under the GIL: ~0.8 ns/char more). Another
        engine gets the ``str`` (:meth:`_encode_pieces` with one piece).
        """
        a, b = span
        if not self.accepts_utf8:
            return self._encode_pieces(text, span, None)
        return self._encode_utf8((a, b, _utf8(text[a:b], a)), text)

    def _encode_pieces(self, text: str, span: tuple[int, int], pool: CpuPool | None) -> tuple[np.ndarray, bool]:
        """Body ids of the chunk ``text[a:b]`` for an engine that takes ``str`` (fastokens), and whether the
        reference produced any of them.

        On a pool worker (``pool`` given) a chunk of at least twice :data:`PIECE_CHARS` (``chunk_chars`` set
        larger, or grid points with no cut near them) is encoded in pieces of about :data:`PIECE_CHARS` cut
        at stable cuts (:meth:`grid`), one engine call each (a grid span is up to ``search_chars`` longer
        than its step: re-cutting it would add a call for a sliver). The engine converts each piece to
        UTF-8 under the GIL (~0.2-0.4 ms), so a repair on another thread waits for the GIL at most that long,
        and while the pool has a repair active this thread also sleeps 0 s between pieces (as
        :meth:`_utf8_chunks` does).
        The engine's ``UnicodeEncodeError`` on a lone surrogate is the surrogate check. A piece holding a
        guarded code point, or one the engine fails on, goes to the reference alone.
        """
        a, b = span
        cuts = self.grid(text, a, b, PIECE_CHARS) if pool is not None and b - a >= 2 * PIECE_CHARS else [a, b]
        adm = self.tok.admission
        parts, ref = [], False
        for x, y in zip(cuts[:-1], cuts[1:]):
            if pool is not None and pool.repairs_active:
                time.sleep(0)
            piece = text[x:y]
            try:
                ids = None if adm.has_guarded(piece) else self._try_engine(piece)
            except UnicodeEncodeError as e:
                raise _lone_surrogate(piece, x, e) from None
            if ids is None:  # guarded, or the engine failed: the reference takes this piece
                _utf8(piece, x)  # (its lone surrogate, if any, is still named)
                ids, ref = self.tok._hf.encode(piece), True
            parts.append(ids)
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), ref

    def _try_engine(self, data: str | bytes) -> np.ndarray | None:
        """The engine's body ids of ``data`` (a chunk's ``str``, or its UTF-8 for an engine that
        :attr:`accepts_utf8`), or ``None`` when the engine raised (logged and counted in ``stats``): never
        answer approximately, the caller then takes the reference. A lone surrogate's
        ``UnicodeEncodeError`` propagates (the request is invalid, not the engine)."""
        try:
            return self._encode(data)
        except UnicodeEncodeError:
            raise
        except Exception as e:
            log.warning("engine %s failed on a chunk (%s); reference used", self.tok.engine.name, e)
            with self._stats_lock:
                self.stats["engine_errors"] += 1
            return None

    def _encode_utf8(self, item: tuple[int, int, bytes], text: str) -> tuple[np.ndarray, bool]:
        """Body ids of the chunk ``text[a:b]`` given as ``(a, b, its UTF-8)``, and whether the reference
        produced them."""
        a, b, data = item
        adm = self.tok.admission
        guarded = (len(data) != b - a or adm._ascii_guarded) and adm.has_guarded_utf8(data)
        ids = None if guarded else self._try_engine(data)
        return (ids, False) if ids is not None else (self.tok._hf.encode(text[a:b]), True)


def _utf8(chunk: str, at: int) -> bytes:
    """``chunk`` as UTF-8; a lone surrogate is an :class:`InvalidRequest` naming its char index (``at`` is
    the chunk's start in the text)."""
    try:
        return chunk.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _lone_surrogate(chunk, at, e) from None


def _lone_surrogate(chunk: str, at: int, e: UnicodeEncodeError) -> InvalidRequest:
    """The :class:`InvalidRequest` for the lone surrogate ``e`` found in ``chunk`` (which starts at char ``at``
    of the text)."""
    return InvalidRequest(
        f"text holds a lone surrogate {chunk[e.start]!r} at char {at + e.start}: not a Unicode scalar "
        "value; send valid UTF-8 text"
    )


__all__ = ["CHUNK_CHARS", "MIN_CHARS", "PIECE_CHARS", "SEARCH_CHARS", "ChunkedEncoder"]
