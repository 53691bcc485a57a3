"""Sessions by correlation ID: an idle TTL, a byte budget with LRU eviction, and START/END semantics.

Memory is counted honestly: each entry costs ``Session.nbytes`` (text blocks as ``sys.getsizeof`` counts
them, the id/offset arrays at their capacity) plus :data:`ENTRY_OVERHEAD` for the Python objects around them
(measured with ``tracemalloc`` in ``tests/pipeline/test_session_store.py``). When the total passes the
budget, the least recently used sessions are evicted; a session that alone is over the budget is evicted
right after its reply. An evicted or unknown session is rebuilt exactly from the whole text of the next
``MODE=full`` request; a ``MODE=delta`` request for it gets ``UnknownSession`` (NOT_FOUND) asking for the
whole text.

Not thread-safe by itself: the serving handler serializes access.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Hashable

DEFAULT_SESSION_TTL_S = 600.0
"""Default idle time after which a session is dropped, in seconds (the sequence batcher's idle timeout)."""

ENTRY_OVERHEAD = 3072
"""Bytes per held session beyond ``Session.nbytes``: the Session, TextStore, TokenBuffer and RepairInfo
objects, the entry, and the store's dict node (measured: 2.3-2.8 KiB, see the test)."""

EVICTION_CAUSES = ("idle", "budget", "start", "error")
"""Why a session was dropped other than by END: idle past the TTL, LRU under the byte budget, a START on its
correlation ID replaced it, or a request failed mid-update (its state could be half-applied)."""

CorrelationId = Hashable  # int or str, as request.correlation_id() returns it


@dataclasses.dataclass
class SessionEntry:
    """One held session.

    Attributes:
        session: the core ``Session`` (text, ids, last repair).
        add_special_tokens: the flag the session was opened with; a ``delta`` request cannot change it.
        text_bytes: UTF-8 bytes of ``session.text`` (checked against ``max_text_bytes`` without re-encoding).
        last_used: clock time of the last request, in seconds.
        nbytes: memory charged to the budget at the last :meth:`SessionStore.account`, in bytes.
    """

    session: Any
    add_special_tokens: bool
    text_bytes: int
    last_used: float
    nbytes: int = 0


class SessionStore:
    """Sessions by correlation ID, least recently used first.

    Args:
        ttl_s: idle time, in seconds, after which a session is dropped (checked lazily on access and by
            :meth:`expire`). Align it with the sequence batcher's ``max_sequence_idle_microseconds``.
        max_bytes: byte budget of all held sessions (``None`` or 0: unbounded).
        clock: monotonic clock in seconds (tests pass a fake one).
        on_evict: called as ``on_evict(corr_id, entry, cause)`` for every eviction (cause in
            :data:`EVICTION_CAUSES`); END is not an eviction.
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[CorrelationId, SessionEntry, str], None] | None = None,
    ):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: unbounded), got {max_bytes!r}")
        self.ttl_s = float(ttl_s)
        self.max_bytes = int(max_bytes) if max_bytes else None
        self._clock = clock
        self._on_evict = on_evict
        self._entries: OrderedDict[CorrelationId, SessionEntry] = OrderedDict()  # LRU first
        self._nbytes = 0
        self._next_sweep = clock() + self.ttl_s
        self.evictions: Counter[str] = Counter()  # by cause, since start
        #: Another store charged to the same budget (the tokenizer's ``PrefixIndex``: ``nbytes``,
        #: ``oldest_use()`` on this store's clock, ``evict_oldest()``), or ``None``. See :meth:`share_budget`.
        self.shared = None

    # ------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, corr_id: CorrelationId) -> bool:
        return self.get(corr_id, touch=False) is not None

    def now(self) -> float:
        return self._clock()

    @property
    def nbytes(self) -> int:
        """Bytes charged for all held sessions (as of each one's last :meth:`account`)."""
        return self._nbytes

    @property
    def expired(self) -> int:
        """Sessions dropped for idleness since start."""
        return self.evictions["idle"]

    def get(self, corr_id: CorrelationId, *, touch: bool = True) -> SessionEntry | None:
        """The live entry for ``corr_id`` (now the most recently used), or ``None`` (never held, ended,
        evicted, or idle past the TTL)."""
        entry = self._entries.get(corr_id)
        if entry is None:
            return None
        if self._clock() - entry.last_used > self.ttl_s:
            self._drop(corr_id, "idle")
            return None
        if touch:
            self._entries.move_to_end(corr_id)
        return entry

    # ------------------------------------------------------------ writing

    def put(self, corr_id: CorrelationId, entry: SessionEntry) -> list[CorrelationId]:
        """Hold ``entry`` (replacing any entry of ``corr_id`` without counting an eviction) and charge it.

        Returns:
            the correlation IDs evicted to stay within the budget (may include ``corr_id`` itself).
        """
        old = self._entries.pop(corr_id, None)
        if old is not None:
            self._nbytes -= old.nbytes
        entry.nbytes = 0
        self._entries[corr_id] = entry
        return self.account(corr_id)

    def share_budget(self, other) -> None:
        """Charge ``other`` (a ``PrefixIndex``) to this store's byte budget: one least-recently-used order
        over sessions and indexed prefix chunks (a shared system prompt is indexed once, however many
        sessions start from it). ``other`` must use this store's clock for its ``oldest_use``."""
        self.shared = other

    def _total(self) -> int:
        return self._nbytes + (self.shared.nbytes if self.shared is not None else 0)

    def account(self, corr_id: CorrelationId | None) -> list[CorrelationId]:
        """Re-measure ``corr_id`` (``None``: nothing) after a request changed it, then evict what was used
        least recently, sessions or (with :meth:`share_budget`) indexed prefix chunks, while the total is over
        the budget.

        Returns:
            the correlation IDs evicted (``corr_id`` last, only if it alone is over the budget).
        """
        entry = self._entries.get(corr_id) if corr_id is not None else None
        if entry is not None:
            size = int(getattr(entry.session, "nbytes", 0)) + ENTRY_OVERHEAD
            self._nbytes += size - entry.nbytes
            entry.nbytes = size
        evicted: list[CorrelationId] = []
        if self.max_bytes is None:
            return evicted
        while self._total() > self.max_bytes:
            victim = next((k for k in self._entries if k != corr_id), None)
            oldest = self.shared.oldest_use() if self.shared is not None else None
            if oldest is not None and (victim is None or oldest <= self._entries[victim].last_used):
                self.shared.evict_oldest()
                continue
            if victim is None:
                break
            self._drop(victim, "budget")
            evicted.append(victim)
        if self._total() > self.max_bytes and corr_id in self._entries:
            self._drop(corr_id, "budget")  # alone over the budget: the reply went out, the state does not stay
            evicted.append(corr_id)
        return evicted

    def pop(self, corr_id: CorrelationId, cause: str | None = None) -> SessionEntry | None:
        """Free the session of ``corr_id``; ``cause`` (one of :data:`EVICTION_CAUSES`) counts it as an
        eviction, ``None`` (END) does not. Returns the entry, or ``None`` if none was held."""
        if corr_id not in self._entries:
            return None
        return self._drop(corr_id, cause)

    def expire(self, *, force: bool = False) -> int:
        """Drop every session idle past the TTL; runs at most once per ``min(TTL, 60 s)`` unless ``force``.

        Returns:
            how many sessions were dropped.
        """
        now = self._clock()
        if not force and now < self._next_sweep:
            return 0
        self._next_sweep = now + min(self.ttl_s, 60.0)
        stale = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
        for k in stale:
            self._drop(k, "idle")
        return len(stale)

    def _drop(self, corr_id: CorrelationId, cause: str | None) -> SessionEntry:
        entry = self._entries.pop(corr_id)
        self._nbytes -= entry.nbytes
        if cause is not None:
            self.evictions[cause] += 1
            if self._on_evict is not None:
                self._on_evict(corr_id, entry, cause)
        return entry


__all__ = ["DEFAULT_SESSION_TTL_S", "ENTRY_OVERHEAD", "EVICTION_CAUSES", "SessionEntry", "SessionStore"]
