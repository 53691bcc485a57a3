"""The one request handler behind both serving faces: the Triton Python backend models and PyTriton.

Pure Python and numpy: no Triton import. ``model_repository/*/1/model.py`` and
:mod:`toktier_backend.faces.pytriton` turn tensors into one :class:`Handler` call and the returned dict
back into tensors.

Sessions live in a :class:`SessionStore`, keyed by the Triton **correlation ID** (an ``int`` or a ``str``, as
``request.correlation_id()`` returns it; ``17`` and ``"17"`` are different sessions, as they are for the
sequence batcher). START replaces whatever the key held, END frees it after the reply, and a session idle
for longer than the store's TTL is dropped; the TTL is set from the sequence batcher's
``max_sequence_idle_microseconds`` so that the store forgets a session when Triton does. The store also
holds a byte budget (LRU eviction): see :mod:`toktier_backend.serving.session_store`.

Each reply may be sampled by the shadow verifier (:mod:`toktier_backend.serving.verifier`) and every request
is counted in the ``toktier_*`` metrics (:mod:`toktier_backend.serving.metrics`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping

import numpy as np

import toktier_backend as tt
from toktier_backend.pipeline.chunked import MIN_CHARS as CHUNKED_MIN_CHARS
from toktier_backend.runtime import pool as runtime_pool
from toktier_backend.errors import InvalidRequest, ToktierError, UnknownSession
from toktier_backend.serving.session_store import (  # noqa: F401  (re-exported: the store used to live here)
    DEFAULT_SESSION_TTL_S,
    SessionEntry,
    SessionStore,
)
from toktier_backend.faces import triton_io

log = logging.getLogger(__name__)

DEFAULT_MAX_TEXT_BYTES = 16 * 1024 * 1024
"""Default cap on a session's whole text and on one ``TEXT`` element, in UTF-8 bytes (config ``max_text_bytes``)."""

DEFAULT_SESSION_BUDGET_BYTES = 1 << 30
"""Default byte budget of one instance's sessions (config ``session_budget_bytes``; 0 = unbounded)."""

MODES = ("full", "delta")
REPLIES = ("full", "patch")

CorrelationId = Hashable  # int or str, as request.correlation_id() returns it


def default_quarantine_file() -> Path:
    """``$TOKTIER_STATE_DIR/quarantine.json``, else ``~/.cache/toktier_backend/quarantine.json``."""
    base = os.environ.get("TOKTIER_STATE_DIR") or os.environ.get("TOKTIER_CACHE_DIR") or Path.home() / ".cache" / "toktier_backend"
    return Path(base) / "quarantine.json"


# ---------------------------------------------------------------- handler


