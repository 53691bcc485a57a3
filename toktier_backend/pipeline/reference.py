"""A slow, readable twin of :mod:`toktier_backend.pipeline.repair`, on plain ``str`` and ``list[int]``.

It takes the same steps in the same order (departure point, stable-cut search in a widening window,
re-encode of the tail, splice) but keeps no offsets: a cut's token index is found by encoding the text
before it. Every encode is the HF reference's. Tests use it as an oracle for the fast path's ids and for
the cut it chooses (tests/pipeline/test_session_fuzz.py). Not for serving: each call is O(text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from toktier_backend.pipeline.repair import WIDENINGS, WINDOW


class Repaired(NamedTuple):
    body: list[int]  # body ids of the new text (no post-processor)
    route: str  # "noop", "append", "edit" or "full" (as RepairInfo.route)
    cut: int  # chars; 0 on "full"
    keep: int  # body ids kept from the old reply
    widenings: int  # doublings of the window before the cut was found


def repair(old: str, old_body: list[int], new: str, *, encode: Callable[[str], list[int]],
           is_stable_cut: Callable[[str, int, int], bool] | None, first: bool = False) -> Repaired:
    """The body ids of ``new``, repaired from ``old`` and its body ids ``old_body``.

    Args:
        encode: ``text -> ids``, HF ``encode(text, add_special_tokens=False).ids``.
        is_stable_cut: ``(text, c, end) -> bool``, reading only ``text[:end]`` (``CutFinder.is_stable_cut``);
            ``None``: no cut can be proven, every change is a full encode.
        first: no reply was given before (an unchanged text is then encoded, not a no-op).

    Returns ``body == encode(new)`` whenever ``is_stable_cut`` is right.
    """
    # 1. departure point: the first char where the texts differ
    d = 0
    while d < min(len(old), len(new)) and old[d] == new[d]:
        d += 1
    if d == len(old) == len(new) and not first:
        return Repaired(list(old_body), "noop", d, len(old_body), 0)
    route = "append" if d == len(old) else "edit"
    # 2. the last stable cut c <= d - 1 that is a token boundary of old_body, in a window doubled as needed
    hi, before = d - 1, new[:d]  # old[:d] == new[:d]: the predicates read no further
    for widenings in range(WIDENINGS + 1):
        if is_stable_cut is None or d == 0 or not new:
            break
        lo = max(1, d - WINDOW * 2**widenings)
        for c in range(hi, lo - 1, -1):  # right to left: the last cut wins
            if not is_stable_cut(before, c, d):
                continue
            head = encode(old[:c])  # stable: encode(old) == encode(old[:c]) + encode(old[c:])
            if old_body[: len(head)] != head:
                continue  # not a token boundary of the old ids
            # 3. re-encode the tail, 4. splice
            return Repaired(head + encode(new[c:]), route, c, len(head), widenings)
        if lo == 1:
            break
        hi = lo - 1
    # no cut in the widest window: a full encode
    return Repaired(encode(new), "full", 0, 0, WIDENINGS + 1 if d > 0 else 0)
