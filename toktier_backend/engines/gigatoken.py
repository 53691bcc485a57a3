"""gigatoken (PyPI ``gigatoken``): byte-level and SentencePiece-style BPE in Rust; exact on the nine files
in ``shared/tokenizers`` in our measurements, ~100x HF on 2K-char windows (see ``bench/``)."""

from __future__ import annotations

import numpy as np

try:
    import gigatoken as _gigatoken
except ImportError as e:  # pragma: no cover - exercised when the optional engine is absent
    _gigatoken = None
    _IMPORT_ERROR = e


class GigatokenEngine:
    name = "gigatoken"

    def __init__(self, path: str):
        from ..errors import EngineUnavailable

        if _gigatoken is None:
            raise EngineUnavailable(f"gigatoken is not installed ({_IMPORT_ERROR}); pip install gigatoken")
        from importlib.metadata import version

        self.version = version("gigatoken")
        try:
            self._tok = _gigatoken.Tokenizer(path)
        except Exception as e:  # the Rust side raises ValueError/RuntimeError for unsupported files
            raise EngineUnavailable(f"gigatoken cannot load {path!r}: {e}") from e
        self._backend = self._tok.backend
        self._one_row = _gigatoken.gigatoken_rs.PadTruncate(0)  # one document: no padding, no truncation

    def encode(self, text: str) -> np.ndarray:
        # gigatoken returns uint32; ids are < 2**31 for every vocabulary, so the view is exact and free.
        return np.asarray(self._tok.encode(text)).view(np.int32)

    def encode_nogil(self, text: str | bytes) -> np.ndarray:
        """:meth:`encode` with the GIL released while the Rust encoder runs, for pool threads.

        ``text`` may be the ``str`` or its UTF-8 ``bytes`` (then gigatoken skips its own conversion, which
        runs under the GIL: ~3 of ~18 ms CPU for 4M chars of agent text).

        gigatoken 0.10.0 ``Tokenizer.encode`` holds the GIL for the whole call and runs on the calling
        thread (measured: a Python thread waits the full 4M-char encode, ~15-30 ms, and no worker thread
        appears), so threads calling it run one at a time. ``encode_batch_padded([text], parallel=False)``
        runs the same encoder on the calling thread with the GIL released (the same probe waits <= the
        5 ms switch interval), and a single row needs no padding. gigatoken documents the batch paths as
        giving identical output; ``tests/parallel`` checks this path against HF on all nine files.

        Returns:
            ``np.ndarray[int32] (n_tokens,)``, a view of gigatoken's ``uint32`` row (ids < 2**31).
        """
        rows, _ = self._backend.encode_batch_padded([text], self._one_row, parallel=False)
        return rows[0].view(np.int32)
