"""A session's text without O(n) copies per append.

Python ``str`` concatenation copies the whole context, so a 3M-char session would pay ~3 MB of memcpy per
1.5K-char append. :class:`TextStore` keeps the text as *blocks*: frozen blocks of at least
``BLOCK`` chars plus a short open tail. An append touches only the tail (amortized O(len(delta))), reading
the last ``k`` chars walks back over at most ``k / BLOCK + 2`` blocks, and a full-text update simply keeps
a reference to the caller's string (it carries the whole text anyway).
"""

from __future__ import annotations

import sys

#: Target block size in chars: the open tail is frozen into one block once it reaches this size.
BLOCK = 1 << 16


class TextStore:
    """The text of one session, as blocks.

    Invariant: ``"".join(self._blocks) == text``, ``len(text) == self.length`` and
    ``self._nbytes == sum(sys.getsizeof(b) for b in self._blocks)`` (kept as blocks change, so :attr:`nbytes`,
    read on every served request, is O(1)).
    """

    __slots__ = ("_blocks", "length", "_tail_len", "_nbytes")

    def __init__(self, text: str = ""):
        self._blocks: list[str] = [text] if text else []
        #: chars held (``len(self)``, as an attribute: the repair reads it several times per request); read it,
        #: never assign it
        self.length = len(text)
        self._tail_len = 0  # chars in the open (not yet frozen) trailing blocks
        self._nbytes = sys.getsizeof(text) if text else 0

    def __len__(self) -> int:
        return self.length

    @property
    def text(self) -> str:
        """The whole text (O(n) on first access after appends; the joined string is kept)."""
        if len(self._blocks) > 1:
            self._blocks = ["".join(self._blocks)]
            self._tail_len = 0
            self._nbytes = sys.getsizeof(self._blocks[0])
        return self._blocks[0] if self._blocks else ""

    @property
    def nbytes(self) -> int:
        """Bytes held by the text (``sys.getsizeof`` of each block: 1, 2 or 4 bytes per char + header). O(1)."""
        return self._nbytes

    def blocks(self) -> tuple[str, ...]:
        """A snapshot of the text: ``"".join(self.blocks())`` is the text as of this call, whatever the store
        does later (blocks are ``str``, immutable; the store replaces blocks, never changes one). O(blocks):
        at most ``len / BLOCK + 257``."""
        return tuple(self._blocks)

    def replace(self, text: str) -> None:
        """Hold ``text`` (no copy)."""
        self._blocks = [text] if text else []
        self.length = len(text)
        self._tail_len = 0
        self._nbytes = sys.getsizeof(text) if text else 0

    def append(self, delta: str) -> None:
        """Append ``delta``: amortized O(len(delta))."""
        if not delta:
            return
        self._blocks.append(delta)
        self.length += len(delta)
        self._tail_len += len(delta)
        self._nbytes += sys.getsizeof(delta)
        if self._tail_len >= BLOCK or len(self._blocks) > 256:
            k = self._open_count()
            joined = "".join(self._blocks[-k:])
            self._nbytes += sys.getsizeof(joined) - sum(sys.getsizeof(b) for b in self._blocks[-k:])
            del self._blocks[-k:]
            self._blocks.append(joined)
            self._tail_len = 0

    def _open_count(self) -> int:
        k, n = 0, 0
        for b in reversed(self._blocks):
            if n >= self._tail_len:
                break
            n += len(b)
            k += 1
        return max(k, 1)

    def tail(self, start: int) -> str:
        """``text[start:]``, in O(len(text) - start + blocks walked)."""
        if start >= self.length:
            return ""
        need = self.length - start
        parts: list[str] = []
        got = 0
        for b in reversed(self._blocks):
            parts.append(b)
            got += len(b)
            if got >= need:
                break
        over = got - need  # chars of the oldest part that are not wanted: slice them off before joining
        if over:
            parts[-1] = parts[-1][over:]
        return parts[0] if len(parts) == 1 else "".join(reversed(parts))

    def truncate(self, n: int) -> None:
        """Keep ``text[:n]``."""
        if n >= self.length:
            return
        drop = self.length - n
        while drop > 0 and self._blocks:
            b = self._blocks[-1]
            if len(b) <= drop:
                self._blocks.pop()
                self._nbytes -= sys.getsizeof(b)
                drop -= len(b)
            else:
                cut = self._blocks[-1] = b[: len(b) - drop]
                self._nbytes += sys.getsizeof(cut) - sys.getsizeof(b)
                drop = 0
        self.length = n
        self._tail_len = min(self._tail_len, n)

    def common_prefix(self, other: str) -> int:
        """Length of the longest common prefix of the text and ``other`` (chars).

        One pass of C-level slice comparisons over 4K-char pieces, then a binary search inside the first
        differing piece: O(n) memory comparison, the cost the full-text mode is allowed.
        """
        pos = 0
        for b in self._blocks:
            if other.startswith(b, pos):
                pos += len(b)
                continue
            return pos + _common_prefix(b, other, pos)
        return pos


def _common_prefix(block: str, other: str, pos: int) -> int:
    """LCP of ``block`` and ``other[pos:]``."""
    n = min(len(block), len(other) - pos)
    step = 4096
    i = 0
    while i < n and block[i : i + step] == other[pos + i : pos + i + step]:
        i += step
    lo, hi = i, min(n, i + step)  # lcp in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if block[lo:mid] == other[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
