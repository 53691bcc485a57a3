"""fastokens (PyPI ``fastokens``): a Rust re-implementation of HF ``tokenizers``' encode path.

The first engine of ``FAST_ENGINE_ORDER`` (``registry.py`` says why). It loads seven of the nine files in
``shared/tokenizers`` (not the tiktoken-converted cl100k_base / o200k_base: "unsupported model type") and
agrees with HF on every Unicode scalar value in every probe context there: its guard tables
(``data/guard/*-fastokens-*``) are empty, computed through :meth:`FastokensEngine.encode`
(``encode_batch_flat``, the call we serve with); provenance: ``docs/design/engines.md``.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

#: fastokens' ids: little-endian uint32 (< 2**31), read as int32 with the same bits
_IDS = np.dtype("<i4")

#: fastokens' helper threads (``FASTOKENS_BPE_THREADS``, read once, at the process's first fastokens encode)
#: are off unless the user set the variable: our pool runs every core's share of a long text, as pieces cut
#: at stable cuts (``pipeline/chunked.py``). Set by ``setdefault``: a process that sets it keeps its value
#: (the pieces stay exact; fastokens may then also hand part of each piece to its helper), and a process
#: whose fastokens already encoded before this import keeps the threads it started. Why off:
#: ``docs/design/parallel.md``.
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
    ``PyUnicode_AsUTF8AndSize``; free for ASCII), then releases the GIL while Rust runs
    (:attr:`releases_gil`). One object serves any number of threads at once, in parallel
    (``docs/design/parallel.md``), so :meth:`reserve` loads nothing.
    The segment cache is turned off (``FASTOKENS_SEGMENT_CACHE`` would turn it on at construction): session
    repair already skips repeated text, and the guard tables were computed without it.
    """

    name = "fastokens"
    releases_gil = True
    #: ``encode`` takes a ``str`` only (fastokens rejects ``bytes``): a chunked encode hands it the piece's
    #: text and fastokens converts it on the worker (``pipeline/chunked.py``).
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

    def encode(self, text: str) -> np.ndarray:
        """Body ids of ``text``, GIL released while Rust runs.

        ``encode_batch_flat([text])`` returns the ids as one little-endian ``uint32`` buffer: no Python int
        per token (``encode(text).ids`` builds a list; cost: ``docs/design/engines.md``).

        Returns:
            ``np.ndarray[int32] (n_tokens,)``, a read-only view of fastokens' buffer (ids < 2**31).

        Raises:
            UnicodeEncodeError: ``text`` holds a lone surrogate (``e.start`` is its char index).
        """
        ids, _offsets = self._tok.encode_batch_flat([text])
        return np.frombuffer(ids, dtype=_IDS)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` of each text, in order (one call each: a batch call would return one flat buffer
        to split again)."""
        return [self.encode(t) for t in texts]

    def reserve(self, n: int) -> None:
        """Nothing to load: one fastokens object serves every thread at once."""
