"""The one request handler behind both serving faces: the Triton Python backend models and PyTriton.

Pure Python and numpy: no Triton import. ``model_repository/*/1/model.py`` and
:mod:`toktier_backend.serving.pytriton_app` turn tensors into one :class:`Handler` call and the returned dict
back into tensors.

Sessions live in a :class:`SessionStore`, keyed by the Triton **correlation ID** (an ``int`` or a ``str``, as
``request.correlation_id()`` returns it; ``17`` and ``"17"`` are different sessions, as they are for the
sequence batcher). START replaces whatever the key held, END frees it after the reply, and a session idle
for longer than the store's TTL is dropped; the TTL is set from the sequence batcher's
``max_sequence_idle_microseconds`` so that the store forgets a session when Triton does.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Hashable, Mapping

import numpy as np

import toktier_backend as tt
from toktier_backend.errors import InvalidRequest, ToktierError, UnknownSession
from toktier_backend.serving import triton_io

DEFAULT_MAX_TEXT_BYTES = 16 * 1024 * 1024
"""Default cap on a session's whole text and on one ``TEXT`` element, in UTF-8 bytes (config ``max_text_bytes``)."""

DEFAULT_SESSION_TTL_S = 600.0
"""Default idle time after which a session is dropped, in seconds (the sequence batcher's idle timeout)."""

MODES = ("full", "delta")
REPLIES = ("full", "patch")

CorrelationId = Hashable  # int or str, as request.correlation_id() returns it


# ---------------------------------------------------------------- session store


@dataclasses.dataclass
class SessionEntry:
    """One held session.

    Attributes:
        session: the core ``Session`` (text, ids, last repair).
        add_special_tokens: the flag the session was opened with; a ``delta`` request cannot change it.
        text_bytes: UTF-8 bytes of ``session.text`` (checked against ``max_text_bytes`` without re-encoding).
        last_used: clock time of the last request, in seconds.
    """

    session: Any
    add_special_tokens: bool
    text_bytes: int
    last_used: float


