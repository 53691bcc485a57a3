"""The serving core behind every face: one session store and byte budget, one shadow verifier, one metrics
registry, one CPU pool (``runtime/pool.py``).

- :mod:`.core` — :class:`~.core.ServingCore`, the calls every face makes (``step``, ``encode``,
  ``encode_stateless``), and :class:`~.core.CoreConfig` (built from model parameters or a face's options).
- :mod:`.session_store` — sessions by key (correlation ID, header, body field) or by prompt prefix (callers
  that send no key: vLLM), with TTL, START/END, one LRU byte budget shared with the tokenizer's prefix index.
- :mod:`.verifier` — the shadow verifier: re-checks sampled replies against the reference, quarantines.
- :mod:`.metrics` — the ``toktier_*`` Prometheus metrics (labels name the face and model).

Pure Python and numpy: importing it imports neither Triton nor ``tritonclient``.
"""
