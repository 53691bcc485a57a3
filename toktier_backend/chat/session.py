"""Exact incremental chat-template rendering: a :class:`ChatSession` renders each request at the cost of what
changed since the previous one, with text equal char for char to a full render.

Mechanism (proof obligations O1-O5 are in :mod:`.analysis`):

1. Messages. Each request's ``messages`` is compared with the previous request's (kept as plain copies,
   :func:`.template.plain`): ``k`` is the first position whose message differs (value, key order and scalar
   type: ``1``, ``1.0`` and ``True`` are equal in Python but render differently). Positions before ``k`` keep
   the previous request's prepared message *objects*, so "same object" means "same message".
2. Plain segments are rendered in full with the current variables; their root ``set`` names are passed on.
   A reusable one (analysis O7: it binds no name) keeps its output with what it read: its free names'
   values, and through a recording view of ``messages`` the highest index and whether it read the length.
   It is reused when the values are equal (``same``), every message it read lies before ``k`` and, if it
   read the length, the length is unchanged; the memo is committed with the request's other memos, so ``k``
   is always computed against the messages it was rendered from (or checked since).
3. A loop segment keeps, per message position, a *record* of its last rendering: output, the ``loop``
   attributes it read (with values), the namespace attributes it read before writing them (with values),
   the namespace writes, the highest ``messages`` index it read and whether it read anything that depends on
   the length. Invariant: every kept record is valid for the state its loop had at that position in the
   render that kept it (O4: equal reads give equal output and writes).
4. Resuming: walking the loop in its own order, at a position ``p < k`` with a record, the session finds the
   first position whose record may be invalid under the current state: (a) one that read a length-dependent
   ``loop`` attribute or ``messages|length`` (when the length changed), (b) the old or new last position if it
   read ``loop.last`` (``loop.first`` for a reversed loop), (c) one that read a message at ``>= k``, (d) for
   each namespace attribute whose current value differs from the one the kept render had at ``p`` (computed
   from the kept writes, no per-position snapshot), its first reader not preceded by a writer. Every record
   before that position is valid by induction (nothing else can make a record's recorded reads differ), so
   their outputs and writes are reused as a block; the invalid one is rendered again, and the walk resumes.
   Outer (non-namespace) values read by the body are compared whole; any change renders the loop anew.
5. Anything the analysis did not prove, and any error while rendering a piece, gives a full render (jinja2,
   the transformers-compatible :class:`.template.ChatRenderer`, or minijinja where its canary admitted it),
   counted in :attr:`ChatSession.stats` under ``"full:" + reason``.

:meth:`ChatSession.render` also reports the *departure*: the first char where the new text differs from the
previous render's, so a tokenizer session can splice from there (``Session.append(delta)`` when the new
text extends the old one).
"""

from __future__ import annotations

import marshal
import operator
from bisect import bisect_left, bisect_right
from collections import Counter
from itertools import repeat
from math import copysign
from typing import Any, Mapping

from toktier_backend.chat import template as _t
from toktier_backend.chat.analysis import COMPARE, IterForm, LoopSegment, PlainSegment, Plan, analyze, order_observed
from toktier_backend.chat.bodycode import OPS, Unsupported, compile_body, compile_plain, loop_attr, plain_value
from toktier_backend.chat.wire import IncrementalBody, parse_messages
from toktier_backend.errors import InvalidRequest


class _Missing:
    __slots__ = ()

    def __repr__(self):
        return "<missing>"


MISSING = _Missing()


class _Never:
    """A snapshot that equals nothing (the message was altered for the render: continue_final_message)."""

    __slots__ = ()

    def __eq__(self, other):
        return False

    __hash__ = None


_NEVER = _Never()


class _Fallback(Exception):
    """The incremental path cannot prove this request; the message is the reason."""


# ---------------------------------------------------------------- value comparison


_SCALARS = (str, int, float, bool, type(None))


def same(a: Any, b: Any) -> bool:
    """Equal for a template: same types (``1``/``1.0``/``True`` differ), same values (``0.0`` and ``-0.0``
    differ: they print differently), same dict key order."""
    if a is b:
        return True
    ta = type(a)
    if ta is not type(b):
        return False
    if ta is float:  # 0.0 == -0.0, but they render "0.0" and "-0.0"
        return a == b and (a != 0.0 or copysign(1.0, a) == copysign(1.0, b))
    if ta in _SCALARS:
        return a == b
    if ta is list or ta is tuple:
        return len(a) == len(b) and all(map(same, a, b))
    if ta is dict:
        return len(a) == len(b) and list(a) == list(b) and all(map(same, a.values(), b.values()))
    return False


# ---------------------------------------------------------------- recording stand-ins


class _Rec:
    """One loop iteration's record (see the module docstring, 3)."""

    __slots__ = ("elem", "out", "loop_reads", "ns_reads", "cmps", "writes", "maxread", "nsens")

    def __init__(self, elem, p):
        self.elem = elem
        self.out = ""
        self.loop_reads: dict = {}
        self.ns_reads: dict = {}
        self.cmps: dict = {}  # key -> [(op, side, other, outcome)]: comparisons recorded by outcome (O6)
        self.writes: dict = {}
        self.maxread = p
        self.nsens = False


# by ``IterForm.reverse``: (attributes whose value at a fixed position depends on the length, the edge
# attribute among them that changes only at the old and new last positions)
_N_SENSITIVE = {True: (frozenset({"index0", "index", "length"}), "first"),
                False: (frozenset({"revindex0", "revindex", "length"}), "last")}


class _RecLoop(_t.SandboxPlain):
    """``loop`` for one iteration; every attribute read is recorded in the iteration's record. Its public
    attributes are ints, bools, message dicts, ``Undefined`` and the methods ``cycle``/``changed``
    (:class:`.template.SandboxPlain`'s contract)."""

    __slots__ = ("_rec", "_p", "_n", "_form", "_items", "_undefined")
    depth = 1
    depth0 = 0

    def __init__(self, rec, p, n, form, items, undefined):
        self._rec, self._p, self._n, self._form, self._items, self._undefined = rec, p, n, form, items, undefined

    def _get(self, attr):
        v = loop_attr(attr, self._p, self._n, self._form.reverse, self._form.start)
        self._rec.loop_reads[attr] = v
        return v

    index0 = property(lambda self: self._get("index0"))
    index = property(lambda self: self._get("index"))
    revindex0 = property(lambda self: self._get("revindex0"))
    revindex = property(lambda self: self._get("revindex"))
    first = property(lambda self: self._get("first"))
    last = property(lambda self: self._get("last"))
    length = property(lambda self: self._get("length"))

    def _neighbour(self, step: int, what: str):
        # whether a neighbour exists at a loop end depends on the length: recorded as length-dependent
        q = self._p + step
        rec = self._rec
        rec.nsens = True
        if 0 <= q < self._n and (self._form.reverse or q >= self._form.start):
            rec.maxread = max(rec.maxread, q)
            return self._items[q]
        return self._undefined(f"there is no {what} item")

    @property
    def previtem(self):
        return self._neighbour(1 if self._form.reverse else -1, "previous")

    @property
    def nextitem(self):
        return self._neighbour(-1 if self._form.reverse else 1, "next")

    def cycle(self, *args):
        if not args:
            raise TypeError("no items for cycling given")
        return args[self._get("index0") % len(args)]

    def changed(self, *value):
        raise _Fallback("loop.changed() keeps state across iterations")

    def __repr__(self):
        # jinja2 prints ``<LoopContext index/length>``: a read of both that no record would hold
        raise _Fallback("loop printed whole")


