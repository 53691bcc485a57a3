"""TokenBuffer: splice and token boundaries against a list model, and replies that later splices never change
(copy-on-write only when a live reply would see a change)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toktier_backend.pipeline.token_buffer import TokenBuffer

NBYTES = np.array([1, 2, 3, 4, 5], dtype=np.int32)  # byte length per id (ids 0..4)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_token_buffer_splice_and_boundaries():
    buf = TokenBuffer(np.array([9], np.int32), np.array([7], np.int32), capacity=2)
    buf.splice(0, np.array([1, 2, 3], np.int32), NBYTES)  # ends: 2, 5, 9
    assert buf.ids().tolist() == [9, 1, 2, 3, 7] and buf.body_nbytes == 9
    assert [buf.tokens_before(b) for b in (0, 2, 4, 5, 9)] == [0, 1, None, 2, 3]
    buf.splice(2, np.array([4, 4], np.int32), NBYTES)  # keep 2 tokens (ends 2, 5), then 5+5, 5+5+5
    assert buf.ids().tolist() == [9, 1, 2, 4, 4, 7] and buf.body_nbytes == 15
    assert not buf.ids().flags.writeable


def test_tokens_before_matches_the_reference_offsets_at_every_byte():
    from ..conftest import load, reference

    text = "def main():\n    print('hello world')  # 1234\n" * 30  # ASCII: bytes == chars
    enc = reference("gpt2").encode(text, add_special_tokens=False)
    buf = TokenBuffer(np.zeros(0, np.int32), np.zeros(0, np.int32))
    buf.splice(0, np.asarray(enc.ids, np.int32), load("gpt2").spec.token_nbytes)
    ends = [e for _, e in enc.offsets]
    want = {e: i + 1 for i, e in enumerate(ends)}
    assert [buf.tokens_before(b) for b in range(len(text) + 2)] == [0] + [want.get(b) for b in range(1, len(text) + 2)]


def test_held_reply_keeps_its_values_through_rewrite_truncation_and_suffix():
    buf = TokenBuffer(np.array([9], np.int32), np.array([7], np.int32), capacity=64)
    buf.splice(0, np.array([1, 2, 3], np.int32), NBYTES)
    a = buf.ids()
    buf.splice(1, np.array([4, 4, 4], np.int32), NBYTES)  # rewrites ids 2, 3 and the suffix slot a shows
    b = buf.ids()
    buf.splice(0, np.array([0], np.int32), NBYTES)  # truncation, then an append over the freed slots
    c = buf.ids()
    buf.splice(1, np.array([3, 3, 3, 3, 3], np.int32), NBYTES)
    assert a.tolist() == [9, 1, 2, 3, 7]
    assert b.tolist() == [9, 1, 4, 4, 4, 7]
    assert c.tolist() == [9, 0, 7]
    assert buf.ids().tolist() == [9, 0, 3, 3, 3, 3, 3, 7]
    part = b[2:4]  # a slice of a reply (its base is the buffer's array too)
    del b
    buf.splice(0, np.array([1, 1, 1, 1], np.int32), NBYTES)
    assert part.tolist() == [4, 4]


def test_splice_stays_in_place_when_no_reply_can_see_a_change():
    buf = TokenBuffer(np.zeros(0, np.int32), np.zeros(0, np.int32), capacity=64)
    buf.splice(0, np.array([1, 2, 3], np.int32), NBYTES)
    at = _address(buf.ids())  # the reply is dropped at once
    buf.splice(1, np.array([4, 4], np.int32), NBYTES)  # changes slots 1, 2: nobody holds them
    assert _address(buf.ids()) == at
    held = buf.ids()  # [1, 4, 4]
    buf.splice(2, np.array([4, 1, 1], np.int32), NBYTES)  # same id in the shared slot, new slots after it
    assert _address(buf.ids()) == at and held.tolist() == [1, 4, 4]
    buf.splice(1, np.array([2], np.int32), NBYTES)  # changes slot 1, which ``held`` shows: copy
    assert _address(buf.ids()) != at and held.tolist() == [1, 4, 4]
    assert buf.ids().tolist() == [1, 2]


ops = st.lists(
    st.tuples(st.integers(0, 40), st.lists(st.integers(0, 4), max_size=12), st.booleans()), max_size=40)


@pytest.mark.parametrize("ids_only", [False, True], ids=["offsets", "ids_only_doubling"])
@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.integers(0, 4), max_size=2), st.lists(st.integers(0, 4), max_size=2))
def test_every_reply_held_or_dropped_matches_the_list_model(ids_only, seq, prefix, suffix):
    """Also for the ids-only buffer with unbounded doubling growth (``offsets=False, grow_max=None``, the
    Triton client's)."""
    kw = {"offsets": False, "grow_max": None} if ids_only else {}
    nbytes = None if ids_only else NBYTES
    buf = TokenBuffer(np.array(prefix, np.int32), np.array(suffix, np.int32), capacity=1, **kw)
    body: list[int] = []
    held: list[tuple[np.ndarray, list[int]]] = []
    buf.splice(0, np.zeros(0, np.int32), nbytes)
    for keep, new, hold in seq:
        keep = min(keep, len(body))
        buf.splice(keep, np.array(new, np.int32), nbytes)
        body = body[:keep] + new
        reply = buf.ids()
        want = prefix + body + suffix
        assert reply.tolist() == want and not reply.flags.writeable
        if not ids_only:
            assert buf.body_nbytes == int(NBYTES[body].sum()) if body else buf.body_nbytes == 0
        if hold:
            held.append((reply, want))
        for r, w in held:
            assert r.tolist() == w
