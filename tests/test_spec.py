"""Loading a tokenizer.json (``toktier_backend.spec``: ``resolve_path``, ``load_spec``) is safe and strict:
JSON only (no pickle, no remote code), clear errors naming the file and line. The sha256 pin is
``load_tokenizer``'s (``test_tokenizer.py``)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

import toktier_backend as tt

PACKAGE = Path(tt.__file__).parent


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE",\n oops}')
    with pytest.raises(tt.UnsupportedTokenizer, match="line 2"):
        tt.load_tokenizer(bad)
    with pytest.raises(tt.UnsupportedTokenizer):
        tt.load_tokenizer(tmp_path / "nothing-here")


def test_malformed_json_names_file_line_and_column(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{\n  "model": {"type": "BPE",\n  oops\n}')
    with pytest.raises(tt.UnsupportedTokenizer, match=r"tokenizer.json: malformed JSON at line 3 column 3"):
        tt.load_tokenizer(bad)


def test_unsupported_model_type_is_refused(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {"type": "NotAModel", "vocab": {}}}')
    with pytest.raises(tt.UnsupportedTokenizer, match="Hugging Face tokenizers cannot load it"):
        tt.load_tokenizer(bad)
    bad.write_text('["not", "a", "tokenizer"]')
    with pytest.raises(tt.UnsupportedTokenizer, match="no 'model' section"):
        tt.load_tokenizer(bad)


def test_a_pickle_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    bad = tmp_path / "tokenizer.json"
    bad.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(tt.UnsupportedTokenizer):
        tt.load_tokenizer(bad)
    assert not marker.exists()


def test_no_pickle_eval_or_remote_code_in_the_load_and_serve_path():
    """``faces/vllm_tokenizer.py`` is excluded: it implements vLLM's tokenizer interface, which passes
    vLLM's own ``trust_remote_code`` flag through to vLLM; our load path never takes it.

    ``marshal`` may write (``chat/session.py`` compares message values by their ``marshal.dumps`` bytes) but
    never read: ``marshal.load``/``loads`` of untrusted bytes is the hazard, as any pickle or dill import.

    One ``exec`` is allowed: ``chat/bodycode.py``'s ``_load``, which runs the Python the chat compiler
    generates from a template's AST (as jinja2 runs the code it generates for every template through
    ``exec``), after checking the source against the subset the generator writes, with three builtins (its
    C10; ``tests/chat/test_bodycode.py`` feeds it hostile sources and templates)."""
    pattern = re.compile(r"^\s*(import pickle|from pickle|import dill|from marshal)|\bmarshal\.loads?\b|"
                         r"\b(eval|exec)\(|trust_remote_code", re.M)
    hits = [f"{p.relative_to(PACKAGE)}: {m.group(0).strip()}" for p in PACKAGE.rglob("*.py")
            if p.relative_to(PACKAGE).as_posix() != "faces/vllm_tokenizer.py"
            for m in pattern.finditer(p.read_text())]
    assert hits == ["chat/bodycode.py: exec("]
    import ast

    tree = ast.parse((PACKAGE / "chat" / "bodycode.py").read_text())
    load = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_load")
    calls = [n for n in ast.walk(load) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "exec"]
    assert len(calls) == 1, "the one exec is _load's"
