"""fastokens (PyPI ``fastokens``): a Rust re-implementation of HF ``tokenizers``' encode path.

The first engine of ``FAST_ENGINE_ORDER`` (``registry.py`` says why). It loads seven of the nine files in
``shared/tokenizers`` (not the tiktoken-converted cl100k_base / o200k_base: "unsupported model type") and
agrees with HF on every Unicode scalar value in every probe context there: its guard tables
(``data/guard/*-fastokens-*``) are empty. They were computed once through ``Tokenizer.encode(text).ids``
and again through :meth:`FastokensEngine.encode` (``encode_batch_flat``, the call we serve with): both
runs found 0 guarded code points on all seven files.
"""

from __future__ import annotations

import os

import numpy as np

#: fastokens' helper threads (``FASTOKENS_BPE_THREADS``, read once, at the process's first fastokens encode)
#: are off unless the user set the variable: our pool runs every core's share of a long text, as pieces cut
#: at stable cuts (``pipeline/chunked.py``). With the helper on, each 256K-char piece also handed work to the one
#: helper thread, which spins after each call for more, on the core the other pool worker needs. Each
#: system in its own process, interleaved, 0.2 s idle gaps, 4M chars of agent text, n=30, p50 ms, pieces
#: with the helper off / the shipped choice with it on (pieces, or one whole call with the helper pinned) /
#: one whole call with it on: gpt2 11.77 / 13.01 / 13.51, llama3_1 10.79 / 12.25 / 11.14, deepseek_v3
#: 11.28 / 11.62 / 11.71, qwen3 12.10 / 12.81 / 17.22; at 1M chars (n=24) gpt2 3.81 / 4.34, qwen3 4.92 /
#: 5.22. Set by ``setdefault``: a process that sets it keeps its value (``ChunkedEncoder.calibrate`` then
#: measures one whole call with the helpers against the pieces), and a process whose fastokens already
#: encoded before this import keeps the pool it started.
BPE_THREADS_DEFAULT = "1"
os.environ.setdefault("FASTOKENS_BPE_THREADS", BPE_THREADS_DEFAULT)

try:
    import fastokens as _fastokens
except ImportError as e:  # pragma: no cover
    _fastokens = None
    _IMPORT_ERROR = e


class FastokensEngine:
    """fastokens behind the engine protocol.

    Threads: ``encode_batch_flat`` converts the ``str`` to UTF-8 under the GIL (CPython's
    ``PyUnicode_AsUTF8AndSize``: ~0.6 ns/char for non-ASCII text, free for ASCII), then releases the GIL
    while Rust runs. One object serves any number of threads at once (two threads encoding 2M chars each on
    one object took as long as one 2M encode). With ``FASTOKENS_BPE_THREADS`` above 1 (this module sets 1
    unless the process set it: :data:`BPE_THREADS_DEFAULT`), fastokens also starts a helper thread of its own
    on the first encode in the process and may split a call's work with it (on gpt2, llama3_1, deepseek_v3;
    not on qwen3); that thread inherits the CPU affinity and nice value of the thread that made the first
    call, so the first call should come from an unpinned thread (the admission canary, at load, is that
    call). See :meth:`helper_threads`.
    The segment cache is turned off (``FASTOKENS_SEGMENT_CACHE`` would turn it on at construction): session
    repair already skips repeated text, and the guard tables were computed without it.
    """

    name = "fastokens"
    #: ``encode_nogil`` takes a ``str`` only (fastokens rejects ``bytes``): a chunked encode hands it the
    #: chunk's text and fastokens converts it on the worker (``parallel.ChunkedEncoder``).
    accepts_utf8 = False

    def __init__(self, path: str):
        from toktier_backend.errors import EngineUnavailable

        if _fastokens is None:
            raise EngineUnavailable(f"fastokens is not installed ({_IMPORT_ERROR}); pip install fastokens")
        try:
            from importlib.metadata import version

            self.version = version("fastokens")
        except Exception:
            self.version = "unknown"
        try:
            self._tok = _fastokens.Tokenizer.from_file(path)
        except Exception as e:
            raise EngineUnavailable(f"fastokens cannot load {path!r}: {e}") from e
        self._tok.enable_segment_cache(0)
        self._helpers: list[int] = []  # native ids of fastokens' helper threads, found on first use

    def helper_threads(self) -> list[int]:
        """Native thread ids of fastokens' helper threads in this process (fastokens 0.3.5 names them
        ``fastokens-<i>``; Linux ``/proc/self/task/*/comm``), ``[]`` before the first encode or elsewhere.
        ``ChunkedEncoder`` pins them, with the caller, to distinct CPUs while it runs a long whole-text
        encode: left to the scheduler, the helper woke on the caller's CPU in most calls after an idle gap
        and the call ran serially (gpt2 4M chars: 14.2 vs 9.9 ms p50, n=20). The ids are found once and
        re-read only when one of them no longer names a fastokens thread (one ``comm`` read per call)."""
        if self._helpers and all(_is_helper(tid) for tid in self._helpers):
            return self._helpers
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:  # pragma: no cover - not Linux
            return []
        self._helpers = sorted(int(tid) for tid in tasks if _is_helper(int(tid)))
        return self._helpers

    def encode(self, text: str) -> np.ndarray:
        """Body ids of ``text``, GIL released while Rust runs.

        ``encode_batch_flat([text])`` returns the ids as one little-endian ``uint32`` buffer: no Python int
        per token (``encode(text).ids`` builds a list: 1M chars of agent text 5.8 vs 3.9 ms).

        Returns:
            ``np.ndarray[int32] (n_tokens,)``, a read-only view of fastokens' buffer (ids < 2**31).

        Raises:
            UnicodeEncodeError: ``text`` holds a lone surrogate (``e.start`` is its char index).
        """
        ids, _offsets = self._tok.encode_batch_flat([text])
        return np.frombuffer(ids, dtype="<u4").view(np.int32)

    #: The pool's name for a GIL-free encode (``toktier_backend.pipeline.chunked`` chunks only engines that have one).
    encode_nogil = encode


def _is_helper(tid: int) -> bool:
    """Is native thread ``tid`` of this process one of fastokens' helpers (its name starts ``fastokens``)?"""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().startswith("fastokens")
    except OSError:  # the thread ended (or not Linux)
        return False
