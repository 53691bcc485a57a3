"""``make``: a :class:`ChunkedEncoder` built from a loaded tokenizer's parts, for the chunked encoder's tests
(``test_chunked.py``) and the pool's (``tests/runtime/test_pool.py``)."""

from __future__ import annotations

from toktier_backend.pipeline.chunked import ChunkedEncoder


def make(tok, pool=None, *, engine=None, **kw) -> ChunkedEncoder:
    """A ChunkedEncoder for ``tok``'s engine (or ``engine``), reference, guard set and cuts, on ``pool``."""
    return ChunkedEncoder(engine or tok.engine, reference=tok.chunked.reference, guard=tok.admission,
                          cuts=tok.cuts, pool=pool, **kw)