class _RecMessages:
    """``messages`` inside a loop body: index reads raise the record's ``maxread``; length-dependent reads
    (``length``, negative or out-of-range indices, slices, iteration) set ``nsens``."""

    __slots__ = ("_items", "_rec")

    def __init__(self, items, rec):
        self._items, self._rec = items, rec

    def __len__(self):
        self._rec.nsens = True
        return len(self._items)

    def __bool__(self):
        self._rec.nsens = True
        return bool(self._items)

    def __getitem__(self, i):
        items, rec = self._items, self._rec
        if type(i) is int and 0 <= i < len(items):
            if i > rec.maxread:
                rec.maxread = i
            return items[i]
        if type(i) is int or isinstance(i, slice):
            rec.nsens = True
            rec.maxread = max(rec.maxread, len(items) - 1)
            return items[i]
        raise TypeError("messages indices must be integers or slices")

    def __iter__(self):
        self._rec.nsens = True
        self._rec.maxread = max(self._rec.maxread, len(self._items) - 1)
        return iter(self._items)

    def __reversed__(self):
        self._rec.nsens = True
        self._rec.maxread = max(self._rec.maxread, len(self._items) - 1)
        return reversed(self._items)


def _recording_namespace_class():
    import jinja2.exceptions

    base = _t.sandbox_environment().globals["namespace"]

    class RecNamespace(base, _t.SandboxPlain):
        """A namespace over the loop's state ``{(name, attr): value}``: reads before the iteration's own
        write are recorded with their value, writes are recorded. A :class:`.template.SandboxPlain`: a
        namespace is none of the types its contract excludes, and a read records only its first value (a
        read of a missing attribute, repeated by the stock path, records ``MISSING`` once)."""

        def __init__(self, name, state, rec):  # noqa: D107 - base __init__ not called: storage is ``state``
            object.__setattr__(self, "_r", (name, state, rec))

        def __getattribute__(self, attr):
            if attr in ("__class__", "_r") or attr.startswith("__"):
                return object.__getattribute__(self, attr)
            name, state, rec = object.__getattribute__(self, "_r")
            key = (name, attr)
            v = state.get(key, MISSING)
            if key not in rec.writes and key not in rec.ns_reads:
                rec.ns_reads[key] = v
            if v is MISSING:
                raise AttributeError(attr)
            return v

        def __setitem__(self, attr, value):
            if isinstance(attr, str) and attr.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore-prefixed names ({attr!r})")
            name, state, rec = object.__getattribute__(self, "_r")
            state[(name, attr)] = value
            rec.writes[(name, attr)] = value

        def __repr__(self):
            # jinja2 prints every attribute: reads that no record would hold
            raise _Fallback("a namespace printed whole")

    return RecNamespace


class _Compare(_t.SandboxCall):
    """The body's comparison recorder (analysis O6): ``x.attr <op> other`` evaluated as jinja would; for a
    recording namespace whose attribute this iteration has not read or written yet, the outcome is recorded
    instead of the value. A :class:`.template.SandboxCall`: neither the class nor its ``__call__`` has an
    attribute its contract excludes."""

    __slots__ = ("_ns_class", "_getattr")

    def __init__(self, ns_class, getattr_):
        self._ns_class = ns_class
        self._getattr = getattr_

    def __call__(self, obj, _name, attr, op, side, other):
        if type(obj) is self._ns_class:
            nsname, state, rec = object.__getattribute__(obj, "_r")
            key = (nsname, attr)
            v = state.get(key, MISSING)
            if v is not MISSING and key not in rec.writes and key not in rec.ns_reads:
                out = OPS[op](v, other) if side == "left" else OPS[op](other, v)
                if type(out) is not bool:
                    raise _Fallback("a comparison gave a non-bool")
                rec.cmps.setdefault(key, []).append((op, side, other, out))
                return out
        v = self._getattr(obj, attr)
        return OPS[op](v, other) if side == "left" else OPS[op](other, v)


def _reader_ok(rec: _Rec, key, v) -> bool:
    """Would ``rec``'s recorded reads of ``key`` be the same with value ``v``?"""
    if key in rec.ns_reads and not same(rec.ns_reads[key], v):
        return False
    for op, side, other, outcome in rec.cmps.get(key, ()):
        if v is MISSING:
            return False
        try:
            out = OPS[op](v, other) if side == "left" else OPS[op](other, v)
        except Exception:  # noqa: BLE001 - the recorded comparison would now raise: not the same
            return False
        if type(out) is not bool or out != outcome:
            return False
    return True


# ---------------------------------------------------------------- a loop's memo


class _Memo:
    """What one loop segment kept from a render (records by message position, sorted position indexes).

    The lists pass to the next render's memo when that one keeps every position and changes no output
    (:func:`_extend`): records are appended, and a re-rendered record replaces its old one only if its
    output is the same. So a memo's *text view* (the outputs of its first ``n`` records, ``nonempty``
    entries below ``n``, ``cum[:n - start]``) never changes once built: ``ChatRender.text`` of an old render
    stays exact. Only the text methods (``text``, ``length``, ``has_output``, ``_tail_text``, ``_stream``)
    read a memo that is no longer the session's latest, and they bound their reads by ``n``; the other
    indexes (``nsens``, ``la``, ``readers``, ``writers``) are read from the latest memo only and are fixed
    in place. The record lists and indexes are set by :func:`_finish` (``cum`` by ``ChatSession._cum``, for
    forward loops).
    """

    __slots__ = ("n", "form", "ns_names", "outer", "entry", "recs", "nsens", "la", "la_max", "readers",
                 "writers", "cum", "nonempty", "keep", "shared")

    def __init__(self, n: int, form: IterForm, ns_names: tuple, outer: dict, entry: dict):
        self.n, self.form, self.ns_names, self.outer, self.entry = n, form, ns_names, outer, entry
        #: forward loops: chars of outputs up to and including each position (``()`` until set)
        self.cum: list[int] | tuple = ()

    def old_value(self, key, p):
        """The value ``key`` had when this memo's loop entered position ``p``."""
        w = self.writers.get(key)
        if w:
            if self.form.reverse:
                i = bisect_right(w, p)
                if i < len(w):
                    return self.recs[w[i]].writes[key]
            else:
                i = bisect_left(w, p)
                if i:
                    return self.recs[w[i - 1]].writes[key]
        return self.entry.get(key, MISSING)

    def _nonempty(self) -> list:
        ne = self.nonempty
        return ne if not ne or ne[-1] < self.n else ne[:bisect_left(ne, self.n)]

    def has_output(self) -> bool:
        ne = self.nonempty
        return bool(ne) and ne[0] < self.n

    def text(self) -> str:
        recs = self.recs
        ne = self._nonempty()
        order = reversed(ne) if self.form.reverse else ne
        return "".join([recs[p].out for p in order])

    def length(self) -> int:
        if self.form.reverse:
            recs, total = self.recs, 0
            for p in self._nonempty():
                total += len(recs[p].out)
            return total
        k = self.n - self.form.start
        return self.cum[k - 1] if k > 0 else 0


class _PlainMemo:
    """A reusable plain segment's last render: ``out``, the free names' values it read (``MISSING``: not a
    variable), the highest message index it read (-1: none), whether it read the length, and the length."""

    __slots__ = ("out", "inputs", "maxread", "nsens", "n")

    def __init__(self, out: str, inputs: dict, maxread: int, nsens: bool, n: int):
        self.out, self.inputs, self.maxread, self.nsens, self.n = out, inputs, maxread, nsens, n


def _first(lst, p, lo, hi, reverse):
    """The first element of sorted ``lst`` met walking from ``p`` (up if not reverse, down if reverse) inside
    ``[lo, hi)``; ``None`` if none."""
    if reverse:
        i = bisect_right(lst, p) - 1
        return lst[i] if i >= 0 and lst[i] >= lo else None
    i = bisect_left(lst, p)
    return lst[i] if i < len(lst) and lst[i] < hi else None


def _append_record(p: int, rec: "_Rec", recs: list, nsens: list, nonempty: list, la: list, readers: dict,
                   writers: dict) -> int:
    """Append the record of position ``p`` (above every position already indexed, so each position list
    stays sorted) to a memo's records and position indexes; returns its lookahead (``rec.maxread - p`` when
    it read a later message, else 0) for ``la_max``."""
    recs.append(rec)
    if rec.nsens:
        nsens.append(p)
    if rec.out:
        nonempty.append(p)
    if rec.ns_reads or rec.cmps:
        for key in rec.ns_reads.keys() | rec.cmps.keys():
            readers.setdefault(key, []).append(p)
    for key in rec.writes:
        writers.setdefault(key, []).append(p)
    if rec.maxread > p:
        la.append(p)
        return rec.maxread - p
    return 0


