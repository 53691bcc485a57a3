"""Serving layer: one request handler behind the Triton Python backend models and the PyTriton face.

- :mod:`.handler` — :class:`~.handler.Handler` (the one request handler) and
  :class:`~.handler.SessionStore` (correlation ID -> session, TTL, START/END). Pure Python.
- :mod:`.triton_io` — tensor <-> Python conversion and error-code mapping, shared by ``model.py`` and PyTriton.
- :mod:`.server` — ``toktier serve``: runs the ``tritonserver`` binary shipped in ``nvidia-pytriton`` (or PyTriton).
- :mod:`.client` — :class:`~.client.SessionClient` over ``tritonclient`` (imported lazily).

Importing this package imports neither Triton nor ``tritonclient``.
"""
