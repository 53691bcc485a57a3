"""Fixtures for the chat tests: HF-layout folders (``tokenizer.json`` + the model's ``tokenizer_config.json``)
for the six shared templates, the transformers reference on them, and our tokenizer.

Missing packages fail the tests that need them (a skip never reads as a pass).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from tests.chat.corpus import SHARED, template_source


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """``folder(name)`` -> a folder with ``tokenizer.json`` (symlink) and the real ``tokenizer_config.json``."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            tok = SHARED / "tokenizers" / name / "tokenizer.json"
            _, cfg = template_source(name)
            if not tok.is_file() or not cfg.is_file():
                pytest.fail(f"{tok} or {cfg} missing (tests need ../shared beside the repo, or TOKTIER_SHARED)")
            d = tmp_path_factory.mktemp(f"chat_{name}")
            (d / "tokenizer.json").symlink_to(tok)
            (d / "tokenizer_config.json").symlink_to(cfg)
            made[name] = d
        return made[name]

    return make


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
