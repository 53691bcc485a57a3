"""``toktier_*`` Prometheus metrics (``prometheus_client``, in the ``serve`` extra), next to Triton's own.

Triton's ``:8002`` serves ``nv_*`` metrics (requests, queue and compute time per model). These add what only
the serving core knows: routes, repairs, fallbacks, the shadow verifier, sessions and their memory.

**One port for all instances: multiprocess mode.** Each Python-backend model instance is its own process
(``toktier_session`` has two, ``toktier_encode`` one). Rather than one port per instance (which Prometheus
would have to discover, and which changes with ``instance_group``), every instance writes its samples to
memory-mapped files in ``$PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode) and one
exporter aggregates them on one port: ``toktier serve --toktier-metrics-port`` (default 8003) runs it in the
launching process; other deployments run ``toktier metrics --multiproc-dir DIR --port 8003`` beside
tritonserver (same ``PROMETHEUS_MULTIPROC_DIR`` in tritonserver's environment). Counters survive an
instance restart; gauges (``live*`` modes) drop the samples of instances that are gone. Without the
environment variable (PyTriton, TensorRT-LLM preprocessing outside Triton, vLLM, the proxy, tests, the
library) metrics go to the default in-process registry: vLLM's own ``/metrics`` shows them, the proxy
serves them with ``--metrics-port``.

Every metric carries ``face`` (who served the request: ``triton``, ``pytriton``, ``trtllm``, ``vllm``,
``proxy``, ``dynamo``; :data:`FACES`) and ``model`` (the Triton model or endpoint of that face:
``toktier_session``, ``toktier_encode``, ``preprocessing``, ``preprocessing_words``, ``tokenizer``,
``completions``, ``chat``). Together they are an :class:`Origin`.

=========================================  =========  ==========================================================
name                                       type       labels / meaning
=========================================  =========  ==========================================================
toktier_requests_total                     counter    model, route, mode (full | delta | encode | chat)
                                                      (every metric also has ``face``)
toktier_request_errors_total               counter    model, code (INVALID_ARG | NOT_FOUND | UNAVAILABLE | INTERNAL)
toktier_request_duration_seconds           histogram  model, route: handler time per request
toktier_repair_window_widenings            histogram  model: doublings of the repair window per repair
toktier_fallbacks_total                    counter    model, reason (guarded | engine_error | quarantined | no_cut | offset_check)
toktier_tokens_total                       counter    model, kind (reused | reencoded)
toktier_verifier_samples_total             counter    model, result (match | mismatch)
toktier_verifier_mismatches_total          counter    model, route
toktier_verifier_dropped_total             counter    model: samples dropped, queue full
toktier_verifier_queue_depth               gauge      model
toktier_quarantined_routes                 gauge      model, route: 1 while quarantined
toktier_sessions                           gauge      model: sessions held
toktier_session_memory_bytes               gauge      model: bytes charged for them (``Session.nbytes`` + overhead)
toktier_session_budget_bytes               gauge      model: the byte budget (summed over instances)
toktier_session_evictions_total            counter    model, cause (idle | budget | start | error)
toktier_prefix_index_bytes                 gauge      model: the cross-session prefix index (its own budget)
toktier_cpu_pool_queue_depth               gauge      model: tasks waiting in the shared CPU pool
toktier_cpu_pool_wait_seconds              gauge      model, priority, stat (mean | p50 | p99 | max): submission to start
toktier_encode_route_total                 counter    model, route: where a stateless encode's body ran (below)
toktier_gpu_engine_loads_total             counter    model, result (ok | off | unavailable | canary_failed): GPU
                                                      instances' engine at load
toktier_chat_renders_total                 counter    model, route (incremental | full), reason (``""`` for
                                                      incremental; below): chat requests' template renders
toktier_chat_template_quarantined          gauge      model: 1 while incremental rendering of the core's chat
                                                      template is quarantined (every chat request renders in full)
=========================================  =========  ==========================================================

Reasons of a ``full`` chat render (``ServingCore.chat``): ``quarantined`` (the shadow verifier caught an
incremental render of this template), ``no_session`` (no key and no held conversation: a short request is
rendered and encoded statelessly), ``busy`` (the conversation's session was in use), ``template`` (the
analysis refused the template, ``ChatSession`` route ``full:template: ...``), ``error <Type>`` (a piece
raised; the full render gives the request's answer), or the ``ChatSession`` fallback's own reason.

Routes of ``toktier_encode_route_total`` (``toktier_backend.gpu.routing``): ``gpu``; on a GPU instance, the
CPU because the text is under ``gpu_crossover_chars`` (``cpu_small``), the instance has no admitted GPU
engine (``cpu_no_gpu``), the GPU engine does not take the text (``cpu_not_accepted``: NFC files),
``gpu_max_queue`` requests already wait (``cpu_queue_full``), the GPU raised (``cpu_gpu_error``), the
``full`` route is quarantined (``cpu_quarantined``), or the whole text goes to the reference
(``cpu_reference``: non-constant post-processor); ``cpu_instance``: a CPU instance (no router).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from toktier_backend.tokenizer import FAST_ROUTES

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
DEFAULT_TOKTIER_METRICS_PORT = 8003

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WIDENING_BUCKETS = (0, 1, 2, 3, 4, 5, 6)

FACES = ("triton", "pytriton", "trtllm", "vllm", "proxy", "dynamo")
"""Values of the ``face`` label."""


@dataclasses.dataclass(frozen=True)
class Origin:
    """Who a request came through: the ``face`` and ``model`` labels of everything it records.

    Attributes:
        face: one of :data:`FACES`.
        model: the Triton model or endpoint of that face (``toktier_session``, ``preprocessing``, ...).
    """

    face: str
    model: str


_instance: "Metrics | None" = None
_UNWRITTEN = object()  # Metrics._set: no value written yet


def get_metrics() -> "Metrics | None":
    """The process-wide :class:`Metrics` on the default registry (created once), or ``None`` when
    ``prometheus_client`` is not installed (the handler then records nothing)."""
    global _instance
    if _instance is None:
        try:
            _instance = Metrics()
        except ImportError:
            log.warning("prometheus_client is not installed: no toktier_* metrics (pip install 'toktier_backend[serve]')")
            return None
    return _instance


class Metrics:
    """The ``toktier_*`` metric objects; every label set starts with ``face``, ``model`` (an :class:`Origin`).

    Args:
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global one; in multiprocess mode
            the values go to ``$PROMETHEUS_MULTIPROC_DIR`` regardless).
        pool_stats: a callable returning the CPU pool's ``stats()`` dict; overrides the ``pool`` the core
            passes to :meth:`set_state` (default: that pool, else the process-wide shared pool once created).
    """

    def __init__(self, registry: Any = None, *, pool_stats: Callable[[], dict | None] | None = None):
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = REGISTRY if registry is None else registry
        o = ["face", "model"]
        self.requests = Counter("toktier_requests", "Requests served, by route and mode.",
                                o + ["route", "mode"], registry=reg)
        self.errors = Counter("toktier_request_errors", "Requests answered with an error, by Triton error code.",
                              o + ["code"], registry=reg)
        self.latency = Histogram("toktier_request_duration_seconds", "Serving-core time per request, by route.",
                                 o + ["route"], buckets=LATENCY_BUCKETS, registry=reg)
        self.widenings = Histogram("toktier_repair_window_widenings",
                                   "Doublings of the repair window per repair (6 = no stable cut: full encode).",
                                   o, buckets=WIDENING_BUCKETS, registry=reg)
        self.fallbacks = Counter("toktier_fallbacks", "Requests the fast path handed to the reference or a full "
                                 "encode, by reason.", o + ["reason"], registry=reg)
        self.tokens = Counter("toktier_tokens", "Ids reused from the previous reply vs re-encoded.",
                              o + ["kind"], registry=reg)
        self.verifier_samples = Counter("toktier_verifier_samples", "Replies checked by the shadow verifier.",
                                        o + ["result"], registry=reg)
        self.verifier_mismatches = Counter("toktier_verifier_mismatches", "Shadow verifier mismatches, by route.",
                                           o + ["route"], registry=reg)
        self.verifier_dropped = Counter("toktier_verifier_dropped", "Samples dropped because the verifier queue "
                                        "was full.", o, registry=reg)
        self.verifier_queue = Gauge("toktier_verifier_queue_depth", "Samples waiting for the verifier.",
                                    o, registry=reg, multiprocess_mode="livesum")
        self.quarantined = Gauge("toktier_quarantined_routes", "1 while the route is quarantined (served by the "
                                 "reference).", o + ["route"], registry=reg, multiprocess_mode="livemax")
        self.sessions = Gauge("toktier_sessions", "Sessions held.", o, registry=reg,
                              multiprocess_mode="livesum")
        self.session_bytes = Gauge("toktier_session_memory_bytes", "Bytes charged for held sessions.", o,
                                   registry=reg, multiprocess_mode="livesum")
        self.session_budget = Gauge("toktier_session_budget_bytes", "Session byte budget (0: unbounded).",
                                    o, registry=reg, multiprocess_mode="livesum")
        self.evictions = Counter("toktier_session_evictions", "Sessions dropped other than by END, by cause.",
                                 o + ["cause"], registry=reg)
        self.prefix_index_bytes = Gauge("toktier_prefix_index_bytes", "Bytes held by the cross-session prefix "
                                        "index (bounded by its own budget).", o, registry=reg,
                                        multiprocess_mode="livesum")
        self.pool_queue = Gauge("toktier_cpu_pool_queue_depth", "Tasks waiting in the shared CPU pool.",
                                o, registry=reg, multiprocess_mode="livesum")
        self.pool_wait = Gauge("toktier_cpu_pool_wait_seconds", "CPU pool wait (submission to start).",
                               o + ["priority", "stat"], registry=reg, multiprocess_mode="livemax")
        self.encode_routes = Counter("toktier_encode_route", "Stateless encodes by where the body ran: gpu, or "
                                     "a cpu_* reason.", o + ["route"], registry=reg)
        self.gpu_engine_loads = Counter("toktier_gpu_engine_loads", "GPU model instances' engine at load: ok, "
                                        "off, unavailable, canary_failed.", o + ["result"], registry=reg)
        self.chat_renders = Counter("toktier_chat_renders", "Chat template renders, by route (incremental | full) "
                                    "and the reason of a full one.", o + ["route", "reason"], registry=reg)
        self.chat_quarantined = Gauge("toktier_chat_template_quarantined", "1 while incremental rendering of the "
                                      "chat template is quarantined.", o, registry=reg, multiprocess_mode="livemax")
        self._explicit_pool_stats = pool_stats is not None
        self.pool_stats = pool_stats or _shared_pool_stats
        self._pool_next = 0.0  # pool stats cost percentiles over a window: refreshed at most once a second
        self._children: dict[tuple, Any] = {}  # (id(metric), label values) -> child, see _child
        # set_state's gauges: the value this process last wrote to each child (see _set)
        self._written: dict[Any, float] = {}
        self._written_lock = threading.Lock()

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once per label tuple: ``labels`` validates the values and takes
        the metric's lock on every call, and a child never changes once created (nothing here removes one)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _set(self, child: Any, value: float) -> None:
        """``child.set(value)`` unless this process last wrote the same value to it: the exported value is
        then unchanged (in multiprocess mode it is this process's file, which only this process writes).
        set_state runs on request threads and the verifier's: check, write and remember under one lock, so
        the remembered value is always the one written last."""
        with self._written_lock:
            if self._written.get(child, _UNWRITTEN) != value:
                child.set(value)
                self._written[child] = value

    # ------------------------------------------------------------ recording

    def touch(self, origin: Origin, *, sessions: bool = False) -> None:
        """Export the counters a healthy server may never increment, at 0 (so alerts see the series);
        ``sessions``: also the eviction causes (an origin that holds sessions)."""
        f, m = origin.face, origin.model
        self.verifier_dropped.labels(f, m)
        self.verifier_samples.labels(f, m, "mismatch")
        if sessions:
            for cause in ("idle", "budget", "start", "error"):
                self.evictions.labels(f, m, cause)

    def observe_reply(self, origin: Origin, mode: str, route: str, seconds: float, repair: Any = None) -> None:
        """One successful request: route/mode count, latency, and what the repair did (``RepairInfo``)."""
        f, m = origin.face, origin.model
        self._child(self.requests, f, m, route, mode).inc()
        self._child(self.latency, f, m, route).observe(seconds)
        if repair is None:
            return
        if route in FAST_ROUTES and getattr(repair, "departure", 0) > 0:
            self._child(self.widenings, f, m).observe(int(repair.widenings))
        reason = getattr(repair, "fallback", "")
        if reason:
            self._child(self.fallbacks, f, m, reason).inc()
        if repair.reused:
            self._child(self.tokens, f, m, "reused").inc(int(repair.reused))
        if repair.reencoded:
            self._child(self.tokens, f, m, "reencoded").inc(int(repair.reencoded))

    def observe_encode_route(self, origin: Origin, route: str) -> None:
        """One stateless encode served on ``route`` (``gpu`` or a ``cpu_*`` reason; see the module docstring)."""
        self.encode_routes.labels(origin.face, origin.model, route).inc()

    def observe_gpu_engine(self, origin: Origin, result: str) -> None:
        """A GPU instance's engine at load: ``ok``, ``off``, ``unavailable`` or ``canary_failed``. Exports the
        GPU fallback routes at 0 so that alerts see the series."""
        f, m = origin.face, origin.model
        self.gpu_engine_loads.labels(f, m, result).inc()
        for route in ("gpu", "cpu_no_gpu", "cpu_gpu_error", "cpu_queue_full"):
            self.encode_routes.labels(f, m, route)

    def observe_chat_render(self, origin: Origin, route: str) -> None:
        """One chat render; ``route`` is ``ChatRender.route`` (``incremental`` or ``full:<reason>``). The reason
        label keeps the text before its first ``:`` (``full:template: <why>`` -> ``template``), at most 64
        chars: a bounded set per template."""
        kind, _, reason = route.partition(":")
        reason = reason.split(":", 1)[0].strip()[:64]
        self._child(self.chat_renders, origin.face, origin.model, kind, reason).inc()

    def set_chat_quarantined(self, origin: Origin, quarantined: bool) -> None:
        self._child(self.chat_quarantined, origin.face, origin.model).set(1 if quarantined else 0)

    def observe_error(self, origin: Origin, code: str) -> None:
        self.errors.labels(origin.face, origin.model, code).inc()

    def observe_eviction(self, origin: Origin, cause: str) -> None:
        self.evictions.labels(origin.face, origin.model, cause).inc()

    def observe_sample(self, origin: Origin, route: str, ok: bool) -> None:
        f, m = origin.face, origin.model
        self.verifier_samples.labels(f, m, "match" if ok else "mismatch").inc()
        if not ok:
            self.verifier_mismatches.labels(f, m, route).inc()

    def set_state(self, origin: Origin, *, store: Any = None, verifier: Any = None, tokenizer: Any = None,
                  dropped_delta: int = 0, pool: Any = None) -> None:
        """Refresh the gauges from the live objects (O(1) each; the CPU pool's at most once a second, from
        ``pool.stats()`` when given, else the ``pool_stats`` callable)."""
        f, m = origin.face, origin.model
        if store is not None:
            self._set(self._child(self.sessions, f, m), len(store))
            self._set(self._child(self.session_bytes, f, m), store.nbytes)
            self._set(self._child(self.session_budget, f, m), store.max_bytes or 0)
        if verifier is not None:
            self._set(self._child(self.verifier_queue, f, m), verifier.queue_depth)
        if dropped_delta:
            self._child(self.verifier_dropped, f, m).inc(dropped_delta)
        if tokenizer is not None:
            q = getattr(tokenizer, "quarantined", {})
            for route in FAST_ROUTES:
                self._set(self._child(self.quarantined, f, m, route), 1 if route in q else 0)
            idx = getattr(tokenizer, "prefix_index", None)
            if idx is not None:
                self._set(self._child(self.prefix_index_bytes, f, m), getattr(idx, "nbytes", 0))
        self._set_pool(origin, pool)

    def _set_pool(self, origin: Origin, pool: Any = None) -> None:
        import time

        now = time.monotonic()
        if now < self._pool_next:
            return
        self._pool_next = now + 1.0
        try:
            if not self._explicit_pool_stats and pool is not None and hasattr(pool, "stats"):
                stats = pool.stats()
            else:
                stats = self.pool_stats()
        except Exception:  # a metrics source must never fail a request
            return
        if not stats:
            return
        f, m = origin.face, origin.model
        self.pool_queue.labels(f, m).set(stats.get("queue_depth", 0))
        for prio, st in (stats.get("by_priority") or {}).items():
            for stat in ("mean", "p50", "p99", "max"):
                v = st.get(f"wait_ms_{stat}")
                if v is not None:
                    self.pool_wait.labels(f, m, prio, stat).set(v / 1e3)


def _shared_pool_stats() -> dict | None:
    """``toktier_backend.runtime.pool``'s shared pool ``stats()`` once that module has created it; else None
    (this never creates a pool)."""
    mod = sys.modules.get("toktier_backend.runtime.pool")
    pool = mod.shared_pool_if_started() if mod is not None else None
    return pool.stats() if pool is not None else None


# ---------------------------------------------------------------- reading (tests, soak, dashboards)


def scrape(url: str, timeout_s: float = 10.0) -> dict[tuple[str, frozenset], float]:
    """A Prometheus text endpoint as ``{(sample name, frozenset(label items)): value}``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


# ---------------------------------------------------------------- the exporter


_DB = re.compile(r"^(?:gauge_live\w+|gauge_\w+|counter|histogram|summary)_(\d+)\.db$")


def _mark_dead_processes(path: Path) -> None:
    """``mark_process_dead`` for every pid with files in ``path`` that no longer runs (its ``live*``
    gauges then vanish from the aggregate; counters stay)."""
    from prometheus_client import multiprocess

    pids = set()
    for f in path.glob("gauge_live*.db"):
        m = _DB.match(f.name)
        if m:
            pids.add(int(m.group(1)))
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, str(path))
        except PermissionError:
            pass


