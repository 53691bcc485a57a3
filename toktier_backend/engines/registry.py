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

#: Fast engines tried in order when none is named: the first that loads the file and passes its canary
#: serves it. fastokens first; gigatoken serves the files fastokens cannot load (cl100k_base, o200k_base).
#: Both are canaried and guarded per file (``engines/admission.py``). Why this order:
#: ``docs/design/engines.md``.
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
