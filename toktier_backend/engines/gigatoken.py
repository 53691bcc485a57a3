"""gigatoken (PyPI ``gigatoken``): byte-level and SentencePiece-style BPE in Rust, admitted per file by the
canary and guard set of ``engines/admission.py``. Speed and agreement: ``docs/design/engines.md``."""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

try:
    import gigatoken as _gigatoken
except ImportError as e:  # pragma: no cover - exercised when the optional engine is absent
    _gigatoken = None
    _IMPORT_ERROR = e


#: Most Rust tokenizer objects one engine loads for concurrent callers (see ``GigatokenEngine.reserve``).
MAX_BACKENDS = 16


class GigatokenEngine:
    """gigatoken behind the engine protocol: :meth:`encode` releases the GIL and is safe from any number of
    threads (each takes a Rust tokenizer object of its own, see :meth:`reserve`)."""

    name = "gigatoken"
    releases_gil = True
    #: ``encode`` also takes the text's UTF-8 ``bytes``: a chunked encode converts each chunk once and the
    #: same bytes feed the guard check and the engine (``pipeline/chunked.py``).
    accepts_utf8 = True

    def __init__(self, path: str):
        from toktier_backend.errors import EngineUnavailable

        if _gigatoken is None:
            raise EngineUnavailable(f"gigatoken is not installed ({_IMPORT_ERROR}); pip install gigatoken")
        from importlib.metadata import version

        self.version = version("gigatoken")
        try:
            self._tok = _gigatoken.Tokenizer(path)
        except Exception as e:  # the Rust side raises ValueError/RuntimeError for unsupported files
            raise EngineUnavailable(f"gigatoken cannot load {path!r}: {e}") from e
        self._path = path
        self._backend = self._tok.backend
        self._one_row = _gigatoken.gigatoken_rs.PadTruncate(0)  # one document: no padding, no truncation
        # Rust tokenizers not in use. gigatoken serializes concurrent calls on one tokenizer object
        # (docs/design/parallel.md), so each concurrent caller checks one out. list.pop / list.append are
        # atomic under the GIL.
        self._free = [self._backend]
        self._backends = 1
        self._lock = threading.Lock()

    @property
    def backends(self) -> int:
        """Rust tokenizer objects loaded (one per concurrent caller seen, at most ``MAX_BACKENDS``)."""
        return self._backends

    def reserve(self, n: int) -> None:
        """Load Rust tokenizer objects up to ``n`` (at most :data:`MAX_BACKENDS`), so that ``n`` threads can
        encode at once. Each costs the file's load time and its tables in memory
        (``docs/design/engines.md``); call it at startup, not on the request path."""
        with self._lock:
            while self._backends < min(n, MAX_BACKENDS):
                self._free.append(_gigatoken.Tokenizer(self._path).backend)
                self._backends += 1

    def encode(self, text: str | bytes) -> np.ndarray:
        """Body ids of ``text`` (a ``str`` or its UTF-8 ``bytes``), with the GIL released while Rust runs.

        Not gigatoken's ``Tokenizer.encode``: in 0.10.0 that holds the GIL for the whole call (a Python
        thread waits out the whole encode) and takes a *mutable* borrow of the Rust tokenizer,
        so a second thread calling any method during a GIL-free call gets ``RuntimeError: Already
        borrowed``. ``encode_batch_padded([text], parallel=False)`` runs the same encoder on the calling
        thread with the GIL released and a shared borrow (any number of threads at once), and one row
        needs no padding. Checked equal to ``Tokenizer.encode`` on the canary and on every guard-set probe
        text (all 1,112,064 scalar values in four contexts) of the nine files in ``shared/tokenizers``, so
        the guard tables computed with ``Tokenizer.encode`` hold for it; ``tests/pipeline/test_chunked.py`` compares it
        with HF. Passing ``bytes`` skips gigatoken's own UTF-8 conversion, which runs under the GIL
        (``docs/design/parallel.md``). Concurrent callers each take a Rust tokenizer object of
        their own (:meth:`reserve`); beyond those they share one, which gigatoken serializes.

        Returns:
            ``np.ndarray[int32] (n_tokens,)``, a view of gigatoken's ``uint32`` row (ids < 2**31).
        """
        try:
            backend = self._free.pop()
        except IndexError:  # more concurrent callers than reserved objects: share one (correct, serialized)
            backend, shared = self._backend, True
        else:
            shared = False
        try:
            rows, _ = backend.encode_batch_padded([text], self._one_row, parallel=False)
        finally:
            if not shared:
                self._free.append(backend)
        return rows[0].view(np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """:meth:`encode` of each text, in order (on the calling thread, one call each)."""
        return [self.encode(t) for t in texts]
