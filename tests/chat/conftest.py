"""Fixtures for the chat tests: HF-layout folders (``tokenizer.json`` + the model's ``tokenizer_config.json``)
for the six shared templates, the transformers reference on them, and our tokenizer.

Missing packages fail the tests that need them (a skip never reads as a pass).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest



@pytest.fixture(scope="session")
def folder(chat_folder):
    """``folder(name)`` -> ``chat_folder(name)`` (``tests/conftest.py``)."""
    return chat_folder


@lru_cache(maxsize=None)
def hf_tokenizer(path: str):
    """``transformers.AutoTokenizer.from_pretrained(path)`` (the reference for text and ids)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        pytest.fail(f"transformers is not installed ({e}): pip install -e '.[test]'")
    return AutoTokenizer.from_pretrained(path)


@lru_cache(maxsize=None)
def our_tokenizer(path: str):
    from toktier_backend import load_tokenizer

    return load_tokenizer(str(Path(path) / "tokenizer.json"))
