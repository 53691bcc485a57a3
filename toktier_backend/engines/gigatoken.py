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

    def encode(self, text: str) -> np.ndarray:
        # gigatoken returns uint32; ids are < 2**31 for every vocabulary, so the view is exact and free.
        return np.asarray(self._tok.encode(text)).view(np.int32)
