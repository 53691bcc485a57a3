"""Incremental parsing of chat request bodies: an agent resends the whole ``messages`` list every turn, so
the body's bytes up to the first changed message are the previous body's bytes; they are not parsed again.

:class:`IncrementalBody` loads a JSON body (bytes) holding a ``messages`` array, either as a top-level object
with a ``"messages"`` member (an OpenAI chat body, ``top="object"``) or as a bare array of messages
(``top="array"``), and returns the value :func:`toktier_backend.jsonio.loads` returns (the standard
library's values), reusing the previous call's message objects for the leading messages whose bytes did not
change.

Mechanism. The loader keeps the previous body ``old`` and the byte offset where each of its messages ends
(the byte after its closing ``}``).

1. ``j`` = the number of old messages whose whole byte span lies in the common prefix of ``old`` and ``raw``
   (C ``bytes.startswith`` over zero-copy ``memoryview`` slices, a binary search over the message ends
   that compares each byte at most about twice; the common case, a body that extends the old array, is one
   compare).
2. Proof that those ``j`` messages are equal to the old ones. A JSON parser reads left to right and its
   state after a prefix (the stack of open arrays/objects, whether it is inside a string, what may come
   next) is a function of the prefix alone. ``raw[:e]`` (``e`` = the end of message ``j - 1``) equals
   ``old[:e]``, so the parser reaches every byte of it in the state it had on ``old``: message ``i < j``
   starts at the same offset, at a value position of the same array, and because a message is an object,
   its end is its closing ``}`` (a number could be extended by the next byte; an object cannot), which lies
   in the prefix. Equal bytes parsed from equal states give equal values (same key order, same scalar
   types), so the old objects may stand for the new ones. In ``top="object"`` mode the members before
   ``"messages"`` are reused the same way (they end before the array's ``[``, inside the prefix).
3. The rest, ``raw[e:]``, is parsed (``jsonio.loads``) behind a fragment prefix that puts the parser in the same
   state as ``raw[:e]`` did: ``[null`` (array mode; inside the array, after a value) or ``{"messages":[null``
   (object mode; inside the top-level object, inside the messages array, after a value). ``raw`` is valid
   JSON iff the fragment is (same grammar state, same remaining bytes; ``raw[:e]`` is valid UTF-8 ending at
   a char boundary), and the fragment's values are those of the same bytes in ``raw``. Members after the
   array are merged as orjson merges duplicate keys (dict assignment in order: first position, last
   value), so the result equals ``jsonio.loads(raw)`` key for key and in order (the fragment is parsed by
   ``jsonio.loads`` too: orjson, or the standard library where the new bytes may hold an integer past 64
   bits; both grammars are JSON's, with ``NaN``/``Infinity`` refused). When the bytes from the
   array's ``]`` to the end are the old body's (the common turn: ``tools`` and options unchanged), they are
   met in the same parser state as in the old body (inside the same array of the same top-level object,
   after a value), so they are valid and give the old members: only ``{"":[null`` + the new messages'
   bytes + ``]}`` is parsed (at the body's nesting depth: orjson limits it), the old members are reused.
   ``null`` stands for message ``j - 1``, not a number: after ``0`` the bytes ``.5`` or ``e5`` would
   continue the number, after ``null`` (as after ``}``) only whitespace, ``,`` or ``]`` are valid.
4. The new messages' ends are found by a compiled regex over ``raw[e:]`` only: it skips JSON strings
   (``"..."`` with escapes) and everything but brackets at C speed; the loop runs per bracket. In object
   mode the members after the array are scanned for a second ``"messages"`` key (it would replace the
   array: then a full parse). The scan's result is used only once orjson accepted the bytes it covers
   (over valid JSON the string skipping is exact, so no bracket inside a string is counted).

Anything else (no message reusable, a changed byte before the array, a top level that is not the expected
object or array, a ``messages`` value that is not an array of objects, a duplicate ``"messages"`` key) is
a plain ``jsonio.loads(raw)`` with ``same_prefix = 0``: still exact. Invalid JSON raises what
:func:`toktier_backend.jsonio.loads` raises.

Ownership: the messages list is the loader's own and is cut and extended in place by the next call (copying
it would touch every message object: O(messages) cache misses); the message dicts (and, in object mode, the
values of the other members) are shared with later results. Callers must not mutate them (a
:class:`~.session.ChatSession` keeps the message dicts of its ``render_body`` as its snapshots, uncopied), nor
keep the list across calls (the session keeps its own list of them). In object mode the top-level dict is new
on every call.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from toktier_backend import jsonio
from toktier_backend.errors import InvalidRequest

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a core dependency
    _orjson = None

# Skips JSON text up to the next bracket that is not inside a string. Possessive: no backtracking.
_TO_BRACKET = re.compile(rb'(?:[^"\[\]{}]++|"(?:[^"\\]++|\\.)*+")*+')
# Skips JSON text up to the next bracket, ':' or string start outside strings.
_TO_TOKEN = re.compile(rb'[^"\[\]{}:]*+')
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')

_Q, _C, _LB, _LK = 34, 58, 123, 91  # ", :, {, [


class Body(NamedTuple):
    """One loaded body.

    Attributes:
        value: equal to ``jsonio.loads(raw)`` when returned (object mode: a new dict each call; array mode:
            the messages list).
        messages: ``value["messages"]`` (object mode) or ``value`` (array mode): the loader's list, changed in
            place by its next call; ``None`` when the body did not have the expected shape (then
            ``same_prefix`` is 0).
        same_prefix: the number of leading messages that are the previous call's objects (byte-identical,
            hence equal values, same key order and scalar types).
    """

    value: Any
    messages: list | None
    same_prefix: int


class IncrementalBody:
    """Loads successive bodies of one conversation (not thread-safe: one call at a time).

    Args:
        top: ``"object"`` (``{"messages": [...], ...}``) or ``"array"`` (``[...]``, the messages themselves).
        key: the member holding the messages in object mode.

    Raises:
        ValueError: ``top`` is neither.
    """

    def __init__(self, *, top: str = "object", key: str = "messages"):
        if top not in ("object", "array"):
            raise ValueError(f"top must be 'object' or 'array', not {top!r}")
        self.top = top
        self.key = key
        # null, not a number, stands for the last reused message: after "0" the bytes ".5" or "e5" would
        # continue a number, after "null" (as after a message's "}") only whitespace, "," or "]" may follow
        self._frag = b"[null" if top == "array" else b"{" + _orjson.dumps(key) + b":[null"
        self._key_bytes = _orjson.dumps(key)
        # the key can be written only literally or with \u escapes (no short escape applies to it)
        self._plain_key = not any(c in key for c in '"\\/') and all(ord(c) >= 0x20 for c in key)
        self.reset()

    def reset(self) -> None:
        """Forget the previous body (the next call parses whole)."""
        self._raw: bytes = b""
        self._msgs: list = []  # the previous call's message objects
        self._ends: list[int] = []  # byte offset after each message's closing brace, in self._raw
        self._before: list = []  # object mode: (key, value) of the members before the messages member
        self._after: dict | None = None  # object mode: the members from the messages member on (its value
        # None), as the last tail parse merged them; None: not known (after a whole parse)
        self._close = 0  # offset of the messages array's ']' in self._raw

    def load(self, raw: bytes | bytearray | memoryview | str) -> Body:
        """Parse ``raw`` (one UTF-8 JSON body; bytes-like objects other than ``bytes`` are copied once).

        Returns:
            :class:`Body`; ``value == jsonio.loads(raw)``.

        Raises:
            InvalidRequest: not valid JSON (as :func:`toktier_backend.jsonio.loads`); the loader then
            forgets the previous body.
        """
        if type(raw) is not bytes:
            # a str is encoded as is (a lone surrogate stays invalid UTF-8: orjson rejects it)
            raw = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
        j = self._reusable(raw)
        if j:
            got = self._tail(raw, j)
            if got is not None:
                return got
        return self._whole(raw)

    # ------------------------------------------------------------ the common prefix

    def _reusable(self, raw: bytes) -> int:
        """How many old messages lie wholly inside the common prefix of the old body and ``raw``."""
        ends = self._ends
        if not ends:
            return 0
        old = memoryview(self._raw)
        if raw.startswith(old[:ends[-1]]):
            return len(ends)
        lo, hi, known = -1, len(ends) - 1, 0  # ends[lo] within the prefix (lo = -1: none), ends[hi] not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if raw.startswith(old[known:ends[mid]], known):
                lo, known = mid, ends[mid]
            else:
                hi = mid
        return lo + 1

    # ------------------------------------------------------------ the tail

    def _tail(self, raw: bytes, j: int) -> Body | None:
        e = self._ends[j - 1]
        # the new messages' spans and the array's end; trusted only once orjson accepted those bytes
        scanned = _message_ends(raw, e)
        if scanned is None:
            return None
        ends, close = scanned
        after = None
        if self.top == "object" and self._after is not None and self._same_suffix(raw, close):
            # the bytes from the array's ']' on are the old body's, met in the same parser state (inside
            # the same array of the same top-level object, after a value): they are valid and give the
            # old members after the array. Only the new messages are parsed.
            after = self._after
            try:  # inside an object, as in the body: the same nesting depth (orjson limits it)
                frag = jsonio.loads(b'{"":[null' + raw[e:close] + b"]}")[""]
            except InvalidRequest:
                return None  # invalid JSON: the whole parse raises the body's own error
            if type(frag) is not list:
                return None
            new = frag[1:]
        else:
            try:
                frag = jsonio.loads(self._frag + raw[e:])
            except InvalidRequest:
                return None
            if self.top == "array":
                if type(frag) is not list:
                    return None
                new = frag[1:]
            else:
                if type(frag) is not dict:
                    return None
                arr = frag.get(self.key)
                if type(arr) is not list or not arr or arr[0] is not None:
                    return None
                new = arr[1:]
                if self._maybe_key(raw, close + 1) and _has_key(raw, close + 1, self.key):
                    return None  # a second messages member would replace the array
                frag[self.key] = None  # keeps the member's place; the list is set below
                after = frag
        if len(ends) != len(new):
            return None
        for m in new:
            if type(m) is not dict:
                return None
        msgs = self._msgs
        del msgs[j:]
        msgs.extend(new)
        del self._ends[j:]
        self._ends.extend(ends)
        self._raw, self._close = raw, close
        if self.top == "array":
            return Body(msgs, msgs, j)
        self._after = after
        value = dict(self._before)
        value.update(after)
        value[self.key] = msgs
        return Body(value, msgs, j)

    def _same_suffix(self, raw: bytes, close: int) -> bool:
        """``raw[close:] == old[old_close:]`` (C compare)."""
        old, old_close = self._raw, self._close
        return len(raw) - close == len(old) - old_close and raw.endswith(memoryview(old)[old_close:])

    def _maybe_key(self, raw: bytes, pos: int) -> bool:
        """Could ``raw[pos:]`` hold a member named ``key``? A JSON string equal to it is written literally
        or with a ``\\u`` escape, so when neither byte pattern occurs (two C scans) it cannot; else the
        Python scan (:func:`_has_key`) decides."""
        if not self._plain_key:
            return True
        return raw.find(self._key_bytes, pos) >= 0 or raw.find(b"\\u", pos) >= 0

    # ------------------------------------------------------------ a whole parse

    def _whole(self, raw: bytes) -> Body:
        self.reset()
        value = jsonio.loads(raw)
        msgs = self._locate(raw, value)
        if msgs is None:  # not the expected shape: no state; the caller's checks give the error
            if self.top == "array":
                msgs = value if type(value) is list else None
            else:
                msgs = value.get(self.key) if type(value) is dict else None
                msgs = msgs if type(msgs) is list else None
        return Body(value, msgs, 0)

    def _locate(self, raw: bytes, value) -> list | None:
        """Set up the state for ``raw`` (already parsed to ``value``); the messages list, or ``None`` when the
        body does not have the expected shape (no state kept)."""
        if self.top == "array":
            if type(value) is not list:
                return None
            start = _first_bracket(raw, 0)
            if start is None or raw[start] != _LK:
                return None
            msgs = value
        else:
            if type(value) is not dict or type(value.get(self.key)) is not list:
                return None
            start = _member_array(raw, self.key, self._maybe_key)
            if start is None:
                return None
            msgs = value[self.key]
        if any(type(m) is not dict for m in msgs):
            return None
        scanned = _message_ends(raw, start + 1)
        if scanned is None or len(scanned[0]) != len(msgs):
            return None
        if self.top == "object":
            before = []
            for k, v in value.items():
                if k == self.key:
                    break
                before.append((k, v))
            self._before = before
        self._raw = raw
        self._msgs = msgs  # the parsed list itself: owned from now on (module docstring)
        self._ends, self._close = scanned
        return msgs


def _message_ends(raw: bytes, pos: int) -> tuple[list[int], int] | None:
    """Scan the elements of an array from ``pos`` (inside it, outside any element): (the offset after each
    element object's closing brace, the offset of the array's ``]``). ``None`` if the bytes end first.
    Exact when the bytes scanned are valid JSON (strings are skipped whole); on invalid bytes the result is
    meaningless, so callers trust it only after orjson accepted those bytes."""
    ends: list[int] = []
    depth = 0
    skip = _TO_BRACKET.match
    n = len(raw)
    while True:
        pos = skip(raw, pos).end()
        if pos >= n:
            return None
        c = raw[pos]
        pos += 1
        if c == _LB or c == _LK:
            depth += 1
        elif depth == 0:  # ']' closing the array (a '}' here would be invalid JSON)
            return ends, pos - 1
        else:
            depth -= 1
            if depth == 0:
                ends.append(pos)


def _first_bracket(raw: bytes, pos: int) -> int | None:
    pos = _TO_BRACKET.match(raw, pos).end()
    return pos if pos < len(raw) else None


def _member_keys(raw: bytes, pos: int, depth: int):
    """Yield ``(key, offset after its ':')`` for each member key at nesting ``depth == 0`` met from ``pos``
    (``depth``: nesting relative to the object scanned; it stops when that object closes)."""
    n = len(raw)
    skip = _TO_TOKEN.match
    skip_nested = _TO_BRACKET.match  # inside a member's value only brackets matter: C speed
    string = _STRING.match
    pending = None
    while True:
        pos = (skip if depth == 0 else skip_nested)(raw, pos).end()
        if pos >= n:
            return
        c = raw[pos]
        if c == _Q:
            m = string(raw, pos)
            if m is None:
                return
            pending = (pos, m.end()) if depth == 0 else None
            pos = m.end()
            continue
        pos += 1
        if c == _C:
            if pending is not None:
                yield _orjson.loads(raw[pending[0]:pending[1]]), pos
            pending = None
        elif c == _LB or c == _LK:
            depth += 1
            pending = None
        else:
            depth -= 1
            pending = None
            if depth < 0:
                return


def _has_key(raw: bytes, pos: int, key: str) -> bool:
    """Does the object being scanned from ``pos`` (at its member level) have a member ``key``?"""
    return any(k == key for k, _ in _member_keys(raw, pos, 0))


def _member_array(raw: bytes, key: str, maybe_key) -> int | None:
    """Offset of the ``[`` of the top-level object's member ``key``, if it is its only such member and an
    array; else ``None``."""
    start = _first_bracket(raw, 0)
    if start is None or raw[start] != _LB:
        return None
    keys = _member_keys(raw, start + 1, 0)
    for k, after in keys:
        if k == key:
            p = _first_bracket(raw, after)
            if p is None or raw[p] != _LK or raw[after:p].strip():
                return None
            scanned = _message_ends(raw, p + 1)  # skip the array at C speed per element
            if scanned is None or (maybe_key(raw, scanned[1] + 1) and _has_key(raw, scanned[1] + 1, key)):
                return None
            return p
    return None


def parse_messages(raw: Any, what: str = "messages") -> list:
    """A JSON array of message objects parsed whole (``jsonio.loads``, orjson): the twin of
    :class:`IncrementalBody` ``top="array"`` for a request with no conversation to compare against.

    Args:
        raw: UTF-8 JSON (``bytes`` or ``str``).
        what: the input's name in error messages (``MESSAGES`` on Triton).

    Raises:
        InvalidRequest: not bytes or str, not JSON, or not a JSON array of objects.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview, str)):
        raise InvalidRequest(f"{what} must be UTF-8 JSON bytes, got {type(raw).__name__}.")
    try:
        messages = jsonio.loads(raw)
    except ValueError as e:
        raise InvalidRequest(f"{what} is not JSON ({e}); send a JSON array of messages, e.g. "
                             f"[{{\"role\": \"user\", \"content\": \"hi\"}}].") from e
    if not isinstance(messages, list):
        raise InvalidRequest(f"{what} must be a JSON array of message objects, got a JSON "
                             f"{type(messages).__name__}.")
    for bad, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"{what} must be a JSON array of message objects; element {bad} is a "
                                 f"{type(m).__name__}.")
    return messages


__all__ = ["Body", "IncrementalBody", "parse_messages"]
