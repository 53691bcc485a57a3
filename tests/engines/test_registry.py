"""The engine registry (``toktier_backend.engines.registry``): the modes it holds. Creating each engine and
checking it against the protocol and the HF reference is ``test_protocol.py``'s subject."""

from __future__ import annotations

from toktier_backend.engines import registry


def test_registry_holds_the_four_engines():
    assert set(registry.names()) >= {"hf", "fastokens", "gigatoken", "gpu"}
