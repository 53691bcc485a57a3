"""Route full encodes between the GPU engine and the CPU engine.

A fresh request (no session to repair: a full encode) goes to the GPU when its text is at least the
measured crossover size and the GPU engine accepts it; everything else takes the CPU engine:

* smaller than ``crossover_chars`` (launch + transfer latency beats the CPU only above it);
* no GPU engine (no device, unsupported family: ``GpuEngine`` raised ``EngineUnavailable`` at load);
* the GPU engine does not accept the text (NFC files: NFC is not the identity);
* the GPU queue is full (backpressure: at most ``max_queue`` requests wait for the device);
* the GPU raised (the request is retried on the CPU; the error is logged and counted).

Every route is counted in :attr:`GpuRouter.counts` (never silent), and :meth:`GpuRouter.encode` returns
the route with the ids. Both engines are exact, so the route never changes the ids.

Hook (not wired here): in ``model_repository/toktier_encode`` the GPU instance group holds one
``GpuRouter(cpu_engine=<admitted fast engine>, gpu_engine=GpuEngine(path))`` per model instance and
calls :meth:`GpuRouter.encode` where the handler now calls the CPU engine's full encode; the CPU
instances keep the CPU engine alone and take the overflow.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import numpy as np

log = logging.getLogger(__name__)

#: Default crossover in chars until one is measured on the device (``measure_crossover``, or
#: ``bench/gpu.py``): an unmeasured guess, deliberately high so a misconfigured router errs to the CPU.
DEFAULT_CROSSOVER_CHARS = 64 * 1024


class GpuRouter:
    """Size-based router with backpressure and CPU fallback.

    Args:
        cpu_engine: any ``Engine`` (the admitted fast engine or the HF reference); always available.
        gpu_engine: a ``GpuEngine``, or ``None`` (then every request is routed to the CPU).
        crossover_chars: requests with at least this many chars go to the GPU.
        max_queue: requests allowed to wait for the device besides the one running; more go to the CPU.
    """

    def __init__(self, cpu_engine, gpu_engine=None, *, crossover_chars: int = DEFAULT_CROSSOVER_CHARS,
                 max_queue: int = 4):
        self.cpu = cpu_engine
        self.gpu = gpu_engine
        self.crossover_chars = int(crossover_chars)
        self.max_queue = int(max_queue)
        self._slots = threading.BoundedSemaphore(max_queue + 1)
        self._device = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.last_error: str = ""

    def route(self, text: str) -> str:
        """The route a request would take if the queue had room: ``"gpu"`` or a ``"cpu_*"`` reason."""
        if self.gpu is None:
            return "cpu_no_gpu"
        if len(text) < self.crossover_chars:
            return "cpu_small"
        if not self.gpu.accepts(text):
            return "cpu_not_accepted"
        return "gpu"

    def encode(self, text: str) -> tuple[np.ndarray, str]:
        """Body ids of ``text`` (``int32[n]``, equal to HF ``encode(text, add_special_tokens=False).ids``)
        and the route taken: ``"gpu"``, ``"cpu_small"``, ``"cpu_no_gpu"``, ``"cpu_not_accepted"``,
        ``"cpu_queue_full"`` or ``"cpu_gpu_error"``."""
        route = self.route(text)
        if route == "gpu":
            if not self._slots.acquire(blocking=False):
                route = "cpu_queue_full"
            else:
                try:
                    with self._device:
                        ids = self.gpu.encode(text)
                    self.counts["gpu"] += 1
                    return ids, "gpu"
                except Exception as e:  # any device failure: this request goes to the CPU, counted
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.warning("GPU encode failed (%s); request served by the CPU engine", self.last_error)
                    route = "cpu_gpu_error"
                finally:
                    self._slots.release()
        self.counts[route] += 1
        return self.cpu.encode(text), route


def measure_crossover(cpu_engine, gpu_engine, texts_by_size: dict[int, str], *, repeats: int = 5) -> int:
    """Smallest size (chars) from ``texts_by_size`` at and above which the GPU engine's median encode
    time beats the CPU engine's; ``max(sizes) + 1`` when it never does. Checks ids are equal first.

    Args:
        texts_by_size: ``{n_chars: text}``, e.g. ``corpus.long_session_text(n)`` for a ladder of ``n``.
    """
    def median_time(engine, text):
        engine.encode(text)  # warm-up (and graph capture)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.encode(text)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    sizes = sorted(texts_by_size)
    wins = {}
    for n in sizes:
        text = texts_by_size[n]
        if gpu_engine.encode(text).tolist() != cpu_engine.encode(text).tolist():
            raise AssertionError(f"GPU and CPU engines disagree on a {n}-char text; refusing to route")
        wins[n] = median_time(gpu_engine, text) < median_time(cpu_engine, text)
    for k, n in enumerate(sizes):
        if all(wins[m] for m in sizes[k:]):
            return n
    return sizes[-1] + 1 if sizes else DEFAULT_CROSSOVER_CHARS