class _LiveMultiProcessCollector:
    def __init__(self, path: Path):
        from prometheus_client import multiprocess

        self.path = path
        self._inner = multiprocess.MultiProcessCollector(None, path=str(path))

    def collect(self):
        _mark_dead_processes(self.path)
        return self._inner.collect()


def multiprocess_registry(path: str | os.PathLike):
    """A registry that aggregates the multiprocess files in ``path`` (dead instances' gauges removed)."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    reg.register(_LiveMultiProcessCollector(Path(path)))
    return reg


def start_exporter(port: int, host: str = "127.0.0.1", *, multiproc_dir: str | os.PathLike | None = None):
    """Serve ``/metrics`` on ``host:port`` in a daemon thread: the multiprocess aggregate of
    ``multiproc_dir``, or the default registry. Returns ``(server, thread)``; ``server.shutdown()`` stops it.
    """
    from prometheus_client import REGISTRY, start_http_server

    reg = multiprocess_registry(multiproc_dir) if multiproc_dir else REGISTRY
    return start_http_server(port, addr=host, registry=reg)


def main(argv: list[str] | None = None) -> int:
    """``toktier metrics``: the aggregating exporter for a tritonserver started by other means."""
    import argparse

    from toktier_backend.config import stop_on_signals

    ap = argparse.ArgumentParser(prog="toktier metrics", description=main.__doc__)
    ap.add_argument("--multiproc-dir", default=os.environ.get(MULTIPROC_ENV),
                    help=f"the {MULTIPROC_ENV} of the tritonserver's instances")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=DEFAULT_TOKTIER_METRICS_PORT)
    args = ap.parse_args(argv)
    if not args.multiproc_dir:
        ap.error(f"--multiproc-dir (or {MULTIPROC_ENV}) is required")
    with stop_on_signals() as stop:
        server, _ = start_exporter(args.port, args.host, multiproc_dir=args.multiproc_dir)
        print(f"toktier metrics: http://{args.host}:{args.port}/metrics ({args.multiproc_dir})", flush=True)
        stop.wait()
        server.shutdown()
    return 0


__all__ = ["DEFAULT_TOKTIER_METRICS_PORT", "FACES", "MULTIPROC_ENV", "Metrics", "Origin", "get_metrics", "metric",
           "multiprocess_registry", "scrape", "start_exporter"]