def _finish(m: _Memo, old: _Memo | None, chunks: list, start: int) -> None:
    """Set ``m``'s records and position indexes from ``chunks``, in position order: ``(lo, hi, None)``, the
    records of positions ``[lo, hi)`` reused from ``old``; ``(p, p + 1, rec)``, a record rendered anew.
    In place on ``old``'s lists where :func:`_extend` can, else built whole."""
    if _extend(m, old, chunks, start):
        return
    recs: list = [None] * start
    readers: dict = {}
    writers: dict = {}
    nsens: list = []
    la: list = []
    nonempty: list = []
    la_max = 0
    for lo, hi, rec in chunks:
        if rec is None:
            recs.extend(old.recs[lo:hi])
            nsens.extend(old.nsens[bisect_left(old.nsens, lo):bisect_left(old.nsens, hi)])
            nonempty.extend(old.nonempty[bisect_left(old.nonempty, lo):bisect_left(old.nonempty, hi)])
            la.extend(old.la[bisect_left(old.la, lo):bisect_left(old.la, hi)])
            la_max = max(la_max, old.la_max)
            for src, dst in ((old.readers, readers), (old.writers, writers)):
                for key, lst in src.items():
                    part = lst[bisect_left(lst, lo):bisect_left(lst, hi)]
                    if part:
                        dst.setdefault(key, []).extend(part)
        else:
            la_max = max(la_max, _append_record(lo, rec, recs, nsens, nonempty, la, readers, writers))
    assert len(recs) == m.n, (len(recs), m.n)
    m.recs, m.readers, m.writers, m.nsens, m.la, m.la_max = recs, readers, writers, nsens, la, la_max
    m.nonempty = nonempty
    first = chunks[0] if chunks else None
    m.keep = first[1] - start if (not m.form.reverse and first and first[2] is None and first[0] == start) else 0
    m.shared = None


def _extend(m: _Memo, old: _Memo | None, chunks: list, start: int) -> bool:
    """The common turn, in place: the old records are reused or re-rendered with the same output, and
    the positions past the old end are new. Then the old memo's lists become the new memo's:
    re-rendered records replace theirs (same output, so every older memo's text view is unchanged),
    the position indexes that only the latest memo reads are fixed at those positions, new records are
    appended: O(changed records), not O(messages). False (nothing done) for any other shape (no record
    reused, a record whose output changed, a shorter list, lists extended already)."""
    n = m.n
    if old is None or n < old.n or len(old.recs) != old.n:
        return False
    recs = old.recs
    old_n = old.n
    fresh = [c for c in chunks if c[2] is not None]
    if len(fresh) == len(chunks):  # nothing reused
        return False
    for p, _, rec in fresh:
        if p < old_n and rec.out != recs[p].out:
            return False
    nsens, nonempty, la = old.nsens, old.nonempty, old.la
    readers, writers = dict(old.readers), dict(old.writers)
    la_max = old.la_max
    for p, _, rec in fresh:
        if p >= old_n:
            la_max = max(la_max, _append_record(p, rec, recs, nsens, nonempty, la, readers, writers))
            continue
        was = recs[p]
        recs[p] = rec
        if was.nsens != rec.nsens:
            _move(nsens, p, was.nsens, rec.nsens)
        if (was.maxread > p) != (rec.maxread > p):
            _move(la, p, was.maxread > p, rec.maxread > p)
        read_before = was.ns_reads.keys() | was.cmps.keys()
        read_after = rec.ns_reads.keys() | rec.cmps.keys()
        for d, before, after in ((readers, read_before, read_after),
                                 (writers, was.writes.keys(), rec.writes.keys())):
            if before == after:  # (a key in both stays indexed at p)
                continue
            for key in before ^ after:
                lst = d.get(key)
                if lst is None:
                    d[key] = lst = []
                _move(lst, p, key in before, key in after)
        if rec.maxread > p:
            la_max = max(la_max, rec.maxread - p)
    assert len(recs) == n, (len(recs), n)
    m.recs, m.readers, m.writers, m.nsens, m.la, m.la_max = recs, readers, writers, nsens, la, la_max
    m.nonempty = nonempty
    m.keep = (fresh[0][0] if fresh else n) - start if not m.form.reverse else 0
    m.shared = old
    return True


def _move(lst: list, p: int, had: bool, has: bool) -> None:
    """Make sorted ``lst`` hold ``p`` iff ``has`` (it holds it iff ``had``)."""
    if had == has:
        return
    i = bisect_left(lst, p)
    if has:
        lst.insert(i, p)
    else:
        del lst[i]


# ---------------------------------------------------------------- the result


class ChatRender:
    """One render: ``text`` (joined on first use), ``departure`` (chars: the first index where ``text`` differs
    from the previous render of the session; ``previous_length`` if it extends it), ``delta`` =
    ``text[departure:]`` (cheap: built from the changed pieces only), ``route`` (``"incremental"`` or
    ``"full:<reason>"``)."""

    __slots__ = ("_pieces", "_text", "departure", "previous_length", "route", "_delta")

    def __init__(self, pieces, text, departure, previous_length, route, delta):
        self._pieces, self._text, self.departure = pieces, text, departure
        self.previous_length, self.route, self._delta = previous_length, route, delta

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "".join(p if isinstance(p, str) else p.text() for p in self._pieces)
        return self._text

    @property
    def delta(self) -> str:
        if self._delta is None:
            self._delta = self.text[self.departure:]
        return self._delta

    @property
    def extends_previous(self) -> bool:
        """The new text starts with the whole previous text (then ``Session.append(delta)`` is exact)."""
        return self.departure == self.previous_length

    def __iter__(self):
        yield self.text
        yield self.departure


def common_prefix_length(a: str, b: str) -> int:
    """Chars ``a`` and ``b`` share at the start (C slice compares, halving)."""
    m = min(len(a), len(b))
    if a[:m] == b[:m]:
        return m
    lo, hi = 0, m  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------- the session


