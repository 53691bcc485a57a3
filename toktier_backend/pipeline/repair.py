"""The repair: serve a session's new text from its previous ids, re-encoding only the tail after a stable cut.

One request, in order (a slow, readable twin of this loop is :mod:`toktier_backend.pipeline.reference`)::

    departure point d        first char where the new text departs from the old one
    stable cut c <= d - 1    the last one in WINDOW chars before d that is a token boundary of the old ids,
                             the window doubled up to WIDENINGS times; none: a full exact encode
    re-encode text[c:]       through the ``encode_body`` handed in (the admitted engine, or the reference)
    splice                   keep the ids before c, append the tail's ids (pipeline/token_buffer.py)
    offset check             the spliced ends must cover exactly the normalized bytes of the new text;
                             if not, the whole text goes to the reference

Pure code: no threads, no files. It does not import :mod:`toktier_backend.tokenizer`; what it needs from a
tokenizer comes in a :class:`Encoders`.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from toktier_backend.pipeline.cuts import CutFinder
from toktier_backend.pipeline.text_store import TextStore
from toktier_backend.pipeline.token_buffer import TokenBuffer

log = logging.getLogger(__name__)

#: First repair window (chars before the departure point) and how often it is doubled.
WINDOW = 1024
WIDENINGS = 5


@dataclass(slots=True)
class RepairInfo:
    """What the last request of a session did.

    Attributes:
        route: ``"full"`` (whole text encoded), ``"append"`` / ``"edit"`` (tail repaired from a cut),
            ``"noop"`` (text unchanged), ``"reference"`` (whole text through the HF reference: file or
            flag not supported by the fast path).
        departure: first char where the new text departs from the old one (chars).
        cut: the stable cut the tail was re-encoded from (chars; 0 for full encodes).
        widenings: how many times the search window was doubled (``WIDENINGS + 1`` = none found).
        reused: ids of the previous reply that are still valid (Triton's ``KEEP``).
        reencoded: ids produced by this request's encode.
        engine: ``"fastokens"``, ``"gigatoken"`` or ``"hf"``; ``"fastokens+hf"`` when a chunked encode
            (``pipeline/chunked.py``) sent some chunks to the reference.
        fallback: why the reference (or a full encode) served what the fast path would have: ``""`` (it
            did not), ``"guarded"`` (guarded code point), ``"engine_error"``, ``"quarantined"`` (route
            quarantined, or the session rebuilt after a quarantine), ``"no_cut"`` (no stable cut in the
            widest window), ``"offset_check"`` (offsets disagreed after a repair).
    """

    route: str = "full"
    departure: int = 0
    cut: int = 0
    widenings: int = 0
    reused: int = 0
    reencoded: int = 0
    engine: str = "hf"
    fallback: str = ""


class Encoders(Protocol):
    """What the repair needs from one tokenizer (``toktier_backend.tokenizer`` hands one in per session).

    Attributes:
        cuts: the file's cut finder.
        token_nbytes: ``int32[vocab]``: normalized UTF-8 bytes per id (``spec.token_nbytes``); ``None``
            when unproven (then no cut is searched).
    """

    @property
    def cuts(self) -> CutFinder: ...

    @property
    def token_nbytes(self) -> np.ndarray | None: ...

    def normalized_nbytes(self, text: str) -> int:
        """Normalized UTF-8 bytes of ``text`` (``spec.normalized_nbytes``)."""

    def encode_body(self, text: str, *, route: str) -> tuple[np.ndarray, str]:
        """``(int32[n] body ids, engine name)`` of a repaired tail, served on ``route``."""

    def encode_fresh(self, text: str) -> tuple[np.ndarray, str]:
        """``(int32[n] body ids, engine name)`` of a whole text with no session state."""

    def encode_reference(self, text: str) -> np.ndarray:
        """``int32[n]`` body ids from the HF reference."""

    def fallback_reason(self, text: str, route: str) -> str:
        """Why ``encode_body`` / ``encode_fresh`` answered ``text`` with the reference."""


def departure(store: TextStore, new: str, *, whole: bool) -> int:
    """First char where the new text departs from the stored one (chars).

    ``whole``: ``new`` is the whole new text (one O(n) comparison); else it is a delta appended to the
    stored text (the departure point is the stored length, O(1)).
    """
    if not whole:
        return store.length
    return store.common_prefix(new) if store.length else 0


def find_cut(enc: Encoders, store: TextStore, buf: TokenBuffer,
             d: int) -> tuple[int, int, int, str, int] | None:
    """``(cut, body tokens kept, widenings, kept text, kept bytes)``: the last stable cut ``c <= d - 1`` that is
    also a token boundary of the stored ids, searching ``WINDOW * 2**k`` chars before ``d`` for
    ``k = 0..WIDENINGS``; ``kept text`` is the stored ``text[c:d]`` (what the repair re-encodes before the new
    text); ``kept bytes`` is the cut's normalized byte position, where the kept tokens end
    (``ends[keep - 1]``, or 0: the position :meth:`TokenBuffer.tokens_before` matched, not read again).

    A cut's token index: its byte position in the normalized old text is the buffer's total minus the
    normalized bytes of the old text after it; a token must end exactly there (``buf.tokens_before``).
    ``None``: no cut in the widest window, or the file's cuts are unproven.
    """
    finder = enc.cuts
    if not finder.supported or enc.token_nbytes is None:
        return None
    store_len = store.length
    hi = d - 1
    for k in range(WIDENINGS + 1):
        lo = max(1, d - WINDOW * (2**k))
        if lo > hi:
            break
        base = max(0, lo - finder.left_context)
        window = store.tail(base)[: d - base]  # old text == new text before d (the whole tail when d ends it)
        while True:
            c = finder.last_cut(window, lo - base, hi - base, d - base)
            if c is None:
                break
            kept = window[c:]
            c += base
            # normalized bytes of the stored text after c (not split at d: a normalizer may compose across it)
            nb = buf.body_nbytes - enc.normalized_nbytes(kept if d == store_len else store.tail(c))
            keep = buf.tokens_before(nb)
            if keep is not None:
                return c, keep, k, kept, nb
            log.warning("stable cut %d is not a token boundary (family %s); trying an earlier one", c, finder.name)
            hi = c - 1
        hi = lo - 1
    return None


def repair(enc: Encoders, store: TextStore, buf: TokenBuffer, new: str, *, whole: bool, d: int,
           force_reference: bool, quarantined: Container[str], first: bool, splice: bool = False) -> RepairInfo:
    """Bring ``store`` and ``buf`` to the new text; return what was done.

    Args:
        new: the whole new text (``whole``), the delta appended to the stored text, or (``splice``) the
            text that replaces the stored text from ``d`` on.
        d: the departure point (:func:`departure`); with ``splice``, the caller's: the new text is
            ``stored[:d] + new``. The cut search only reads the stored text before ``d``, which the new
            text shares, so any ``d`` not past the true departure point gives the same ids.
        force_reference: encode the whole text through the reference (the session's ids predate a
            quarantine).
        quarantined: routes the fast path may not serve (``"append"``, ``"edit"``, ``"full"``).
        first: no reply was given before (``reused`` is then 0).

    On return ``buf`` holds ``HF encode(new text, add_special_tokens=False).ids`` between its constant
    prefix and suffix, and ``store`` holds the new text. An exception from an encode leaves both unchanged.
    """
    old_len = store.length
    if splice:
        new_len = d + len(new)
    else:
        new_len = len(new) if whole else old_len + len(new)
    route = "append" if d == old_len else "edit"
    if force_reference or route in quarantined:
        return _full(enc, store, buf, new, whole, d, 0, first, reference=True, fallback="quarantined", splice=splice)
    found = find_cut(enc, store, buf, d) if d > 0 and new_len > 0 else None
    if found is None:
        no_cut = d > 0 and new_len > 0 and enc.cuts.supported
        return _full(enc, store, buf, new, whole, d, WIDENINGS + 1 if d > 0 else 0, first,
                     fallback="no_cut" if no_cut else "", splice=splice)
    c, keep, widenings, kept, base = found
    # the new text after c: the stored text[c:d] (the new text shares it), then what departs at d
    tail = new[c:] if whole else kept + new
    body, engine = enc.encode_body(tail, route=route)
    buf.splice(keep, body, enc.token_nbytes)
    if buf.body_nbytes != base + enc.normalized_nbytes(tail):
        # The offsets no longer describe the text: never answer from them. Rebuild from the reference.
        log.error("offset check failed after a repair (family %s, cut %d): rebuilding with the reference",
                  enc.cuts.name, c)
        # only the kept ids of the previous reply are still in the buffer: KEEP may not go past them
        return _full(enc, store, buf, new, whole, d, widenings, first, reference=True, fallback="offset_check",
                     old_valid=buf.n_prefix + keep, splice=splice)
    _commit(store, new, whole, d if splice else None)
    return RepairInfo(
        route=route, departure=d, cut=c, widenings=widenings, reused=buf.n_prefix + keep,
        reencoded=len(body), engine=engine,
        fallback=enc.fallback_reason(tail, route) if engine == "hf" else "",
    )


def _commit(store: TextStore, new: str, whole: bool, at: int | None = None) -> None:
    if at is not None:
        store.truncate(at)
        store.append(new)
    elif whole:
        store.replace(new)
    else:
        store.append(new)


def _full(enc: Encoders, store: TextStore, buf: TokenBuffer, new: str, whole: bool, d: int, widenings: int,
          first: bool, *, reference: bool = False, fallback: str = "", old_valid: int | None = None,
          splice: bool = False) -> RepairInfo:
    """The whole new text encoded (the reference when ``reference``), spliced over the whole buffer."""
    if splice:
        text = store.text[:d] + new
    else:
        text = new if whole else store.text + new
    # a view, not a copy: splice never changes ids a live view shows (copy-on-write, token_buffer.py)
    old = None if first else buf.ids()[:old_valid]
    if reference:
        body, engine = enc.encode_reference(text), "hf"
    else:
        body, engine = enc.encode_fresh(text)
    if engine == "hf" and not fallback:
        fallback = enc.fallback_reason(text, "full")
    buf.splice(0, body, enc.token_nbytes if enc.token_nbytes is not None else zeros_for(body))
    if splice:
        store.replace(text)
    else:
        _commit(store, new, whole)
    reused = common_prefix_len(old, buf.ids()) if old is not None else 0
    return RepairInfo(route="full", departure=d, cut=0, widenings=widenings, reused=reused,
                      reencoded=len(body), engine=engine, fallback=fallback)


def zeros_for(ids: np.ndarray) -> np.ndarray:
    """Offsets table stand-in when a file has none: sessions then never cut, so ends are unused."""
    return np.zeros(int(ids.max()) + 1 if len(ids) else 1, dtype=np.int32)


def common_prefix_len(a: np.ndarray | None, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays (ids)."""
    if a is None:
        return 0
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
