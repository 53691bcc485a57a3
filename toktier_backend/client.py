"""``SessionClient``: one agent session over ``toktier_session``, with transparent, exact re-open.

The client tracks the session's whole text and ids. It sends ``MODE=delta`` for :meth:`append` and
``MODE=full`` for :meth:`update`, asks for ``REPLY=patch`` (only ids from ``KEEP`` on) by default, and
rebuilds the ids as ``ids[:KEEP] + INPUT_ID``. When the server no longer holds the session, it resends the
whole text it tracks, so the ids stay exact:

- the sequence batcher idled the sequence out (Triton: "must specify the START flag on the first request of
  the sequence"): resend with START and ``MODE=full``;
- the model instance lost it (``NOT_FOUND`` / ``UnknownSession``: restart, eviction): resend ``MODE=full``;
- a request failed in transport (timeout, connection reset; the server may have applied it): the next
  request sends the whole text with ``REPLY=full``.

Behind a proxy (``toktier fleet``, :mod:`toktier_backend.deploy.fleet`) every request carries the session
key in the ``x-toktier-session`` header, so the proxy keeps a session on one replica; a replica that lacks
it answers as above and the whole text rebuilds it. Every START after the first uses a new sequence ID
(:attr:`SessionClient.sequence_id`), so a replica still holding an older state of a session that moved
away and back never serves it.

Per append the client does O(len(delta) + len(patch)) work, not O(context): the ids live in a
:class:`~toktier_backend.pipeline.token_buffer.TokenBuffer` (ids only, capacity doubling) that ``KEEP`` and
the patch are spliced into in place, and the text in a
:class:`~toktier_backend.pipeline.text_store.TextStore` (blocks, joined only when :attr:`SessionClient.text`
is read or a re-open resends it). The ids a call returns are a read-only view that later calls never change
(copy-on-write: a splice that would change a slot a live view shows copies the ids first).

``tritonclient`` is imported on first use. A ``tritonclient.http`` client is not thread-safe: give each
thread its own ``SessionClient`` (the default: each one opens its own connection).

Example::

    >>> c = SessionClient("127.0.0.1:8001")            # gRPC; protocol="http" for port 8000
    >>> c.open("hello").tolist()
    [31373]
    >>> c.append(" world").tolist()
    [31373, 995]
    >>> c.close()
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np

from toktier_backend.errors import InvalidRequest, ToktierError, UnknownSession
from toktier_backend.deploy.fleet import SESSION_HEADER, routing_key
from toktier_backend.pipeline.text_store import TextStore
from toktier_backend.pipeline.token_buffer import TokenBuffer

_counter = itertools.count(1)

START_REQUIRED = "must specify the START flag"


@dataclass
class Reply:
    """The last reply: ``keep`` (ids of the previous reply still valid), ``n`` (total ids), ``route``."""

    keep: int
    n: int
    route: str
    reopened: bool


class SessionClient:
    """One session of ``toktier_session`` on a Triton server.

    Args:
        url: ``host:port`` of the gRPC (default) or HTTP endpoint.
        protocol: ``"grpc"`` or ``"http"``.
        model: model name.
        session_id: correlation ID (non-zero int or non-empty str); default: a fresh unique string.
        face: ``"native"`` (correlation ID + sequence flags, our model repository) or ``"pytriton"``
            (request parameters ``session_id`` / ``session_start`` / ``session_end``).
        reply: ``"patch"`` (default) or ``"full"``.
        add_special_tokens: HF ``add_special_tokens`` for the session.
        client: an existing ``tritonclient`` client to share (gRPC clients are thread-safe; HTTP ones are not).
        timeout_s: per-request client timeout, in seconds (``None``: none).
        verify: also check ``len(ids) == REQUEST_INPUT_LEN`` on every reply (cheap; default on). A reply
            whose ``KEEP`` exceeds the ids held is refused either way (:class:`ToktierError`).

    Attributes:
        text: the session text the client tracks (``str``; joined from blocks on read: O(n)).
        ids: ``int32[n]``, a read-only view of the last reply's ids (HF ``encode(text).ids``).
        last: the last :class:`Reply`; ``reopens``: transparent re-opens so far.
    """

    def __init__(
        self,
        url: str,
        *,
        protocol: Literal["grpc", "http"] = "grpc",
        model: str = "toktier_session",
        session_id: int | str | None = None,
        face: Literal["native", "pytriton"] = "native",
        reply: Literal["patch", "full"] = "patch",
        add_special_tokens: bool = True,
        client: Any = None,
        timeout_s: float | None = None,
        verify: bool = True,
    ):
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol={protocol!r}: use 'grpc' or 'http'")
        if face not in ("native", "pytriton"):
            raise ValueError(f"face={face!r}: use 'native' or 'pytriton'")
        if reply not in ("patch", "full"):
            raise ValueError(f"reply={reply!r}: use 'patch' or 'full'")
        self.url = url
        self.protocol = protocol
        self.model = model
        self.session_id = session_id if session_id is not None else f"tt-{os.getpid()}-{next(_counter)}-{uuid.uuid4().hex[:8]}"
        self.face = face
        self.reply = reply
        self.add_special_tokens = add_special_tokens
        self.timeout_s = timeout_s
        self.verify = verify
        if protocol == "grpc":
            import tritonclient.grpc as mod
        else:
            import tritonclient.http as mod
        self._mod = mod
        self._own_client = client is None
        if client is None:
            # HTTP: the client-side limit is the connection's network timeout (infer's own ``timeout`` is
            # Triton's server-side timeout, in microseconds); gRPC takes ``client_timeout`` per call.
            http_kw = {"network_timeout": timeout_s, "connection_timeout": timeout_s} if protocol == "http" and timeout_s else {}
            client = mod.InferenceServerClient(url, **http_kw)
        self._client = client
        self._store = TextStore()
        self._buf = _ids_buffer()
        self.is_open = False
        self.last: Reply | None = None
        self.reopens = 0  # transparent re-opens so far
        self._epoch = 0  # STARTs after the first: each gets a new sequence ID (see sequence_id)
        self._started = False
        self._headers = {SESSION_HEADER: routing_key(self.session_id)}  # the proxy routes by it
        self._dirty = False  # a request failed in transport: resend the whole text next
        self._fixed: dict[tuple, tuple[list, list]] = {}  # (mode, reply, flag) -> the other inputs, outputs

    @property
    def sequence_id(self) -> int | str:
        """The server-side correlation ID: ``session_id``, then ``f"{session_id}#{k}"`` after the k-th re-START.

        A fleet proxy may move a session away from a replica and back (replica added and removed, a replica
        skipped after a timeout) while that replica still holds an older state under the old ID; a new ID
        per START makes it answer "START required" instead of building on stale text.
        """
        return self.session_id if self._epoch == 0 else f"{self.session_id}#{self._epoch}"

    @property
    def text(self) -> str:
        """The session text: what the server's ids are of once the last call returned (O(n) on first read
        after appends; the joined string is kept)."""
        return self._store.text

    @property
    def ids(self) -> np.ndarray:
        """``int32[n]``, read-only: the ids of :attr:`text` (the last reply). Never changed by later calls."""
        return self._buf.ids()

    # ------------------------------------------------------------ session API

    def open(self, text: str = "") -> np.ndarray:
        """Start the sequence (START) with the whole ``text``. Returns ids int32[n] (HF ``encode(text).ids``)."""
        ids = self._send(text, mode="full", start=True)
        self.is_open = True
        self._store.replace(text)
        return ids

    def update(self, text: str) -> np.ndarray:
        """Send the whole new ``text`` (``MODE=full``); opens the session if needed. Returns ids int32[n]."""
        if not self.is_open:
            return self.open(text)
        ids = self._request(text, "full", full_text=lambda: text)
        self._store.replace(text)
        return ids

    def append(self, delta: str) -> np.ndarray:
        """Send only the appended ``delta`` (``MODE=delta``). Returns ids int32[n] of ``text + delta``.

        O(len(delta) + len(patch)) here; the whole text is joined only when the server must be re-opened.
        """
        if not self.is_open:
            return self.open(self.text + delta)
        ids = self._request(delta, "delta", full_text=lambda: self.text + delta)
        self._store.append(delta)
        return ids

    def close(self) -> None:
        """End the sequence (END frees the server's state). Best effort: a session the server already
        forgot is not an error. Closes the connection if this client opened it."""
        if self.is_open:
            try:
                self._send("", mode="delta", end=True)
            except (UnknownSession, _StartRequired):
                pass
            self.is_open = False
        if self._own_client:
            try:
                self._client.close()
            except Exception:
                pass

    def __enter__(self) -> "SessionClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ transport

    def _request(self, payload: str, mode: str, *, full_text: Callable[[], str]) -> np.ndarray:
        """Send ``payload``; on the paths that need the whole text, ``full_text()`` builds it (O(n), so only
        there). The client's text is updated by the caller once this returns."""
        reply, reopened = None, False
        if self._dirty:
            # an earlier request failed in transport: the server may or may not have applied it, so the
            # ids we hold may not be the ones KEEP refers to. The whole text with a full reply is exact.
            payload, mode, reply, reopened = full_text(), "full", "full", True
        try:
            return self._send(payload, mode=mode, reply=reply, reopened=reopened)
        except _StartRequired:
            # the sequence batcher forgot the sequence (idle timeout): a new sequence with the whole text
            self.reopens += 1
            return self._send(full_text(), mode="full", start=True, reopened=True)
        except UnknownSession:
            # the model instance forgot the session but the sequence is live: the whole text rebuilds it.
            # PyTriton has no sequence batcher to pin the ID to one replica: a new one (START) there.
            self.reopens += 1
            return self._send(full_text(), mode="full", start=self.face == "pytriton", reopened=True)

    def _send(
        self, text: str, *, mode: str, start: bool = False, end: bool = False, reopened: bool = False,
        reply: str | None = None,
    ) -> np.ndarray:
        mod = self._mod
        reply = reply or self.reply
        if start:
            self._epoch += self._started  # never START an ID twice: some replica may hold its old state
            self._started = True
        key = (mode, reply, bool(self.add_special_tokens))
        fixed = self._fixed.get(key)
        if fixed is None:
            # the inputs besides TEXT, and the outputs, are the same for every request with this mode,
            # reply and flag: built once (tritonclient reads them when it builds a request and never changes them)
            fixed = self._fixed[key] = (
                [_tensor(mod, "MODE", np.array([[mode.encode()]], dtype=np.object_), "BYTES"),
                 _tensor(mod, "REPLY", np.array([[reply.encode()]], dtype=np.object_), "BYTES"),
                 _tensor(mod, "ADD_SPECIAL_TOKENS", np.array([[self.add_special_tokens]], dtype=np.bool_), "BOOL")],
                [mod.InferRequestedOutput(n) for n in ("INPUT_ID", "REQUEST_INPUT_LEN", "KEEP", "ROUTE")],
            )
        inputs = [_tensor(mod, "TEXT", np.array([[text.encode("utf-8")]], dtype=np.object_), "BYTES"), *fixed[0]]
        kwargs: dict[str, Any] = {"outputs": fixed[1], "headers": self._headers}
        if self.timeout_s is not None and self.protocol == "grpc":
            kwargs["client_timeout"] = self.timeout_s
        if self.face == "native":
            kwargs.update(sequence_id=self.sequence_id, sequence_start=start, sequence_end=end)
        else:
            kwargs["parameters"] = {"session_id": self.sequence_id, "session_start": start, "session_end": end}
        try:
            result = self._client.infer(self.model, inputs, **kwargs)
        except Exception as e:  # InferenceServerException: map ours to typed errors, re-raise the rest
            mapped = _map_error(e)
            if mapped is None:
                self._dirty = True  # transport or server failure: the request may have been applied
                raise
            raise mapped from e
        patch = result.as_numpy("INPUT_ID").reshape(-1).astype(np.int32, copy=False)
        n = int(result.as_numpy("REQUEST_INPUT_LEN").reshape(-1)[0])
        keep = int(result.as_numpy("KEEP").reshape(-1)[0])
        route = result.as_numpy("ROUTE").reshape(-1)[0]
        route = route.decode() if isinstance(route, bytes) else str(route)
        held = self._buf.n_body
        keep_now = keep if reply == "patch" else 0  # ids of the held reply the new one starts with
        if self.face == "pytriton" and len(patch) and keep_now + len(patch) == n + 1 and patch[-1] == -1:
            patch = patch[:-1]  # PyTriton 0.7 sends "no ids" as [-1]
        if keep_now > held or (self.verify and keep_now + len(patch) != n):
            self._dirty = True  # the held ids stay as they were; the next request resends the whole text
            raise ToktierError(
                f"session {self.session_id!r}: reply does not add up (KEEP={keep}, held {held} ids, "
                f"INPUT_ID {len(patch)}, REQUEST_INPUT_LEN={n})"
            )
        # ids[:keep] + patch, written in place past KEEP (copy-on-write for views handed out earlier)
        self._buf.splice(keep_now, patch)
        ids = self._buf.ids()
        self._dirty = False
        self.last = Reply(keep=keep, n=n, route=route, reopened=reopened)
        return ids


class _StartRequired(ToktierError):
    """Triton's sequence batcher holds no live sequence for this correlation ID (idle timeout)."""


def _ids_buffer() -> TokenBuffer:
    """An empty ids-only buffer (no prefix/suffix: KEEP counts all ids of a reply) with capacity doubling."""
    none = np.zeros(0, dtype=np.int32)
    return TokenBuffer(none, none, offsets=False, grow_max=None)


def _tensor(mod, name: str, value: np.ndarray, dtype: str):
    t = mod.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def _map_error(e: Exception) -> Exception | None:
    msg = str(e)
    if START_REQUIRED in msg:
        return _StartRequired(msg)
    if "UnknownSession" in msg:
        return UnknownSession(msg)
    if "InvalidRequest" in msg:
        return InvalidRequest(msg)
    return None
