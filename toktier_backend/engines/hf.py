"""The reference engine: Hugging Face ``tokenizers``, frozen. Oracle and fallback of every route."""

from __future__ import annotations

import numpy as np
import tokenizers


class HFEngine:
    """``tokenizers.Tokenizer.from_file(path)`` behind the engine protocol.

    Truncation and padding configured in the file are disabled for the body encode (the post-processor
    and any truncation are the caller's business; files that configure them take the reference path for
    whole requests, see ``api.Tokenizer``).
    """

    name = "hf"
    version = tokenizers.__version__

    def __init__(self, path: str, tokenizer: tokenizers.Tokenizer | None = None):
        self.tokenizer = tokenizer if tokenizer is not None else tokenizers.Tokenizer.from_file(path)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]
