"""Chunked full encode at stable cuts, on the shared CPU pool.

A request with no session state (first turn, rebuild after eviction or restart, a stateless caller) carries
the whole text. :class:`ChunkedEncoder` splits a long one at stable cuts about :meth:`~ChunkedEncoder.step`
chars apart (``CutFinder.last_cut`` near each grid point: the family predicates of ``pipeline/cuts``),
encodes every chunk on its own on the pool (``runtime/pool.py``), and concatenates the body ids. By the
definition of a stable cut (``cuts/finder.py``)::

    encode(text) == encode(text[:c1]) + encode(text[c1:c2]) + ... + encode(text[ck:])     (body ids)

so the result equals HF ``encode(text, add_special_tokens=False).ids``; the post-processor is applied once,
to the whole text, by the caller (``Tokenizer.encode``). Each chunk is checked on its own: a chunk holding a
guarded code point (``engines/admission.py``) goes to the reference, the others stay on the admitted engine.

**Threads.** Only an engine whose ``encode`` releases the GIL (``Engine.releases_gil``: fastokens,
gigatoken) is chunked; with HF ``tokenizers``, which holds the GIL, threads would only take turns.

- An engine that takes ``str`` (fastokens, ``Engine.accepts_utf8`` false) converts each call's text to
  UTF-8 itself, under the GIL. The text is cut into pieces of about :data:`PIECE_CHARS`, and every piece is
  a pool task of its own, taken by whichever worker is free: one worker's conversion overlaps the other's
  GIL-free encode, the GIL is held one piece's conversion at a time, the work balances to within a piece,
  and a repair can run between any two pieces. The engine's ``UnicodeEncodeError`` is the lone surrogate
  check.
- An engine that takes UTF-8 (gigatoken) gets one chunk per pool worker (at most :data:`CHUNK_CHARS`
  each). The calling thread converts each chunk once (that also rejects lone surrogates and feeds the guard
  check) and queues it as soon as it is converted (a generator consumed by ``CpuPool.map``), so chunk ``i``
  is encoded while chunk ``i + 1`` is converted. The caller never encodes a chunk itself: the work stays on
  the pool's workers, which are pinned to distinct CPUs while they run a chunk (``CpuPool(pin=...)``).

While the pool has a repair queued or running (``CpuPool.repairs_active``), a converting thread sleeps 0 s
between pieces, which releases the GIL to the repair's Python code. Texts shorter than :data:`MIN_CHARS`
are one engine call on the calling thread. Why: ``docs/design/parallel.md``.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from toktier_backend.engines.admission import Admission
from toktier_backend.engines.protocol import Engine
from toktier_backend.errors import InvalidRequest
from toktier_backend.pipeline.cuts import CutFinder
from toktier_backend.runtime.pool import CHUNK, CpuPool, shared_pool

log = logging.getLogger(__name__)

#: Largest chunk (chars) for an engine that takes UTF-8, when ``chunk_chars`` is not set: a text gets one
#: chunk per pool worker, more only past this size (each further chunk costs a wake-up, a GIL hand-off and
#: a migration; balance comes from equal halves).
CHUNK_CHARS = 2 * 1024 * 1024
#: Texts shorter than this (chars) are one engine call on the calling thread: below it, the workers'
#: wake-up and a migration cost more than the second core gains.
MIN_CHARS = 1_000_000
#: Piece size (chars): a pool task of its own for an engine that takes ``str``; the unit of UTF-8
#: conversion (one GIL hold) for one that takes bytes.
PIECE_CHARS = 256 * 1024
#: How far before each grid point (:meth:`ChunkedEncoder.grid`) to look for a stable cut (chars). Agent
#: text has one every few chars; a window with none (a 1M-char run of one letter, of spaces, of digits)
#: merges two chunks, and the search stays O(chunks * SEARCH_CHARS) instead of O(len(text)) on text with
#: no cut.
SEARCH_CHARS = 1024
#: Chars of sample text each pool worker encodes in :meth:`ChunkedEncoder.prepare` (one piece).
WARM_CHARS = PIECE_CHARS


class ChunkedEncoder:
    """Body ids of a whole text: one engine call for a short one, stable-cut chunks on the pool for a long
    one (``Tokenizer.chunked``).

    Args:
        engine: the admitted engine (``Engine``; chunked only when ``engine.releases_gil``).
        reference: the HF reference engine: serves a chunk that holds a guarded code point or that the
            engine failed on.
        guard: the engine's admission (its guard set: ``Admission.has_guarded``).
        cuts: the file's ``CutFinder`` (chunked only when ``cuts.supported``).
        pool: the pool chunk tasks run on (default: :func:`shared_pool`, looked up per call).
        chunk_chars: fixed chunk size (chars); ``None`` (default): :meth:`step`.
        min_chars: texts shorter than this (chars) are not chunked.
        search_chars: how far before each grid point to search for a stable cut (chars).

    ``engine`` and ``guard`` may be replaced later (the attributes of the same names: an engine installed
    after load must serve every path or none); the next call uses them.

    Attributes:
        stats: counters: ``encodes`` (chunked encodes), ``chunks``, ``reference_chunks`` (a guarded code
            point or an engine error sent the chunk to the reference), ``engine_errors``.

    Raises:
        ValueError: ``chunk_chars`` or ``search_chars`` below 1.
    """

    def __init__(self, engine: Engine, *, reference: Engine, guard: Admission, cuts: CutFinder,
                 pool: CpuPool | None = None, chunk_chars: int | None = None, min_chars: int = MIN_CHARS,
                 search_chars: int = SEARCH_CHARS):
        if (chunk_chars is not None and chunk_chars < 1) or search_chars < 1:
            raise ValueError(f"chunk_chars and search_chars must be >= 1, got {chunk_chars!r}, {search_chars!r}")
        self.engine = engine
        self.reference = reference
        self.guard = guard
        self.cuts = cuts
        self._pool = pool
        self.chunk_chars = None if chunk_chars is None else int(chunk_chars)
        self.min_chars = int(min_chars)
        self.search_chars = int(search_chars)
        self._prepared: CpuPool | None = None  # the pool prepare() last warmed
        self._prepare_lock = threading.Lock()
        self.stats = {"encodes": 0, "chunks": 0, "reference_chunks": 0, "engine_errors": 0}
        self._stats_lock = threading.Lock()

    @property
    def pool(self) -> CpuPool:
        return self._pool if self._pool is not None else shared_pool()

    @pool.setter
    def pool(self, pool: CpuPool | None) -> None:
        self._pool = pool

    def prepare(self) -> None:
        """Make the first chunked encode as fast as the next ones, once per pool: ``engine.reserve(workers +
        1)`` (room for every pool worker and the calling thread; gigatoken loads one Rust object per
        concurrent caller, ``docs/design/engines.md``), then one encode of :data:`WARM_CHARS` chars of the
        bundled sample sessions on every pool worker at once (``CpuPool.run_on_each_worker``): an engine's
        first call on a thread builds per-thread state (``docs/design/parallel.md``), which a request would
        otherwise pay. Serving calls it at model load; otherwise the first chunked encode does (called from
        a pool worker, it only reserves). A failed warm-up is logged, never raised: it only costs the first
        request time."""
        pool = self.pool
        if not self.available:
            self._prepared = pool
            return
        self.engine.reserve(pool.workers + 1)
        if pool.in_worker():  # (the warm-up would wait for this worker: a later call from outside does it)
            return
        with self._prepare_lock:  # (concurrent first requests: one warm-up)
            if self._prepared is pool:
                return
            from toktier_backend.corpus import long_session_text

            warm = long_session_text(WARM_CHARS)
            try:
                pool.run_on_each_worker(lambda: self.engine.encode(warm))
            except Exception as e:  # (an optimisation only)
                log.warning("engine %s: warm-up on the pool's workers failed (%s)", self.engine.name, e)
            self._prepared = pool

    @property
    def available(self) -> bool:
        """Can this tokenizer chunk at all? Needs a cut family and an engine that releases the GIL."""
        return self.engine.releases_gil and self.cuts.supported

    def wants(self, text: str, start: int = 0) -> bool:
        """Would :meth:`encode` chunk ``text[start:]`` (at least ``min_chars`` chars, and :attr:`available`)?"""
        return len(text) - start >= self.min_chars and self.available

    def step(self, n: int) -> int:
        """Grid step (chars) for a text of ``n`` chars: ``chunk_chars`` when set; else, for an engine that
        takes ``str`` (fastokens), :data:`PIECE_CHARS`: every piece is a pool task of its own, taken by
        whichever worker is free; else (an engine that takes UTF-8, converted by the caller) one chunk per
        pool worker, at most :data:`CHUNK_CHARS` each: ``ceil(n / max(workers, ceil(n / CHUNK_CHARS)))``."""
        if self.chunk_chars is not None:
            return self.chunk_chars
        if not self.engine.accepts_utf8:
            return PIECE_CHARS
        chunks = max(self.pool.workers, -(-n // CHUNK_CHARS))
        return max(1, -(-n // chunks))

    def bounds(self, text: str, start: int = 0) -> list[int]:
        """Chunk boundaries ``[start, c1, ..., ck, len(text)]`` (chars, ascending): :meth:`grid` at
        :meth:`step` of ``len(text) - start``."""
        return self.grid(text, start, len(text), self.step(len(text) - start))

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
        finder = self.cuts
        n = len(text)
        out = [a]
        for g in range(a + step, b, step):
            c = finder.last_cut(text, max(out[-1] + 1, g - self.search_chars + 1), g, n)
            if c is not None:
                out.append(c)
        out.append(b)
        return out

    def encode(self, text: str, start: int = 0) -> tuple[np.ndarray, str]:
        """Body ids of ``text[start:]`` (no post-processor). ``start`` must be 0 or a stable cut of ``text``
        (a prefix-index hit's cut): the chunks are cut on the whole text, nothing is copied.

        :meth:`wants` it (``min_chars`` or more, :attr:`available`): chunks at :meth:`bounds`, on the
        pool. Else one engine call on the calling thread (for an engine that takes UTF-8: one
        ``str.encode``, which is also the lone surrogate check and the guard check's input).

        Returns:
            ``(ids, engine)``: ``ids`` is ``np.ndarray[int32] (n_tokens,)`` and equals HF
            ``encode(text[start:], add_special_tokens=False).ids``; ``engine`` is the engine's name,
            ``"hf"`` when every chunk went to the reference, or ``"<engine>+hf"`` when some did.

        Raises:
            InvalidRequest: ``text[start:]`` holds a lone surrogate (names its char index in ``text``).
        """
        name = self.engine.name
        if not self.wants(text, start):
            ids, ref = self._encode_chunk(text, (start, len(text)))
            return ids, "hf" if ref else name
        if self._prepared is not self.pool:  # (a new pool has new, cold threads)
            self.prepare()
        b = self.bounds(text, start)
        spans = list(zip(b[:-1], b[1:]))
        pool = self.pool
        if len(spans) == 1:  # no cut found: one chunk, on this thread
            parts = [self._encode_chunk(text, spans[0])]
        elif self.engine.accepts_utf8:  # a generator: each chunk is queued as soon as this thread has its UTF-8
            parts = pool.map(lambda item: self._encode_utf8(item, text), self._utf8_chunks(text, spans, pool),
                             priority=CHUNK)
        else:  # the engine converts each piece itself, on the worker (see _encode_pieces)
            parts = pool.map(lambda span: self._encode_pieces(text, span, pool), spans, priority=CHUNK)
        ids = np.concatenate([p for p, _ in parts]) if len(parts) > 1 else parts[0][0]
        refs = sum(1 for _, ref in parts if ref)
        with self._stats_lock:
            self.stats["encodes"] += 1
            self.stats["chunks"] += len(spans)
            self.stats["reference_chunks"] += refs
        return ids, name if refs == 0 else "hf" if refs == len(spans) else f"{name}+hf"

    def _utf8_chunks(self, text: str, spans: list[tuple[int, int]], pool: CpuPool):
        """Yield ``(a, b, UTF-8 of text[a:b])`` for each span, converting on the calling thread.

        Why here and not in the chunk tasks: the conversion holds the GIL, so the workers would take turns
        at it anyway, and a worker that wakes up needs the GIL before it can start. Done on the calling
        thread as a generator that ``CpuPool.map`` consumes, chunk ``i`` is queued (and a worker starts on
        it, GIL-free in the engine) while this thread converts chunk ``i + 1``; the caller's own thread never
        runs an engine call, so the engine work lands on the pool's threads, which the pool pins to separate
        cores.

        Each chunk is converted in pieces of :data:`PIECE_CHARS` and, while the pool has a repair queued or
        running (:attr:`CpuPool.repairs_active`), this thread sleeps 0 s between pieces, which releases the
        GIL to the repair.
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

        An engine that takes UTF-8 gets the chunk encoded to UTF-8 once, under the GIL: that rejects lone
        surrogates, the guard check reads the bytes in numpy, and the engine takes the bytes (gigatoken would
        otherwise convert the ``str`` itself, under the GIL, once more). Another engine gets the ``str``
        (:meth:`_encode_pieces` with one piece).
        """
        a, b = span
        if not self.engine.accepts_utf8:
            return self._encode_pieces(text, span, None)
        return self._encode_utf8((a, b, _utf8(text[a:b], a)), text)

    def _encode_pieces(self, text: str, span: tuple[int, int], pool: CpuPool | None) -> tuple[np.ndarray, bool]:
        """Body ids of the chunk ``text[a:b]`` for an engine that takes ``str`` (fastokens), and whether the
        reference produced any of them.

        On a pool worker (``pool`` given) a chunk of at least twice :data:`PIECE_CHARS` (``chunk_chars`` set
        larger, or grid points with no cut near them) is encoded in pieces of about :data:`PIECE_CHARS` cut
        at stable cuts (:meth:`grid`), one engine call each (a grid span is up to ``search_chars`` longer
        than its step: re-cutting it would add a call for a sliver). The engine converts each piece to
        UTF-8 under the GIL, so a repair on another thread waits for the GIL at most one piece's conversion,
        and while the pool has a repair active this thread also sleeps 0 s between pieces (as
        :meth:`_utf8_chunks` does).
        The engine's ``UnicodeEncodeError`` on a lone surrogate is the surrogate check. A piece holding a
        guarded code point, or one the engine fails on, goes to the reference alone.
        """
        a, b = span
        cuts = self.grid(text, a, b, PIECE_CHARS) if pool is not None and b - a >= 2 * PIECE_CHARS else [a, b]
        guard = self.guard
        parts, ref = [], False
        for x, y in zip(cuts[:-1], cuts[1:]):
            if pool is not None and pool.repairs_active:
                time.sleep(0)
            piece = text[x:y]
            try:
                ids = None if guard.has_guarded(piece) else self._try_engine(piece)
            except UnicodeEncodeError as e:
                raise _lone_surrogate(piece, x, e) from None
            if ids is None:  # guarded, or the engine failed: the reference takes this piece
                _utf8(piece, x)  # (its lone surrogate, if any, is still named)
                ids, ref = self.reference.encode(piece), True
            parts.append(ids)
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), ref

    def _try_engine(self, data: str | bytes) -> np.ndarray | None:
        """The engine's body ids of ``data`` (a chunk's ``str``, or its UTF-8 for an engine that
        accepts it), or ``None`` when the engine raised (logged and counted in ``stats``): never answer
        approximately, the caller then takes the reference. A lone surrogate's ``UnicodeEncodeError``
        propagates (the request is invalid, not the engine)."""
        engine = self.engine
        try:
            return engine.encode(data)
        except UnicodeEncodeError:
            raise
        except Exception as e:
            log.warning("engine %s failed on a chunk (%s); reference used", engine.name, e)
            with self._stats_lock:
                self.stats["engine_errors"] += 1
            return None

    def _encode_utf8(self, item: tuple[int, int, bytes], text: str) -> tuple[np.ndarray, bool]:
        """Body ids of the chunk ``text[a:b]`` given as ``(a, b, its UTF-8)``, and whether the reference
        produced them. (An ASCII chunk, as many bytes as chars, is checked only when an ASCII code point is
        guarded.)"""
        a, b, data = item
        guard = self.guard
        guarded = (len(data) != b - a or guard.ascii_guarded) and guard.has_guarded_utf8(data)
        ids = None if guarded else self._try_engine(data)
        return (ids, False) if ids is not None else (self.reference.encode(text[a:b]), True)


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
