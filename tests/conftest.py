"""Shared fixtures: the tokenizer files in ``../shared``, loaded once per test run, and the fuzz budget.

``--fuzz-steps N`` (or ``TOKTIER_FUZZ_STEPS``) sets the differential fuzz steps *per tokenizer file*
(default 12,000: ~108K checked steps over the nine files); pass e.g. ``--fuzz-steps 500000`` for millions.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import pytest
import tokenizers

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TOKTIER_SHARED", REPO.parent / "shared"))
NAMES = ["gpt2", "llama3", "llama3_1", "qwen2_5", "qwen3", "deepseek_v3", "gemma3", "cl100k_base", "o200k_base"]


def tokenizer_path(name: str) -> Path:
    p = SHARED / "tokenizers" / name / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p} missing: tests need ../shared beside the repo (or TOKTIER_SHARED)")
    return p


@lru_cache(maxsize=None)
def load(name: str, engine: str = "auto"):
    """Our tokenizer for a shared file (cached for the whole run); ``engine`` as ``load_tokenizer``'s."""
    import toktier_backend as tt

    return tt.load_tokenizer(tokenizer_path(name), engine=engine)


@lru_cache(maxsize=None)
def reference(name: str) -> tokenizers.Tokenizer:
    """The HF reference, loaded independently of our code."""
    return tokenizers.Tokenizer.from_file(str(tokenizer_path(name)))


def pytest_addoption(parser):
    parser.addoption("--fuzz-steps", type=int, default=int(os.environ.get("TOKTIER_FUZZ_STEPS", 12000)),
                     help="differential fuzz steps per tokenizer file")


@pytest.fixture(scope="session")
def fuzz_steps(request) -> int:
    return request.config.getoption("--fuzz-steps")


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    from toktier_backend.corpus import load_turns, trajectory_files

    return [load_turns(f)[-1] for f in trajectory_files(SHARED / "corpus" / "swe-agent")]


@pytest.fixture(scope="session")
def cases() -> list[dict]:
    lines = (SHARED / "cases" / "tokenizer_cases.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="session")
def chat_folder(tmp_path_factory):
    """``chat_folder(name)`` -> a folder in the HF layout: ``tokenizer.json`` (a symlink to the shared file)
    beside the model's real ``tokenizer_config.json`` with its chat template and special tokens
    (``../shared/chat_templates/<name>/``)."""
    from tests.chat.corpus import template_source

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
