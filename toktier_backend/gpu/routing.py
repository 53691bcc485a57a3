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

Batches (:meth:`GpuRouter.encode_many`, one Triton ``execute()``): each request is routed as above; those
routed to the GPU that get a queue slot share one ``GpuEngine.encode_batch`` call (each text its own
segment; the engine packs them into one launch sequence of one size class, or more only when their total
exceeds its ``max_bytes``), and the result is split per request. The requests routed to the CPU are
encoded on the calling thread while the device pass runs on the router's launch thread. A request that
cannot be encoded (a lone surrogate, a CPU engine error) gets its own exception; the others their exact
ids. When the device pass raises, its requests are retried one by one on the CPU (``cpu_gpu_error``).

Wiring (``model_repository/toktier_encode``): each model instance of kind GPU (``instance_group [ { kind:
KIND_GPU ... } ]``) builds its router with :func:`gpu_router_for` at load: ``GpuEngine(path)`` on the
instance's device, admitted only if it passes the same load-time canary as the CPU fast engines
(:func:`toktier_backend.engines.admission.run_canary`), and ``cpu_engine`` = :class:`FreshCpuEngine`, the
tokenizer's own fresh-text encode (prefix index, chunked encode, guard set, quarantine). The handler
(``faces/triton.py``) sends the body of every stateless encode through :meth:`GpuRouter.encode`; the
post-processor and validation are unchanged. A GPU instance whose engine cannot load or fails the canary
keeps a router without a GPU engine (every request ``cpu_no_gpu``) and never fails the model load. CPU
instances have no router and take the overflow: Triton's scheduler hands a request to whichever instance is
free. Routes are exported as ``toktier_encode_route_total`` (``serving/metrics.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Sequence

import numpy as np

from toktier_backend.engines.protocol import DeviceEngine, Engine

if TYPE_CHECKING:  # pragma: no cover
    from toktier_backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Default crossover in chars until one is measured on the device (``measure_crossover``, or
#: ``bench/gpu.py``): an unmeasured guess, deliberately high so a misconfigured router errs to the CPU.
DEFAULT_CROSSOVER_CHARS = 64 * 1024


class GpuRouter:
    """Size-based router with backpressure and CPU fallback.

    Args:
        cpu_engine: any :class:`~toktier_backend.engines.protocol.Engine` (in serving, :class:`FreshCpuEngine`: the tokenizer's own fresh-text
            encode; or the admitted fast engine, or the HF reference); always available.
        gpu_engine: a :class:`~toktier_backend.engines.protocol.DeviceEngine` (``GpuEngine``), or ``None`` (then every
            request is routed to the CPU).
        crossover_chars: requests with at least this many chars go to the GPU.
        max_queue: requests allowed to wait for the device besides the one running; more go to the CPU.
    """

    def __init__(self, cpu_engine: Engine, gpu_engine: DeviceEngine | None = None, *, crossover_chars: int = DEFAULT_CROSSOVER_CHARS,
                 max_queue: int = 4):
        self.cpu = cpu_engine
        self.gpu = gpu_engine
        self.crossover_chars = int(crossover_chars)
        self.max_queue = int(max_queue)
        self._slots = threading.BoundedSemaphore(max_queue + 1)
        self._device = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.last_error: str = ""
        #: How the GPU engine was obtained (set by :func:`gpu_router_for`): ``"ok"``, ``"unavailable"``
        #: (no CUDA device, no numba, unsupported family), ``"canary_failed"``; ``gpu_reason`` says why.
        self.gpu_status = "ok" if gpu_engine is not None else "unavailable"
        self.gpu_reason = ""
        self._launcher: ThreadPoolExecutor | None = None
        self._launcher_lock = threading.Lock()
        self._batch = threading.local()  # results of encode_many served by encode (see batch())

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
        ``"cpu_queue_full"`` or ``"cpu_gpu_error"``.

        Inside :meth:`batch` on this thread, a text of that batch (the same ``str`` object) gets its result
        from the batch's one pass (its exception, if it had one, is raised here)."""
        held = getattr(self._batch, "results", None)
        if held is not None:
            hit = held.get(id(text))
            if hit is not None and hit[0] is text:
                result = hit[1]
                if isinstance(result, BaseException):
                    raise result
                return result
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

    def encode_many(self, texts: list[str]) -> list[tuple[np.ndarray, str] | Exception]:
        """:meth:`encode` for each text of one batch, the GPU share in one device pass.

        Args:
            texts: the requests' texts (``str``), e.g. the stateless encodes of one Triton ``execute()``.

        Returns:
            per text, in order: ``(ids, route)`` as :meth:`encode` returns it (``int32[n]`` body ids, equal
            to HF ``encode(text, add_special_tokens=False).ids``), or the exception that text raised
            (``InvalidRequest`` for a lone surrogate, whatever the CPU engine raised); never raises for
            one text. Requests routed to the GPU take one queue slot each (``max_queue`` + 1 in all,
            shared with concurrent :meth:`encode` calls); those that find none take the CPU
            (``cpu_queue_full``). A returned array is never written again.
        """
        out: list = [None] * len(texts)
        gpu_k: list[int] = []
        cpu_k: list[tuple[int, str]] = []
        for k, text in enumerate(texts):
            if self.gpu is not None and len(text) >= self.crossover_chars:
                bad = _lone_surrogate(text)  # before accepts(): its NFC check cannot take one either
                if bad is not None:
                    out[k] = bad
                    continue
            route = self.route(text)
            if route == "gpu":
                if self._slots.acquire(blocking=False):
                    gpu_k.append(k)
                    continue
                route = "cpu_queue_full"
            cpu_k.append((k, route))
        pending = None
        if gpu_k:
            batch = [texts[k] for k in gpu_k]
            if cpu_k:  # overlap: the device pass on the launch thread, the CPU share here
                pending = self._launch_thread().submit(self._device_pass, batch)
            else:
                pending = _Done(self._device_pass(batch))
        for k, route in cpu_k:
            out[k] = self._cpu_one(texts[k], route)
        if pending is not None:
            ids_list, error = pending.result()
            if error is None:
                self.counts["gpu"] += len(gpu_k)
                for k, ids in zip(gpu_k, ids_list):
                    out[k] = (ids, "gpu")
            else:
                for k in gpu_k:
                    out[k] = self._cpu_one(texts[k], "cpu_gpu_error")
        return out

    @contextmanager
    def batch(self, texts: list[str]):
        """Encode ``texts`` with :meth:`encode_many` now; within the block, :meth:`encode` on this thread
        returns each one's result (looked up by object identity) instead of encoding it again. A face
        that encodes request by request (validation, post-processor, metrics per request) thus sends a
        whole batch to the device in one pass. Yields the list :meth:`encode_many` returned."""
        results = self.encode_many(texts)
        previous = getattr(self._batch, "results", None)
        self._batch.results = {id(t): (t, r) for t, r in zip(texts, results)}
        try:
            yield results
        finally:
            self._batch.results = previous

    def close(self) -> None:
        """Stop the launch thread (if one was started)."""
        with self._launcher_lock:
            if self._launcher is not None:
                self._launcher.shutdown(wait=True)
                self._launcher = None

    # ------------------------------------------------------------------------------ internals
    def _launch_thread(self) -> ThreadPoolExecutor:
        with self._launcher_lock:
            if self._launcher is None:
                self._launcher = ThreadPoolExecutor(1, thread_name_prefix="toktier-gpu-launch")
            return self._launcher

    def _device_pass(self, batch: list[str]) -> tuple[list[np.ndarray] | None, str | None]:
        """One ``encode_batch`` under the device lock; releases the batch's queue slots. Returns the ids
        per text, or ``(None, error)`` when the engine raised (logged and kept in ``last_error``)."""
        try:
            with self._device:
                got = self.gpu.encode_batch(batch)
            if len(got) != len(batch):
                raise RuntimeError(f"encode_batch returned {len(got)} results for {len(batch)} texts")
            return got, None
        except Exception as e:  # any device failure: these requests go to the CPU, counted
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("GPU batch encode of %d texts failed (%s); served by the CPU engine", len(batch),
                        self.last_error)
            return None, self.last_error
        finally:
            for _ in batch:
                self._slots.release()

    def _cpu_one(self, text: str, route: str) -> tuple[np.ndarray, str] | Exception:
        self.counts[route] += 1
        try:
            return self.cpu.encode(text), route
        except Exception as e:  # this request's own error (e.g. InvalidRequest); the batch goes on
            return e


class _Done:
    """A finished result with ``Future.result()``'s shape."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _lone_surrogate(text: str):
    """``InvalidRequest`` naming the first lone surrogate of ``text`` (UTF-8 cannot encode it), else ``None``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        from toktier_backend.errors import InvalidRequest

        return InvalidRequest(f"TEXT holds a lone surrogate {text[e.start:e.end]!r} at char {e.start}, which UTF-8 "
                              f"cannot encode. Send valid Unicode text.")
    return None


class FreshCpuEngine:
    """A tokenizer's CPU encode of a fresh text as an ``Engine``: what a CPU model instance runs.

    ``encode(text)`` is ``tokenizer.encode_fresh(text)[0]``: body ids ``int32[n]`` (no post-processor),
    equal to HF ``encode(text, add_special_tokens=False).ids``, through the prefix index, the chunked encode
    on the CPU pool, the admitted fast engine outside its guard set, and the reference under quarantine.
    """

    name = "cpu"
    #: (the tokenizer chunks long texts on its own pool; callers need not)
    releases_gil = False
    accepts_utf8 = False

    def __init__(self, tokenizer: "Tokenizer"):
        self.tokenizer = tokenizer

    @property
    def version(self) -> str:
        """The tokenizer's admitted engine's version."""
        return self.tokenizer.engine.version

    def encode(self, text: str) -> np.ndarray:
        return self.tokenizer.encode_fresh(text)[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def reserve(self, n: int) -> None:
        """Nothing to load here (the tokenizer's chunked encoder reserves for its pool)."""


class _OnDevice:
    """A ``GpuEngine`` whose calls run with CUDA device ``device_id`` current. numba keeps the current
    context per thread; a request thread other than the one that loaded the engine would get device 0."""

    name = "gpu"
    releases_gil = False
    accepts_utf8 = False

    def __init__(self, engine: DeviceEngine, device_id: int):
        from numba import cuda

        self.engine, self.device_id, self._gpus = engine, device_id, cuda.gpus
        self.version = engine.version

    def accepts(self, text: str) -> bool:
        return self.engine.accepts(text)

    def encode(self, text: str) -> np.ndarray:
        with self._gpus[self.device_id]:
            return self.engine.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        with self._gpus[self.device_id]:
            return self.engine.encode_batch(texts)

    def reserve(self, n: int) -> None:
        """Nothing to load: the router serializes device calls."""


def _new_gpu_engine(path: str, device_id: int):
    """``GpuEngine(path)`` built on CUDA device ``device_id``, wrapped so every call runs on it.

    Raises:
        ImportError: numba (the ``[gpu]`` extra) is missing.
        EngineUnavailable: no CUDA device, no device ``device_id``, or the file's family is not supported.
    """
    from numba import cuda

    from toktier_backend.errors import EngineUnavailable
    from toktier_backend.gpu import _warp
    from toktier_backend.gpu.engine import GpuEngine

    if not _warp.SIM and not cuda.is_available():
        raise EngineUnavailable("engine 'gpu': no CUDA device is available (numba.cuda.is_available() is False)")
    if not 0 <= device_id < len(cuda.gpus):
        raise EngineUnavailable(f"engine 'gpu': no CUDA device {device_id} (this process sees {len(cuda.gpus)})")
    with cuda.gpus[device_id]:
        return _OnDevice(GpuEngine(path), device_id)


def gpu_router_for(tokenizer: "Tokenizer", *, device_id: int = 0, crossover_chars: int = DEFAULT_CROSSOVER_CHARS,
                   max_queue: int = 4, engine_factory=None) -> GpuRouter:
    """The router of a GPU model instance: ``GpuEngine`` on ``device_id``, admitted by the canary.

    Args:
        tokenizer: the instance's core ``Tokenizer``; its fresh-text encode is the CPU engine.
        device_id: the CUDA device (Triton's ``model_instance_device_id``).
        crossover_chars, max_queue: as :class:`GpuRouter`.
        engine_factory: ``(path, device_id) -> engine`` (default: ``GpuEngine`` on that device).

    Returns:
        a :class:`GpuRouter`. Never raises for the GPU engine: when it cannot be built (``ImportError``,
        ``EngineUnavailable``, a CUDA error) or disagrees with the HF reference on the canary
        (``admission.run_canary``, the check every fast engine passes at load), the router has no GPU
        engine (``gpu_status`` ``"unavailable"`` / ``"canary_failed"``, ``gpu_reason``; one log line) and
        every request takes the CPU engine, counted as ``cpu_no_gpu``.
    """
    from toktier_backend.engines.admission import run_canary

    cpu = FreshCpuEngine(tokenizer)
    factory = engine_factory or _new_gpu_engine
    path = str(tokenizer.spec.path)

    def cpu_only(status: str, what: str, reason: str, level: int) -> GpuRouter:
        router = GpuRouter(cpu, None, crossover_chars=crossover_chars, max_queue=max_queue)
        router.gpu_status, router.gpu_reason = status, reason
        log.log(level, "GPU engine %s on device %d for %s (%s); this instance serves from the CPU engine",
                what, device_id, path, reason)
        return router

    try:
        gpu = factory(path, device_id)
    except Exception as e:  # no device, no numba, unsupported family, CUDA error: never fail the model load
        return cpu_only("unavailable", "unavailable", f"{type(e).__name__}: {e}", logging.WARNING)
    reason = run_canary(tokenizer.spec, gpu)
    if reason:
        return cpu_only("canary_failed", "refused by the canary", reason, logging.ERROR)
    log.info("GPU engine admitted on device %d for %s (canary passed; crossover %d chars, queue %d)",
             device_id, path, crossover_chars, max_queue)
    return GpuRouter(cpu, gpu, crossover_chars=crossover_chars, max_queue=max_queue)


def measure_crossover(cpu_engine: Engine, gpu_engine: Engine, texts_by_size: dict[int, str], *, repeats: int = 5) -> int:
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
