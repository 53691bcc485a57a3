"""A deliberately wrong fast engine, for the shadow verifier's tests (in-process and in a real tritonserver).

It wraps the admitted engine and, on any text holding :data:`TRIGGER`, replaces the last id by another id of
the *same normalized byte length*: the splice's offset re-check cannot see it, so only the shadow verifier
can. It is installed after admission (admission would refuse it), as a bug in a new engine build would be.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

TRIGGER = "FAULTY"


class FaultyEngine:
    """An ``engines.protocol.Engine`` around ``inner``. Holds the GIL as far as the chunked encoder knows
    (``releases_gil`` false): every text reaches :meth:`encode` whole, so the trigger is never cut apart."""

    name = "faulty"
    version = "test"
    releases_gil = False
    accepts_utf8 = False

    def __init__(self, inner, token_nbytes: np.ndarray):
        self.inner = inner
        self.calls = 0
        # id -> another id with the same byte length (the next one in id order)
        self._swap = np.arange(len(token_nbytes), dtype=np.int32)
        by_len: dict[int, list[int]] = {}
        for i, n in enumerate(token_nbytes.tolist()):
            by_len.setdefault(n, []).append(i)
        for ids in by_len.values():
            for a, b in zip(ids, ids[1:] + ids[:1]):
                self._swap[a] = b

    def encode(self, text: str) -> np.ndarray:
        self.calls += 1
        ids = self.inner.encode(text)
        if TRIGGER in text and len(ids):
            ids = np.array(ids, dtype=np.int32)
            ids[-1] = self._swap[ids[-1]]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def reserve(self, n: int) -> None:
        self.inner.reserve(n)


def install(tokenizer) -> FaultyEngine:
    """Replace ``tokenizer.engine`` by a :class:`FaultyEngine` around it; returns it."""
    eng = FaultyEngine(tokenizer.engine, tokenizer.spec.token_nbytes)
    tokenizer.engine = eng
    return eng
