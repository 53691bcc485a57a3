"""A session's ids and token end offsets in amortized-growth int32 buffers, truncated and appended in place.

Layout of ``ids``: ``[prefix ids][body ids][suffix ids]`` — the post-processor's constant ids around the
body (Llama 3: ``prefix = [<|begin_of_text|>]``). ``ends[i]`` is the end of body token ``i`` in bytes of
*normalized* UTF-8 text (so ``ends[-1]`` is the normalized byte length of the whole body).
Memory: 8 bytes per token (4 for the id, 4 for the end) plus bounded headroom: a buffer grows to
``need + headroom(need)`` with ``headroom(n) = min(n // 16, GROW_MAX) + 16`` slots (not by doubling), and is
shrunk when its slack passes ``2 * headroom``. So ids + ends take at most ``8 n + 2 * 8 * headroom(n)``
bytes: <= 9 bytes per token, and <= 8 bytes per token + 64.25 KiB at any size. Growth reallocates the
arrays in place (``ndarray.resize``: no copy where the allocator can extend or remap the block) once per
``headroom`` new tokens, and copies the kept ids instead only while a view holds the ids array (below).

Replies are never changed later (copy-on-write): :meth:`TokenBuffer.ids` hands out read-only views of the
ids array, and :meth:`TokenBuffer.splice` writes in place only where no live view can see a change. A view
holds a reference to the array it was cut from (numpy keeps the owner as ``base``, also for views of views,
memoryviews and DLPack capsules), so the array's reference count says whether any view is alive; the
buffer also remembers the longest view it handed out of the current array. A splice that would give a slot
a live view shows a *different* id copies the kept ids into a fresh array first (O(n)) and leaves the old one
to its views; writing the same ids, or slots past every view, stays in place. So a caller that drops its
reply, or keeps it across an append that re-encodes the tokens after the cut unchanged, pays O(append);
an edit or truncation that changes ids a held reply shows pays one copy of the ids (4 bytes per token).

``TokenBuffer(..., offsets=False, grow_max=None)`` is the ids alone (no ends: 4 bytes per token) with
doubling growth (``headroom(n) = n + 16``): the ids a Triton client rebuilds from ``KEEP`` and a
patch (:class:`toktier_backend.client.SessionClient`), where one session per process makes the bound on
unused capacity moot and a copy per 4096 tokens would not be.
"""

from __future__ import annotations

import bisect
import sys

import numpy as np

#: Most slots a buffer grows by at once (bounds the unused capacity per session: 8 bytes per slot).
GROW_MAX = 4096
#: Last tokens :meth:`TokenBuffer.tokens_before` searches first.
_NEAR = 256


def _refs(buf: "TokenBuffer") -> int:
    """References to ``buf``'s ids array, as this function sees them (the buffer's own, the call's, views)."""
    return sys.getrefcount(buf._ids)


def headroom(n: int, grow_max: int | None = GROW_MAX) -> int:
    """Spare slots given to a buffer grown (or shrunk) to hold ``n`` tokens (``grow_max=None``: ``n``, so the
    capacity doubles)."""
    return (n if grow_max is None else min(n >> 4, grow_max)) + 16


