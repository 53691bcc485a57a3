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

    def encode(self, text: str | bytes) -> np.ndarray:
        """Body ids of ``text`` (a ``str`` or its UTF-8 ``bytes``), with the GIL released while Rust runs.

        Not gigatoken's ``Tokenizer.encode``: in 0.10.0 that holds the GIL for the whole call (a Python
        thread waits out a 4M-char encode, ~15-30 ms) and takes a *mutable* borrow of the Rust tokenizer,
        so a second thread calling any method during a GIL-free call gets ``RuntimeError: Already
        borrowed``. ``encode_batch_padded([text], parallel=False)`` runs the same encoder on the calling
        thread with the GIL released and a shared borrow (any number of threads at once), and one row
        needs no padding. Checked equal to ``Tokenizer.encode`` on the canary and on every guard-set probe
        text (all 1,112,064 scalar values in four contexts) of the nine files in ``shared/tokenizers``, so
        the guard tables computed with ``Tokenizer.encode`` hold for it; ``tests/parallel`` compares it
        with HF. Passing ``bytes`` skips gigatoken's own UTF-8 conversion, which runs under the GIL (~3 of
        ~18 ms CPU for 4M chars of agent text).

        Returns:
            ``np.ndarray[int32] (n_tokens,)``, a view of gigatoken's ``uint32`` row (ids < 2**31).
        """
        rows, _ = self._backend.encode_batch_padded([text], self._one_row, parallel=False)
        return rows[0].view(np.int32)

    #: The pool's name for a GIL-free encode (``toktier_backend.parallel`` chunks only engines that have one).
    encode_nogil = encode
