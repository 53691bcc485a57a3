"""TextStore against a plain ``str`` model (hypothesis). TokenBuffer: tests/pipeline/test_token_buffer.py."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from toktier_backend.pipeline import text_store
from toktier_backend.pipeline.text_store import TextStore

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
            # the running byte total equals the blocks' sizes, measured afresh (the budget's input)
            assert store.nbytes == sum(sys.getsizeof(b) for b in store._blocks)
            assert (store.nbytes == 0) == (model == "")
            for k in (0, 1, len(model) // 2, max(0, len(model) - 3), len(model)):
                assert store.tail(k) == model[k:]
            other = model[: len(probe) % (len(model) + 1)] + probe
            want = next((i for i, (a, b) in enumerate(zip(model, other)) if a != b), min(len(model), len(other)))
            assert store.common_prefix(other) == want
        assert store.text == model
    finally:
        text_store.BLOCK = old_block
