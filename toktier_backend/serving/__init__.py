"""The serving core behind every face: one session store and byte budget, one shadow verifier, one metrics
registry, one CPU pool (``runtime/pool.py``).

- :mod:`.session_store` — sessions by key (correlation ID, header, body field) with TTL, START/END, LRU
  byte budget shared with the tokenizer's prefix index.
- :mod:`.prefix_sessions` — sessions found by prompt prefix, for callers that send no key (vLLM).
- :mod:`.verifier` — the shadow verifier: re-checks sampled replies against the reference, quarantines.
- :mod:`.metrics` — the ``toktier_*`` Prometheus metrics (labels name the face).

Pure Python and numpy: importing it imports neither Triton nor ``tritonclient``.
"""
