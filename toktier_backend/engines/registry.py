"""Engine registry: name -> (module, class), imported lazily (the vLLM tokenizer-registry pattern).

Missing optional packages fail at load (:class:`EngineUnavailable`), never per request.
"""

from __future__ import annotations

import importlib
import warnings

from toktier_backend.engines.protocol import Engine
from toktier_backend.errors import EngineUnavailable

_REGISTRY: dict[str, tuple[str, str]] = {
    "hf": ("toktier_backend.engines.hf", "HFEngine"),
    "gigatoken": ("toktier_backend.engines.gigatoken", "GigatokenEngine"),
    "fastokens": ("toktier_backend.engines.fastokens", "FastokensEngine"),
    "gpu": ("toktier_backend.gpu.engine", "GpuEngine"),  # extra [gpu]: numba kernels, full encode on a CUDA device
}

#: Fast engines tried in order when none is named. fastokens first: on agent text it was faster than
#: gigatoken on every file both load, at every size (2-core VM, ``bench/``, p50): 2K-char repair windows
#: 12-15 vs 19-24 us (gemma3 168 vs 1061 us), 128K chars 340-560 vs 440-700 us, 1M-char full encodes
#: 3.6-4.9 vs 4.1-5.8 ms, 4M chars chunked on two cores 10.9-12.3 vs 13.4-17.2 ms; and it agrees with HF on
#: every code point of those files (empty guard sets). One exception since: on one thread, on the SWE-agent
#: corpus text (non-ASCII here and there), gigatoken was faster for gpt2 (2M chars 6.70 vs 7.70 ms; a tie
#: for llama3_1, fastokens ahead for deepseek_v3 8.08 vs 10.28); fastokens stays first for every file: with
#: its helper thread off, its pieces on our pool beat gigatoken's one thread on gpt2 too (4M chars, p50:
#: 10.9 vs 13.7 ms, ``bench/README.md``). gigatoken serves the files fastokens
#: cannot load (cl100k_base, o200k_base). Both are canaried and guarded per file (``engines/admission.py``).
FAST_ENGINE_ORDER = ("fastokens", "gigatoken")


def register(name: str, module: str, cls: str) -> None:
    """Register an engine class under ``name`` (warns when overwriting)."""
    if name in _REGISTRY and _REGISTRY[name] != (module, cls):
        warnings.warn(f"engine {name!r} re-registered: {_REGISTRY[name]} -> {(module, cls)}", stacklevel=2)
    _REGISTRY[name] = (module, cls)


def names() -> list[str]:
    """Registered engine names, in registration order."""
    return list(_REGISTRY)


def create(name: str, path: str) -> Engine:
    """Instantiate engine ``name`` for the tokenizer file at ``path`` (an :class:`Engine`).

    Raises:
        EngineUnavailable: unknown name, package missing, or the engine cannot load the file.
    """
    try:
        module, cls = _REGISTRY[name]
    except KeyError:
        raise EngineUnavailable(f"unknown engine {name!r}; known: {sorted(_REGISTRY)}") from None
    try:
        return getattr(importlib.import_module(module), cls)(path)
    except EngineUnavailable:
        raise
    except ImportError as e:
        raise EngineUnavailable(f"engine {name!r} cannot be imported: {e}") from e
