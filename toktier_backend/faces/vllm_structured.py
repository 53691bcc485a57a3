"""What vLLM's structured-output backends and its renderer need from ``TokTierTokenizer`` beyond encoding.

Structured outputs. vLLM hands the engine's tokenizer to xgrammar, guidance (llguidance) and outlines.
xgrammar's ``TokenizerInfo.from_huggingface`` (``xgrammar/tokenizer_info.py``) and llguidance's
``llguidance.hf.from_tokenizer`` accept a tokenizer only when ``isinstance(tok,
transformers.PreTrainedTokenizerFast)``; vLLM's ``GuidanceBackend.is_tokenizer_supported`` asks
``isinstance(tok, TokenizersBackend)`` (the same class in transformers 5). They then read the vocabulary and
``backend_tokenizer`` only, never our ids. :func:`presented_class` makes ``TokTierTokenizer.__class__`` (what
``isinstance`` consults after ``type()``) the wrapped HF tokenizer's class, and attribute reads fall through
to that tokenizer, so each backend builds its tables from the very tokenizer vLLM's ``hf`` mode would load;
``type(tok)`` stays ``TokTierTokenizer`` and every method we define (encoding) stays ours. Assigning
``__class__`` is refused quietly (:func:`assign_class`): vLLM's ``maybe_make_thread_pool`` would re-class an
HF tokenizer into a pool of deep copies, a guard for HF's Rust tokenizer that this class, which
serializes its own state, does not need.

Shared loads. vLLM copies the tokenizer when it builds a renderer (``copy.copy``), deep-copies it into
thread pools, and loads it again for structured outputs; without a cheap copy each of those is a full load
(AutoTokenizer, our tokenizer, guard tables). :func:`shared_load` keeps one loaded state per process, keyed by
the load arguments and the sha256 of the local ``tokenizer.json``, so every copy, deep copy and unpickling
(``__reduce__``) in a process reuses it.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any, Callable

_SHARED: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


def presented_class(tok: Any) -> type:
    """``tok.__class__`` as ``isinstance`` sees it: the wrapped HF tokenizer's class (e.g.
    ``Qwen2TokenizerFast``), or the real class while there is none yet."""
    hf = tok.__dict__.get("hf")
    return type(tok) if hf is None else type(hf)


def assign_class(tok: Any, value: type) -> None:
    """``tok.__class__ = value``: ignored (see the module docstring); the object keeps serving as itself."""


def load_key(path_or_repo_id: str | Path, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """Cache key of one load: the arguments, plus the sha256 of ``tokenizer.json`` when the path is a local
    folder or file (an edited file is a new key)."""
    p = Path(str(path_or_repo_id))
    f = p / "tokenizer.json" if p.is_dir() else p
    digest = hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None
    return (str(path_or_repo_id), repr(args), repr(sorted(kwargs.items())), digest)


def shared_load(key: tuple, load: Callable[[], Any]) -> Any:
    """``load()`` once per ``key`` in this process (thread-safe); later calls return the same object."""
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = load()
        return _SHARED[key]