class TokenBuffer:
    """Ids and token end offsets of one session (layout in the module docstring).

    Args:
        prefix, suffix: ``int32`` ids the post-processor puts around the body.
        capacity: initial slots.
        offsets: keep the token end offsets (``False``: ids only; :meth:`splice` then takes no
            ``token_nbytes``, and the offset methods must not be called).
        grow_max: most slots to grow by at once (``None``: double the capacity); see :func:`headroom`.

    Invariant: every view returned by :meth:`ids` keeps the values it had when it was returned.
    """

    __slots__ = ("_ids", "_ends", "_n", "body_nbytes", "_prefix", "_suffix", "_shown", "_grow_max")

    def __init__(self, prefix: np.ndarray, suffix: np.ndarray, capacity: int = 16, *, offsets: bool = True,
                 grow_max: int | None = GROW_MAX):
        self._prefix = prefix
        self._suffix = suffix
        self._grow_max = grow_max
        cap = max(capacity, len(prefix) + len(suffix) + 1)
        self._ids = np.empty(cap, dtype=np.int32)
        self._ends = np.empty(cap, dtype=np.int32) if offsets else None
        self._ids[: len(prefix)] = prefix
        self._n = 0  # body tokens
        #: Normalized UTF-8 bytes covered by the body tokens (``ends[n_body - 1]`` as a Python int, 0 when
        #: empty): set by :meth:`splice`; read it, never assign it.
        self.body_nbytes = 0
        self._shown = 0  # longest view handed out of the current ids array (slots)

    @property
    def n_body(self) -> int:
        return self._n

    @property
    def n_prefix(self) -> int:
        return len(self._prefix)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (data and array objects; capacity, not just the used part)."""
        return sys.getsizeof(self._ids) + (0 if self._ends is None else sys.getsizeof(self._ends))

    @property
    def capacity(self) -> int:
        """Slots allocated (ids and ends alike)."""
        return len(self._ids)

    def ids(self) -> np.ndarray:
        """``np.ndarray[int32] (n_prefix + n_body + n_suffix,)``, a read-only view. Later splices never
        change the values it shows (module docstring: copy-on-write)."""
        n = len(self._prefix) + self._n + len(self._suffix)
        v = self._ids[:n]
        v.setflags(write=False)
        if n > self._shown:
            self._shown = n
        return v

    def tokens_before(self, nbytes: int) -> int | None:
        """Number of body tokens ending at or before byte ``nbytes``; ``None`` when no token ends exactly
        there (the position is inside a token)."""
        if nbytes == 0:
            return 0
        # bisect over a memoryview of the ends (non-decreasing): each probe reads one int32 as a Python int,
        # with no numpy call per request (cost: docs/design/served_path.md). The view is released on
        # return, so it never blocks the ndarray.resize of a later splice.
        # The cut sought is usually among the last tokens: when every end before the last NEAR lies at or
        # before ``nbytes`` (ends[n - NEAR - 1] <= nbytes, the ends being non-decreasing), the bisection
        # over the last NEAR gives the same index as over all of them, and touches 1 KiB, not the array.
        with memoryview(self._ends) as ends:
            n = self._n
            lo = n - _NEAR if n > _NEAR and ends[n - _NEAR - 1] <= nbytes else 0
            k = bisect.bisect_right(ends, nbytes, lo, n)
            return k if k > 0 and ends[k - 1] == nbytes else None

    def splice(self, keep: int, new_ids: np.ndarray, token_nbytes: np.ndarray | None = None) -> None:
        """Keep the first ``keep`` body tokens, append ``new_ids`` (``np.ndarray[int32]``) after them.

        ``token_nbytes``: ``int32[vocab]`` normalized UTF-8 bytes per id (the ends are its running sum);
        ``None`` only for a buffer built with ``offsets=False``.
        Views returned by :meth:`ids` before the call keep their values (copy-on-write).
        """
        p, s = len(self._prefix), len(self._suffix)
        start = p + keep
        need = start + len(new_ids) + s
        have = len(self._ids)
        # slots a live view may show: none when only the buffer (and this call) hold the array
        unshared = _refs(self) <= _UNSHARED
        shown = 0 if unshared else self._shown
        room = headroom(need, self._grow_max)
        grow = need > have or have - need > 2 * room  # grow, or give back a truncation's slack
        cap = need + room if grow else have
        # Growth in place: ndarray.resize reallocs, keeping the first entries (large blocks move by remapping
        # pages, not copying). numpy refuses (ValueError) when anything but the attribute and the call holds
        # the array, so no view can be left pointing at freed memory; it is called on the attribute itself
        # (a helper's argument would be one reference more). The ends are never handed out.
        if grow and self._ends is not None:
            try:
                self._ends.resize(cap)
            except ValueError:
                ends = np.empty(cap, dtype=np.int32)
                ends[:keep] = self._ends[:keep]
                self._ends = ends
        resized = False
        if grow and unshared:
            try:
                self._ids.resize(cap)
                resized = True
            except ValueError:
                pass
        if not resized and (grow or (shown > start and self._changes_shown(start, new_ids, min(shown, need)))):
            ids = np.empty(cap, dtype=np.int32)
            ids[:start] = self._ids[:start]
            self._ids = ids  # the old array stays with its views, unchanged
            shown = 0
        self._shown = shown
        self._ids[start : start + len(new_ids)] = new_ids
        if self._ends is not None:
            # ends[keep + i] = ends[keep - 1] + nbytes(new_ids[0..i]): the gathered sizes written after the
            # last kept end, then one running sum over [last kept end, sizes...] in place (numpy defines an
            # accumulate whose output is its input as the same without overlap); the kept end is unchanged
            if keep:
                ends = self._ends[keep - 1 : keep + len(new_ids)]
                token_nbytes.take(new_ids, out=ends[1:])
            else:
                ends = self._ends[: len(new_ids)]
                token_nbytes.take(new_ids, out=ends)
            np.add.accumulate(ends, out=ends)
            self.body_nbytes = int(ends[-1]) if len(ends) else 0
        self._n = keep + len(new_ids)
        if s:
            self._ids[p + self._n : p + self._n + s] = self._suffix

    def _changes_shown(self, start: int, new_ids: np.ndarray, end: int) -> bool:
        """Whether writing ``new_ids`` then the suffix at ``start`` changes any of the slots ``[start, end)``."""
        n = min(end - start, len(new_ids))
        if n > 0 and (self._ids[start : start + n] != new_ids[:n]).any():
            return True
        at = start + len(new_ids)  # the suffix's new place
        return end > at and bool((self._ids[at:end] != self._suffix[: end - at]).any())


#: ``_refs`` of a buffer whose ids array no view holds (calibrated here: the count an interpreter reports
#: for the same call pattern differs between CPython versions).
_UNSHARED = _refs(TokenBuffer(np.zeros(0, np.int32), np.zeros(0, np.int32)))
