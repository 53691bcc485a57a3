"""The serving core: one per loaded tokenizer per process, behind every face.

Every face (Triton and PyTriton models, TensorRT-LLM ``preprocessing``, vLLM's tokenizer, the OpenAI proxy,
Dynamo) parses its protocol, makes one call here and formats the reply. A :class:`ServingCore` holds

- one :class:`~toktier_backend.serving.session_store.SessionStore`: sessions found by key (correlation ID,
  header, body field) or by prompt prefix (callers that send no key), under one TTL, one LRU order and one
  byte budget shared with the tokenizer's cross-session prefix index;
- one shadow :class:`~toktier_backend.serving.verifier.Verifier` (sampled replies re-checked against the HF
  reference off the request path; a mismatch quarantines the route, in the quarantine file);
- one :class:`~toktier_backend.serving.metrics.Metrics` (the ``toktier_*`` metrics, labelled with the
  request's :class:`~toktier_backend.serving.metrics.Origin`: face and model);
- one :class:`~toktier_backend.runtime.pool.CpuPool` (the process-wide shared pool).

Each call validates its input (UTF-8, lone surrogates, ``max_text_bytes``), runs a session step on the pool
at ``REPAIR`` priority (at once, on the calling thread, never behind the chunks of a long encode), samples
the reply to the verifier, and counts it. Calls:

- :meth:`ServingCore.step`: one request of a keyed sequence (Triton's sequence batcher): ``full`` or
  ``delta`` text, ``full`` or ``patch`` reply, START replaces, END frees. A request finding its session in
  use by another waits for it (sequence order).
- :meth:`ServingCore.encode`: the whole text, repaired in the session of ``key`` if given, else in the
  session its prefix finds (texts of at least ``min_prefix_chars``), else a stateless encode. A session in
  use by another request is not waited for: that request gets a plain encode (route ``busy``).
- :meth:`ServingCore.encode_stateless`: one text, no session (on a GPU model instance: the GPU router).
- :meth:`ServingCore.chat`: a chat request (``messages``): the conversation's ``ChatSession`` (held in the
  same store entry as its tokenizer session) renders the core's chat template incrementally, then the
  tokenizer session is advanced from the render's departure. Sampled renders are re-rendered by the jinja2
  reference on the verifier thread; a mismatch quarantines incremental rendering of the template.

Every id returned equals HF ``Tokenizer.from_file(path).encode(text, add_special_tokens=flag).ids``: the
session and the prefix match only decide how much is re-encoded.

Thread-safe: the store's lock guards its bookkeeping only (never held while encoding); each session is used
by one request at a time (its entry lock). Pure Python and numpy: no Triton import.
"""

from __future__ import annotations

import dataclasses
import logging
import marshal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping

import numpy as np

from toktier_backend.chat.wire import parse_messages
from toktier_backend.config import default_quarantine_file, parse_bool
from toktier_backend.errors import EngineUnavailable, InvalidRequest, UnknownSession, UnsupportedTokenizer
from toktier_backend.runtime import pool as runtime_pool
from toktier_backend.runtime.pool import CpuPool
from toktier_backend.serving.metrics import Metrics, Origin, get_metrics
from toktier_backend.serving.session_store import (
    DEFAULT_CHECKPOINT_CHARS,
    DEFAULT_SESSION_TTL_S,
    PrefixKey,
    SessionEntry,
    SessionStore,
)
from toktier_backend.serving.verifier import DEFAULT_CPU_SHARE, ChatCheck, Verifier, chat_template_key
from toktier_backend.tokenizer import Tokenizer, decode_text, load_tokenizer

if TYPE_CHECKING:  # the GPU package is imported only by a GPU model instance
    from toktier_backend.gpu.routing import GpuRouter

log = logging.getLogger(__name__)

DEFAULT_MAX_TEXT_BYTES = 16 * 1024 * 1024
"""Default cap on one text and on a session's whole text, in UTF-8 bytes (parameter ``max_text_bytes``)."""

DEFAULT_SESSION_BUDGET_BYTES = 1 << 30
"""Default byte budget of one core's sessions (parameter ``session_budget_bytes``; 0 = unbounded)."""

DEFAULT_MIN_PREFIX_CHARS = 2048
"""Texts without a key shorter than this (chars) get a stateless encode, no prefix-found session."""

MODES = ("full", "delta")
REPLIES = ("full", "patch")

Key = Hashable  # int or str (a correlation ID, a header value); 0, "" and None mean none


# ---------------------------------------------------------------- replies


@dataclasses.dataclass(frozen=True)
class Reply:
    """What one core call returns.

    Attributes:
        ids: ``int32[n]`` (all ids) or ``int32[n - keep]`` (``reply="patch"``: ids from ``keep`` on); a copy
            owned by the caller, equal to (the tail of) HF ``encode(text, add_special_tokens=flag).ids``.
        n: total ids of the text (the session's whole text for a ``delta``).
        keep: ids of the session's previous reply still valid (0 for a new session, a stateless or busy
            encode).
        route: the repair route (``full``, ``append``, ``edit``, ``noop``, ``reference``), ``encode``
            (stateless) or ``busy`` (the session was in use: plain encode).
        session: ``"key"``, ``"prefix"`` or ``None`` (no session).
        fresh: the session was opened by this request (faces that report ``new`` use it).
        render: a chat request's template render route (``incremental`` or ``full:<reason>``); ``None`` for
            a text.
    """

    ids: np.ndarray
    n: int
    keep: int
    route: str
    session: str | None = None
    fresh: bool = False
    render: str | None = None

    @property
    def shown_route(self) -> str:
        """``"new"`` for a session's first request, else :attr:`route` (the proxy's and TensorRT-LLM's)."""
        return "new" if self.fresh else self.route


