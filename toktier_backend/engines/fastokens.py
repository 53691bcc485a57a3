"""fastokens (PyPI ``fastokens``): a Rust re-implementation of HF ``tokenizers``' encode path."""

from __future__ import annotations

import numpy as np

try:
    import fastokens as _fastokens
except ImportError as e:  # pragma: no cover
    _fastokens = None
    _IMPORT_ERROR = e


class FastokensEngine:
    name = "fastokens"

    def __init__(self, path: str):
        from ..errors import EngineUnavailable

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

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