class ChatSession:
    """Incremental renderer of one conversation (not thread-safe: one request at a time per session).

    Args:
        template: jinja source of the chat template.
        special_tokens: ``{"bos_token": ..., ...}`` (see :func:`.template.special_tokens`).
        fast_full: render the full-render fallback with minijinja where its canary admits the template
            (:mod:`.fast`); the reference :meth:`full_render` is always jinja2.
        trust_identity: opt-in, for in-process callers that never mutate a message dict after passing it:
            a message that is the same object as at that position in the previous request is not compared
            (cost of the compare: ``docs/design/chat.md``). Leave off for requests decoded from the wire (new
            objects every time anyway) or when dicts may be edited in place.
        compiled_bodies: render loop iterations through their compiled Python twins (:mod:`.bodycode`) where
            the template's bodies compile, else through the jinja2 bodies only (same text and records).

    Raises:
        UnsupportedTokenizer: the template does not compile.
    """

    def __init__(self, template: str, special_tokens: Mapping[str, str] | None = None, *, fast_full: bool = True,
                 trust_identity: bool = False, plan: Plan | None = None, full_renderer=None,
                 compiled_bodies: bool = True):
        self.reference = _t.ChatRenderer(template, special_tokens)
        self.compiled_bodies = compiled_bodies
        self.plan = plan if plan is not None else analyze(template)
        self.trust_identity = trust_identity
        self._full = full_renderer
        if self._full is None and fast_full:
            from toktier_backend.chat.fast import admit

            self._full = admit(template, self.reference.special_tokens).renderer
        if self._full is None:
            self._full = self.reference
        self.stats: Counter = Counter()
        self._ns_class = _recording_namespace_class()
        from jinja2.utils import Namespace

        self._namespace = Namespace
        self._undefined = _t.segment_environment().undefined
        self._compare = _Compare(self._ns_class, _t.segment_environment().getattr)
        self.reset()

    def reset(self) -> None:
        """Forget the previous request (the next render reuses nothing)."""
        self._forget_messages()
        self._pieces: list = []
        self._text: str | None = ""
        self._length = 0

    def _forget_messages(self) -> None:
        """Drop what the next request would reuse (messages, records), keeping the previous text: the next
        render is whole, its departure still measured against the last text served."""
        if getattr(self, "_memos", None) is not None:  # the kept text is made of the memos: join it first
            self._old_text()
            self._pieces, self._length = [self._text], len(self._text)
        self._snaps: list = []
        # the caller's message object per position, kept for same_prefix and trust_identity only (None: not
        # kept); invariant: aligned with _snaps, and the value of _raw[i] (unmutated) equals _snaps[i]
        self._raw: list | None = None
        self._body = None  # the IncrementalBody of render_body
        # every message value that is not a str: (positions, keys, signatures), sorted by position; then the
        # positions whose entries are not computed yet (``lazy``, sorted): messages a JSON parse gave, whose
        # snapshot is the message itself (:meth:`_diff`), computed from it when a request compares them
        self._strict: tuple[list, list, list, list] = ([], [], [], [])
        self._next_strict = self._strict
        self._chat: list = []
        self._memos: list | None = None
        self._plain_options: dict = {}  # option name -> (plain copy, its signature): _plain_kept

    # ------------------------------------------------------------ public

    def full_render(self, messages: list[Mapping[str, Any]], **options: Any) -> str:
        """The reference text (jinja2, transformers-compatible) for the same arguments as :meth:`render`;
        a verifier hook for shadow checks. Does not touch the session."""
        return self.reference.render(messages, **options)

    def render(
        self,
        messages: list[Mapping[str, Any]],
        *,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        same_prefix: int | None = None,
        **kwargs: Any,
    ) -> ChatRender:
        """Render ``messages`` (same arguments and text as :meth:`.template.ChatRenderer.render`).

        Args:
            same_prefix: ``Body.same_prefix`` of the :class:`.wire.IncrementalBody` that gave ``messages``
                (one loader per session): ``messages[:same_prefix]`` are objects it gave at those positions
                before, unmutated; they are then neither compared nor checked again. Verified at its last
                position against the object the session keeps there (:meth:`_checked_prefix`); a failed
                check compares as usual. ``None`` (callers without a loader): the session does not keep
                the caller's objects (unless ``trust_identity``), so it holds no extra reference to them.

        Returns:
            :class:`ChatRender`; ``text`` equals ``full_render(...)`` char for char.

        Raises:
            InvalidRequest: malformed messages, or the template refused them (the session then forgets the
            messages and records it kept, not the text: the next request renders whole, its departure is
            measured against the last text served).
        """
        return self._request(messages, same_prefix, None, tools=tools, documents=documents,
                             add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, **kwargs)

    def _request(self, messages, same_prefix, decoded_from, /, *, tools=None, documents=None,
                 add_generation_prompt=False, continue_final_message=False, **kwargs) -> ChatRender:
        """:meth:`render`. ``decoded_from``: ``messages[decoded_from:]`` are values this session parsed from
        JSON (:meth:`render_body`, :meth:`render_more_body`; ``None``: none are), kept as their own
        snapshots (:meth:`_diff`)."""
        if "same_prefix" in kwargs:  # (render's own argument; the callers that set it here take none)
            raise TypeError("same_prefix is set by the session here")
        keep = same_prefix is not None or self.trust_identity
        same_prefix = self._checked_prefix(messages, same_prefix)
        # the trusted prefix passed this check in the previous request (same objects, unmutated)
        _t.check_request(messages[same_prefix:] if same_prefix else messages, add_generation_prompt,
                         continue_final_message)
        try:
            return self._render(messages, tools, documents, add_generation_prompt, continue_final_message,
                                same_prefix, keep, decoded_from, kwargs)
        except BaseException:
            self._forget_messages()  # _diff edits the kept lists in place: after a failure they are stale
            raise

    def render_body(self, raw: bytes, *, top: str = "object", **options: Any) -> tuple[ChatRender, Any]:
        """Parse a JSON request body (:class:`.wire.IncrementalBody`: only the bytes from the first changed
        message on) and render its messages.

        Args:
            raw: UTF-8 JSON bytes: ``{"messages": [...], ...}`` (``top="object"``) or ``[...]``
                (``top="array"``); the same ``top`` for every call of a session.
            options: as :meth:`render` (``tools``, ``add_generation_prompt``, template kwargs); taken from
                the caller, not from the body.

        Returns:
            ``(render, body)``: ``body`` equals ``jsonio.loads(raw)``; its message dicts are shared with
            later calls and must not be mutated.

        Raises:
            InvalidRequest: not valid JSON, no list of messages, or as :meth:`render`.
        """
        if self._body is None or self._body.top != top:
            self._body = IncrementalBody(top=top)
        loader = self._body
        try:
            got = loader.load(raw)
        except BaseException:
            self._forget_messages()
            raise
        if got.messages is None:
            self._forget_messages()
            want = "a JSON array of message objects" if top == "array" else "a 'messages' member"
            raise InvalidRequest(f"request body has no list of messages (expected {want})")
        try:
            return self._request(got.messages, got.same_prefix, 0, **options), got.value
        except BaseException:
            loader.reset()  # the session forgot its state: the next same_prefix must not refer to it
            raise

    @property
    def messages(self) -> list:
        """The last request's messages: the caller's objects where the session keeps them (``same_prefix``,
        ``trust_identity``, :meth:`render_more`), else its own plain snapshots. Changed in place by the next
        request: copy what must outlive it."""
        return self._raw if self._raw is not None else self._snaps

    @property
    def extendable(self) -> bool:
        """Can :meth:`render_more` extend the last request (one was rendered and kept, and it did not end
        inside its final message)?"""
        return bool(self._snaps) and self._snaps[-1] is not _NEVER

    def render_more(self, new_messages: list[Mapping[str, Any]], **options: Any) -> ChatRender:
        """Render the previous request's messages followed by ``new_messages``: the client sends only the
        messages after its previous request's (Triton ``MODE=delta`` with ``MESSAGES``). Same text as
        :meth:`render` of the whole list; nothing before the new messages is compared or copied.

        The session's list of the caller's objects (``_raw``, made once from its own snapshots when the
        previous request kept none) is extended in place and rendered with ``same_prefix`` = its old length:
        sound because every object in it equals the snapshot at its position (invariant of ``_raw``).

        Args:
            new_messages: message dicts (parsed JSON); shared with later requests, must not be mutated.
            options: as :meth:`render`.

        Raises:
            InvalidRequest: no previous request to extend (none rendered, it failed, or it ended inside its
            final message with ``continue_final_message``), malformed messages, or the template refused
            them (then as :meth:`render`).
        """
        if type(new_messages) is not list:
            raise InvalidRequest(f"messages must be a list of message objects, got {type(new_messages).__name__}")
        return self._more(new_messages, False, options)

    def render_more_body(self, raw: bytes, **options: Any) -> ChatRender:
        """:meth:`render_more` of the messages in ``raw``, a JSON array of message objects (Triton's
        ``MESSAGES`` in ``MODE=delta``), parsed here (:func:`.wire.parse_messages`). The parsed messages hold
        exact JSON types only, so the session keeps them as their own snapshots, with no copy.

        Raises:
            InvalidRequest: ``raw`` is not a JSON array of objects (the session is unchanged), or as
            :meth:`render_more`.
        """
        return self._more(parse_messages(raw), True, options)

    def _more(self, new_messages: list, decoded: bool, options: dict) -> ChatRender:
        if not self.extendable:
            raise InvalidRequest(
                "a delta of messages needs the conversation's previous request: none is held (first request, "
                "a failed one, or one with continue_final_message); send the whole conversation")
        if self._raw is None:
            self._raw = list(self._snaps)  # O(messages) once: the session's own copies, equal to the snapshots
        raw = self._raw
        n = len(raw)
        if self._body is not None:
            self._body.reset()  # its kept bytes no longer describe the messages
        raw.extend(new_messages)
        # (a failure forgets the kept lists, raw with them)
        return self._request(raw, n, n if decoded else None, **options)

    def _render(self, messages, tools, documents, add_generation_prompt, continue_final_message, same_prefix,
                keep, decoded_from, kwargs) -> ChatRender:
        k, snaps, chat = self._diff(messages, same_prefix, keep, decoded_from)
        final = None
        if continue_final_message:
            chat = list(chat)
            final, chat[-1] = _t.continue_message(chat, self.reference.source, continue_final_message)
            snaps = list(snaps)
            snaps[-1] = _NEVER
            if self._raw is not None:
                self._raw[-1] = _NEVER  # the tagged copy must not be reused, nor trusted, for the same object
            k = min(k, len(chat) - 1)
        options = dict(tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, **kwargs)
        if not self.plan.incremental:
            return self._full_path(messages, options, snaps, chat, "template: " + self.plan.reason)
        variables = dict(self.reference.special_tokens)
        if kwargs:  # template kwargs (none: nothing to copy or compare)
            variables.update(self._plain_kept("kwargs", kwargs))
        base = dict(messages=chat, tools=self._plain_kept("tools", tools),
                    documents=self._plain_kept("documents", documents),
                    add_generation_prompt=bool(add_generation_prompt), **variables)
        try:
            pieces, memos = self._render_segments(chat, k, base)
        except _Fallback as e:
            return self._full_path(messages, options, snaps, chat, str(e))
        except Exception as e:  # noqa: BLE001 - the full render raises the request's error (O4)
            return self._full_path(messages, options, snaps, chat, f"error {type(e).__name__}")
        if final is not None:
            text = "".join(p if isinstance(p, str) else p.text() for p in pieces)
            try:
                text = _t.finish_continue(text, final)
            except InvalidRequest:
                return self._full_path(messages, options, snaps, chat, "continue_final_message")
            old_text = self._old_text()
            departure = common_prefix_length(old_text, text)
            result = ChatRender([text], text, departure, len(old_text), "incremental", None)
            self._commit(snaps, chat, memos, [text], text, len(text))
        else:
            departure, delta, length = self._departure(pieces, memos)
            result = ChatRender(pieces, None, departure, self._length, "incremental", delta)
            self._commit(snaps, chat, memos, pieces, None, length)
        self.stats["incremental"] += 1
        return result

    # ------------------------------------------------------------ messages

    def _diff(self, messages, same_prefix=0, keep=False, decoded_from=None):
        """(k, snapshots, prepared messages): ``k`` is the first position whose message differs strictly from
        the previous request's. ``==`` on the lists (C, identity shortcut) finds value changes; it ignores
        int/float/bool and dict-order differences, so values that are not strings are also compared by
        ``marshal`` bytes (exact for JSON types: distinct types and key orders give distinct bytes), and
        top-level key order is compared where the template can observe it (``Plan.observes_message_order``).
        Positions below a checked ``same_prefix`` (:meth:`render`) are not compared.

        ``keep``: keep the caller's objects (``_raw``) for the next request's checks. The kept lists
        (snapshots, prepared messages, strict signatures, caller objects) are cut and extended in place:
        O(changed messages), not O(messages); :meth:`render` forgets them if the request fails.

        ``decoded_from``: messages from that position on were parsed from JSON by this session (``None``:
        none were). Such a message is its own snapshot: a JSON parse gives exact ``dict``, ``list``, ``str``,
        ``int``, ``float``, ``bool`` and ``None`` only (orjson and ``json`` alike: ``jsonio.loads``), which
        :func:`.template.plain` would copy as they are, and the caller may not mutate it (the contract of
        :meth:`render_body` and :meth:`render_more_body`, as for the ``same_prefix`` objects it trusts)."""
        old = self._snaps
        m = min(len(messages), len(old))
        k = m
        trusted = same_prefix  # checked by render (_checked_prefix)
        if not trusted and self.trust_identity and m and self._raw is not None:
            # opt-in: the caller does not mutate message dicts it passed, so the same object is the same
            # message (invariant of _raw); only positions from the first new object on are compared
            flags = list(map(operator.is_, messages[:m], self._raw[:m]))
            trusted = flags.index(False) if False in flags else m
        if trusted < m and old[trusted:m] != messages[trusted:m]:
            lo, hi = trusted, m  # the first mismatch lies in [lo, hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if old[lo:mid] == messages[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            k = lo
        self.stats["messages_trusted"] += trusted
        if k > trusted:
            k = self._strict_prefix(messages, k, trusted)
        snaps = old
        chat = self._chat
        del snaps[k:], chat[k:]
        pos, keys, reprs, lazy = self._strict
        cut = bisect_left(pos, k)
        del pos[cut:], keys[cut:], reprs[cut:], lazy[bisect_left(lazy, k):]
        own = len(messages) if decoded_from is None else decoded_from
        for i in range(k, len(messages)):
            m = messages[i]
            sn = m if i >= own else _t.plain(m)
            snaps.append(sn)
            chat.append(_t.prepare_plain(sn))
            if i >= own:  # its own snapshot, never mutated: its strict entries can wait (_settle_strict)
                lazy.append(i)
                continue
            for key, v in m.items():  # the caller's values: a non-JSON one is strict (_needs_strict)
                if type(v) is not str and self._needs_strict(v, (key,)):
                    pos.append(i)
                    keys.append(key)
                    reprs.append(_signature(sn.get(key if type(key) is str else _t.plain(key), MISSING)))
        self._next_strict = (pos, keys, reprs, lazy)
        raw = self._raw
        if not keep:
            self._raw = None
        elif raw is None:
            self._raw = list(messages)  # O(messages) once, when a caller starts passing same_prefix
        elif raw is not messages:  # (render_more passes the kept list itself, already extended)
            del raw[k:]
            raw.extend(messages[k:])
        return k, snaps, chat

    def _checked_prefix(self, messages, same_prefix: int) -> int:
        """``same_prefix`` if its last position holds the object the session keeps there, else 0.

        Sound for lists from one :class:`.wire.IncrementalBody`: the loader reuses an object at a position
        only with every object before it, and the session keeps, per position, an object whose value equals
        its snapshot there (``_raw``: set when the position was compared or rendered, kept while later
        requests were equal there). So ``messages[same_prefix - 1] is _raw[same_prefix - 1]`` means every
        message before it is an object the loader already gave at that position, equal to the snapshot."""
        raw = self._raw
        if (raw is None or type(same_prefix) is not int or same_prefix <= 0 or type(messages) is not list
                or same_prefix > min(len(messages), len(raw), len(self._snaps))
                or messages[same_prefix - 1] is not raw[same_prefix - 1]):
            return 0
        return same_prefix

    def _needs_strict(self, v, path: tuple) -> bool:
        """Can a value equal to ``v`` by ``==`` render differently? Yes if it holds a number or bool
        (``1 == 1.0 == True``), a dict of 2+ keys where the template may see key order
        (:func:`.analysis.order_observed`), or any type but ``str``, ``None``, ``dict``, ``list`` and
        ``tuple`` (``b"x" == bytearray(b"x")``, whose plain copies ``"<bytes>"`` and ``"<bytearray>"``
        differ). Such a value's snapshot is a plain copy whose signature the caller's value never has:
        its message is rendered again at every request (rare: no JSON body holds one)."""
        t = type(v)
        if t is str or v is None:
            return False
        if t is dict:
            if len(v) > 1 and order_observed(self.plan.order_paths, path):
                return True
            for k, x in v.items():
                if type(x) is not str and self._needs_strict(x, path + (k,)):
                    return True
            return False
        if t is list or t is tuple:
            for x in v:
                if type(x) is not str and self._needs_strict(x, path + ("*",)):
                    return True
            return False
        return True

    def _strict_prefix(self, messages, k, lo=0):
        """Lower ``k`` to the first position in ``[lo, k)`` whose message equals the old one by ``==`` but
        not strictly (marshal bytes of values where that can show; key order where observable)."""
        self._settle_strict(lo, k)
        pos, keys, reprs, _ = self._strict
        i0, j = bisect_left(pos, lo), bisect_left(pos, k)
        pos, keys, reprs = pos[i0:j], keys[i0:j], reprs[i0:j]
        if pos:
            msgs = operator.itemgetter(*pos)(messages) if len(pos) > 1 else (messages[pos[0]],)
            try:
                got = list(map(marshal.dumps, map(_get_or_missing, msgs, keys), repeat(0, len(pos))))
            except ValueError:  # a value marshal cannot write (a str subclass, ...): compare one by one
                got = [_signature(m.get(key, MISSING)) for m, key in zip(msgs, keys)]
            if got != reprs:
                k = next(i for i, g, r in zip(pos, got, reprs) if g != r)
        if self.plan.observes_message_order and k > lo:
            old = self._snaps
            if list(map(list, old[lo:k])) != list(map(list, messages[lo:k])):
                k = next(i for i in range(lo, k) if list(old[i]) != list(messages[i]))
        return k

    def _settle_strict(self, lo: int, hi: int) -> None:
        """Compute the strict entries of the lazy positions in ``[lo, hi)`` from their snapshots, as
        :meth:`_diff` computes them from the caller's values: the snapshot is the caller's object there, which
        the caller does not mutate (:meth:`render_more_body`), so the entries are the ones it would have
        computed when the message came. O(entries) per call, with one sort when any are added."""
        pos, keys, reprs, lazy = self._strict
        a, b = bisect_left(lazy, lo), bisect_left(lazy, hi)
        if a == b:
            return
        snaps = self._snaps
        add = []
        for i in lazy[a:b]:
            sn = snaps[i]
            if type(sn) is not dict:  # _NEVER (continue_final_message): it equals nothing, so k is below it
                continue
            for key, v in sn.items():
                if type(v) is not str and self._needs_strict(v, (key,)):
                    add.append((i, key, _signature(v)))
        del lazy[a:b]
        if add:
            # (sorted is stable: a position's keys stay in their order)
            merged = sorted([*zip(pos, keys, reprs), *add], key=operator.itemgetter(0))
            pos[:], keys[:], reprs[:] = (list(x) for x in zip(*merged))

    # ------------------------------------------------------------ full path

    def _old_text(self) -> str:
        if self._text is None:
            self._text = "".join(p if isinstance(p, str) else p.text() for p in self._pieces)
        return self._text

    def _full_path(self, messages, options, snaps, chat, reason) -> ChatRender:
        text = self._full.render(messages, **options)
        old_text = self._old_text()
        departure = common_prefix_length(old_text, text)
        self.stats["full:" + reason] += 1
        result = ChatRender([text], text, departure, len(old_text), "full:" + reason, None)
        self._commit(snaps, chat, None, [text], text, len(text))
        return result

    def _commit(self, snaps, chat, memos, pieces, text, length):
        self._strict = self._next_strict
        self._snaps, self._chat, self._memos, self._pieces, self._text, self._length = (
            snaps, chat, memos, pieces, text, length)

    def _plain_kept(self, key: str, value):
        """``plain(value)``: the copy made for the previous request when ``value`` has that copy's
        :func:`_signature`, so that an unchanged option is the same object as last time (the segments'
        comparisons of it stop at identity) and is not copied again.

        Sound because a copy holds exact JSON types and tuples only: ``marshal`` writes each of those types
        with a type code of its own (exact ``str``, ``int``, ``float``, ``bool``, ``None``, ``list``,
        ``tuple``, ``dict``; floats by ``repr`` in version 0, so the sign of zero too), raises for their
        subclasses, and writes every other object it accepts with codes a copy never holds (bytes-like
        objects as bytes, sets, complex, code). The format is self-delimiting, so bytes equal to the copy's
        signature decode to the copy's structure: ``value`` is made of the same exact types, scalars, key
        orders and nesting, and ``plain(value)`` would equal the copy strictly."""
        if value is None:  # its own copy; the kept one stays for a later request
            return None
        sig = _signature(value)
        prev = self._plain_options.get(key)
        if prev is not None and prev[1] == sig:  # (_NEVER equals nothing)
            return prev[0]
        copy = _t.plain(value)
        self._plain_options[key] = (copy, _signature(copy))
        return copy

    # ------------------------------------------------------------ segments

    def _render_segments(self, chat, k, variables):
        old_memos = self._memos
        pieces: list = []
        memos: list = []
        built = set(map(id, variables.values()))  # plain() copies, special tokens (str), bools: plain values
        for si, seg in enumerate(self.plan.segments):
            if isinstance(seg, PlainSegment):
                if seg.reusable:
                    memo = self._run_reusable(seg, chat, k, variables, built,
                                              old_memos[si] if old_memos is not None else None)
                    pieces.append(memo.out)
                    memos.append(memo)
                    continue
                fast = self._fast_plain(seg, variables)
                exported = None
                if fast is not None:
                    try:
                        out, exported = fast(variables, built)
                    except Exception:  # noqa: BLE001 - not proven here (bodycode): the jinja2 render, below
                        self.stats["plain_compiled_bailed"] += 1
                if exported is None:
                    ctx = seg.template.new_context(variables)
                    out = "".join(seg.template.root_render_func(ctx))
                    # every root assignment, as the full render's later statements see them (O1):
                    # ``context.vars``, not ``get_exported()``, which leaves out names starting with "_"
                    exported = ctx.vars
                variables.update(exported)
                pieces.append(out)
                memos.append(out)
            else:
                old = old_memos[si] if old_memos is not None else None
                memo = self._run_loop(seg, chat, k, variables, old)
                pieces.append(memo)
                memos.append(memo)
        return pieces, memos

    def _run_reusable(self, seg, chat, k, variables, built, old) -> _PlainMemo:
        """A reusable plain segment (analysis O7; module docstring, 2): the previous request's memo if what
        it read is unchanged, else a fresh render recording its reads. It binds no name: nothing to export.
        ``built``: ids of the request's own variables (plain by construction; held by the caller)."""
        inputs = {name: variables.get(name, MISSING) for name in seg.free if name != "messages"}
        n = len(chat)
        cacheable = not seg.uses_messages or variables.get("messages") is chat
        if cacheable:
            for v in inputs.values():
                if not (v is MISSING or id(v) in built or plain_value(v)):
                    cacheable = False
                    break
        if (cacheable and type(old) is _PlainMemo and old.maxread < k and (not old.nsens or old.n == n)
                and old.inputs.keys() == inputs.keys() and _all_same(old.inputs, inputs)):
            self.stats["plain_reused"] += 1
            return old
        rec = _Rec(None, -1)
        ctx_vars = variables
        out = None
        if seg.uses_messages and cacheable:
            ctx_vars = dict(variables)
            ctx_vars["messages"] = _RecMessages(chat, rec)
        else:  # no reads of messages to record: the compiled twin renders it where it compiles
            fast = self._fast_plain(seg, variables)
            if fast is not None:
                try:
                    out = fast(variables, built)[0]
                except Exception:  # noqa: BLE001 - not proven here (bodycode): the jinja2 render, below
                    self.stats["plain_compiled_bailed"] += 1
        if out is None:
            out = "".join(seg.template.root_render_func(seg.template.new_context(ctx_vars)))
        if not cacheable:  # a read the memo cannot describe: never reused (maxread above every k)
            rec.maxread = n
        return _PlainMemo(out, inputs, rec.maxread, rec.nsens, n)

    def _form(self, seg: LoopSegment, chat, variables) -> IterForm:
        if seg.alias is None:
            return seg.forms[0]
        value = variables.get(seg.alias, MISSING)
        if value is chat:
            return IterForm(0, False) if IterForm(0, False) in seg.forms else self._no_form(seg)
        if type(value) is list:
            for f in seg.forms:
                cand = chat[::-1] if f.reverse else chat[f.start:]
                if len(cand) == len(value) and all(map(operator.is_, cand, value)):
                    return f
        return self._no_form(seg)

    @staticmethod
    def _no_form(seg):
        raise _Fallback(f"{seg.alias} is not one of its analysed forms")

    def _run_loop(self, seg: LoopSegment, chat, k, variables, old: _Memo | None) -> _Memo:
        n = len(chat)
        form = self._form(seg, chat, variables)
        ns_names, outer = [], {}
        namespace = self._namespace
        for name in seg.outer_names:
            if name not in variables:
                continue
            v = variables[name]
            if isinstance(v, namespace):
                ns_names.append(name)
            elif plain_value(v):
                outer[name] = v
            else:
                raise _Fallback(f"the loop body reads {name!r}, a {type(v).__name__} (O3)")
        if len(ns_names) > 1 and len({id(variables[name]) for name in ns_names}) < len(ns_names):
            # the state is keyed by name: one namespace under two names would be two copies
            raise _Fallback("the loop body reads one namespace under two names")
        state: dict = {}
        for name in ns_names:
            for a, v in object.__getattribute__(variables[name], "_Namespace__attrs").items():
                state[(name, a)] = v
        memo = _Memo(n, form, tuple(ns_names), outer, dict(state))
        if old is not None and not (old.form == form and old.ns_names == memo.ns_names
                                    and old.outer.keys() == outer.keys() and _all_same(old.outer, outer)):
            old = None
        if old is not None and form.start > n:
            old = None
        start = 0 if form.reverse else form.start
        chunks: list = []  # (lo, hi, None): positions [lo, hi) reused from old; (p, p + 1, rec): rendered anew
        step = -1 if form.reverse else 1
        p = n - 1 if form.reverse else start
        end = -1 if form.reverse else n
        limit = min(k, n, old.n) if old is not None else 0  # positions < limit have a record for the same message
        bad_la = self._bad_lookahead(old, k, limit) if old is not None else []
        nsens_attrs, edge = _N_SENSITIVE[form.reverse]
        fast = self._fast_body(seg, form, memo.ns_names, outer)
        reused = rendered = bailed = 0
        while p != end:
            if p < limit:
                q = self._first_invalid(old, p, state, n, k, limit, bad_la, form, edge)
                if q != p:
                    lo, hi = (q + 1, p + 1) if form.reverse else (p, q)
                    chunks.append((lo, hi, None))
                    reused += hi - lo
                    # the state after the block: each key's last write inside it, in loop order
                    if form.reverse:
                        for key, w in old.writers.items():
                            i = bisect_right(w, q)
                            if i < len(w) and w[i] <= p:
                                state[key] = old.recs[w[i]].writes[key]
                    else:
                        for key, w in old.writers.items():
                            i = bisect_left(w, q)
                            if i and w[i - 1] >= p:
                                state[key] = old.recs[w[i - 1]].writes[key]
                    p = q
                    continue
            elem = chat[p]
            if fast is not None:
                rec = _Rec(elem, p)
                try:
                    rec.out = fast(elem, p, n, chat, state, rec, outer)
                except Exception:  # noqa: BLE001 - not proven here (bodycode): the jinja2 body, below
                    bailed += 1
                else:
                    if rec.writes:
                        state.update(rec.writes)
                    if not nsens_attrs.isdisjoint(rec.loop_reads):
                        rec.nsens = True
                    chunks.append((p, p + 1, rec))
                    rendered += 1
                    p += step
                    continue
            rec = self._jinja_iteration(seg, elem, p, n, form, chat, state, outer, ns_names)
            if not nsens_attrs.isdisjoint(rec.loop_reads):
                rec.nsens = True
            chunks.append((p, p + 1, rec))
            rendered += 1
            p += step
        if form.reverse:
            chunks.reverse()
        _finish(memo, old, chunks, start)
        entry = memo.entry
        if len(state) != len(entry):  # (the state starts as a copy of the entry and only gains keys)
            # a namespace's attributes are in first-write order (jinja2's Namespace: a dict): the keys it had
            # before the loop, then each new one at the first iteration (in loop order) whose record writes it;
            # reused blocks replay writes in the old render's order, so the order is taken from the index
            added = [key for key in state if key not in entry]
            w = memo.writers
            added.sort(key=(lambda key: -w[key][-1]) if form.reverse else (lambda key: w[key][0]))
            state = {key: state[key] for key in [*(key for key in state if key in entry), *added]}
        for name in ns_names:
            attrs = object.__getattribute__(variables[name], "_Namespace__attrs")
            attrs.clear()
            for (nm, a), v in state.items():
                if nm == name:
                    attrs[a] = v
        if not form.reverse:
            self._cum(memo, old, start)
        self.stats["iterations_reused"] += reused
        self.stats["iterations_rendered"] += rendered
        if bailed:
            self.stats["iterations_compiled_bailed"] += bailed
        return memo

    def _jinja_iteration(self, seg: LoopSegment, elem, p: int, n: int, form: IterForm, chat, state: dict,
                         outer: dict, ns_names: list) -> _Rec:
        """One iteration rendered by the jinja2 body, its reads recorded through the stand-ins (``_RecLoop``,
        ``_RecMessages``, the recording namespace, ``_Compare``); writes go to ``state`` as they happen."""
        rec = _Rec(elem, p)
        ctx_vars = dict(outer)
        ctx_vars[seg.target] = elem
        ctx_vars["loop"] = _RecLoop(rec, p, n, form, chat, self._undefined)
        if seg.uses_messages:
            ctx_vars["messages"] = _RecMessages(chat, rec)
        for name in ns_names:
            ctx_vars[name] = self._ns_class(name, state, rec)
        ctx_vars[COMPARE] = self._compare
        body = seg.body
        rec.out = "".join(body.root_render_func(body.new_context(ctx_vars)))
        return rec

    def _fast_plain(self, seg: PlainSegment, variables: dict):
        """The compiled twin of a plain segment (:func:`.bodycode.compile_plain`) for the free names the
        variables hold; ``None`` where it is refused, or with ``compiled_bodies=False``. Kept on the segment,
        as :meth:`_fast_body`."""
        if not self.compiled_bodies:
            return None
        key = tuple(map(variables.__contains__, seg.free))
        try:
            return seg.fast[key]
        except KeyError:
            pass
        try:
            fn = compile_plain(_t.segment_environment(), seg.node,
                               present=frozenset(name for name in seg.free if name in variables))
        except Unsupported as e:
            fn = None
            self.stats["plain_not_compiled: " + str(e)] += 1
        seg.fast[key] = fn
        return fn

    def _fast_body(self, seg: LoopSegment, form: IterForm, ns_names: tuple, outer: dict):
        """The compiled twin of ``seg``'s body (:mod:`.bodycode`) for this form, these namespaces and outer
        names; ``None`` where it is refused (then every iteration renders through jinja2), or with
        ``compiled_bodies=False``. Compiled once per specialization and kept on the segment (a plan is
        shared by every session of its template)."""
        if not self.compiled_bodies:
            return None
        key = (form, ns_names, tuple(outer))
        try:
            return seg.fast[key]
        except KeyError:
            pass
        try:
            fn = compile_body(_t.segment_environment(), seg.node, target=seg.target, reverse=form.reverse,
                              start=form.start, ns_names=ns_names, outer_names=tuple(outer),
                              uses_messages=seg.uses_messages, missing=MISSING)
        except Unsupported as e:
            fn = None
            self.stats["body_not_compiled: " + str(e)] += 1
        seg.fast[key] = fn
        return fn

    @staticmethod
    def _bad_lookahead(old: _Memo, k, limit):
        """Positions below ``limit`` whose record read a message at ``>= k`` (module docstring, 4c)."""
        la = old.la
        i = bisect_left(la, k - old.la_max)
        return [x for x in la[i:] if x < limit and old.recs[x].maxread >= k]

    @staticmethod
    def _first_invalid(old: _Memo, p, state, n, k, limit, bad_la, form, edge) -> int:
        """The first position from ``p`` (in loop order, among those below ``limit``) whose record may be
        invalid; the walk's end if none (module docstring, 4)."""
        rev = form.reverse
        lo, hi = (0, p + 1) if rev else (p, limit)
        cands = []
        if n != old.n:
            c = _first(old.nsens, p, lo, hi, rev)
            if c is not None:
                cands.append(c)
            for x in (old.n - 1, n - 1):
                if lo <= x < hi:
                    reads = old.recs[x].loop_reads
                    # the edge attribute (``last`` forward, ``first`` reversed) is the bool ``x == n - 1``:
                    # position n - 1 ends a forward loop over messages[start:] and starts a reversed one
                    if edge in reads and reads[edge] is not (x == n - 1):
                        cands.append(x)
        for x in bad_la:
            if lo <= x < hi:
                cands.append(x)
        # only a key some kept record read can make one invalid (a key that neither the state nor the kept
        # render has is MISSING on both sides)
        for key, rd in old.readers.items():
            if not rd:
                continue
            v = state.get(key, MISSING)
            was = old.old_value(key, p)
            if v is was or same(v, was):
                continue
            wr = old.writers.get(key)
            w = _first(wr, p, lo, hi, rev) if wr else None
            # readers from p up to (and at) the first writer see the current value: the first whose
            # recorded reads differ under it is invalid (O6: comparisons may still hold)
            if rev:
                i = bisect_right(rd, p) - 1
                while i >= 0 and rd[i] >= lo and (w is None or rd[i] >= w):
                    if not _reader_ok(old.recs[rd[i]], key, v):
                        cands.append(rd[i])
                        break
                    i -= 1
            else:
                i = bisect_left(rd, p)
                while i < len(rd) and rd[i] < hi and (w is None or rd[i] <= w):
                    if not _reader_ok(old.recs[rd[i]], key, v):
                        cands.append(rd[i])
                        break
                    i += 1
        if not cands:
            return -1 if rev else limit
        return max(cands) if rev else min(cands)

    @staticmethod
    def _cum(memo: _Memo, old: _Memo | None, start: int):
        recs = memo.recs
        keep = memo.keep if old is not None else 0
        if memo.shared is not None and memo.shared is old and len(old.cum) == old.n - start:
            # shared (:func:`_extend`): outputs below old.n are unchanged, extended in place; old keeps
            # its view (old.n)
            cum = old.cum
            keep = old.n - start
        else:
            cum = old.cum[:keep] if keep else []
        total = cum[-1] if cum else 0
        for r in recs[start + keep:]:
            total += len(r.out)
            cum.append(total)
        memo.cum = cum

    # ------------------------------------------------------------ departure

    def _departure(self, pieces, memos) -> tuple[int, str, int]:
        """(departure, delta, new total length). Segments (and a forward loop's records reused before its
        first rendered one) that are the same are skipped by length; from the first that may differ, the old
        and new texts are compared as streams of pieces, so only the chars up to the first difference and
        the new text after it are touched. The new length is ``departure + len(delta)``: the new text is the
        old text's first ``departure`` chars, then the delta."""
        old_pieces = self._pieces
        base = 0
        i = 0
        skip = 0  # records of the forward loop piece where the streams start that are the same as before
        if self._memos is not None and len(old_pieces) == len(pieces):
            for i, (new, old) in enumerate(zip(pieces, old_pieces)):
                if type(new) is not type(old):  # the previous render kept its whole text (continue_final_message)
                    break
                if isinstance(new, str):
                    if new == old:
                        base += len(new)
                        continue
                    break
                if new.form.reverse or old.form != new.form:
                    if not new.has_output() and not old.has_output():
                        continue
                    break
                j = new.keep
                if new.shared is old:
                    # extended in place (:func:`_extend`): every record below old.n has its old output, so
                    # the old piece's text is the new piece's text up to there; equal lengths: the records
                    # past old.n (if any) print nothing, so the texts are equal
                    if new.length() == old.length():
                        base += new.length()
                        continue
                    skip = max(0, old.n - new.form.start)
                    base += old.length()
                    rest = old_pieces[i + 1:]
                    if _all_str(rest):
                        # the old text after the shared records is these strings (the old piece has no record
                        # past old.n): join both rests whole, the new one is the delta's source anyway
                        old_rest = "".join(rest)
                        new_rest = "".join(_stream(pieces, i, skip))
                        d = common_prefix_length(old_rest, new_rest)
                        return base + d, new_rest[d:], base + len(new_rest)
                    break
                if _tail_text(new, j) == _tail_text(old, j):
                    base += new.length()
                    continue
                base += new.cum[j - 1] if j else 0
                skip = j
                break
            else:  # every piece was the same: ``base`` is the whole text
                return base, "", base
            old_stream = _stream(old_pieces, i, skip)
            new_stream = _stream(pieces, i, skip)
        else:
            old_stream = iter([self._old_text()])
            new_stream = _stream(pieces, 0, 0)
        d, new_rest = _common_prefix_streams(old_stream, new_stream)
        return base + d, new_rest, base + d + len(new_rest)

    @staticmethod
    def _join(pieces) -> str:
        return "".join(p if isinstance(p, str) else p.text() for p in pieces)


