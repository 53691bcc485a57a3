"""Sessions by key (correlation ID, header or body field) or by prompt prefix: an idle TTL, one byte budget
and one LRU order (shared with the tokenizer's prefix index), and START/END semantics.

Memory is counted honestly: each entry costs ``Session.nbytes`` (text blocks as ``sys.getsizeof`` counts
them, the id/offset arrays at their capacity) plus :data:`ENTRY_OVERHEAD` for the Python objects around them
(bounded by a ``tracemalloc`` test in ``tests/serving/test_session_store.py``). When the total passes the
budget, the least recently used sessions are evicted; a session that alone is over the budget is evicted
right after its reply. An evicted or unknown session is rebuilt exactly from the whole text of the next
``MODE=full`` request; a ``MODE=delta`` request for it gets ``UnknownSession`` (NOT_FOUND) asking for the
whole text.

**Found by prefix.** Callers that send no key (vLLM's ``encode(prompt)``, a proxy request without a session
header) find a held session by the prompt's prefix: the text is hashed at doubling checkpoints
(``checkpoint_chars * 2**k`` chars: 1K, 2K, 4K, ...) and the deepest checkpoint shared with a held session
picks it (:meth:`SessionStore.find_prefix`). An agent that resends its whole conversation plus a new turn
shares every checkpoint of its previous request. Such sessions are held under a :class:`PrefixKey` (never
equal to a caller's key) in the same LRU order and budget as keyed ones. Exactness never depends on the
match: ``Session.update(text)`` finds the real departure point by comparing texts, so a hash collision or
a stale session costs time, never a wrong id.

Thread-safe: every method takes the store's lock (an ``RLock``, :attr:`SessionStore.lock`, which a caller
may hold around several calls). A session itself is used by one request at a time: :attr:`SessionEntry.lock`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Hashable

DEFAULT_SESSION_TTL_S = 600.0
"""Default idle time after which a session is dropped, in seconds (the sequence batcher's idle timeout)."""

ENTRY_OVERHEAD = 4096
"""Bytes per held session beyond ``Session.nbytes``: the Session, TextStore, TokenBuffer and RepairInfo
objects, the entry (with its lock), and the store's dict node: an upper bound of what the ``tracemalloc``
test counts (numbers: ``docs/design/sessions.md``)."""

EVICTION_CAUSES = ("idle", "budget", "start", "error")
"""Why a session was dropped other than by END: idle past the TTL, LRU under the byte budget (or beyond
``max_sessions``), a START on its key replaced it, or a request failed mid-update (its state could be
half-applied)."""

DEFAULT_CHECKPOINT_CHARS = 1024
"""First prefix checkpoint, in chars; checkpoints double from there."""

CorrelationId = Hashable  # int or str, as request.correlation_id() returns it


@dataclasses.dataclass(frozen=True)
class PrefixKey:
    """The store key of a session found by prefix (no caller key): never equal to an ``int`` or ``str``."""

    n: int


@dataclasses.dataclass
class SessionEntry:
    """One held session.

    Attributes:
        session: the core ``Session`` (text, ids, last repair).
        add_special_tokens: the flag the session was opened with; a ``delta`` request cannot change it.
        text_bytes: UTF-8 bytes of ``session.text`` (checked against ``max_text_bytes`` without re-encoding).
        last_used: clock time of the last request, in seconds.
        nbytes: memory charged to the budget at the last :meth:`SessionStore.account`, in bytes.
        lock: held by the one request using the session (the core takes it around a step).
        checkpoints: prefix index keys held by this entry (prefix-found sessions only).
        depth: deepest checkpoint index of its text (``-1``: none).
        requests: successful requests served from it (0: its first is running or failed).
        chat: the conversation's ``ChatSession`` (chat requests only; ``None`` otherwise): evicted and ended
            with the tokenizer session, its bytes charged beside it.
        chat_nbytes: bytes charged for ``chat`` (the core's estimate, ``serving.core.chat_nbytes``).
        chat_synced: ``requests`` at the last chat step that left ``session.text`` equal to ``chat``'s last
            render (``-1``: not in step: a request with a text, or a failed chat step, came between).
        chat_fingerprint: the chat index key of a chat session held without a caller key
            (:meth:`SessionStore.find_chat`).
    """

    session: Any  # toktier_backend.Session (a stand-in with ``nbytes`` in the store's tests)
    add_special_tokens: bool
    text_bytes: int
    last_used: float
    nbytes: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)
    checkpoints: tuple = ()
    depth: int = -1
    requests: int = 0
    chat: Any = None
    chat_nbytes: int = 0
    chat_synced: int = -1
    chat_fingerprint: Hashable | None = None
    chat_width: int = 1  # bytes per char of the chat session's text (1, 2, 4), for chat_nbytes


