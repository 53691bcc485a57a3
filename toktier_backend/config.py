"""Small helpers every part of the package shares, one copy each: where caches and state live, how a
config string becomes a bool, the special tokens of ``tokenizer_config.json``, a stop event for SIGTERM /
SIGINT, and the environment the Triton Python backend stub needs.

Pure standard library (imports nothing of the package but :mod:`toktier_backend.errors`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from toktier_backend.errors import UnsupportedTokenizer

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
"""The folder that holds ``toktier_backend`` (put first on the Python stub's ``PYTHONPATH``)."""

#: Tokenizer specs that name the bundled GPT-2 file (``toktier serve --tokenizer default``, the models'
#: ``tokenizer`` parameter): :func:`toktier_backend.tokenizer.tokenizer_path`.
DEFAULT_SPECS = frozenset({"", "default"})


# ---------------------------------------------------------------- cache and state folders


def cache_dir() -> Path:
    """``$TOKTIER_CACHE_DIR``, else ``~/.cache/toktier_backend``: derived files that can be rebuilt (guard
    tables, GPU class tables, HF backend serializations)."""
    return Path(os.environ.get("TOKTIER_CACHE_DIR") or Path.home() / ".cache" / "toktier_backend")


def state_dir() -> Path:
    """``$TOKTIER_STATE_DIR``, else :func:`cache_dir`: state an operator acts on (the quarantine file)."""
    return Path(os.environ.get("TOKTIER_STATE_DIR") or cache_dir())


def default_quarantine_file() -> Path:
    """``state_dir() / "quarantine.json"``: the shadow verifier's quarantine, shared by every model instance
    and restart (``toktier quarantine list|clear``)."""
    return state_dir() / "quarantine.json"


# ---------------------------------------------------------------- config values

_TRUE = ("true", "1", "t", "y", "yes", "on")
_FALSE = ("false", "0", "f", "n", "no", "off")


def parse_bool(value: Any, default: bool, *, name: str = "value") -> bool:
    """A config or request value as a bool.

    Rule (one for every face): ``bool`` as is; ``0``/``1``; strings, case-insensitive, ``true 1 t y yes on``
    or ``false 0 f n no off`` (TensorRT-LLM's ``add_special_tokens`` words, plus on/off). Unset (``None``),
    empty, or an unfilled template (``"${add_special_tokens}"``, as ``fill_template.py`` leaves it) give
    ``default``.

    Raises:
        ValueError: anything else (names ``name`` and the value): a typo never silently flips a flag.
    """
    if value is None or isinstance(value, bool):
        return default if value is None else value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    v = str(value).strip().lower()
    if v == "" or v.startswith("${"):
        return default
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use one of {list(_TRUE)} or {list(_FALSE)}")


# ---------------------------------------------------------------- tokenizer_config.json

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def special_tokens(tokenizer_path: str | Path | None) -> dict[str, str]:
    """Special token strings (``bos_token``, ``eos_token``, ... of :data:`SPECIAL_TOKEN_NAMES`) from the
    ``tokenizer_config.json`` beside a tokenizer (HF layout); a value is a string or ``{"content": str}``.

    Args:
        tokenizer_path: the ``tokenizer.json`` or its folder; ``None``: no folder.

    Returns:
        ``{name: token}`` for the names it sets to a string; ``{}`` when there is no file.

    Raises:
        UnsupportedTokenizer: the file exists but is not readable JSON holding an object (names the file):
            a model whose eos token cannot be read must not be served with a guessed one.
    """
    if tokenizer_path is None:
        return {}
    p = Path(tokenizer_path)
    cfg = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
    if not cfg.is_file():
        return {}
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnsupportedTokenizer(f"{cfg}: not readable JSON ({e}); fix or remove it") from e
    if not isinstance(data, dict):
        raise UnsupportedTokenizer(f"{cfg}: expected a JSON object, got {type(data).__name__}")
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        v = data.get(name)
        if isinstance(v, Mapping):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


# ---------------------------------------------------------------- processes


@contextlib.contextmanager
def stop_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[threading.Event]:
    """An ``Event`` set by any of ``signals`` while the block runs; the previous handlers come back after it
    (``toktier serve``, ``toktier fleet`` and ``toktier proxy`` run until it is set). Main thread only
    (``signal.signal``'s rule)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in signals}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stub_environment(libs: Sequence[Path | str] = (), base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for ``tritonserver`` and its Python backend stubs (ours, and PyTriton's).

    ``LD_LIBRARY_PATH`` gets this interpreter's ``LIBDIR`` first (the stub links ``libpython3.X.so``; a
    system libpython of the same version would otherwise be picked up), then ``libs``, then what it held;
    ``PYTHONPATH`` gets :data:`PACKAGE_ROOT` first; ``PATH`` gets this interpreter's folder first (an entry
    already present further on moves to the front: no duplicates).

    Args:
        libs: more library folders (``nvidia_pytriton.libs``).
        base: the environment to extend (default ``os.environ``); not changed.
    """
    env = dict(os.environ if base is None else base)

    def prepend(key: str, first: Sequence[str]) -> None:
        new = list(dict.fromkeys(p for p in first if p))
        rest = [p for p in env.get(key, "").split(os.pathsep) if p and p not in new]
        env[key] = os.pathsep.join(new + rest)

    prepend("LD_LIBRARY_PATH", [sysconfig.get_config_var("LIBDIR") or "", *map(str, libs)])
    prepend("PYTHONPATH", [str(PACKAGE_ROOT)])
    prepend("PATH", [str(Path(sys.executable).parent)])
    return env


__all__ = ["PACKAGE_ROOT", "SPECIAL_TOKEN_NAMES", "cache_dir", "default_quarantine_file", "parse_bool",
           "special_tokens", "state_dir", "stop_on_signals", "stub_environment"]