def _all_same(old: dict, new: dict) -> bool:
    """``same(old[x], new[x])`` for every key of ``new`` (its keys are ``old``'s)."""
    for x, v in new.items():
        w = old[x]
        if w is not v and not same(w, v):
            return False
    return True


def _all_str(values) -> bool:
    """Is every value an exact ``str``?"""
    for v in values:
        if type(v) is not str:
            return False
    return True


def _signature(value) -> bytes:
    """``marshal`` version 0 (no references, no interning): equal bytes mean equal JSON values with the
    same scalar types and dict key order; a value it cannot write gets a signature that equals nothing."""
    try:
        return marshal.dumps(value, 0)
    except ValueError:
        return _NEVER


def _get_or_missing(message, key):
    return message.get(key, MISSING)


def _tail_text(memo, j) -> str:
    """Outputs of a forward loop's records from index ``j`` (position ``start + j``) on."""
    ne, recs = memo.nonempty, memo.recs
    return "".join([recs[q].out for q in ne[bisect_left(ne, memo.form.start + j):bisect_left(ne, memo.n)]])


def _stream(pieces, i, j):
    """The text of ``pieces[i:]`` as a stream of strings, starting at record ``j`` of a forward loop piece
    ``pieces[i]`` (positions are ``start + j``)."""
    for idx in range(i, len(pieces)):
        p = pieces[idx]
        if isinstance(p, str):
            if p:
                yield p
            continue
        recs = p.recs
        if p.form.reverse:
            for q in reversed(p._nonempty()):
                yield recs[q].out
        else:
            first = p.form.start + (j if idx == i else 0)
            ne = p.nonempty
            for q in ne[bisect_left(ne, first):bisect_left(ne, p.n)]:
                yield recs[q].out


def _common_prefix_streams(a, b) -> tuple[int, str]:
    """(chars the two streams share at the start, the rest of ``b`` after them as one string)."""
    abuf = bbuf = ""
    done = 0
    a_end = b_end = False
    while True:
        while len(abuf) < 4096 and not a_end:
            nxt = next(a, None)
            if nxt is None:
                a_end = True
            else:
                abuf += nxt
        while len(bbuf) < max(4096, len(abuf)) and not b_end:
            nxt = next(b, None)
            if nxt is None:
                b_end = True
            else:
                bbuf += nxt
        m = min(len(abuf), len(bbuf))
        c = common_prefix_length(abuf[:m], bbuf[:m])
        if c < m or (a_end and len(abuf) == m) or (b_end and len(bbuf) == m):
            rest = bbuf[c:]
            return done + c, rest + "".join(b)
        done += m
        abuf, bbuf = abuf[m:], bbuf[m:]
