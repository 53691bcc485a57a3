"""GPU full-encode path: parallel pre-tokenization and BPE merges (numba.cuda), exact against HF.

Optional extra ``[gpu]`` (numba, cupy-cuda12x). Importing this package imports neither: the NumPy half
(:mod:`.predicates`, :mod:`.tables`, :mod:`.unicode_tables`, :mod:`.routing`) needs only NumPy and
``tokenizers``; :class:`GpuEngine` (and the kernels) load numba on first use.

* :mod:`.predicates` — per-family pre-token boundary predicates in NumPy (the proofs live there).
* :mod:`.tables` — tokenizer tables for the device and :func:`.tables.encode_numpy`, the CPU twin.
* :mod:`.kernels`, :mod:`.merges`, :mod:`._warp` — the numba.cuda kernels.
* :mod:`.engine` — :class:`GpuEngine` (``Engine`` protocol, registry name ``"gpu"``).
* :mod:`.routing` — :class:`GpuRouter`: size crossover, backpressure, CPU fallback.
"""

from __future__ import annotations

__all__ = ["GpuEngine", "GpuRouter"]


def __getattr__(name: str):
    if name == "GpuEngine":
        from toktier_backend.gpu.engine import GpuEngine

        return GpuEngine
    if name == "GpuRouter":
        from toktier_backend.gpu.routing import GpuRouter

        return GpuRouter
    raise AttributeError(name)
