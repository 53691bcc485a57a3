"""TextStore and TokenBuffer against plain ``str`` / list models (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from toktier_backend.pipeline import text_store
from toktier_backend.pipeline.text_store import TextStore
from toktier_backend.pipeline.token_buffer import TokenBuffer

ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.text(max_size=40)),
        st.tuples(st.just("truncate"), st.integers(0, 200)),
        st.tuples(st.just("replace"), st.text(max_size=120)),
        st.tuples(st.just("text"), st.just("")),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.text(max_size=150))
def test_text_store_matches_str(seq, probe):
    old_block = text_store.BLOCK
    text_store.BLOCK = 16  # force block freezing in small examples
    try:
        store, model = TextStore(), ""
        for op, arg in seq:
            if op == "append":
                store.append(arg)
                model += arg
            elif op == "truncate":
                store.truncate(arg)
                model = model[:arg]
            elif op == "replace":
                store.replace(arg)
                model = arg
            else:
                assert store.text == model
            assert len(store) == len(model)
            for k in (0, 1, len(model) // 2, max(0, len(model) - 3), len(model)):
                assert store.tail(k) == model[k:]
            other = model[: len(probe) % (len(model) + 1)] + probe
            want = next((i for i, (a, b) in enumerate(zip(model, other)) if a != b), min(len(model), len(other)))
            assert store.common_prefix(other) == want
        assert store.text == model
    finally:
        text_store.BLOCK = old_block


def test_token_buffer_splice_and_boundaries():
    nbytes = np.array([1, 2, 3, 4, 5], dtype=np.int32)  # byte length per id
    buf = TokenBuffer(np.array([9], np.int32), np.array([7], np.int32), capacity=2)
    buf.splice(0, np.array([1, 2, 3], np.int32), nbytes)  # ends: 2, 5, 9
    assert buf.ids().tolist() == [9, 1, 2, 3, 7] and buf.body_nbytes == 9
    assert [buf.tokens_before(b) for b in (0, 2, 4, 5, 9)] == [0, 1, None, 2, 3]
    buf.splice(2, np.array([4, 4], np.int32), nbytes)  # keep 2 tokens (ends 2, 5), then 5+5, 5+5+5
    assert buf.ids().tolist() == [9, 1, 2, 4, 4, 7] and buf.body_nbytes == 15
    assert not buf.ids().flags.writeable