class SessionStore:
    """Sessions by key or prompt prefix, least recently used first.

    Args:
        ttl_s: idle time, in seconds, after which a session is dropped (checked lazily on access and by
            :meth:`expire`). Align it with the sequence batcher's ``max_sequence_idle_microseconds``.
        max_bytes: byte budget of all held sessions (``None`` or 0: unbounded).
        max_sessions: most sessions held (``None`` or 0: unbounded); the least recently used go beyond it
            (cause ``budget``).
        checkpoint_chars: first prefix checkpoint, in chars (:meth:`checkpoints`).
        clock: monotonic clock in seconds (tests pass a fake one).
        on_evict: called as ``on_evict(key, entry, cause)`` for every eviction (cause in
            :data:`EVICTION_CAUSES`), under the store's lock; END is not an eviction.
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_bytes: int | None = None,
        max_sessions: int | None = None,
        checkpoint_chars: int = DEFAULT_CHECKPOINT_CHARS,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[CorrelationId, SessionEntry, str], None] | None = None,
    ):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: unbounded), got {max_bytes!r}")
        if max_sessions is not None and max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0 (0: unbounded), got {max_sessions!r}")
        if checkpoint_chars < 1:
            raise ValueError(f"checkpoint_chars must be >= 1, got {checkpoint_chars!r}")
        self.ttl_s = float(ttl_s)
        self.max_bytes = int(max_bytes) if max_bytes else None
        self.max_sessions = int(max_sessions) if max_sessions else None
        self.checkpoint_chars = int(checkpoint_chars)
        #: Taken by every method; hold it around several calls that must see one state.
        self.lock = threading.RLock()
        self._index: dict[tuple, CorrelationId] = {}  # (flag, k, hash(text[:P_k])) -> key of a prefix session
        self._chat_index: dict[Hashable, CorrelationId] = {}  # conversation fingerprint -> key (find_chat)
        self._prefix_keys = itertools.count(1)
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

    def __contains__(self, key: CorrelationId) -> bool:
        return self.get(key, touch=False) is not None

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

    def get(self, key: CorrelationId, *, touch: bool = True) -> SessionEntry | None:
        """The live entry for ``key`` (now the most recently used), or ``None`` (never held, ended,
        evicted, or idle past the TTL)."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if self._clock() - entry.last_used > self.ttl_s:
                self._drop(key, "idle")
                return None
            if touch:
                self._entries.move_to_end(key)
            return entry

    def holds(self, key: CorrelationId, entry: SessionEntry) -> bool:
        """Is ``entry`` still the one held under ``key`` (not ended, evicted or replaced meanwhile)?"""
        with self.lock:
            return self._entries.get(key) is entry

    # ------------------------------------------------------------ by prefix

    def checkpoints(self, text: str, flag: bool) -> tuple[tuple, int]:
        """Index keys ``(flag, k, hash(text[:checkpoint_chars * 2**k]))`` of every checkpoint within
        ``text``, and the deepest ``k`` (``-1`` when the text is shorter than the first checkpoint).
        Costs one hash of each prefix: about ``2 * len(text)`` chars hashed."""
        keys, k, p = [], 0, self.checkpoint_chars
        while p <= len(text):
            keys.append((bool(flag), k, hash(text[:p])))
            k += 1
            p *= 2
        return tuple(keys), k - 1

    def find_prefix(self, checkpoints: tuple) -> tuple[CorrelationId, SessionEntry] | None:
        """The held prefix session sharing the deepest of ``checkpoints`` (from :meth:`checkpoints`), now the
        most recently used, or ``None``.

        A text is matched to a session only when it shares that session's deepest (or next-deepest)
        checkpoint: it grew or was edited near its end. A fork earlier than that (another conversation with
        the same system prompt) gets a session of its own, so two conversations never take turns rewriting
        one session.
        """
        with self.lock:
            for ck in reversed(checkpoints):  # deepest shared checkpoint first
                key = self._index.get(ck)
                if key is None:
                    continue
                entry = self.get(key)
                if entry is None:
                    continue
                return (key, entry) if ck[1] >= entry.depth - 1 else None
            return None

    def new_prefix_key(self) -> PrefixKey:
        """A fresh key for a session found by prefix."""
        return PrefixKey(next(self._prefix_keys))

    def index(self, key: CorrelationId, checkpoints: tuple, depth: int) -> None:
        """Point ``checkpoints`` at the prefix session ``key`` (its text's, after a request), replacing what
        the entry indexed before; nothing when ``key`` is no longer held."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            self._unindex(key, entry)
            for ck in checkpoints:
                self._index[ck] = key
            entry.checkpoints, entry.depth = tuple(checkpoints), int(depth)

    def _unindex(self, key: CorrelationId, entry: SessionEntry) -> None:
        for ck in entry.checkpoints:
            if self._index.get(ck) == key:
                del self._index[ck]
        entry.checkpoints = ()
        fp = entry.chat_fingerprint
        if fp is not None and self._chat_index.get(fp) == key:
            del self._chat_index[fp]

    # ------------------------------------------------------------ chat sessions without a key

    def find_chat(self, fingerprint: Hashable) -> tuple[CorrelationId, SessionEntry] | None:
        """The held session indexed under a conversation ``fingerprint`` (:meth:`index_chat`), now the most
        recently used, or ``None``. A fingerprint names the start of a conversation (the core hashes its first
        messages): two conversations that share it share one session and cost each other re-renders, never
        a wrong id (the chat session compares every message, the tokenizer session every char)."""
        with self.lock:
            key = self._chat_index.get(fingerprint)
            if key is None:
                return None
            entry = self.get(key)
            return None if entry is None else (key, entry)

    def index_chat(self, key: CorrelationId, fingerprint: Hashable) -> None:
        """Point ``fingerprint`` at the session ``key`` (replacing the session it pointed at before, which
        stays held until the LRU order, its TTL or the budget drops it); nothing when ``key`` is not held."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            if entry.chat_fingerprint is not None and self._chat_index.get(entry.chat_fingerprint) == key:
                del self._chat_index[entry.chat_fingerprint]
            self._chat_index[fingerprint] = key
            entry.chat_fingerprint = fingerprint

    # ------------------------------------------------------------ writing

    def put(self, key: CorrelationId, entry: SessionEntry) -> list[CorrelationId]:
        """Hold ``entry`` (replacing any entry of ``key`` without counting an eviction) and charge it.

        Returns:
            the keys evicted to stay within the budget (may include ``key`` itself).
        """
        with self.lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
                self._unindex(key, old)
            entry.nbytes = 0
            self._entries[key] = entry
            return self.account(key)

    def share_budget(self, other) -> None:
        """Charge ``other`` (a ``PrefixIndex``) to this store's byte budget: one least-recently-used order
        over sessions and indexed prefix chunks (a shared system prompt is indexed once, however many
        sessions start from it). ``other`` must use this store's clock for its ``oldest_use``."""
        self.shared = other

    def _total(self) -> int:
        return self._nbytes + (self.shared.nbytes if self.shared is not None else 0)

    def account(self, key: CorrelationId | None) -> list[CorrelationId]:
        """Re-measure ``key`` (``None``: nothing) after a request changed it, then evict what was used
        least recently, sessions or (with :meth:`share_budget`) indexed prefix chunks, while the total is over
        the budget or more than ``max_sessions`` are held.

        Returns:
            the keys evicted (``key`` last, only if it alone is over the budget).
        """
        with self.lock:
            entry = self._entries.get(key) if key is not None else None
            if entry is not None:
                size = int(getattr(entry.session, "nbytes", 0)) + ENTRY_OVERHEAD + int(entry.chat_nbytes)
                self._nbytes += size - entry.nbytes
                entry.nbytes = size
            evicted: list[CorrelationId] = []
            while self.max_sessions is not None and len(self._entries) > self.max_sessions:
                victim = next((k for k in self._entries if k != key), None)
                if victim is None:
                    break
                self._drop(victim, "budget")
                evicted.append(victim)
            if self.max_bytes is None:
                return evicted
            while self._total() > self.max_bytes:
                victim = next((k for k in self._entries if k != key), None)
                oldest = self.shared.oldest_use() if self.shared is not None else None
                if oldest is not None and (victim is None or oldest <= self._entries[victim].last_used):
                    self.shared.evict_oldest()
                    continue
                if victim is None:
                    break
                self._drop(victim, "budget")
                evicted.append(victim)
            if self._total() > self.max_bytes and key in self._entries:
                self._drop(key, "budget")  # alone over the budget: the reply went out, the state does not stay
                evicted.append(key)
            return evicted

    def pop(self, key: CorrelationId, cause: str | None = None) -> SessionEntry | None:
        """Free the session of ``key``; ``cause`` (one of :data:`EVICTION_CAUSES`) counts it as an
        eviction, ``None`` (END) does not. Returns the entry, or ``None`` if none was held."""
        with self.lock:
            if key not in self._entries:
                return None
            return self._drop(key, cause)

    def expire(self, *, force: bool = False) -> int:
        """Drop every session idle past the TTL; runs at most once per ``min(TTL, 60 s)`` unless ``force``.

        Returns:
            how many sessions were dropped.
        """
        with self.lock:
            now = self._clock()
            if not force and now < self._next_sweep:
                return 0
            self._next_sweep = now + min(self.ttl_s, 60.0)
            stale = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
            for k in stale:
                self._drop(k, "idle")
            return len(stale)

    def clear(self) -> None:
        """Drop every session (END semantics: not counted as evictions)."""
        with self.lock:
            for key in list(self._entries):
                self._drop(key, None)

    def _drop(self, key: CorrelationId, cause: str | None) -> SessionEntry:
        entry = self._entries.pop(key)
        self._nbytes -= entry.nbytes
        self._unindex(key, entry)
        if cause is not None:
            self.evictions[cause] += 1
            if self._on_evict is not None:
                self._on_evict(key, entry, cause)
        return entry


__all__ = ["DEFAULT_CHECKPOINT_CHARS", "DEFAULT_SESSION_TTL_S", "ENTRY_OVERHEAD", "EVICTION_CAUSES", "PrefixKey",
           "SessionEntry", "SessionStore"]