# ---------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class CoreConfig:
    """Everything a core is built from (:meth:`ServingCore.from_config`); :meth:`from_parameters` reads a
    Triton model's ``config.pbtxt`` parameters (``model_repository/README.md``).

    Attributes:
        tokenizer: a ``tokenizer.json`` path, a folder holding one, a Hub id, or ``"default"`` (bundled GPT-2).
        tokenizer_sha256: pin of the file's sha256 (``None``: any file).
        engine: ``"auto"``, ``"hf"``, or a fast engine name.
        max_text_bytes: cap on one text and on a session's whole text, UTF-8 bytes.
        session_ttl_s: idle time after which a session is dropped, seconds.
        session_budget_bytes: byte budget of the sessions and the prefix index (0: unbounded).
        max_sessions: most sessions held (0: unbounded).
        min_prefix_chars: shortest text (chars) without a key matched to a session by prefix.
        checkpoint_chars: first prefix checkpoint, chars.
        verifier_rate, verifier_first_n, verifier_cpu_share, verifier_queue, verifier_debug: the shadow
            verifier (``serving.verifier.Verifier``; no verifier when rate and first_n are both 0).
        quarantine_file: shared quarantine file (``""``: ``config.default_quarantine_file()``).
        pool_workers: ``None``: the process-wide pool as it is; else replace it with this many workers (0 = one
            per core) and ``pool_express`` / ``pool_nice`` / ``pool_pin`` (``runtime/pool.py``).
        chunk_chars, parallel_min_chars: the tokenizer's chunked full encode (``None``: its defaults).
        gpu_engine, gpu_crossover_chars, gpu_max_queue: a GPU model instance's router (``gpu/routing.py``).
        chat_template: the chat template of :meth:`ServingCore.chat`: a file (``.jinja``, or ``.json`` holding
            ``chat_template``) or the jinja source; ``""``: the one beside the tokenizer
            (``chat/template.py`` ``load_chat_template``: ``chat_template.jinja``, ``chat_template.json``,
            ``tokenizer_config.json``).
    """

    tokenizer: str = "default"
    tokenizer_sha256: str | None = None
    engine: str = "auto"
    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    session_budget_bytes: int = DEFAULT_SESSION_BUDGET_BYTES
    max_sessions: int = 0
    min_prefix_chars: int = DEFAULT_MIN_PREFIX_CHARS
    checkpoint_chars: int = DEFAULT_CHECKPOINT_CHARS
    verifier_rate: float = 0.01
    verifier_first_n: int = 32
    verifier_cpu_share: float = DEFAULT_CPU_SHARE
    verifier_queue: int = 64
    verifier_debug: bool = False
    quarantine_file: str = ""
    pool_workers: int | None = None
    pool_express: int = 1
    pool_nice: int = 0
    pool_pin: bool = True
    chunk_chars: int | None = None
    parallel_min_chars: int | None = None
    gpu_engine: str = "auto"
    gpu_crossover_chars: int | None = None
    gpu_max_queue: int = 4
    chat_template: str = ""

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], **overrides) -> "CoreConfig":
        """Parse model parameters (all strings; unset or empty = the default; unknown keys are ignored, so a
        face's own parameters can sit beside them). ``overrides`` (field names) win over ``params``.

        Keys: ``tokenizer``, ``tokenizer_sha256``, ``engine``, ``max_text_bytes``, ``session_budget_bytes``,
        ``max_sessions``, ``session_ttl_s``, ``min_prefix_chars``, ``verifier_rate``, ``verifier_first_n``,
        ``verifier_cpu_share``, ``verifier_queue``, ``verifier_debug``, ``quarantine_file``, ``pool_workers`` (unset: the process-wide
        pool as it is; 0 = replace it with one worker per core),
        ``pool_express``, ``pool_nice``, ``pool_pin``, ``chunk_chars`` (0 = the encoder's default),
        ``parallel_min_chars``, ``gpu_engine`` (``auto`` | ``off``), ``gpu_crossover_chars``, ``gpu_max_queue``,
        ``chat_template`` (a file or the source; unset: the one beside the tokenizer).
        A value still holding an unfilled ``${...}`` template counts as unset.

        Raises:
            ValueError: a value is not a number / boolean where one is needed, or ``gpu_engine`` is not
                ``auto`` / ``off`` (names the parameter).
        """

        def raw(key: str) -> str | None:
            v = (params.get(key) or "").strip()
            return None if not v or v.startswith("${") else v

        def num(key: str, default, kind=int):
            v = raw(key)
            if v is None:
                return default
            try:
                return kind(v)
            except ValueError:
                raise ValueError(f"model parameter {key}={v!r} is not a valid {kind.__name__}") from None

        d = cls()
        gpu_mode = (raw("gpu_engine") or "auto").lower()
        if gpu_mode not in ("auto", "off"):
            raise ValueError(f"model parameter gpu_engine={gpu_mode!r} is not one of ['auto', 'off']")
        values = dict(
            tokenizer=raw("tokenizer") or d.tokenizer,
            tokenizer_sha256=raw("tokenizer_sha256"),
            engine=raw("engine") or d.engine,
            max_text_bytes=num("max_text_bytes", d.max_text_bytes),
            session_ttl_s=num("session_ttl_s", d.session_ttl_s, float),
            session_budget_bytes=num("session_budget_bytes", d.session_budget_bytes),
            max_sessions=num("max_sessions", d.max_sessions),
            min_prefix_chars=num("min_prefix_chars", d.min_prefix_chars),
            verifier_rate=num("verifier_rate", d.verifier_rate, float),
            verifier_first_n=num("verifier_first_n", d.verifier_first_n),
            verifier_cpu_share=num("verifier_cpu_share", d.verifier_cpu_share, float),
            verifier_queue=num("verifier_queue", d.verifier_queue),
            verifier_debug=parse_bool(raw("verifier_debug"), False, name="model parameter verifier_debug"),
            quarantine_file=raw("quarantine_file") or "",
            pool_workers=num("pool_workers", None),
            pool_express=num("pool_express", d.pool_express),
            pool_nice=num("pool_nice", d.pool_nice),
            pool_pin=parse_bool(raw("pool_pin"), True, name="model parameter pool_pin"),
            chunk_chars=num("chunk_chars", 0) or None,
            parallel_min_chars=num("parallel_min_chars", None),
            gpu_engine=gpu_mode,
            gpu_crossover_chars=num("gpu_crossover_chars", None),
            gpu_max_queue=num("gpu_max_queue", d.gpu_max_queue),
            chat_template=raw("chat_template") or "",
        )
        values.update(overrides)
        return cls(**values)


# ---------------------------------------------------------------- the core


