"""Sessions for the integrations: keyed by an ID, or found by the prompt's prefix.

The Triton models key a session by the correlation ID; the routes in this package do not always get one:

- the TensorRT-LLM ``preprocessing`` model gets a correlation ID only when the ensemble request carries one;
- the proxy gets a session header or a conversation ID only when the client sends one;
- vLLM's tokenizer API (``encode(prompt)``) never gets an ID at all.

:class:`SessionCache` serves all three. With a ``key`` it behaves like the Triton session store (START
replaces, END frees). Without one, a prompt of at least ``min_prefix_chars`` is matched to a held session by
its **prefix**: the text is hashed at doubling checkpoints (``checkpoint_chars * 2**k`` chars: 1K, 2K, 4K, …)
and the deepest checkpoint shared with a held session picks it. An agent that resends its whole conversation
plus a new turn shares every checkpoint of its previous request, so the same session is found and only the
tail after the last stable cut is re-encoded.

Exactness never depends on the key: ``Session.update(text)`` finds the real departure point by comparing
the texts, so a hash collision, a stale session or a mismatched key costs time, never a wrong id. Every id
returned equals HF ``Tokenizer.from_file(path).encode(text, add_special_tokens=flag).ids``.

Concurrency: the cache is thread-safe. A session is used by one request at a time; a request that finds
its session busy (the same key sent twice concurrently, or two prompts sharing a prefix) is served by a
plain full encode (route ``"busy"``) instead of waiting.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np

from toktier_backend.errors import InvalidRequest

DEFAULT_MAX_SESSIONS = 256
DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB of text + ids + offsets
DEFAULT_TTL_S = 600.0
DEFAULT_MIN_PREFIX_CHARS = 2048
DEFAULT_CHECKPOINT_CHARS = 1024


@dataclasses.dataclass
class Encoded:
    """One encode through the cache.

    Attributes:
        ids: ``int32[n]``, a copy owned by the caller; equals HF ``encode(text, add_special_tokens=flag).ids``.
        route: the session's repair route (``"full"``, ``"append"``, ``"edit"``, ``"noop"``, ``"reference"``),
            ``"new"`` for a session's first request, ``"encode"`` for a plain encode (no session: short
            prompt or no key), ``"busy"`` (the session was in use: plain encode).
        reused: ids of the previous reply of the session still valid (0 without one).
        session: ``"key"``, ``"prefix"`` or ``None`` (plain encode).
    """

    ids: np.ndarray
    route: str
    reused: int = 0
    session: str | None = None


@dataclasses.dataclass
class _Entry:
    session: Any  # toktier_backend.Session
    flag: bool  # add_special_tokens
    key: Hashable | None  # explicit key, or None for a prefix-found session
    last_used: float
    checkpoints: tuple = ()  # prefix index keys held by this entry
    depth: int = -1  # deepest checkpoint index of its text
    busy: bool = False
    dropped: bool = False  # freed (END, START) while a request was running on it
    nbytes: int = 0
    requests: int = 0


class SessionCache:
    """Sessions of one tokenizer, by key or by prompt prefix, with an LRU cap and an idle TTL.

    Args:
        tokenizer: a core ``toktier_backend.Tokenizer``.
        max_sessions: most sessions held; the least recently used idle one is dropped beyond it.
        max_bytes: most memory held by all sessions (text + ids + offsets), in bytes; LRU drop beyond it.
        ttl_s: a session idle longer than this many seconds is dropped.
        min_prefix_chars: prompts shorter than this (chars) with no key get a plain encode, no session.
        checkpoint_chars: first prefix checkpoint, in chars; checkpoints double from there.
        clock: monotonic clock in seconds (tests pass a fake one).

    Example (GPT-2)::

        >>> import toktier_backend as tt
        >>> cache = SessionCache(tt.load_tokenizer(None), min_prefix_chars=8, checkpoint_chars=4)
        >>> cache.encode("hello world, hello").route
        'new'
        >>> r = cache.encode("hello world, hello world"); r.route, r.session
        ('append', 'prefix')
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        min_prefix_chars: int = DEFAULT_MIN_PREFIX_CHARS,
        checkpoint_chars: int = DEFAULT_CHECKPOINT_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_sessions < 1 or max_bytes < 1 or not ttl_s > 0 or checkpoint_chars < 1 or min_prefix_chars < 0:
            raise ValueError(
                f"SessionCache: max_sessions={max_sessions!r}, max_bytes={max_bytes!r}, ttl_s={ttl_s!r} and "
                f"checkpoint_chars={checkpoint_chars!r} must be positive, min_prefix_chars={min_prefix_chars!r} >= 0"
            )
        self.tokenizer = tokenizer
        self.max_sessions = int(max_sessions)
        self.max_bytes = int(max_bytes)
        self.ttl_s = float(ttl_s)
        self.min_prefix_chars = int(min_prefix_chars)
        self.checkpoint_chars = int(checkpoint_chars)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU order: oldest first
        self._by_key: dict[Hashable, int] = {}
        self._index: dict[tuple, int] = {}  # (flag, k, hash(text[:P_k])) -> entry id
        self._ids = itertools.count(1)
        self._bytes = 0
        self.stats = {"encode": 0, "new": 0, "repaired": 0, "busy": 0, "evicted": 0, "expired": 0}

    # ------------------------------------------------------------ public

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory held by all sessions, in bytes, as of their last request."""
        return self._bytes

    def encode(
        self,
        text: str,
        *,
        key: Hashable | None = None,
        add_special_tokens: bool = True,
        start: bool = False,
        end: bool = False,
    ) -> Encoded:
        """Ids of ``text``, repairing a held session when one matches.

        Args:
            text: the whole prompt (full-text mode: the session is updated to it, wherever it departs).
            key: session key (correlation ID, header value, conversation ID); ``None``, ``0`` and ``""`` mean
                none: the prompt's prefix finds the session (prompts of ``min_prefix_chars`` or more).
            add_special_tokens: HF ``add_special_tokens``; a keyed session opened with the other flag is
                replaced.
            start: drop what ``key`` held first (Triton's sequence START).
            end: free the session of ``key`` after this request (Triton's sequence END), even if it fails.

        Returns:
            :class:`Encoded`; ``ids`` equal HF ``encode(text, add_special_tokens=flag).ids``.

        Raises:
            InvalidRequest: ``text`` is not a ``str`` of Unicode scalar values, or is over the tokenizer's
                size limit. A held session is left as it was.
        """
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be str, got {type(text).__name__}; decode UTF-8 bytes first")
        flag = bool(add_special_tokens)
        if key is not None and (isinstance(key, bool) or key in (0, "")):
            key = None
        try:
            if key is None:
                return self._encode_by_prefix(text, flag)
            return self._encode_by_key(text, flag, key, start)
        finally:
            if end and key is not None:
                with self._lock:
                    self._drop_key(key)

    def drop(self, key: Hashable) -> bool:
        """Free the session of ``key``; ``False`` if none was held."""
        with self._lock:
            return self._drop_key(key)

    def clear(self) -> None:
        """Drop every idle session."""
        with self._lock:
            for eid in [e for e, x in self._entries.items() if not x.busy]:
                self._remove(eid)

    # ------------------------------------------------------------ keyed

    def _encode_by_key(self, text: str, flag: bool, key: Hashable, start: bool) -> Encoded:
        with self._lock:
            self._sweep()
            if start:
                self._drop_key(key)
            eid = self._by_key.get(key)
            entry = self._entries.get(eid) if eid is not None else None
            if entry is not None and entry.busy:
                self.stats["busy"] += 1
                entry = None
                busy = True
            else:
                busy = False
                if entry is not None and entry.flag != flag:
                    self._remove(eid)
                    entry = None
                if entry is None:
                    eid, entry = self._new_entry(flag, key)
                    self._by_key[key] = eid
                entry.busy = True
        if busy:
            return Encoded(self._plain(text, flag), "busy")
        return self._run(eid, entry, text, (), -1, "key")

    # ------------------------------------------------------------ by prefix

    def _checkpoints(self, text: str, flag: bool) -> tuple[tuple, int]:
        """Index keys ``(flag, k, hash(text[:checkpoint_chars * 2**k]))`` for every checkpoint within ``text``,
        and the deepest ``k`` (``-1`` if the text is shorter than the first checkpoint)."""
        keys, k, p = [], 0, self.checkpoint_chars
        while p <= len(text):
            keys.append((flag, k, hash(text[:p])))
            k += 1
            p *= 2
        return tuple(keys), k - 1

    def _encode_by_prefix(self, text: str, flag: bool) -> Encoded:
        if len(text) < self.min_prefix_chars:
            self.stats["encode"] += 1
            return Encoded(self._plain(text, flag), "encode")
        checkpoints, depth = self._checkpoints(text, flag)
        with self._lock:
            self._sweep()
            chosen = None
            for ck in reversed(checkpoints):  # deepest shared checkpoint first
                eid = self._index.get(ck)
                entry = self._entries.get(eid) if eid is not None else None
                if entry is None:
                    continue
                # Reuse when the text shares the candidate's deepest (or next-deepest) checkpoint: it grew or
                # was edited near its end. A fork earlier than that (another conversation with the same system
                # prompt) gets its own session, so two conversations never take turns rewriting one session.
                if ck[1] >= entry.depth - 1:
                    chosen = (eid, entry)
                break
            if chosen is not None and chosen[1].busy:
                self.stats["busy"] += 1
                busy = True
            else:
                busy = False
                if chosen is None:
                    chosen = self._new_entry(flag, None)
                chosen[1].busy = True
        if busy:
            return Encoded(self._plain(text, flag), "busy")
        eid, entry = chosen
        return self._run(eid, entry, text, checkpoints, depth, "prefix")

    # ------------------------------------------------------------ the update

    def _run(self, eid: int, entry: _Entry, text: str, checkpoints: tuple, depth: int, kind: str) -> Encoded:
        try:
            ids = entry.session.update(text)
            out = np.array(ids, dtype=np.int32)  # a copy: the session's view dies on its next call
            repair = entry.session.last_repair
        except InvalidRequest:
            with self._lock:  # the core leaves the session as it was
                entry.busy = False
                if entry.requests == 0:
                    self._remove(eid)
            raise
        except BaseException:
            with self._lock:  # maybe half-updated: forget it
                entry.busy = False
                self._remove(eid)
            raise
        first = entry.requests == 0
        with self._lock:
            entry.busy = False
            entry.requests += 1
            entry.last_used = self._clock()
            if entry.dropped:
                self._remove(eid)
            elif eid in self._entries:
                self._entries.move_to_end(eid)
                self._bytes += int(entry.session.nbytes) - entry.nbytes
                entry.nbytes = int(entry.session.nbytes)
                if kind == "prefix":
                    self._reindex(eid, entry, checkpoints, depth)
            self.stats["new" if first else "repaired"] += 1
            self._enforce_caps()
        route = "new" if first else str(repair.route)
        return Encoded(out, route, 0 if first else int(repair.reused), kind)

    def _plain(self, text: str, flag: bool) -> np.ndarray:
        return np.array(self.tokenizer.encode(text, add_special_tokens=flag), dtype=np.int32)

    # ------------------------------------------------------------ bookkeeping (under self._lock)

    def _new_entry(self, flag: bool, key: Hashable | None) -> tuple[int, _Entry]:
        eid = next(self._ids)
        entry = _Entry(self.tokenizer.session(add_special_tokens=flag), flag, key, self._clock())
        self._entries[eid] = entry
        return eid, entry

    def _reindex(self, eid: int, entry: _Entry, checkpoints: tuple, depth: int) -> None:
        for ck in entry.checkpoints:
            if self._index.get(ck) == eid:
                del self._index[ck]
        for ck in checkpoints:
            self._index[ck] = eid
        entry.checkpoints, entry.depth = checkpoints, depth

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid, None)
        if entry is None:
            return
        self._bytes -= entry.nbytes
        for ck in entry.checkpoints:
            if self._index.get(ck) == eid:
                del self._index[ck]
        if entry.key is not None and self._by_key.get(entry.key) == eid:
            del self._by_key[entry.key]

    def _drop_key(self, key: Hashable) -> bool:
        eid = self._by_key.get(key)
        if eid is None:
            return False
        entry = self._entries.get(eid)
        if entry is not None and entry.busy:
            del self._by_key[key]  # the running request finishes on it, then it is removed
            entry.key, entry.dropped = None, True
            return True
        self._remove(eid)
        return True

    def _sweep(self) -> None:
        now = self._clock()
        for eid, entry in list(self._entries.items()):  # oldest first
            if now - entry.last_used <= self.ttl_s:
                break
            if not entry.busy:
                self._remove(eid)
                self.stats["expired"] += 1

    def _enforce_caps(self) -> None:
        for eid, entry in list(self._entries.items()):  # oldest first
            if len(self._entries) <= self.max_sessions and self._bytes <= self.max_bytes:
                break
            if not entry.busy:
                self._remove(eid)
                self.stats["evicted"] += 1
