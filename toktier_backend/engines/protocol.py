"""The one engine protocol every tokenization backend implements.

An engine maps text to the *body* ids of the tokenizer: what HF ``tokenizers`` returns for
``encode(text, add_special_tokens=False).ids`` — added-token matching, normalizer, pre-tokenizer and model,
but no post-processor. The post-processor (BOS/EOS templates) is applied once, by the caller.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Engine(Protocol):
    """A tokenization backend.

    Attributes:
        name: registry name (``"hf"``, ``"gigatoken"``, ``"fastokens"``, ``"gpu"``).
        version: the backend package's version, part of the guard-set cache key.
    """

    name: str
    version: str

    def encode(self, text: str) -> np.ndarray:
        """Body ids of ``text``.

        Returns:
            ``np.ndarray[int32] (n_tokens,)``; equals HF ``encode(text, add_special_tokens=False).ids``
            for every text the engine is admitted for (see ``engines/admission.py``).
        """
        ...