class Handler:
    """Serves ``toktier_session`` and ``toktier_encode`` requests for one tokenizer.

    Args:
        tokenizer: a core ``Tokenizer`` (``tt.load_tokenizer(spec)``).
        name: how error messages name the tokenizer (its spec).
        max_text_bytes: cap, in UTF-8 bytes, on one ``TEXT`` element and on a session's whole text.
        session_ttl_s: idle TTL of the session store, in seconds.
        session_budget_bytes: byte budget of the session store (``None`` or 0: unbounded).
        clock: monotonic clock in seconds, for the store.
        verifier: a shadow ``Verifier`` for this tokenizer (``None``: replies are not sampled).
        metrics: a ``serving.metrics.Metrics`` (``None``: nothing recorded).
        pool: the CPU pool (``toktier_backend.runtime.pool.CpuPool``; ``None``: the process-wide
            ``runtime_pool.shared_pool()``). Session steps go through ``pool.call`` at ``REPAIR`` priority (they
            run at once on the calling thread, counted by the pool, and a long encode's conversion yields the
            GIL to them) and the tokenizer's chunked full encodes run on its workers at ``CHUNK`` priority;
            ``pool.stats()`` gives queue depth, tasks in flight, wait and run times.
        router: a ``gpu.routing.GpuRouter`` (a GPU model instance of ``toktier_encode``): the body of each
            stateless encode goes through ``router.encode`` (GPU above its crossover, else the CPU);
            ``None``: the tokenizer's own encode (a CPU instance).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str = "tokenizer",
        max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        session_budget_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        verifier: Any = None,
        metrics: Any = None,
        pool: runtime_pool.CpuPool | None = None,
        router: Any = None,
    ):
        if max_text_bytes <= 0:
            raise ValueError(f"max_text_bytes must be > 0, got {max_text_bytes!r}")
        self.tokenizer = tokenizer
        self.name = name
        self.max_text_bytes = int(max_text_bytes)
        self.metrics = metrics
        self.verifier = verifier
        self.router = router
        self.store = SessionStore(ttl_s=session_ttl_s, max_bytes=session_budget_bytes, clock=clock,
                                  on_evict=self._on_evict)
        self._lock = threading.Lock()
        self._dropped_seen = 0
        index = getattr(tokenizer, "prefix_index", None)
        if index is not None and self.store.max_bytes is not None:
            # one byte budget, one LRU order over sessions and indexed prefix chunks (issue #10)
            index.clock = self.store.now
            index.budget_bytes = min(index.budget_bytes, self.store.max_bytes)
            self.store.share_budget(index)
            index.on_grow = self._enforce_budget
        self.pool = pool if pool is not None else runtime_pool.shared_pool()
        if hasattr(tokenizer, "chunked"):
            if pool is not None:
                tokenizer.chunked.pool = pool
            tokenizer.chunked.prepare()  # engine objects for the pool's workers: at load, not on a request
        if verifier is not None and metrics is not None and verifier.on_result is None:
            verifier.on_result = self._on_sample

    @classmethod
    def from_spec(cls, spec: str, *, sha256: str | None = None, engine: str = "auto", **kwargs: Any) -> "Handler":
        """Load the tokenizer named by ``spec`` (a ``tokenizer.json`` path, a folder holding one, a Hub id,
        or ``"default"`` for the bundled GPT-2 file) and build a handler for it.

        Args:
            sha256: pin of the file's sha256 (``None``: any file).
            engine: ``"auto"``, ``"hf"``, or a fast engine name.

        Raises:
            tt.UnsupportedTokenizer: the file cannot be served (malformed, unsupported, or not the pinned one).
        """
        if spec in ("", "default"):
            spec = tt.default_tokenizer_path()
        return cls(tt.load_tokenizer(spec, sha256=sha256 or None, engine=engine), name=str(spec), **kwargs)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], *, session_ttl_s: float = DEFAULT_SESSION_TTL_S,
                        model: str = "toktier_session", instance_kind: str = "CPU",
                        device_id: int = 0) -> "Handler":
        """A handler from a model's ``config.pbtxt`` parameters (all strings; see ``model_repository/README.md``):
        ``tokenizer``, ``tokenizer_sha256``, ``engine``, ``max_text_bytes``, ``session_budget_bytes``,
        ``verifier_rate``, ``verifier_first_n``, ``verifier_queue``, ``verifier_debug``, ``quarantine_file``;
        the CPU pool's ``pool_workers`` (0 = one per core), ``pool_express`` (threads that run only session
        repairs), ``pool_nice`` (added to the general workers' nice value), ``pool_pin`` (1: pin chunk workers),
        ``chunk_chars`` (0 = ``ChunkedEncoder.step``'s default), ``parallel_min_chars`` (chunked full encode,
        chars) and ``long_text_strategy`` (``auto``: measured at load, per kind of text; ``chunks`` or ``whole``; see
        ``toktier_backend.pipeline.chunked``);
        for a ``toktier_encode`` instance of kind ``"GPU"``: ``gpu_engine`` (``"auto"``: GPU engine on
        ``device_id`` when it loads and passes the canary, else the CPU; ``"off"``), ``gpu_crossover_chars``
        (texts of at least this many chars go to the GPU) and ``gpu_max_queue`` (see ``gpu/routing.py``).

        Args:
            instance_kind: Triton's ``model_instance_kind`` (``"CPU"``, ``"GPU"``, ``"MODEL"``).
            device_id: Triton's ``model_instance_device_id`` (the CUDA device of a GPU instance).

        Raises:
            tt.UnsupportedTokenizer: the file cannot be served, or ``tokenizer`` is empty or an unfilled
                ``${...}`` (the bundled GPT-2 file only as ``default``); the model then fails to load.
            ValueError: a parameter is not a number where one is needed, ``gpu_engine`` is not ``auto`` /
                ``off``, or ``long_text_strategy`` not ``auto`` / ``chunks`` / ``whole`` (names the
                parameter). A GPU engine that cannot load never raises: it is logged and
                counted, and the instance serves from the CPU.
        """

        def num(key: str, default: str, kind=int):
            raw = (params.get(key) or default).strip()
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"model parameter {key}={raw!r} is not a valid {kind.__name__}") from None

        from toktier_backend.faces.parameters import tokenizer_spec

        spec = tokenizer_spec(params, ("tokenizer",), model=model)  # unfilled/empty: refuse before any work
        pool = runtime_pool.configure_shared_pool(num("pool_workers", "0") or None, express=num("pool_express", "1"),
                                              nice=num("pool_nice", "0"), pin=num("pool_pin", "1") != 0)
        handler = cls.from_spec(
            spec,
            sha256=(params.get("tokenizer_sha256") or "").strip() or None,
            engine=(params.get("engine") or "auto").strip(),
            max_text_bytes=num("max_text_bytes", str(DEFAULT_MAX_TEXT_BYTES)),
            session_ttl_s=session_ttl_s,
            session_budget_bytes=num("session_budget_bytes", str(DEFAULT_SESSION_BUDGET_BYTES)),
            pool=pool,
        )
        chunked = getattr(handler.tokenizer, "chunked", None)
        if chunked is not None:
            chunked.chunk_chars = num("chunk_chars", "0") or None  # 0: ChunkedEncoder.step's default
            chunked.min_chars = num("parallel_min_chars", str(CHUNKED_MIN_CHARS))
            strategy = (params.get("long_text_strategy") or "auto").strip().lower()
            if strategy not in ("auto", "chunks", "whole"):
                raise ValueError(f"model parameter long_text_strategy={strategy!r} is not one of "
                                 "['auto', 'chunks', 'whole']")
            if strategy != "auto":  # (auto: what prepare() measured at load)
                chunked.strategy = strategy
        from toktier_backend.serving.verifier import Verifier
        from toktier_backend.serving.metrics import get_metrics

        handler.metrics = get_metrics()
        if model == "toktier_encode" and str(instance_kind).upper() == "GPU":
            gpu_mode = (params.get("gpu_engine") or "auto").strip().lower()
            if gpu_mode not in ("auto", "off"):
                raise ValueError(f"model parameter gpu_engine={gpu_mode!r} is not one of ['auto', 'off']")
            status = "off"
            if gpu_mode == "auto":
                from toktier_backend.gpu.routing import DEFAULT_CROSSOVER_CHARS, gpu_router_for

                handler.router = gpu_router_for(
                    handler.tokenizer, device_id=int(device_id),
                    crossover_chars=num("gpu_crossover_chars", str(DEFAULT_CROSSOVER_CHARS)),
                    max_queue=num("gpu_max_queue", "4"),
                )
                status = handler.router.gpu_status
            else:
                log.info("toktier_encode GPU instance (device %s): gpu_engine=off, serving from the CPU engine", device_id)
            if handler.metrics is not None:
                handler.metrics.observe_gpu_engine(model, status)
        rate = num("verifier_rate", "0.01", float)
        first_n = num("verifier_first_n", "32")
        if rate > 0 or first_n > 0:
            qfile = (params.get("quarantine_file") or "").strip() or str(default_quarantine_file())
            handler.verifier = Verifier(
                handler.tokenizer, rate=rate, first_n=first_n, queue_size=num("verifier_queue", "64"),
                debug=(params.get("verifier_debug") or "false").strip().lower() in ("1", "true", "yes"),
                quarantine_file=qfile, name=handler.name,
                on_result=handler._on_sample if handler.metrics is not None else None,
            )
        if handler.metrics is not None:
            handler.metrics.touch(model)
        handler._refresh_gauges(model)
        if model == "toktier_session":
            handler.start_sweeper()
        return handler

    def start_sweeper(self, interval_s: float | None = None) -> None:
        """Drop idle sessions every ``interval_s`` seconds (default ``min(TTL / 2, 30)``) on a daemon
        thread, so memory is given back and the gauges are right even when no request arrives."""
        if getattr(self, "_sweeper", None) is not None:
            return
        interval = interval_s if interval_s is not None else min(self.store.ttl_s / 2, 30.0)
        self._stop = threading.Event()

        def sweep():
            while not self._stop.wait(interval):
                with self._lock:
                    self.store.expire(force=True)
                    self._refresh_gauges("toktier_session")

        self._sweeper = threading.Thread(target=sweep, name="toktier-session-sweeper", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        """Stop the verifier and sweeper threads (``finalize``)."""
        if getattr(self, "_sweeper", None) is not None:
            self._stop.set()
            self._sweeper.join(5)
            self._sweeper = None
        if self.verifier is not None:
            self.verifier.close()

    # ------------------------------------------------------------ sessions

    def handle_session(
        self,
        corr_id: CorrelationId,
        text: bytes | str,
        mode: str | bytes | None = None,
        reply: str | bytes | None = None,
        add_special: bool | None = None,
        *,
        start: bool = False,
        end: bool = False,
    ) -> dict[str, np.ndarray]:
        """One request of a sequence.

        Args:
            corr_id: the correlation ID (non-zero ``int`` or non-empty ``str``).
            text: UTF-8 bytes (or ``str``): the whole text (``mode="full"``) or the appended text (``"delta"``).
            mode: ``"full"`` (default) or ``"delta"``.
            reply: ``"full"`` (default: all ids) or ``"patch"`` (only ids from ``KEEP`` on).
            add_special: HF ``add_special_tokens``; ``None`` = the session's flag, or ``True`` for a new one.
            start: the sequence START flag: drop whatever ``corr_id`` held first; needs ``mode="full"``.
            end: the sequence END flag: free the session after replying (also when the request fails).

        Returns:
            ``INPUT_ID`` int32[n - KEEP] (patch) or int32[n] (full); ``REQUEST_INPUT_LEN`` int32[1] = n, the
            total ids of the session text; ``KEEP`` int32[1], ids of the previous reply still valid (0 for a
            new session); ``ROUTE`` object[1] (bytes), the repair route. The ids equal HF
            ``Tokenizer.encode(session_text, add_special_tokens=flag).ids``.

        Raises:
            InvalidRequest: bad mode/reply, not UTF-8 or lone surrogates, over ``max_text_bytes``, START with
                ``delta``, or a ``delta`` that changes ``add_special_tokens``. The session is unchanged.
            UnknownSession: ``delta`` for a correlation ID this server does not hold: resend ``full``.
        """
        t0 = time.perf_counter()
        with self._lock:
            try:
                self._sync()
                if start and self.store.get(corr_id, touch=False) is not None:  # an idle one counts as idle
                    self.store.pop(corr_id, "start")
                # at REPAIR priority: runs now on this thread, never behind chunks of long encodes (pipeline/chunked.py)
                out, entry, mode = self.pool.call(self._session_step, corr_id, text, mode, reply, add_special,
                                                  start, priority=runtime_pool.REPAIR)
            except ToktierError as e:
                self._count_error("toktier_session", e)
                raise
            except Exception as e:
                self._count_error("toktier_session", e)
                raise
            finally:
                if end:
                    self.store.pop(corr_id)
            repair = getattr(entry.session, "last_repair", None)
            route = _route(out)
            if self.metrics is not None:
                self.metrics.observe_reply("toktier_session", mode, route, time.perf_counter() - t0, repair)
            if self.verifier is not None and self.verifier.wants():
                ids = out["INPUT_ID"] if reply_is_full(out) else entry.session.ids
                self.verifier.submit(entry.session.text, ids, add_special_tokens=entry.add_special_tokens,
                                     route=route, cut=int(getattr(repair, "cut", 0) or 0),
                                     engine=str(getattr(repair, "engine", "")))
            self._refresh_gauges("toktier_session")
            return out

    def handle_session_tensors(
        self, corr_id: CorrelationId, inputs: Mapping[str, np.ndarray | None], *, start: bool, end: bool
    ) -> dict[str, np.ndarray]:
        """:meth:`handle_session` from input tensors (``TEXT``, optional ``MODE``, ``REPLY``,
        ``ADD_SPECIAL_TOKENS``; shape [1] or [1, 1]). START/END are honoured even when the tensors are bad."""
        try:
            args = triton_io.session_args(inputs)
        except ToktierError as e:
            with self._lock:
                if start or end:
                    self.store.pop(corr_id, "start" if start else None)
                self._count_error("toktier_session", e)
            raise
        return self.handle_session(corr_id, **args, start=start, end=end)

    def _session_step(self, corr_id, text, mode, reply, add_special, start):
        self.store.expire()
        mode = _choice("MODE", mode, MODES)
        reply = _choice("REPLY", reply, REPLIES)
        _check_corr_id(corr_id)
        size = self._check_size(text, corr_id)
        value = _decode(text, corr_id, self.name)
        entry = self.store.get(corr_id)
        now = self.store.now()
        if mode == "full":
            flag = True if add_special is None else bool(add_special)
            fresh = entry is None or entry.add_special_tokens != flag
            if fresh:
                # held only once its first update succeeded: a failed one leaves the store as it was
                entry = SessionEntry(self.tokenizer.session(add_special_tokens=flag), flag, 0, now)
                ids = entry.session.update(value)
                self.store.put(corr_id, entry)
            else:
                ids = self._run(corr_id, entry, lambda s: s.update(value))
            entry.text_bytes = size
        else:
            if start:
                raise InvalidRequest(
                    f"correlation ID {corr_id!r}: the sequence START request has MODE='delta', but a new "
                    f"sequence holds no text to append to. Send the whole text with MODE='full' on START."
                )
            if entry is None:
                raise UnknownSession(
                    f"correlation ID {corr_id!r}: this server holds no session for it (never opened, ended, idle "
                    f"longer than {self.store.ttl_s:g} s, evicted under the session memory budget, or the server "
                    f"restarted), so MODE='delta' has no text to append to. Resend the whole text with "
                    f"MODE='full' (tokenizer {self.name})."
                )
            if add_special is not None and bool(add_special) != entry.add_special_tokens:
                raise InvalidRequest(
                    f"correlation ID {corr_id!r}: ADD_SPECIAL_TOKENS={bool(add_special)} but the session was "
                    f"opened with {entry.add_special_tokens}; a delta cannot change it. Omit it, or resend the "
                    f"whole text with MODE='full'."
                )
            total = entry.text_bytes + size
            if total > self.max_text_bytes:
                raise InvalidRequest(
                    f"correlation ID {corr_id!r}: the session text would grow to {total} bytes, over "
                    f"max_text_bytes={self.max_text_bytes}. End the session or raise the model parameter."
                )
            fresh = False
            ids = self._run(corr_id, entry, lambda s: s.append(value))
            entry.text_bytes = total
        entry.last_used = now
        self.store.account(corr_id)  # re-measure; may evict least recently used sessions (or this one)
        repair = getattr(entry.session, "last_repair", None)
        keep = 0 if fresh or repair is None else int(repair.reused)
        route = "new" if repair is None else str(repair.route)
        n = len(ids)
        out = ids[keep:] if reply == "patch" else ids
        return {
            "INPUT_ID": np.array(out, dtype=np.int32),  # a copy: the session's view dies on its next call
            "REQUEST_INPUT_LEN": np.array([n], dtype=np.int32),
            "KEEP": np.array([keep], dtype=np.int32),
            "ROUTE": np.array([route.encode()], dtype=np.object_),
        }, entry, mode

    def _run(self, corr_id, entry: SessionEntry, step) -> np.ndarray:
        try:
            return step(entry.session)
        except InvalidRequest:
            raise  # the core keeps the session unchanged on a bad request
        except BaseException:
            # The session may be half-updated: forget it, so the next delta gets NOT_FOUND and the client
            # resends the whole text (exact over available).
            self.store.pop(corr_id, "error")
            raise

    # ------------------------------------------------------------ stateless encode

    def handle_encode(self, text: bytes | str, add_special: bool | None = None) -> dict[str, np.ndarray]:
        """Encode one text.

        Args:
            text: UTF-8 bytes (or ``str``).
            add_special: HF ``add_special_tokens`` (``None`` = ``True``).

        Returns:
            ``INPUT_ID`` int32[n], equal to HF ``encode(text, add_special_tokens=flag).ids``
            (gpt2: ``b"hello world"`` -> ``[31373, 995]``); ``REQUEST_INPUT_LEN`` int32[1] = n.

        Raises:
            InvalidRequest: not UTF-8, lone surrogates, or over ``max_text_bytes``.
        """
        t0 = time.perf_counter()
        flag = True if add_special is None else bool(add_special)
        try:
            self._sync()
            self._check_size(text, None)
            value = _decode(text, None, self.name)
            if self.router is None:
                ids, route = self.tokenizer.encode(value, add_special_tokens=flag), "cpu_instance"
            else:
                ids, route = self.tokenizer._encode_with(value, flag, self._routed_body)
                if route == "reference":
                    route = "cpu_reference"
        except Exception as e:
            self._count_error("toktier_encode", e)
            raise
        if self.metrics is not None:
            self.metrics.observe_reply("toktier_encode", "encode", "encode", time.perf_counter() - t0)
            self.metrics.observe_encode_route("toktier_encode", route)
        if self.verifier is not None and self.verifier.wants():
            self.verifier.submit(value, ids, add_special_tokens=flag, route="encode",
                                 engine="gpu" if route == "gpu" else getattr(self.tokenizer.engine, "name", ""))
        self._refresh_gauges("toktier_encode")
        return {
            "INPUT_ID": np.asarray(ids, dtype=np.int32),
            "REQUEST_INPUT_LEN": np.array([len(ids)], dtype=np.int32),
        }

    def _routed_body(self, text: str) -> tuple[np.ndarray, str]:
        """Body ids ``int32[n]`` of a fresh text on a GPU instance, and the route (``GpuRouter.encode``'s, or
        ``"cpu_quarantined"``). A quarantined ``full`` route (the shadow verifier caught a stateless reply,
        possibly the GPU's) keeps every text off the GPU until an operator clears it."""
        if "full" in self.tokenizer.quarantined:
            return self.tokenizer.encode_fresh(text)[0], "cpu_quarantined"
        return self.router.encode(text)

    def handle_encode_tensors(self, inputs: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """:meth:`handle_encode` from input tensors (``TEXT``, optional ``ADD_SPECIAL_TOKENS``)."""
        try:
            args = triton_io.encode_args(inputs)
        except ToktierError as e:
            self._count_error("toktier_encode", e)
            raise
        return self.handle_encode(**args)

    # ------------------------------------------------------------ verifier, metrics

    def _sync(self) -> None:
        if self.verifier is not None:
            self.verifier.sync()  # quarantine file: at most one stat() per poll interval

    def _count_error(self, model: str, exc: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.observe_error(model, triton_io.error_code(exc))

    def _enforce_budget(self) -> None:
        """The prefix indexer's thread, after an insert: evict (sessions or index chunks, least recently used
        first) until both fit the shared budget again."""
        with self._lock:
            self.store.account(None)

    def _on_evict(self, corr_id, entry, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.evictions.labels("toktier_session", cause).inc()

    def _on_sample(self, sample, ok: bool) -> None:
        """Verifier thread: count the check; on a mismatch refresh the quarantine gauges at once."""
        model = "toktier_encode" if sample.route == "encode" else "toktier_session"
        self.metrics.observe_sample(model, sample.route, ok)
        self.metrics.set_state(model, verifier=self.verifier, tokenizer=None if ok else self.tokenizer)

    def _refresh_gauges(self, model: str) -> None:
        if self.metrics is None:
            return
        dropped = 0
        if self.verifier is not None:
            dropped = self.verifier.dropped - self._dropped_seen
            self._dropped_seen += dropped
        self.metrics.set_state(model, store=self.store if model == "toktier_session" else None,
                               verifier=self.verifier, tokenizer=self.tokenizer, dropped_delta=dropped,
                               pool=getattr(self, "pool", None))

    # ------------------------------------------------------------ checks

    def _check_size(self, text: bytes | str, corr_id: CorrelationId | None) -> int:
        """The size of ``text`` in UTF-8 bytes; raises :class:`InvalidRequest` over ``max_text_bytes``."""
        size = len(text) if isinstance(text, (bytes, bytearray, memoryview)) else len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_text_bytes:
            where = "" if corr_id is None else f"correlation ID {corr_id!r}: "
            raise InvalidRequest(
                f"{where}TEXT is {size} bytes, over max_text_bytes={self.max_text_bytes} (tokenizer {self.name}). "
                f"Split the text, send deltas, or raise the model parameter max_text_bytes."
            )
        return size


def _route(out: Mapping[str, np.ndarray]) -> str:
    r = out["ROUTE"].reshape(-1)[0]
    return r.decode() if isinstance(r, bytes) else str(r)


def reply_is_full(out: Mapping[str, np.ndarray]) -> bool:
    """Does ``INPUT_ID`` hold all ids (a full reply), not just those from ``KEEP`` on?"""
    return len(out["INPUT_ID"]) == int(out["REQUEST_INPUT_LEN"].reshape(-1)[0])


def _decode(raw: bytes | str, corr_id: CorrelationId | None, name: str) -> str:
    where = "" if corr_id is None else f"correlation ID {corr_id!r}: "
    if isinstance(raw, str):
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(
                f"{where}TEXT holds a lone surrogate {raw[e.start:e.end]!r} at char {e.start}, which UTF-8 cannot "
                f"encode (tokenizer {name}). Send valid Unicode text."
            ) from e
        return raw
    try:
        return tt.decode_text(bytes(raw))
    except InvalidRequest as e:
        raise InvalidRequest(f"{where}{e} (tokenizer {name})") from e


def _choice(name: str, value: str | bytes | None, choices: tuple[str, ...]) -> str:
    if value is None:
        return choices[0]
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", "replace")
    value = str(value).strip().lower()
    if value == "":
        return choices[0]
    if value not in choices:
        raise InvalidRequest(f"{name}={value!r} is not one of {list(choices)}; omit it for {choices[0]!r}.")
    return value


def _check_corr_id(corr_id: CorrelationId) -> None:
    if isinstance(corr_id, bool) or not isinstance(corr_id, (int, str)) or corr_id in (0, ""):
        raise InvalidRequest(
            f"correlation ID {corr_id!r}: a session needs a non-zero integer or non-empty string correlation ID "
            f"(sequence_id in tritonclient)."
        )