class ServingCore:
    """The sessions, verifier, metrics and pool of one tokenizer; every face calls it.

    Args:
        tokenizer: the core ``Tokenizer`` (``load_tokenizer(spec)``).
        name: how error messages and logs name the tokenizer (its spec).
        max_text_bytes: cap, in UTF-8 bytes, on one text and on a session's whole text.
        session_ttl_s: idle TTL of the session store, seconds.
        session_budget_bytes: byte budget of the store, shared with the tokenizer's prefix index (``None``
            or 0: unbounded).
        max_sessions: most sessions held (``None`` or 0: unbounded).
        min_prefix_chars: texts without a key at least this long (chars) are matched to a session by prefix.
        checkpoint_chars: first prefix checkpoint, chars.
        clock: monotonic clock in seconds, for the store (tests pass a fake one).
        verifier: the shadow verifier for this tokenizer (``None``: replies are not sampled).
        metrics: where ``toktier_*`` go (``None``: nothing recorded).
        pool: the CPU pool (``None``: ``runtime.pool.shared_pool()``); the tokenizer's chunked encodes run on
            it too.
        router: a GPU model instance's ``GpuRouter``: stateless encodes of fresh texts go through it (GPU
            above its crossover, else the CPU); ``None``: the tokenizer's own encode.
        chat_template: jinja source of the chat template :meth:`chat` renders (``None``: chat requests are
            refused; :meth:`from_config` loads the one beside the tokenizer).
        special_tokens: the template's ``bos_token``, ``eos_token``, ... (``config.special_tokens``).
        chat_session: the class (or factory) of a conversation's renderer, called as
            ``chat_session(source, special_tokens, fast_full=False, plan=plan, full_renderer=renderer)``
            (default ``chat.session.ChatSession``).

    Raises:
        ValueError: ``max_text_bytes`` <= 0, or a bad store setting.
        UnsupportedTokenizer: the chat template does not compile.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        name: str = "tokenizer",
        max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        session_budget_bytes: int | None = None,
        max_sessions: int | None = None,
        min_prefix_chars: int = DEFAULT_MIN_PREFIX_CHARS,
        checkpoint_chars: int = DEFAULT_CHECKPOINT_CHARS,
        clock: Callable[[], float] = time.monotonic,
        verifier: Verifier | None = None,
        metrics: Metrics | None = None,
        pool: CpuPool | None = None,
        router: "GpuRouter | None" = None,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        chat_session: Callable[..., Any] | None = None,
    ):
        if max_text_bytes <= 0:
            raise ValueError(f"max_text_bytes must be > 0, got {max_text_bytes!r}")
        if min_prefix_chars < 0:
            raise ValueError(f"min_prefix_chars must be >= 0, got {min_prefix_chars!r}")
        self.tokenizer = tokenizer
        self.name = name
        self.max_text_bytes = int(max_text_bytes)
        self.min_prefix_chars = int(min_prefix_chars)
        self.metrics = metrics
        self.verifier = verifier
        self.router = router
        self.store = SessionStore(ttl_s=session_ttl_s, max_bytes=session_budget_bytes, max_sessions=max_sessions,
                                  checkpoint_chars=checkpoint_chars, clock=clock, on_evict=self._on_evict)
        self._local = threading.local()  # the origin of the request this thread serves (eviction labels)
        self._origins: list[Origin] = []  # registered by faces; the first labels what no request caused
        self._session_origins: list[Origin] = []
        self._gauge_lock = threading.Lock()
        self._dropped_seen = 0
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()
        index = getattr(tokenizer, "prefix_index", None)
        if index is not None and self.store.max_bytes is not None:
            # one byte budget, one LRU order over sessions and indexed prefix chunks
            index.clock = self.store.now
            index.budget_bytes = min(index.budget_bytes, self.store.max_bytes)
            self.store.share_budget(index)
            index.on_grow = self._enforce_budget
        self.pool = pool if pool is not None else runtime_pool.shared_pool()
        chunked = getattr(tokenizer, "chunked", None)
        if chunked is not None:
            if pool is not None:
                chunked.pool = pool
            chunked.prepare()  # engine objects for the pool's workers: at load, not on a request
        if verifier is not None and metrics is not None and verifier.on_result is None:
            verifier.on_result = self._on_sample
        self.chat_template: ChatTemplate | None = None
        if chat_template:
            self.chat_template = ChatTemplate(chat_template, special_tokens, session_class=chat_session)

    @classmethod
    def from_config(cls, config: CoreConfig, *, tokenizer: Tokenizer | None = None,
                    clock: Callable[[], float] = time.monotonic, gpu_device: int | None = None,
                    metrics: Metrics | None = None, sweeper: bool = True) -> "ServingCore":
        """Build a core for serving: the pool (replaced when ``config.pool_workers`` is set), the tokenizer
        (loaded from ``config.tokenizer`` unless given), the process-wide metrics, the verifier with its
        quarantine file, and the GPU router of a GPU model instance.

        Args:
            tokenizer: an already loaded tokenizer (vLLM's face loads the HF backend's file itself).
            gpu_device: the CUDA device of a GPU model instance (``None``: a CPU instance, no router). With
                ``config.gpu_engine == "auto"`` the router puts fresh texts above the crossover on the GPU
                engine if it loads and passes the canary; otherwise (logged and counted) the CPU serves.
            metrics: default :func:`~toktier_backend.serving.metrics.get_metrics` (``None`` when
                prometheus_client is missing).
            sweeper: start the idle-session sweeper thread (:meth:`start_sweeper`).

        Raises:
            UnsupportedTokenizer: the file cannot be served (malformed, unsupported, not the pinned one), or
                ``config.chat_template`` names a template that cannot be read or compiled (one found beside
                the tokenizer that cannot be is logged, and chat requests are refused).
        """
        c = config
        if c.pool_workers is not None:
            pool = runtime_pool.configure_shared_pool(c.pool_workers or None, express=c.pool_express,
                                                      nice=c.pool_nice, pin=c.pool_pin)
        else:
            pool = runtime_pool.shared_pool()
        spec = c.tokenizer
        if tokenizer is None:
            tokenizer = load_tokenizer(spec, sha256=c.tokenizer_sha256 or None, engine=c.engine)
        chunked = getattr(tokenizer, "chunked", None)
        if chunked is not None:
            if c.chunk_chars is not None:
                chunked.chunk_chars = c.chunk_chars
            if c.parallel_min_chars is not None:
                chunked.min_chars = c.parallel_min_chars
        router = None
        if gpu_device is not None:
            if c.gpu_engine == "auto":
                from toktier_backend.gpu.routing import DEFAULT_CROSSOVER_CHARS, gpu_router_for

                router = gpu_router_for(tokenizer, device_id=int(gpu_device),
                                        crossover_chars=DEFAULT_CROSSOVER_CHARS if c.gpu_crossover_chars is None
                                        else c.gpu_crossover_chars,
                                        max_queue=c.gpu_max_queue)
            else:
                log.info("GPU model instance (device %s): gpu_engine=off, serving from the CPU engine", gpu_device)
        metrics = metrics if metrics is not None else get_metrics()
        verifier = None
        if c.verifier_rate > 0 or c.verifier_first_n > 0:
            verifier = Verifier(tokenizer, rate=c.verifier_rate, first_n=c.verifier_first_n,
                                cpu_share=c.verifier_cpu_share,
                                queue_size=c.verifier_queue, debug=c.verifier_debug,
                                quarantine_file=c.quarantine_file or str(default_quarantine_file()), name=str(spec))
        template, special = _load_chat_template(tokenizer, c.chat_template)
        core = cls(tokenizer, name=str(spec), max_text_bytes=c.max_text_bytes, session_ttl_s=c.session_ttl_s,
                   session_budget_bytes=c.session_budget_bytes, max_sessions=c.max_sessions,
                   min_prefix_chars=c.min_prefix_chars, checkpoint_chars=c.checkpoint_chars, clock=clock,
                   verifier=verifier, metrics=metrics, pool=pool, router=router, chat_template=template,
                   special_tokens=special)
        core.gpu_status = None if gpu_device is None else (router.gpu_status if router is not None else "off")
        if sweeper:
            core.start_sweeper()
        return core

    gpu_status: str | None = None
    """A GPU model instance's engine at load (``ok``, ``off``, ``unavailable``, ``canary_failed``); ``None``:
    a CPU instance."""

    # ------------------------------------------------------------ faces

    def register(self, origin: Origin, *, sessions: bool) -> None:
        """A face announces itself (at load): its zero-valued counters are exported, a GPU instance's engine
        load result is counted, and the gauges are set. ``sessions``: the face holds sessions (its origin
        then labels the store's gauges and evictions no request caused)."""
        if origin not in self._origins:
            self._origins.append(origin)
        if sessions and origin not in self._session_origins:
            self._session_origins.append(origin)
        if self.metrics is not None:
            self.metrics.touch(origin, sessions=sessions)
            if self.gpu_status is not None:
                self.metrics.observe_gpu_engine(origin, self.gpu_status)
        self._refresh(origin, sessions=sessions)

    def start_sweeper(self, interval_s: float | None = None) -> None:
        """Drop idle sessions every ``interval_s`` seconds (default ``min(TTL / 2, 30)``) on a daemon
        thread, so memory is given back and the gauges are right even when no request arrives."""
        if self._sweeper is not None:
            return
        interval = interval_s if interval_s is not None else min(self.store.ttl_s / 2, 30.0)

        def sweep():
            while not self._stop.wait(interval):
                self.store.expire(force=True)
                for origin in list(self._session_origins):
                    self._refresh(origin, sessions=True)

        self._sweeper = threading.Thread(target=sweep, name="toktier-session-sweeper", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        """Stop the verifier and sweeper threads (a model's ``finalize``)."""
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(5)
            self._sweeper = None
        if self.verifier is not None:
            self.verifier.close()

    # ------------------------------------------------------------ keyed sequences

    def step(
        self,
        origin: Origin,
        key: Key,
        text: bytes | str,
        *,
        mode: str | bytes | None = None,
        reply: str | bytes | None = None,
        add_special_tokens: bool | None = None,
        start: bool = False,
        end: bool = False,
    ) -> Reply:
        """One request of the sequence ``key`` (Triton's sequence batcher semantics).

        Args:
            origin: the face and model, for the metrics.
            key: the sequence's key (non-zero ``int`` or non-empty ``str``; ``17`` and ``"17"`` differ).
            text: UTF-8 bytes (or ``str``): the whole text (``mode="full"``) or the appended text (``"delta"``).
            mode: ``"full"`` (default) or ``"delta"``.
            reply: ``"full"`` (default: all ids) or ``"patch"`` (only ids from ``keep`` on).
            add_special_tokens: HF ``add_special_tokens``; ``None`` = the session's flag, or ``True`` for a new
                one. A ``full`` text with the other flag replaces the session.
            start: the sequence START flag: drop what ``key`` held first (counted as an eviction, cause
                ``start``), even when the request is then refused; needs ``mode="full"``.
            end: the sequence END flag: free the session after replying (also when the request fails).

        Returns:
            :class:`Reply`; gpt2: ``b"hello"`` then delta ``b" world"`` -> ``n == 2``, ids
            ``[31373, 995]`` (full) or ``[995]`` with ``keep == 1`` (patch).

        Raises:
            InvalidRequest: bad mode/reply or key, not UTF-8 or lone surrogates, over ``max_text_bytes``
                (also the session's grown text), START with ``delta``, or a ``delta`` that changes
                ``add_special_tokens``. The session is unchanged.
            UnknownSession: ``delta`` for a key this core does not hold (never opened, ended, idle past the
                TTL, evicted): resend the whole text with ``full``.
        """
        t0 = time.perf_counter()
        self._local.origin = origin
        try:
            self._sync()
            if start and self.store.get(key, touch=False) is not None:  # (an idle one counts as idle)
                self.store.pop(key, "start")
            mode = _choice("MODE", mode, MODES)
            reply = _choice("REPLY", reply, REPLIES)
            _check_key(key)
            value, size = self._text(text, key)
            if mode == "delta" and start:
                raise InvalidRequest(
                    f"correlation ID {key!r}: the sequence START request has MODE='delta', but a new "
                    f"sequence holds no text to append to. Send the whole text with MODE='full' on START."
                )
            out = self._keyed(origin, key, value, size, mode, reply, add_special_tokens, wait=True, t0=t0)
        except Exception as e:
            self._count_error(origin, e)
            raise
        finally:
            if end:
                self.store.pop(key)
            self._local.origin = None
        self._refresh(origin, sessions=True)
        return out

    # ------------------------------------------------------------ whole texts

    def encode(
        self,
        origin: Origin,
        text: bytes | str,
        *,
        key: Key | None = None,
        add_special_tokens: bool = True,
        start: bool = False,
        end: bool = False,
        what: str = "TEXT",
    ) -> Reply:
        """Ids of a whole text, repaired in a held session when one matches.

        Args:
            origin: the face and model, for the metrics.
            text: UTF-8 bytes or ``str``: the whole prompt (the session is updated to it, wherever it departs).
            key: the session's key (correlation ID, header value, conversation ID); ``None``, ``0``, ``""``
                mean none: a text of at least ``min_prefix_chars`` finds its session by prefix, a shorter one
                gets a stateless encode.
            add_special_tokens: HF ``add_special_tokens``; a keyed session opened with the other flag is
                replaced.
            start: drop what ``key`` held first (Triton's sequence START).
            end: free the session of ``key`` after this request (Triton's sequence END), even if it fails.
            what: how error messages name the field (``"QUERY"``, ``"prompt"``).

        Returns:
            :class:`Reply` with all ids (``session`` ``"key"``/``"prefix"``, or ``None`` and route
            ``encode`` / ``busy``).

        Raises:
            InvalidRequest: not UTF-8, lone surrogates, or over ``max_text_bytes``. A held session is left
                as it was.
        """
        t0 = time.perf_counter()
        flag = bool(add_special_tokens)
        if key is not None and (isinstance(key, bool) or key in (0, "")):
            key = None
        self._local.origin = origin
        sessions = key is not None
        try:
            self._sync()
            if start and key is not None and self.store.get(key, touch=False) is not None:
                self.store.pop(key, "start")
            value, size = self._text(text, key, what)
            if key is not None:
                out = self._keyed(origin, key, value, size, "full", "full", flag, wait=False, t0=t0)
            elif len(value) >= self.min_prefix_chars:
                sessions = True
                out = self._by_prefix(origin, value, size, flag, t0)
            else:
                out = self._stateless(origin, value, flag, t0)
        except Exception as e:
            self._count_error(origin, e)
            raise
        finally:
            if end and key is not None:
                self.store.pop(key)
            self._local.origin = None
        self._refresh(origin, sessions=sessions)
        return out

    def encode_stateless(self, origin: Origin, text: bytes | str, *, add_special_tokens: bool = True,
                         what: str = "TEXT") -> Reply:
        """Ids of one text, no session.

        On a GPU model instance the body of a fresh text goes through the router (GPU above its crossover,
        else the CPU; counted in ``toktier_encode_route_total``).

        Returns:
            :class:`Reply`, route ``encode``; gpt2 ``b"hello world"`` -> ids ``[31373, 995]``.

        Raises:
            InvalidRequest: not UTF-8, lone surrogates, or over ``max_text_bytes``.
        """
        t0 = time.perf_counter()
        try:
            self._sync()
            value, _ = self._text(text, None, what)
            out = self._stateless(origin, value, bool(add_special_tokens), t0)
        except Exception as e:
            self._count_error(origin, e)
            raise
        self._refresh(origin, sessions=False)
        return out

    def encode_batch(self, origin: Origin, items: list[tuple[bytes | str, bool] | Exception]) -> list[Reply | Exception]:
        """:meth:`encode_stateless` for every ``(text, add_special_tokens)`` of one batch; an ``Exception``
        item (a request its face refused) is passed through.

        On a GPU model instance the valid texts whose ids the fast path serves are first encoded together
        (``GpuRouter.batch``: the GPU share in one device pass, the rest on the CPU); each request then runs
        as alone (validation, post-processor, metrics, verifier), its body taken from that pass.

        Returns:
            one :class:`Reply` or the exception that request raised, per item, in order (errors counted).
        """
        t0 = time.perf_counter()
        self._sync()
        decoded: list[tuple[str, bool] | Exception] = []
        for item in items:
            if isinstance(item, Exception):
                decoded.append(item)
                continue
            try:
                decoded.append((self._text(item[0], None)[0], bool(item[1])))
            except Exception as e:
                self._count_error(origin, e)
                decoded.append(e)

        def run_all() -> list[Reply | Exception]:
            out: list[Reply | Exception] = []
            for d in decoded:
                if isinstance(d, Exception):
                    out.append(d)
                    continue
                try:
                    out.append(self._stateless(origin, d[0], d[1], t0))
                except Exception as e:
                    self._count_error(origin, e)
                    out.append(e)
            return out

        texts = [d[0] for d in decoded if not isinstance(d, Exception) and not self.tokenizer.needs_reference(d[1])]
        if self.router is None or "full" in self.tokenizer.quarantined or not texts:
            out = run_all()
        else:
            with self.router.batch(texts):
                out = run_all()
        self._refresh(origin, sessions=False)
        return out

    # ------------------------------------------------------------ chat

    def use_chat_template(self, source: str | None, special_tokens: Mapping[str, str] | None = None) -> None:
        """Make ``source`` the chat template of :meth:`chat` (a face that resolves its own, e.g. vLLM's HF
        tokenizer or the proxy's ``--chat-template``); ``None``: none. A held conversation rendered with
        another template gets a new renderer at its next request (:meth:`_chat_run`).

        Raises:
            UnsupportedTokenizer: the template does not compile.
        """
        if not source:
            self.chat_template = None
            return
        cur = self.chat_template
        special = dict(special_tokens or {})
        if cur is not None and cur.source == source and cur.special_tokens == special:
            return
        self.chat_template = ChatTemplate(source, special,
                                          session_class=cur.session_class if cur is not None else None)

    def chat(
        self,
        origin: Origin,
        messages: list[Mapping[str, Any]] | bytes,
        *,
        key: Key | None = None,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        reply: str | bytes | None = None,
        start: bool = False,
        end: bool = False,
        wait: bool = False,
        mode: str | bytes | None = None,
    ) -> Reply:
        """Ids of a chat request: ``messages`` rendered with the core's chat template, then encoded, as
        transformers' ``apply_chat_template(messages, tokenize=True, ...)`` does.

        The conversation's :class:`~toktier_backend.chat.session.ChatSession` lives in the store entry of
        its tokenizer session (one TTL, LRU order and byte budget; evicted and ended together). It renders
        only what changed since the conversation's previous request; the tokenizer session then appends the
        render's delta when the new text extends the old one, else is updated to the new text
        (:meth:`_chat_advance`). Found by ``key``, else by the conversation's first two messages (a
        fingerprint held by :meth:`SessionStore.find_chat`); with neither, a conversation whose message
        contents are shorter than ``min_prefix_chars`` is rendered in full and encoded without a session.
        While the shadow verifier holds the template's incremental rendering in quarantine, every request
        is rendered in full (route ``full:quarantined``).

        Args:
            origin: the face and model, for the metrics.
            messages: OpenAI-style ``{"role", "content", ...}`` dicts (parsed JSON), or the UTF-8 JSON
                array of them as ``bytes`` (Triton's ``MESSAGES``): a keyed conversation then parses only
                the bytes from its first changed message on (:class:`~toktier_backend.chat.wire.
                IncrementalBody`, held by its chat session); the message dicts it gives are shared with the
                conversation's later requests.
            key: the conversation's key (correlation ID, header value, body field); ``None``, ``0``, ``""``:
                none.
            tools, documents, add_generation_prompt, continue_final_message: as ``apply_chat_template``.
            chat_template_kwargs: more template variables (``enable_thinking``, ...); may override the
                special tokens, not the names above.
            add_special_tokens: HF ``add_special_tokens`` of the encode (default ``False``: the template
                writes the special tokens, as ``apply_chat_template(tokenize=True)`` encodes).
            reply: ``"full"`` (default) or ``"patch"`` (ids from ``keep`` on).
            start: drop what ``key`` held first (Triton's sequence START).
            end: free the session of ``key`` after this request, even if it fails.
            wait: a keyed session in use by another request is waited for (Triton's sequence order);
                ``False``: that request is rendered in full and encoded without a session (``busy``).
            mode: ``"full"`` (default): ``messages`` is the whole conversation. ``"delta"`` (keyed only):
                ``messages`` are the messages after the previous request's, which the conversation's chat
                session still holds (:meth:`ChatSession.render_more`): O(new messages) from the wire on,
                nothing of the old conversation is compared.

        Returns:
            :class:`Reply`; ``render`` is the render route (``incremental`` or ``full:<reason>``,
            ``toktier_chat_renders_total``). The ids equal HF ``Tokenizer.from_file(path).encode(text,
            add_special_tokens=flag).ids`` of ``text`` = the jinja2 reference render
            (``chat.template.ChatRenderer``, transformers-compatible).

        Raises:
            InvalidRequest: the core has no chat template, malformed messages or options, the template
                refused the request, or the rendered text is over ``max_text_bytes`` or not encodable;
                ``mode="delta"`` without a key or with ``start``. A held session is left as it was (its renderer may have
                advanced: the next request then updates the tokenizer session from the whole text).
            UnknownSession: ``mode="delta"`` and the key holds no chat session that rendered and kept its
                previous request (none, ended, evicted, after a text request, a refused request or
                ``continue_final_message``, busy, or rendered in full while quarantined): resend the whole
                conversation (``mode="full"``).
        """
        t0 = time.perf_counter()
        flag = bool(add_special_tokens)
        if key is not None and (isinstance(key, bool) or key in (0, "")):
            key = None
        self._local.origin = origin
        quarantined = False
        try:
            self._sync()
            if start and key is not None and self.store.get(key, touch=False) is not None:
                self.store.pop(key, "start")
            reply = _choice("REPLY", reply, REPLIES)
            delta = _choice("MODE", mode, MODES) == "delta"
            if key is not None:
                _check_key(key)
            elif delta:
                raise InvalidRequest("a delta of messages (MODE=delta) needs a session key (a correlation ID): "
                                     "send the whole conversation instead")
            if delta and start:
                raise InvalidRequest(
                    f"correlation ID {key!r}: the sequence START request has MODE='delta' with MESSAGES, but a new "
                    f"sequence has no previous request to extend: send the whole conversation (MODE=full) on START")
            tpl = self.chat_template
            if tpl is None:
                raise InvalidRequest(
                    f"this server has no chat template for tokenizer {self.name}: put tokenizer_config.json (with "
                    f"chat_template) or chat_template.jinja beside tokenizer.json, or set the chat_template "
                    f"parameter (a file or the template); or send the rendered TEXT instead."
                )
            options = _chat_options(tools, documents, add_generation_prompt, continue_final_message,
                                    chat_template_kwargs)
            quarantined = self.verifier is not None and tpl.key in self.verifier.chat_quarantined
            if key is None:
                messages = _parsed(messages)  # no conversation to compare raw bytes with
            if key is not None:
                out = self._chat_keyed(origin, tpl, key, messages, options, flag, reply, wait, quarantined, t0,
                                       delta)
            else:
                out = self._chat_unkeyed(origin, tpl, messages, options, flag, reply, quarantined, t0)
        except Exception as e:
            self._count_error(origin, e)
            raise
        finally:
            if end and key is not None:
                self.store.pop(key)
            self._local.origin = None
        self._refresh(origin, sessions=True)
        if self.metrics is not None:
            self.metrics.set_chat_quarantined(origin, quarantined)
        return out

    def _no_delta_base(self, key: Key, why: str) -> str:
        """The message of a refused delta of messages (``UnknownSession``)."""
        return (f"correlation ID {key!r} (tokenizer {self.name}): MODE=delta with MESSAGES needs the "
                f"conversation's previous chat request, and this server holds none to extend ({why}): resend the "
                f"whole conversation with MODE=full")

    def _chat_keyed(self, origin: Origin, tpl: "ChatTemplate", key: Key, messages, options: dict, flag: bool,
                    reply: str, wait: bool, quarantined: bool, t0: float, delta: bool = False) -> Reply:
        self.store.expire()
        while True:
            entry = self.store.get(key)
            if delta and (entry is None or entry.add_special_tokens != flag):
                raise UnknownSession(self._no_delta_base(key, "no chat session is held for it"))
            if entry is None or entry.add_special_tokens != flag:
                # held only once its first request succeeded: a failed one leaves the store as it was
                new = SessionEntry(self.tokenizer.session(add_special_tokens=flag), flag, 0, self.store.now())
                with new.lock:
                    return self._chat_run(origin, tpl, key, new, messages, options, reply, quarantined, t0,
                                          fresh=True)
            if not entry.lock.acquire(blocking=wait):
                if delta:
                    raise UnknownSession(self._no_delta_base(key, "its session is in use by another request"))
                return self._chat_stateless(origin, tpl, _parsed(messages), options, flag, t0,
                                            "quarantined" if quarantined else "busy")
            try:
                if not self.store.holds(key, entry):
                    continue  # ended, evicted or replaced while this request waited: look again
                if delta and not (entry.chat is not None and getattr(entry.chat, "template", None) is tpl
                                  and entry.chat.extendable):
                    raise UnknownSession(self._no_delta_base(
                        key, "its previous request was not a chat request this session rendered and kept"))
                return self._chat_run(origin, tpl, key, entry, messages, options, reply, quarantined, t0,
                                      delta=delta)
            finally:
                entry.lock.release()

    def _chat_unkeyed(self, origin: Origin, tpl: "ChatTemplate", messages, options: dict, flag: bool, reply: str,
                      quarantined: bool, t0: float) -> Reply:
        self.store.expire()
        fp = _chat_fingerprint(flag, messages)
        found = self.store.find_chat(fp) if fp is not None else None
        if found is None:
            if fp is None or _content_chars(messages, self.min_prefix_chars) < self.min_prefix_chars:
                return self._chat_stateless(origin, tpl, messages, options, flag, t0,
                                            "quarantined" if quarantined else "no_session")
            key = self.store.new_prefix_key()
            entry = SessionEntry(self.tokenizer.session(add_special_tokens=flag), flag, 0, self.store.now())
            with entry.lock:
                return self._chat_run(origin, tpl, key, entry, messages, options, reply, quarantined, t0,
                                      fresh=True, fingerprint=fp)
        key, entry = found
        if not entry.lock.acquire(blocking=False):
            return self._chat_stateless(origin, tpl, messages, options, flag, t0,
                                        "quarantined" if quarantined else "busy")
        try:
            if not self.store.holds(key, entry):
                return self._chat_stateless(origin, tpl, messages, options, flag, t0,
                                            "quarantined" if quarantined else "busy")
            return self._chat_run(origin, tpl, key, entry, messages, options, reply, quarantined, t0)
        finally:
            entry.lock.release()

    @staticmethod
    def _chat_advance(render, session, text_bytes: int, synced: bool) -> tuple[Callable, int]:
        """How the tokenizer session follows a render: ``(update, size)``, ``update(session) -> ids`` and the
        new text's size in UTF-8 bytes.

        ``synced``: the session's text is the chat session's previous render (no other request, no failed
        step since). Then the new text is the session's first ``render.departure`` chars + ``render.delta``
        (the definition of ``departure``): an ``append(delta)`` when it extends the old text, else a
        ``splice(departure, delta)``; neither joins nor compares the text before the departure. Otherwise
        ``update(text)``, which finds the departure again by comparing texts.

        Raises:
            InvalidRequest: the text holds a lone surrogate (UTF-8 cannot encode it).
        """
        if synced:
            delta, at = render.delta, render.departure
            if render.extends_previous:
                return (lambda s: s.append(delta)), text_bytes + _utf8_size(delta)
            return (lambda s: s.splice(at, delta)), text_bytes - _utf8_size(session.tail(at)) + _utf8_size(delta)
        text = render.text
        return (lambda s: s.update(text)), _utf8_size(text)

    def _chat_run(self, origin: Origin, tpl: "ChatTemplate", key: Key, entry: SessionEntry, messages, options: dict,
                  reply: str, quarantined: bool, t0: float, *, fresh: bool = False,
                  fingerprint: Hashable | None = None, delta: bool = False) -> Reply:
        """Render (incrementally, or in full while quarantined), advance the tokenizer session on the pool at
        REPAIR priority, hold and charge the entry, sample, count. The caller holds ``entry.lock``.
        ``delta``: ``messages`` follow the messages of ``entry.chat``'s previous request (checked by the
        caller: :meth:`ChatSession.extendable`, same template)."""
        synced = entry.chat is not None and entry.chat_synced == entry.requests
        # the raw body the chat session's incremental parser keeps (a delta is parsed whole, and resets it)
        body_bytes = len(messages) if not delta and isinstance(messages, (bytes, bytearray, memoryview)) else 0
        entry.chat_synced = -1  # until this step has succeeded (a failed render or encode breaks the pairing)
        if delta:
            chat = entry.chat
            if isinstance(messages, (bytes, bytearray, memoryview)):  # parsed by the session: kept uncopied
                render = chat.render_more_body(messages, **options)
            else:
                render = chat.render_more(messages, **options)
            messages = chat.messages
            if quarantined:  # the kept messages are still exact; the text comes from the full render
                render = _FullRender(tpl.full_renderer().render(messages, **options), "full:quarantined")
                chat, synced = None, False
        elif quarantined:
            messages = _parsed(messages)
            render = _FullRender(tpl.full_renderer().render(messages, **options), "full:quarantined")
            chat = None  # its records no longer describe the session's text: dropped, rebuilt when released
            synced = False
        else:
            chat = entry.chat
            if chat is None or getattr(chat, "template", None) is not tpl:
                chat, synced = tpl.session(), False  # new, or made for a template the core no longer uses
            if isinstance(messages, (bytes, bytearray, memoryview)):
                try:
                    render, messages = chat.render_body(messages, top="array", **options)
                except InvalidRequest:
                    parse_messages(messages)  # a malformed array raises its precise error (only on a refusal)
                    raise  # well formed: the template refused it
            else:
                render = chat.render(messages, **options)
        update, size = self._chat_advance(render, entry.session, entry.text_bytes, synced)
        if size > self.max_text_bytes:
            raise InvalidRequest(
                f"the rendered prompt is {size} bytes, over max_text_bytes={self.max_text_bytes} (tokenizer "
                f"{self.name}). Shorten the conversation or raise the model parameter max_text_bytes."
            )
        try:
            ids = self.pool.call(update, entry.session, priority=runtime_pool.REPAIR)
        except InvalidRequest:
            raise  # the tokenizer keeps the session unchanged on a bad request
        except BaseException:
            with self.store.lock:
                if not fresh and self.store.holds(key, entry):
                    self.store.pop(key, "error")  # possibly half-updated: the next request starts afresh
            raise
        chars = render.departure + len(render.delta)
        width = max(entry.chat_width if chat is not None and chat is entry.chat else 1, _char_width(render.delta))
        with self.store.lock:
            entry.chat, entry.chat_width = chat, width
            entry.text_bytes = size
            entry.last_used = self.store.now()
            entry.requests += 1
            entry.chat_synced = entry.requests if chat is not None else -1
            entry.chat_nbytes = (chat_nbytes(chars, entry.chat_width, len(messages), body_bytes)
                                 if chat is not None else 0)
            if fresh:
                self.store.put(key, entry)  # (may evict least recently used sessions, or this one)
            else:
                self.store.account(key)
            if fingerprint is not None:
                self.store.index_chat(key, fingerprint)
        repair = getattr(entry.session, "last_repair", None)
        keep = 0 if fresh or repair is None else int(repair.reused)
        route = "new" if repair is None else str(repair.route)
        out = np.array(ids[keep:] if reply == "patch" else ids, dtype=np.int32)  # owned by the reply
        if self.metrics is not None:
            self.metrics.observe_reply(origin, "chat", route, time.perf_counter() - t0, repair)
            self.metrics.observe_chat_render(origin, render.route)
        if self.verifier is not None and self.verifier.wants():
            self.verifier.submit(entry.session.text_blocks(), entry.session.ids, frozen=True,
                                 add_special_tokens=entry.add_special_tokens, route=route,
                                 cut=int(getattr(repair, "cut", 0) or 0), engine=str(getattr(repair, "engine", "")),
                                 tag=origin, chat=tpl.check(messages, options, render.route))
        kind = "prefix" if fingerprint is not None or isinstance(key, PrefixKey) else "key"
        return Reply(out, len(ids), keep, route, kind, fresh, render.route)

    def _chat_stateless(self, origin: Origin, tpl: "ChatTemplate", messages, options: dict, flag: bool, t0: float,
                        reason: str) -> Reply:
        """A full render (minijinja where its canary admitted the template, else jinja2) and a plain encode,
        no session: ``reason`` is ``no_session``, ``busy`` or ``quarantined``."""
        text = tpl.full_renderer().render(messages, **options)
        value, _ = self._text(text, None, "the rendered prompt")
        ids = np.asarray(self.tokenizer.encode(value, add_special_tokens=flag), dtype=np.int32)
        route = "busy" if reason == "busy" else "encode"
        render_route = "full:" + reason
        if self.metrics is not None:
            self.metrics.observe_reply(origin, "chat", route, time.perf_counter() - t0)
            self.metrics.observe_chat_render(origin, render_route)
        if self.verifier is not None and self.verifier.wants():
            self.verifier.submit(value, ids, add_special_tokens=flag, route="encode",
                                 engine=str(getattr(self.tokenizer.engine, "name", "")), tag=origin,
                                 chat=tpl.check(messages, options, render_route))
        return Reply(ids, len(ids), 0, route, None, False, render_route)

    def drop(self, key: Key) -> bool:
        """Free the session of ``key`` (END without a request); ``False`` if none was held."""
        return self.store.pop(key) is not None

    def refuse(self, origin: Origin, exc: BaseException, *, key: Key | None = None, start: bool = False,
               end: bool = False) -> None:
        """A request the face refused before calling the core (unparsable tensors, a missing input): count
        the error, and still honour START (drop what ``key`` held, cause ``start``) and END (free it)."""
        if key is not None and not isinstance(key, bool) and key not in (0, "") and (start or end):
            self.store.pop(key, "start" if start else None)
        self._count_error(origin, exc)

    # ------------------------------------------------------------ the steps

    def _keyed(self, origin: Origin, key: Key, value: str, size: int, mode: str, reply: str,
               add_special: bool | None, *, wait: bool, t0: float) -> Reply:
        """A keyed session step; ``wait=False``: a session in use gets a plain encode (route ``busy``)."""
        self.store.expire()
        while True:
            entry = self.store.get(key)
            if mode == "full":
                flag = True if add_special is None else bool(add_special)
                if entry is None or entry.add_special_tokens != flag:
                    # held only once its first update succeeded: a failed one leaves the store as it was
                    new = SessionEntry(self.tokenizer.session(add_special_tokens=flag), flag, 0, self.store.now())
                    with new.lock:
                        return self._run(origin, key, new, lambda s: s.update(value), mode, reply, size, t0,
                                         fresh=True)
            elif entry is None:
                raise UnknownSession(
                    f"correlation ID {key!r}: this server holds no session for it (never opened, ended, idle "
                    f"longer than {self.store.ttl_s:g} s, evicted under the session memory budget, or the server "
                    f"restarted), so MODE='delta' has no text to append to. Resend the whole text with "
                    f"MODE='full' (tokenizer {self.name})."
                )
            if not entry.lock.acquire(blocking=wait):
                return self._busy(origin, value, entry.add_special_tokens if add_special is None else bool(add_special), t0)
            try:
                if not self.store.holds(key, entry):
                    continue  # ended, evicted or replaced while this request waited: look again
                if mode == "full":
                    return self._run(origin, key, entry, lambda s: s.update(value), mode, reply, size, t0)
                if add_special is not None and bool(add_special) != entry.add_special_tokens:
                    raise InvalidRequest(
                        f"correlation ID {key!r}: ADD_SPECIAL_TOKENS={bool(add_special)} but the session was "
                        f"opened with {entry.add_special_tokens}; a delta cannot change it. Omit it, or resend "
                        f"the whole text with MODE='full'."
                    )
                total = entry.text_bytes + size
                if total > self.max_text_bytes:
                    raise InvalidRequest(
                        f"correlation ID {key!r}: the session text would grow to {total} bytes, over "
                        f"max_text_bytes={self.max_text_bytes}. End the session or raise the model parameter."
                    )
                return self._run(origin, key, entry, lambda s: s.append(value), mode, reply, total, t0)
            finally:
                entry.lock.release()

    def _by_prefix(self, origin: Origin, value: str, size: int, flag: bool, t0: float) -> Reply:
        self.store.expire()
        checkpoints, depth = self.store.checkpoints(value, flag)
        found = self.store.find_prefix(checkpoints)
        if found is None:
            key = self.store.new_prefix_key()
            entry = SessionEntry(self.tokenizer.session(add_special_tokens=flag), flag, 0, self.store.now())
            with entry.lock:
                return self._run(origin, key, entry, lambda s: s.update(value), "full", "full", size, t0,
                                 fresh=True, checkpoints=(checkpoints, depth))
        key, entry = found
        if not entry.lock.acquire(blocking=False):
            return self._busy(origin, value, flag, t0)
        try:
            if not self.store.holds(key, entry):
                return self._busy(origin, value, flag, t0)  # evicted meanwhile: not worth a new session now
            return self._run(origin, key, entry, lambda s: s.update(value), "full", "full", size, t0,
                             checkpoints=(checkpoints, depth))
        finally:
            entry.lock.release()

    def _run(self, origin: Origin, key: Key, entry: SessionEntry, update, mode: str, reply: str, size: int,
             t0: float, *, fresh: bool = False, checkpoints: tuple | None = None) -> Reply:
        """Run ``update(session)`` on the pool at REPAIR priority (the caller holds ``entry.lock``), then hold
        and charge the entry, sample the reply, count it."""
        try:
            # at REPAIR priority: runs now on this thread, never behind chunks of long encodes
            ids = self.pool.call(update, entry.session, priority=runtime_pool.REPAIR)
        except InvalidRequest:
            raise  # the tokenizer keeps the session unchanged on a bad request
        except BaseException:
            with self.store.lock:
                if not fresh and self.store.holds(key, entry):
                    # The session may be half-updated: forget it, so the next delta gets NOT_FOUND and the
                    # client resends the whole text (exact over available).
                    self.store.pop(key, "error")
            raise
        with self.store.lock:
            entry.text_bytes = size
            entry.last_used = self.store.now()
            entry.requests += 1
            if fresh:
                self.store.put(key, entry)  # (may evict least recently used sessions, or this one)
            else:
                self.store.account(key)
            if checkpoints is not None:
                self.store.index(key, *checkpoints)
        repair = getattr(entry.session, "last_repair", None)
        keep = 0 if fresh or repair is None else int(repair.reused)
        route = "new" if repair is None else str(repair.route)
        n = len(ids)
        # a copy owned by the reply: a face or Triton that still held a view of the session buffer when the
        # next request of the session arrives would make that splice copy the whole buffer (copy-on-write)
        out = np.array(ids[keep:] if reply == "patch" else ids, dtype=np.int32)
        if self.metrics is not None:
            self.metrics.observe_reply(origin, mode, route, time.perf_counter() - t0, repair)
        if self.verifier is not None and self.verifier.wants():
            # by reference, no O(n) copy here: the text's blocks (joined on the verifier's thread) and the session's
            # copy-on-write view of the ids, which no later call changes
            self.verifier.submit(entry.session.text_blocks(), entry.session.ids, frozen=True,
                                 add_special_tokens=entry.add_special_tokens, route=route,
                                 cut=int(getattr(repair, "cut", 0) or 0), engine=str(getattr(repair, "engine", "")),
                                 tag=origin)
        kind = "prefix" if checkpoints is not None else "key"
        return Reply(out, n, keep, route, kind, fresh)

    def _busy(self, origin: Origin, value: str, flag: bool, t0: float) -> Reply:
        """The session is in use by another request: a plain encode, counted as route ``busy``."""
        r = self._stateless(origin, value, flag, t0, count_as=("full", "busy"))
        return dataclasses.replace(r, route="busy")

    def _stateless(self, origin: Origin, value: str, flag: bool, t0: float,
                   count_as: tuple[str, str] = ("encode", "encode")) -> Reply:
        if self.router is None:
            ids, where = self.tokenizer.encode(value, add_special_tokens=flag), "cpu_instance"
        else:
            ids, where = self.tokenizer.encode_with_body(value, flag, self._routed_body)
            if where == "reference":
                where = "cpu_reference"
        ids = np.asarray(ids, dtype=np.int32)
        if self.metrics is not None:
            self.metrics.observe_reply(origin, count_as[0], count_as[1], time.perf_counter() - t0)
            self.metrics.observe_encode_route(origin, where)
        if self.verifier is not None and self.verifier.wants():
            self.verifier.submit(value, ids, add_special_tokens=flag, route="encode",
                                 engine="gpu" if where == "gpu" else str(getattr(self.tokenizer.engine, "name", "")),
                                 tag=origin)
        return Reply(ids, len(ids), 0, "encode")

    def _routed_body(self, text: str) -> tuple[np.ndarray, str]:
        """Body ids ``int32[n]`` of a fresh text on a GPU instance, and the route (``GpuRouter.encode``'s, or
        ``"cpu_quarantined"``). A quarantined ``full`` route (the shadow verifier caught a stateless reply,
        possibly the GPU's) keeps every text off the GPU until an operator clears it."""
        if "full" in self.tokenizer.quarantined:
            return self.tokenizer.encode_fresh(text)[0], "cpu_quarantined"
        return self.router.encode(text)

    # ------------------------------------------------------------ verifier, metrics

    def _sync(self) -> None:
        if self.verifier is not None:
            self.verifier.sync()  # quarantine file: at most one stat() per poll interval

    def _count_error(self, origin: Origin, exc: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.observe_error(origin, error_code(exc))

    def _enforce_budget(self) -> None:
        """The prefix indexer's thread, after an insert: evict (sessions or index chunks, least recently used
        first) until both fit the shared budget again."""
        self.store.account(None)

    def _label(self) -> Origin:
        """The origin of what this thread is doing: its request's, else the first face's that holds sessions."""
        origin = getattr(self._local, "origin", None)
        if origin is not None:
            return origin
        origins = self._session_origins or self._origins
        return origins[0] if origins else Origin("core", "sessions")

    def _on_evict(self, key: Key, entry: SessionEntry, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_eviction(self._label(), cause)

    def _on_sample(self, sample, ok: bool) -> None:
        """Verifier thread: count the check under the request's origin; on a mismatch refresh the quarantine
        gauges of every origin at once."""
        origin = sample.tag if isinstance(sample.tag, Origin) else self._label()
        self.metrics.observe_sample(origin, sample.route, ok)
        for o in ([origin] + [x for x in self._origins if x != origin]) if not ok else [origin]:
            self.metrics.set_state(o, verifier=self.verifier, tokenizer=None if ok else self.tokenizer)

    def _refresh(self, origin: Origin, *, sessions: bool) -> None:
        if self.metrics is None:
            return
        with self._gauge_lock:
            dropped = 0
            if self.verifier is not None:
                dropped = self.verifier.dropped - self._dropped_seen
                self._dropped_seen += dropped
        self.metrics.set_state(origin, store=self.store if sessions else None, verifier=self.verifier,
                               tokenizer=self.tokenizer, dropped_delta=dropped, pool=self.pool)

    # ------------------------------------------------------------ checks

    def _text(self, raw: bytes | str, key: Key | None, what: str = "TEXT") -> tuple[str, int]:
        """``raw`` as ``str`` and its size in UTF-8 bytes.

        Raises:
            InvalidRequest: not ``bytes``/``str``, over ``max_text_bytes``, not UTF-8, or a lone surrogate.
        """
        where = "" if key is None else f"correlation ID {key!r}: "
        if isinstance(raw, (bytes, bytearray, memoryview)):
            size = len(raw)
        elif isinstance(raw, str):
            size = len(raw.encode("utf-8", "surrogatepass"))
        else:
            raise InvalidRequest(f"{where}{what} must be a string (UTF-8 bytes), got {type(raw).__name__}")
        if size > self.max_text_bytes:
            raise InvalidRequest(
                f"{where}{what} is {size} bytes, over max_text_bytes={self.max_text_bytes} (tokenizer {self.name}). "
                f"Split the text, send deltas, or raise the model parameter max_text_bytes."
            )
        return self._decode(raw, where, what), size

    def _decode(self, raw: bytes | str, where: str, what: str) -> str:
        if isinstance(raw, str):
            try:
                raw.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequest(
                    f"{where}{what} holds a lone surrogate {raw[e.start:e.end]!r} at char {e.start}, which UTF-8 "
                    f"cannot encode (tokenizer {self.name}). Send valid Unicode text."
                ) from e
            return raw
        try:
            return decode_text(bytes(raw), what=what)
        except InvalidRequest as e:
            raise InvalidRequest(f"{where}{e} (tokenizer {self.name})") from e


# ---------------------------------------------------------------- chat templates


CHAT_COPIES = 3
"""Copies of the rendered text a chat session keeps, as an upper bound for the byte budget: the message
snapshots (their strings), the records' rendered pieces, and the joined text of the last render (bounded by
a ``tracemalloc`` test in ``tests/serving/test_chat_core.py``)."""

CHAT_MESSAGE_BYTES = 2048
"""Bytes per message a chat session keeps beyond its strings: two dicts (snapshot and prepared copy), the
record of each loop, list slots (same test)."""

CHAT_OVERHEAD = 64 * 1024
"""Bytes per chat session beyond its messages: the session, its plan's per-session objects, the recording
namespace class (same test)."""


def chat_nbytes(chars: int, width: int, messages: int, body_bytes: int = 0) -> int:
    """Bytes charged for a chat session whose last render was ``chars`` chars of ``width`` bytes per char
    (1, 2 or 4: CPython's compact strings) over ``messages`` messages, plus the ``body_bytes`` of the raw
    request its incremental parser keeps (``chat.wire.IncrementalBody``; 0 for parsed messages)."""
    return CHAT_COPIES * width * chars + CHAT_MESSAGE_BYTES * messages + CHAT_OVERHEAD + body_bytes


class ChatTemplate:
    """A core's chat template: the jinja2 reference (compiled at load), and, on first use, the analysis
    (``chat.analysis.analyze``) and the minijinja admission (``chat.fast.admit``) shared by every
    conversation's ``ChatSession``.

    Args:
        source: jinja source.
        special_tokens: the template's ``bos_token``, ``eos_token``, ...
        session_class: the conversation renderer's class (default ``chat.session.ChatSession``).

    Raises:
        UnsupportedTokenizer: the template does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, *,
                 session_class: Callable[..., Any] | None = None):
        from toktier_backend.chat.template import ChatRenderer

        self.source = source
        self.reference = ChatRenderer(source, special_tokens)
        self.special_tokens = dict(self.reference.special_tokens)
        self.key = chat_template_key(source)
        self.session_class = session_class
        self._lock = threading.Lock()
        self._plan = None
        self._full = None

    def _prepare(self) -> None:
        with self._lock:
            if self._plan is not None:
                return
            from toktier_backend.chat.analysis import analyze
            from toktier_backend.chat.fast import admit

            full = admit(self.source, self.special_tokens).renderer
            self._full = full if full is not None else self.reference
            self._plan = analyze(self.source)

    def full_renderer(self):
        """The full renderer: minijinja where its canary admitted the template, else the jinja2 reference
        (``render(messages, **options) -> str``; thread-safe)."""
        if self._plan is None:
            self._prepare()
        return self._full

    def session(self):
        """A new conversation renderer (``ChatSession``) sharing this template's analysis and full renderer."""
        if self._plan is None:
            self._prepare()
        cls = self.session_class
        if cls is None:
            from toktier_backend.chat.session import ChatSession as cls
        chat = cls(self.source, self.special_tokens, fast_full=False, plan=self._plan, full_renderer=self._full)
        chat.template = self  # which template it renders (``ServingCore.use_chat_template`` may replace it)
        return chat

    def check(self, messages, options: dict, route: str) -> ChatCheck:
        """What the verifier needs to re-render a sampled request: plain copies (the caller may reuse its
        dicts), the jinja2 reference (``ChatSession.full_render`` renders with the same one)."""
        from toktier_backend.chat.template import plain

        return ChatCheck(self.reference.render, plain(messages), plain(options), self.key, route)


@dataclasses.dataclass(frozen=True)
class _FullRender:
    """A whole-text render in ``ChatRender``'s shape (the quarantined path): it never extends anything."""

    text: str
    route: str
    departure: int = 0
    extends_previous: bool = False

    @property
    def delta(self) -> str:
        return self.text


_CHAT_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})


def _chat_options(tools, documents, add_generation_prompt, continue_final_message, kwargs) -> dict:
    """The render's keyword arguments.

    Raises:
        InvalidRequest: ``tools`` / ``documents`` not lists, ``continue_final_message`` neither a bool nor a
            string (a field name, as transformers 5 takes it), ``chat_template_kwargs`` not an object of
            string keys, or one of its keys is a name the request sets itself.
    """
    for name, v in (("tools", tools), ("documents", documents)):
        if v is not None and not isinstance(v, list):
            raise InvalidRequest(f"{name} must be a list (JSON array) or absent, got {type(v).__name__}")
    if not isinstance(continue_final_message, (bool, str)):
        raise InvalidRequest("continue_final_message must be a boolean or the name of the field to continue, got "
                             f"{type(continue_final_message).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequest(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    bad = [k for k in kwargs if not isinstance(k, str) or k in _CHAT_RESERVED]
    if bad:
        raise InvalidRequest(f"chat_template_kwargs may not set {bad!r}: send them as the request's own fields")
    return {**kwargs, "tools": tools, "documents": documents, "add_generation_prompt": bool(add_generation_prompt),
            "continue_final_message": continue_final_message}


def _parsed(messages):
    """``messages`` as a list: raw JSON bytes (Triton's ``MESSAGES``) parsed whole."""
    if isinstance(messages, (bytes, bytearray, memoryview)):
        return parse_messages(messages)
    return messages


def _chat_fingerprint(flag: bool, messages) -> Hashable | None:
    """A conversation's identity without a key: the hash of its first two messages (``marshal`` bytes), or
    ``None`` when they are not plain JSON values (such a request gets a full render, no session)."""
    if not isinstance(messages, list) or not messages:
        return None
    try:
        return (bool(flag), len(messages[:2]), hash(marshal.dumps(messages[:2], 0)))
    except ValueError:
        return None


def _content_chars(messages, limit: int) -> int:
    """Chars of the messages' string contents, counted up to ``limit`` (a lower bound of the prompt's)."""
    n = 0
    if not isinstance(messages, list):
        return 0
    for m in messages:
        c = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(x.get("text") or "") for x in c if isinstance(x, Mapping) and isinstance(x.get("text"), str))
        if n >= limit:
            break
    return n


def _utf8_size(text: str) -> int:
    """UTF-8 bytes of ``text``.

    Raises:
        InvalidRequest: a lone surrogate.
    """
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"the rendered prompt holds a lone surrogate {text[e.start:e.end]!r}, which UTF-8 cannot encode. Send "
            f"valid Unicode text in the messages."
        ) from e


def _char_width(text: str) -> int:
    """Bytes per char of CPython's compact string ``text``: 1, 2 or 4 (from ``sys.getsizeof``, O(1))."""
    if not text:
        return 1
    extra = sys.getsizeof(text) - sys.getsizeof("")
    return 4 if extra >= 4 * len(text) else 2 if extra >= 2 * len(text) else 1


def _load_chat_template(tokenizer: Tokenizer, configured: str) -> tuple[str | None, dict]:
    """The chat template source and special tokens of a core (:meth:`ServingCore.from_config`).

    Raises:
        UnsupportedTokenizer: ``configured`` cannot be read or does not compile.
    """
    from toktier_backend.chat.template import ChatRenderer, load_chat_template
    from toktier_backend.config import special_tokens

    path = getattr(tokenizer, "path", None)
    if configured:
        source = load_chat_template(path, configured)
        return source, special_tokens(path)
    try:
        source = load_chat_template(path)
        special = special_tokens(path)
        if source:
            ChatRenderer(source, special)  # compiles it (cached): a broken one refuses chat, not the model
        return source, special
    except UnsupportedTokenizer as e:
        log.error("chat template beside %s unusable, chat requests will be refused: %s", path, e)
        return None, {}


# ---------------------------------------------------------------- helpers


_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (InvalidRequest, "INVALID_ARG"),
    (UnknownSession, "NOT_FOUND"),
    (EngineUnavailable, "UNAVAILABLE"),
    (UnsupportedTokenizer, "UNAVAILABLE"),
)


def error_code(exc: BaseException) -> str:
    """The Triton error code name for ``exc``: INVALID_ARG, NOT_FOUND, UNAVAILABLE or INTERNAL (the
    ``code`` label of ``toktier_request_errors_total`` for every face)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return "INTERNAL"


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


def _check_key(key: Key) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, str)) or key in (0, ""):
        raise InvalidRequest(
            f"correlation ID {key!r}: a session needs a non-zero integer or non-empty string correlation ID "
            f"(sequence_id in tritonclient)."
        )


__all__ = ["DEFAULT_MAX_TEXT_BYTES", "DEFAULT_MIN_PREFIX_CHARS", "DEFAULT_SESSION_BUDGET_BYTES", "MODES", "REPLIES",
           "ChatTemplate", "CoreConfig", "Origin", "Reply", "ServingCore", "chat_nbytes", "error_code"]