class SessionStore:
    """Sessions by correlation ID, with an idle TTL and START/END semantics.

    Not thread-safe by itself: :class:`Handler` serializes access. A later issue adds byte budgets and LRU.

    Args:
        ttl_s: idle time, in seconds, after which a session is dropped (checked lazily on access and by
            :meth:`expire`). Align it with the sequence batcher's ``max_sequence_idle_microseconds``.
        clock: monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(self, *, ttl_s: float = DEFAULT_SESSION_TTL_S, clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._entries: dict[CorrelationId, SessionEntry] = {}
        self._next_sweep = clock() + self.ttl_s
        self.expired = 0  # sessions dropped for idleness, since start

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, corr_id: CorrelationId) -> bool:
        return self.get(corr_id) is not None

    def now(self) -> float:
        return self._clock()

    def get(self, corr_id: CorrelationId) -> SessionEntry | None:
        """The live entry for ``corr_id``, or ``None`` (never held, ended, or idle past the TTL)."""
        entry = self._entries.get(corr_id)
        if entry is not None and self._clock() - entry.last_used > self.ttl_s:
            del self._entries[corr_id]
            self.expired += 1
            return None
        return entry

    def put(self, corr_id: CorrelationId, entry: SessionEntry) -> None:
        self._entries[corr_id] = entry

    def pop(self, corr_id: CorrelationId) -> SessionEntry | None:
        """Free the session of ``corr_id`` (END, or a START that replaces it); ``None`` if none was held."""
        return self._entries.pop(corr_id, None)

    def expire(self, *, force: bool = False) -> int:
        """Drop every session idle past the TTL; runs at most once per TTL unless ``force``.

        Returns:
            how many sessions were dropped.
        """
        now = self._clock()
        if not force and now < self._next_sweep:
            return 0
        self._next_sweep = now + self.ttl_s
        stale = [k for k, e in self._entries.items() if now - e.last_used > self.ttl_s]
        for k in stale:
            del self._entries[k]
        self.expired += len(stale)
        return len(stale)

    @property
    def nbytes(self) -> int:
        """Memory held by all sessions, in bytes (sum of ``Session.nbytes``)."""
        return sum(int(e.session.nbytes) for e in self._entries.values())


# ---------------------------------------------------------------- handler


class Handler:
    """Serves ``toktier_session`` and ``toktier_encode`` requests for one tokenizer.

    Args:
        tokenizer: a core ``Tokenizer`` (``tt.load_tokenizer(spec)``).
        name: how error messages name the tokenizer (its spec).
        max_text_bytes: cap, in UTF-8 bytes, on one ``TEXT`` element and on a session's whole text.
        session_ttl_s: idle TTL of the session store, in seconds.
        clock: monotonic clock in seconds, for the store.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str = "tokenizer",
        max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_text_bytes <= 0:
            raise ValueError(f"max_text_bytes must be > 0, got {max_text_bytes!r}")
        self.tokenizer = tokenizer
        self.name = name
        self.max_text_bytes = int(max_text_bytes)
        self.store = SessionStore(ttl_s=session_ttl_s, clock=clock)
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> "Handler":
        """Load the tokenizer named by ``spec`` (a ``tokenizer.json`` path, a folder holding one, a Hub id,
        or ``"default"`` for the bundled GPT-2 file) and build a handler for it.

        Raises:
            tt.UnsupportedTokenizer: the file cannot be served.
        """
        if spec in ("", "default"):
            spec = tt.default_tokenizer_path()
        return cls(tt.load_tokenizer(spec), name=str(spec), **kwargs)

    # ------------------------------------------------------------ sessions

    def handle_session(
        self,
        corr_id: CorrelationId,
        text: bytes | str,
        mode: str | bytes | None = None,
        reply: str | bytes | None = None,
        add_special: bool | None = None,
        *,
        start: bool = False,
        end: bool = False,
    ) -> dict[str, np.ndarray]:
        """One request of a sequence.

        Args:
            corr_id: the correlation ID (non-zero ``int`` or non-empty ``str``).
            text: UTF-8 bytes (or ``str``): the whole text (``mode="full"``) or the appended text (``"delta"``).
            mode: ``"full"`` (default) or ``"delta"``.
            reply: ``"full"`` (default: all ids) or ``"patch"`` (only ids from ``KEEP`` on).
            add_special: HF ``add_special_tokens``; ``None`` = the session's flag, or ``True`` for a new one.
            start: the sequence START flag: drop whatever ``corr_id`` held first; needs ``mode="full"``.
            end: the sequence END flag: free the session after replying (also when the request fails).

        Returns:
            ``INPUT_ID`` int32[n - KEEP] (patch) or int32[n] (full); ``REQUEST_INPUT_LEN`` int32[1] = n, the
            total ids of the session text; ``KEEP`` int32[1], ids of the previous reply still valid (0 for a
            new session); ``ROUTE`` object[1] (bytes), the repair route. The ids equal HF
            ``Tokenizer.encode(session_text, add_special_tokens=flag).ids``.

        Raises:
            InvalidRequest: bad mode/reply, not UTF-8 or lone surrogates, over ``max_text_bytes``, START with
                ``delta``, or a ``delta`` that changes ``add_special_tokens``. The session is unchanged.
            UnknownSession: ``delta`` for a correlation ID this server does not hold: resend ``full``.
        """
        with self._lock:
            try:
                if start:
                    self.store.pop(corr_id)
                return self._session_step(corr_id, text, mode, reply, add_special, start)
            finally:
                if end:
                    self.store.pop(corr_id)

    def handle_session_tensors(
        self, corr_id: CorrelationId, inputs: Mapping[str, np.ndarray | None], *, start: bool, end: bool
    ) -> dict[str, np.ndarray]:
        """:meth:`handle_session` from input tensors (``TEXT``, optional ``MODE``, ``REPLY``,
        ``ADD_SPECIAL_TOKENS``; shape [1] or [1, 1]). START/END are honoured even when the tensors are bad."""
        try:
            args = triton_io.session_args(inputs)
        except ToktierError:
            if start or end:
                with self._lock:
                    self.store.pop(corr_id)
            raise
        return self.handle_session(corr_id, **args, start=start, end=end)

    def _session_step(self, corr_id, text, mode, reply, add_special, start) -> dict[str, np.ndarray]:
        self.store.expire()
        mode = _choice("MODE", mode, MODES)
        reply = _choice("REPLY", reply, REPLIES)
        _check_corr_id(corr_id)
        size = self._check_size(text, corr_id)
        value = _decode(text, corr_id, self.name)
        entry = self.store.get(corr_id)
        now = self.store.now()
        if mode == "full":
            flag = True if add_special is None else bool(add_special)
            fresh = entry is None or entry.add_special_tokens != flag
            if fresh:
                # held only once its first update succeeded: a failed one leaves the store as it was
                entry = SessionEntry(self.tokenizer.session(add_special_tokens=flag), flag, 0, now)
                ids = entry.session.update(value)
                self.store.put(corr_id, entry)
            else:
                ids = self._run(corr_id, entry, lambda s: s.update(value))
            entry.text_bytes = size
        else:
            if start:
                raise InvalidRequest(
                    f"correlation ID {corr_id!r}: the sequence START request has MODE='delta', but a new "
                    f"sequence holds no text to append to. Send the whole text with MODE='full' on START."
                )
            if entry is None:
                raise UnknownSession(
                    f"correlation ID {corr_id!r}: this server holds no session for it (never opened, ended, idle "
                    f"longer than {self.store.ttl_s:g} s, or the server restarted), so MODE='delta' has no text "
                    f"to append to. Resend the whole text with MODE='full' (tokenizer {self.name})."
                )
            if add_special is not None and bool(add_special) != entry.add_special_tokens:
                raise InvalidRequest(
                    f"correlation ID {corr_id!r}: ADD_SPECIAL_TOKENS={bool(add_special)} but the session was "
                    f"opened with {entry.add_special_tokens}; a delta cannot change it. Omit it, or resend the "
                    f"whole text with MODE='full'."
                )
            total = entry.text_bytes + size
            if total > self.max_text_bytes:
                raise InvalidRequest(
                    f"correlation ID {corr_id!r}: the session text would grow to {total} bytes, over "
                    f"max_text_bytes={self.max_text_bytes}. End the session or raise the model parameter."
                )
            fresh = False
            ids = self._run(corr_id, entry, lambda s: s.append(value))
            entry.text_bytes = total
        entry.last_used = now
        repair = getattr(entry.session, "last_repair", None)
        keep = 0 if fresh or repair is None else int(repair.reused)
        route = "new" if repair is None else str(repair.route)
        n = len(ids)
        out = ids[keep:] if reply == "patch" else ids
        return {
            "INPUT_ID": np.array(out, dtype=np.int32),  # a copy: the session's view dies on its next call
            "REQUEST_INPUT_LEN": np.array([n], dtype=np.int32),
            "KEEP": np.array([keep], dtype=np.int32),
            "ROUTE": np.array([route.encode()], dtype=np.object_),
        }

    def _run(self, corr_id, entry: SessionEntry, step) -> np.ndarray:
        try:
            return step(entry.session)
        except InvalidRequest:
            raise  # the core keeps the session unchanged on a bad request
        except BaseException:
            # The session may be half-updated: forget it, so the next delta gets NOT_FOUND and the client
            # resends the whole text (exact over available).
            self.store.pop(corr_id)
            raise

    # ------------------------------------------------------------ stateless encode

    def handle_encode(self, text: bytes | str, add_special: bool | None = None) -> dict[str, np.ndarray]:
        """Encode one text.

        Args:
            text: UTF-8 bytes (or ``str``).
            add_special: HF ``add_special_tokens`` (``None`` = ``True``).

        Returns:
            ``INPUT_ID`` int32[n], equal to HF ``encode(text, add_special_tokens=flag).ids``
            (gpt2: ``b"hello world"`` -> ``[31373, 995]``); ``REQUEST_INPUT_LEN`` int32[1] = n.

        Raises:
            InvalidRequest: not UTF-8, lone surrogates, or over ``max_text_bytes``.
        """
        self._check_size(text, None)
        value = _decode(text, None, self.name)
        ids = self.tokenizer.encode(value, add_special_tokens=True if add_special is None else bool(add_special))
        return {
            "INPUT_ID": np.asarray(ids, dtype=np.int32),
            "REQUEST_INPUT_LEN": np.array([len(ids)], dtype=np.int32),
        }

    def handle_encode_tensors(self, inputs: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """:meth:`handle_encode` from input tensors (``TEXT``, optional ``ADD_SPECIAL_TOKENS``)."""
        return self.handle_encode(**triton_io.encode_args(inputs))

    # ------------------------------------------------------------ checks

    def _check_size(self, text: bytes | str, corr_id: CorrelationId | None) -> int:
        """The size of ``text`` in UTF-8 bytes; raises :class:`InvalidRequest` over ``max_text_bytes``."""
        size = len(text) if isinstance(text, (bytes, bytearray, memoryview)) else len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_text_bytes:
            where = "" if corr_id is None else f"correlation ID {corr_id!r}: "
            raise InvalidRequest(
                f"{where}TEXT is {size} bytes, over max_text_bytes={self.max_text_bytes} (tokenizer {self.name}). "
                f"Split the text, send deltas, or raise the model parameter max_text_bytes."
            )
        return size


def _decode(raw: bytes | str, corr_id: CorrelationId | None, name: str) -> str:
    where = "" if corr_id is None else f"correlation ID {corr_id!r}: "
    if isinstance(raw, str):
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(
                f"{where}TEXT holds a lone surrogate {raw[e.start:e.end]!r} at char {e.start}, which UTF-8 cannot "
                f"encode (tokenizer {name}). Send valid Unicode text."
            ) from e
        return raw
    try:
        return tt.decode_text(bytes(raw))
    except InvalidRequest as e:
        raise InvalidRequest(f"{where}{e} (tokenizer {name})") from e


def _choice(name: str, value: str | bytes | None, choices: tuple[str, ...]) -> str:
    if value is None:
        return choices[0]
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", "replace")
    value = str(value).strip().lower()
    if value == "":
        return choices[0]
    if value not in choices:
        raise InvalidRequest(f"{name}={value!r} is not one of {list(choices)}; omit it for {choices[0]!r}.")
    return value


def _check_corr_id(corr_id: CorrelationId) -> None:
    if isinstance(corr_id, bool) or not isinstance(corr_id, (int, str)) or corr_id in (0, ""):
        raise InvalidRequest(
            f"correlation ID {corr_id!r}: a session needs a non-zero integer or non-empty string correlation ID "
            f"(sequence_id in tritonclient)."
        )
