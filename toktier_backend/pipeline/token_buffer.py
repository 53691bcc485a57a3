"""A session's ids and token end offsets in amortized-growth int32 buffers, truncated and appended in place.

Layout of ``ids``: ``[prefix ids][body ids][suffix ids]`` — the post-processor's constant ids around the
body (Llama 3: ``prefix = [<|begin_of_text|>]``). ``ends[i]`` is the end of body token ``i`` in bytes of
*normalized* UTF-8 text (so ``ends[-1]`` is the normalized byte length of the whole body).
Memory: 8 bytes per token (4 for the id, 4 for the end) plus bounded headroom: a buffer grows to
``need + headroom(need)`` with ``headroom(n) = min(n // 16, GROW_MAX) + 16`` slots (not by doubling), and is
shrunk when its slack passes ``2 * headroom``. So ids + ends take at most ``8 n + 2 * 8 * headroom(n)``
bytes: <= 9 bytes per token, and <= 8 bytes per token + 64.25 KiB at any size. Growth copies the kept
ids once per ``headroom`` new tokens (amortized O(16) per token up to 64K tokens, O(n / 4096) above).
"""

from __future__ import annotations

import sys

import numpy as np

#: Most slots a buffer grows by at once (bounds the unused capacity per session: 8 bytes per slot).
GROW_MAX = 4096


def headroom(n: int) -> int:
    """Spare slots given to a buffer grown (or shrunk) to hold ``n`` tokens."""
    return min(n >> 4, GROW_MAX) + 16


class TokenBuffer:
    __slots__ = ("_ids", "_ends", "_n", "_prefix", "_suffix")

    def __init__(self, prefix: np.ndarray, suffix: np.ndarray, capacity: int = 16):
        self._prefix = prefix
        self._suffix = suffix
        cap = max(capacity, len(prefix) + len(suffix) + 1)
        self._ids = np.empty(cap, dtype=np.int32)
        self._ends = np.empty(cap, dtype=np.int32)
        self._ids[: len(prefix)] = prefix
        self._n = 0  # body tokens

    @property
    def n_body(self) -> int:
        return self._n

    @property
    def n_prefix(self) -> int:
        return len(self._prefix)

    @property
    def body_nbytes(self) -> int:
        """Normalized UTF-8 bytes covered by the body tokens."""
        return int(self._ends[self._n - 1]) if self._n else 0

    def body_nbytes_before(self, keep: int) -> int:
        """Normalized UTF-8 bytes covered by the first ``keep`` body tokens."""
        return int(self._ends[keep - 1]) if keep else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the two arrays (data and array objects; capacity, not just the used part)."""
        return sys.getsizeof(self._ids) + sys.getsizeof(self._ends)

    @property
    def capacity(self) -> int:
        """Slots allocated (ids and ends alike)."""
        return len(self._ids)

    def ids(self) -> np.ndarray:
        """``np.ndarray[int32] (n_prefix + n_body + n_suffix,)``, a read-only view valid until the next
        change of this buffer."""
        p = len(self._prefix)
        v = self._ids[: p + self._n + len(self._suffix)]
        v = v.view()
        v.flags.writeable = False
        return v

    def tokens_before(self, nbytes: int) -> int | None:
        """Number of body tokens ending at or before byte ``nbytes``; ``None`` when no token ends exactly
        there (the position is inside a token)."""
        if nbytes == 0:
            return 0
        # np.int32 needle: a Python int would make numpy cast the whole array (O(n)) before searching
        k = int(np.searchsorted(self._ends[: self._n], np.int32(nbytes), side="right"))
        return k if k > 0 and self._ends[k - 1] == nbytes else None

    def splice(self, keep: int, new_ids: np.ndarray, token_nbytes: np.ndarray) -> None:
        """Keep the first ``keep`` body tokens, append ``new_ids`` (``np.ndarray[int32]``) after them."""
        p, s = len(self._prefix), len(self._suffix)
        need = p + keep + len(new_ids) + s
        have = len(self._ids)
        if need > have or have - need > 2 * headroom(need):  # grow, or give back a truncation's slack
            cap = need + headroom(need)
            ids = np.empty(cap, dtype=np.int32)
            ends = np.empty(cap, dtype=np.int32)
            ids[: p + keep] = self._ids[: p + keep]
            ends[:keep] = self._ends[:keep]
            self._ids, self._ends = ids, ends
        base = self._ends[keep - 1] if keep else np.int32(0)
        self._ids[p + keep : p + keep + len(new_ids)] = new_ids
        ends = self._ends[keep : keep + len(new_ids)]
        np.cumsum(token_nbytes[new_ids], out=ends)
        ends += base
        self._n = keep + len(new_ids)
        if s:
            self._ids[p + self._n : p + self._n + s] = self._suffix
