"""The reference engine: Hugging Face ``tokenizers``, frozen. Oracle and fallback of every route."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tokenizers


class HFEngine:
    """``tokenizers.Tokenizer.from_file(path)`` behind the engine protocol.

    Truncation and padding configured in the file are disabled for the body encode (the post-processor
    and any truncation are the caller's business; files that configure them take the reference path for
    whole requests, see ``tokenizer.Tokenizer``).

    ``tokenizers`` holds the GIL in ``encode`` (:attr:`releases_gil` is ``False``): a long text is never
    chunked onto threads for it.
    """

    name = "hf"
    version = tokenizers.__version__
    releases_gil = False
    accepts_utf8 = False

    def __init__(self, path: str, tokenizer: tokenizers.Tokenizer | None = None):
        self.tokenizer = tokenizer if tokenizer is not None else tokenizers.Tokenizer.from_file(path)

    def encode(self, text: str) -> np.ndarray:
        """HF ``encode(text, add_special_tokens=False).ids`` as ``np.ndarray[int32] (n_tokens,)``.

        Raises:
            TypeError: ``text`` holds a lone surrogate (``tokenizers`` cannot convert it).
        """
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """HF ``encode_batch(texts, add_special_tokens=False)``: ``[int32[n_i]]`` in order."""
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def reserve(self, n: int) -> None:
        """Nothing to load: one ``tokenizers.Tokenizer`` serves every thread."""
