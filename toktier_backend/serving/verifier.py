"""Shadow verifier: re-encode sampled replies with the frozen HF reference, off the request path.

Admission (canary + exhaustive guard set) and the cut proofs are what make every id exact; the verifier is
the net under them, in production. It samples replies — always the first ``first_n`` per tokenizer and
engine build, then each with probability ``rate`` while the checks stay within ``cpu_share`` of one CPU —
and hands them to one background thread through a
bounded queue: a full queue *drops* the sample (counted), it never blocks a reply. The thread encodes the
text with ``tokenizers.Tokenizer.encode_batch([text])`` (which releases the GIL, unlike ``encode``) and
compares.

On a mismatch it

1. counts it and logs a repro: tokenizer sha256, engine build, route, cut, the differing id window, and the
   smallest text window around it on which the fast engine alone disagrees with the reference (if any:
   otherwise the cut/splice is the suspect). The text is redacted (lengths and a sha256) unless
   ``debug=True``;
2. quarantines the route that produced the reply (every fast route when the engine alone reproduces the
   disagreement) for this tokenizer and engine build: ``Tokenizer.quarantine``, so those requests go to the
   reference and live sessions rebuild once from it;
3. persists the quarantine to the :class:`QuarantineFile` when one is configured, so that every model
   instance (each a process) and every restart sees it, until an operator clears it:
   ``toktier quarantine list`` / ``toktier quarantine clear [--route R]`` (see ``model_repository/README.md``).

A sample holds references to the reply's text (no copy: a ``str``, or a session's text blocks, joined by the
thread) and a copy of its ids, or the ids themselves when the caller vouches that they never change
(``frozen``: a session's copy-on-write view); the queue is bounded in samples and in bytes.

**Chat requests** (``ServingCore.chat``) carry a :class:`ChatCheck`: the thread first renders the request in
full with the jinja2 reference (``ChatSession.full_render``) and compares the text char for char with the
one that was encoded, then checks the ids as above. A text mismatch quarantines *incremental rendering of
that template* (:meth:`Verifier.quarantine_chat`): the same quarantine file, under the build key
``chat-template/<template sha256>`` and route ``incremental``, so every instance and restart renders that
template in full (``ServingCore`` counts those renders with reason ``quarantined``) until an operator clears
it (``toktier quarantine clear --key chat-template/``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from toktier_backend.tokenizer import FAST_ROUTES, Tokenizer

log = logging.getLogger(__name__)


#: Default :class:`Verifier` ``cpu_share``: 2 % of one CPU for the checks beyond the first ``first_n``.
DEFAULT_CPU_SHARE = 0.02
#: Seconds of checks the budget allows ahead of ``cpu_share`` x uptime (one long check can always start).
BURST_S = 1.0

CHAT_KEY_PREFIX = "chat-template/"
"""Build keys ``chat-template/<sha256 of the template source>`` in the quarantine file: a chat template whose
incremental rendering is quarantined (route :data:`CHAT_ROUTE`)."""

CHAT_ROUTE = "incremental"


def chat_template_key(source: str) -> str:
    """The sha256 (hex) of a chat template's jinja source: what a chat quarantine is per."""
    return hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()


def build_key(tokenizer: Tokenizer) -> str:
    """``"<file sha256>/<engine>-<version>"``: what a quarantine and the first-N sampling are per."""
    eng = tokenizer.engine
    return f"{tokenizer.spec.sha256}/{eng.name}-{getattr(eng, 'version', 'unknown')}"


# ---------------------------------------------------------------- quarantine file


class QuarantineFile:
    """Quarantined routes in one JSON file, shared by model instances (processes) and restarts.

    Layout: ``{"<build key>": {"<route>": {"reason": str, "since": unix seconds, "tokenizer": path}}}``.
    Writes take an exclusive ``flock`` on ``<path>.lock`` and replace the file atomically; readers poll the
    file's mtime, so an operator's edit (``toktier quarantine clear``) reaches every instance within the
    poll interval.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> dict[str, dict[str, dict]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.error("quarantine file %s unreadable (%s): keeping the quarantine held in memory", self.path, e)
            raise
        return data if isinstance(data, dict) else {}

    def mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime_ns / 1e9
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def _locked(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.path) + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, data: dict) -> None:
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, self.path)

    def add(self, key: str, route: str, record: dict) -> None:
        """Quarantine ``route`` for build ``key`` (kept if already there)."""
        with self._locked():
            data = self.load()
            data.setdefault(key, {}).setdefault(route, record)
            self._write(data)

    def clear(self, key: str | None = None, route: str | None = None) -> list[tuple[str, str]]:
        """Release ``route`` (``None``: all) of builds whose key starts with ``key`` (``None``: all builds;
        a file sha256 prefix selects a tokenizer). Returns the ``(key, route)`` pairs released."""
        with self._locked():
            data = self.load()
            released = []
            for k in list(data):
                if key is not None and not k.startswith(key):
                    continue
                for r in list(data[k]):
                    if route is None or r == route:
                        del data[k][r]
                        released.append((k, r))
                if not data[k]:
                    del data[k]
            if released:
                self._write(data)
        return released


# ---------------------------------------------------------------- samples and repros


@dataclass
class ChatCheck:
    """What the verifier needs to re-render a chat request: ``render(messages, **options)`` is the jinja2
    reference (``ChatSession.full_render``), ``messages`` a plain copy taken when sampled (the caller may
    reuse its dicts), ``template`` the template's :func:`chat_template_key`, ``route`` how the text was
    rendered (``incremental`` or ``full:<reason>``)."""

    render: Callable[..., str]
    messages: list
    options: dict
    template: str
    route: str


@dataclass
class Sample:
    text: str  # the reply's text (the submitted blocks, joined by the thread before the check)
    ids: np.ndarray  # int32[n], a copy of the reply's ids, or the frozen ids themselves
    add_special_tokens: bool
    route: str  # the RepairInfo route, or "encode" for the stateless model
    cut: int
    engine: str
    key: str
    nbytes: int
    tag: Any = None  # the submitter's (the serving core's Origin), handed back to ``on_result``
    chat: ChatCheck | None = None  # a chat request: its text is re-rendered first


@dataclass
class Repro:
    """What a mismatch log line carries (``text_window`` only with ``debug``)."""

    key: str
    tokenizer: str
    route: str
    cut: int
    engine: str
    n_got: int
    n_want: int
    id_window: tuple[int, int]  # [first differing id, end of the differing ids in the reference)
    char_window: tuple[int, int]  # text chars covering the differing ids
    engine_window: tuple[int, int] | None  # smallest text window on which the engine alone disagrees
    window_sha256: str
    quarantined: list[str] = field(default_factory=list)
    text_window: str | None = None
    got_window: list[int] | None = None
    want_window: list[int] | None = None


def _diff_window(got: np.ndarray, want: np.ndarray) -> tuple[int, int, int]:
    """``(first, got_end, want_end)``: the differing id windows ``got[first:got_end]`` vs
    ``want[first:want_end]`` after stripping the common prefix and suffix."""
    n = min(len(got), len(want))
    neq = np.flatnonzero(got[:n] != want[:n])
    first = int(neq[0]) if len(neq) else n
    k = 0
    while k < n - first and got[len(got) - 1 - k] == want[len(want) - 1 - k]:
        k += 1
    return first, len(got) - k, len(want) - k


# ---------------------------------------------------------------- the verifier


class Verifier:
    """Samples replies and checks them against the HF reference on a background thread.

    Args:
        tokenizer: the core ``Tokenizer`` whose replies are checked (its ``reference`` is the oracle, its
            ``quarantine`` is what a mismatch triggers).
        rate: probability that a reply beyond the first ``first_n`` is sampled (0 disables that).
        first_n: replies always sampled per build key (tokenizer file sha256 + engine name and version).
        cpu_share: the most of one CPU the checks may take over time, beyond the first ``first_n``: a reply
            is sampled (with probability ``rate``) only while the checks' busy time so far is at most
            ``cpu_share`` x the seconds since the verifier started, plus :data:`BURST_S`. A check re-encodes
            the whole text with the reference (O(context) CPU), so without it a fixed ``rate`` costs the
            server more per request the longer the contexts (``docs/design/served_path.md``). ``None`` or 0:
            no budget. Replies the budget refused: :attr:`budget_skipped`.
        queue_size: most samples waiting; beyond it a sample is dropped (counted in ``dropped``).
        max_queue_bytes: most bytes (text + ids) waiting; beyond it a sample is dropped.
        debug: put the differing text window and ids in the log (default: redacted).
        quarantine_file: a :class:`QuarantineFile` path shared by instances; ``None``: in memory only.
        poll_s: how often, in seconds, :meth:`sync` re-reads the quarantine file.
        name: how logs name this tokenizer.
        on_result: ``on_result(sample, ok)`` after each check (metrics).
        seed: RNG seed (tests).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        rate: float = 0.01,
        first_n: int = 32,
        cpu_share: float | None = DEFAULT_CPU_SHARE,
        queue_size: int = 64,
        max_queue_bytes: int = 64 << 20,
        debug: bool = False,
        quarantine_file: str | os.PathLike | None = None,
        poll_s: float = 1.0,
        name: str = "",
        on_result: Callable[[Sample, bool], None] | None = None,
        seed: int | None = None,
    ):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate!r}")
        self.tokenizer = tokenizer
        self.rate = float(rate)
        self.first_n = int(first_n)
        if cpu_share is not None and not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"cpu_share must be in [0, 1], got {cpu_share!r}")
        self.cpu_share = float(cpu_share or 0.0)
        self._t0 = time.monotonic()
        self._spent = 0.0  # seconds the worker spent checking (wall time of each check: GIL waits included)
        self.budget_skipped = 0  # replies the rate picked that the budget refused
        self.max_queue_bytes = int(max_queue_bytes)
        self.debug = bool(debug)
        self.name = name or str(tokenizer.spec.path)
        self.file = QuarantineFile(quarantine_file) if quarantine_file else None
        self.poll_s = float(poll_s)
        self.on_result = on_result
        self._rng = random.Random(seed)
        self._queue: queue.Queue[Sample | None] = queue.Queue(maxsize=max(1, int(queue_size)))
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._qlock = threading.Lock()  # quarantine changes: file + memory together (worker vs sync)
        self._seen: dict[str, int] = {}
        #: chat templates (:func:`chat_template_key`) whose incremental rendering is quarantined -> reason
        self.chat_quarantined: dict[str, str] = {}
        self._file_mtime: float | None = None
        self._next_poll = 0.0
        self._busy = 0  # samples taken by the worker and not finished
        # counters since start
        self.samples = 0  # checked
        self.mismatches = 0
        self.dropped = 0
        self.repros: list[Repro] = []  # the last 16
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="toktier-verifier", daemon=True)
        self._thread.start()
        self.sync(force=True)

    # ------------------------------------------------------------ request path (O(1) unless sampled)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def wants(self) -> bool:
        """Should the next reply be sampled? Counts it toward the first ``first_n`` of its build."""
        key = build_key(self.tokenizer)
        seen = self._seen.get(key, 0)
        if seen < self.first_n:
            self._seen[key] = seen + 1
            return True
        if self.rate <= 0 or self._rng.random() >= self.rate:
            return False
        if self.cpu_share and self._spent > self.cpu_share * (time.monotonic() - self._t0) + BURST_S:
            self.budget_skipped += 1
            return False
        return True

    def submit(self, text: str, ids: np.ndarray, *, add_special_tokens: bool, route: str, cut: int = 0,
               engine: str = "", tag: Any = None, frozen: bool = False, chat: ChatCheck | None = None) -> bool:
        """Queue one reply for checking. Never blocks.

        ``text``: a ``str``, or a tuple of blocks (``Session.text_blocks()``) that the thread joins: O(blocks)
        here. ``ids`` is copied unless ``frozen``: the caller guarantees nothing ever changes it (a
        ``Session.ids`` view: later calls never change the values it shows, ``pipeline/token_buffer.py``), and
        it is held by reference: O(1) here. (Held, it makes the session's next splice check the slots it shows,
        and copy the ids once if one changes: at most the copy this saves.)
        ``tag`` comes back as ``Sample.tag`` to ``on_result`` (the core passes the request's origin).
        ``chat``: the reply is a chat request's; its text is re-rendered by the reference first.

        Returns:
            False when the sample was dropped (queue full in samples or bytes, or closed).
        """
        ids = ids if frozen and ids.dtype == np.int32 else np.array(ids, dtype=np.int32)
        nbytes = (sys.getsizeof(text) if isinstance(text, str) else sum(sys.getsizeof(b) for b in text)) + ids.nbytes
        sample = Sample(text, ids, bool(add_special_tokens), route, int(cut), engine, build_key(self.tokenizer), nbytes,
                        tag, chat)
        with self._lock:
            if self._closed or self._queued_bytes + nbytes > self.max_queue_bytes:
                self.dropped += 1
                return False
            try:
                self._queue.put_nowait(sample)
            except queue.Full:
                self.dropped += 1
                return False
            self._queued_bytes += nbytes
        return True

    def sync(self, *, force: bool = False) -> None:
        """Apply the quarantine file to the tokenizer (at most once per ``poll_s`` unless ``force``):
        routes listed for this build are quarantined, routes no longer listed are released."""
        if self.file is None:
            return
        now = time.monotonic()
        if not force and now < self._next_poll:
            return
        self._next_poll = now + self.poll_s
        mtime = self.file.mtime()
        if not force and mtime == self._file_mtime:
            return
        with self._qlock:
            try:
                data = self.file.load()
            except (OSError, ValueError):
                return  # keep what is held: never release on an unreadable file
            self._file_mtime = mtime
            listed = data.get(build_key(self.tokenizer), {})
            tok = self.tokenizer
            for route, record in listed.items():
                if route in FAST_ROUTES and route not in tok.quarantined:
                    tok.quarantine(route, str(record.get("reason", "listed in the quarantine file")))
            for route in [r for r in tok.quarantined if r not in listed]:
                tok.release(route)
            self.chat_quarantined = {k[len(CHAT_KEY_PREFIX):]: str(v[CHAT_ROUTE].get("reason", "listed"))
                                     for k, v in data.items()
                                     if k.startswith(CHAT_KEY_PREFIX) and isinstance(v, dict)
                                     and isinstance(v.get(CHAT_ROUTE), dict)}

    # ------------------------------------------------------------ operator API

    def quarantine(self, route: str, reason: str) -> None:
        """Quarantine ``route`` now, here and in the quarantine file."""
        with self._qlock:
            if self.file is not None:
                try:
                    self.file.add(build_key(self.tokenizer), route,
                                  {"reason": reason, "since": time.time(), "tokenizer": str(self.tokenizer.spec.path)})
                    self._file_mtime = self.file.mtime()
                except (OSError, ValueError) as e:  # still quarantined here, in memory
                    log.error("cannot write quarantine file %s: %s", self.file.path, e)
            self.tokenizer.quarantine(route, reason)

    def release(self, route: str | None = None) -> list[str]:
        """Clear the quarantine of ``route`` (``None``: all), here and in the quarantine file."""
        with self._qlock:
            if self.file is not None:
                self.file.clear(build_key(self.tokenizer), route)
                self._file_mtime = self.file.mtime()
            return self.tokenizer.release(route)

    def quarantine_chat(self, template: str, reason: str) -> None:
        """Quarantine incremental rendering of the chat template ``template`` (:func:`chat_template_key`)
        now, here and in the quarantine file: the core renders its requests in full from then on."""
        with self._qlock:
            if self.file is not None:
                try:
                    self.file.add(CHAT_KEY_PREFIX + template, CHAT_ROUTE, {"reason": reason, "since": time.time()})
                    self._file_mtime = self.file.mtime()
                except (OSError, ValueError) as e:  # still quarantined here, in memory
                    log.error("cannot write quarantine file %s: %s", self.file.path, e)
            self.chat_quarantined[template] = reason

    def release_chat(self, template: str | None = None) -> list[str]:
        """Clear the chat quarantine of ``template`` (``None``: every template), here and in the file."""
        with self._qlock:
            if self.file is not None:
                self.file.clear(CHAT_KEY_PREFIX + (template or ""), CHAT_ROUTE)
                self._file_mtime = self.file.mtime()
            released = [t for t in self.chat_quarantined if template is None or t == template]
            for t in released:
                del self.chat_quarantined[t]
            return released

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued sample is checked (tests, shutdown). Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.empty() and self._busy == 0:
                return True
            time.sleep(0.005)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    # ------------------------------------------------------------ background thread

    def _run(self) -> None:
        while True:
            sample = self._queue.get()
            if sample is None:
                return
            self._busy += 1
            with self._lock:
                self._queued_bytes -= sample.nbytes
            t0 = time.perf_counter()
            try:
                if not isinstance(sample.text, str):
                    sample.text = "".join(sample.text)  # a session's text blocks: joined here, off the request path
                self._check(sample)
            except Exception:  # the verifier must never take the server down
                log.exception("shadow verifier failed on a sample (route %s)", sample.route)
            finally:
                self._spent += time.perf_counter() - t0
                self._busy -= 1

    def _check(self, s: Sample) -> None:
        if s.chat is not None and not self._check_chat(s):
            return
        ref = self.tokenizer.reference
        enc = ref.encode_batch([s.text], add_special_tokens=s.add_special_tokens)[0]  # releases the GIL
        want = np.asarray(enc.ids, dtype=np.int32)
        ok = len(want) == len(s.ids) and bool(np.array_equal(want, s.ids))
        self.samples += 1
        if not ok:
            self.mismatches += 1
            self._on_mismatch(s, want, enc.offsets)
        if self.on_result is not None:
            try:
                self.on_result(s, ok)
            except Exception:
                log.exception("verifier on_result callback failed")

    def _check_chat(self, s: Sample) -> bool:
        """Re-render a chat sample with the reference; on a text mismatch count it, log where the texts part
        (redacted unless ``debug``), quarantine the template's incremental rendering, report ``on_result``
        (route ``chat:<render route>``) and return False (the ids of a wrong text are not checked)."""
        c = s.chat
        try:
            want = c.render(c.messages, **c.options)
        except Exception as e:  # the reference refuses what was served: a mismatch as well
            want, why = None, f"the reference render raised {type(e).__name__}: {e}"
        else:
            why = ""
        if want == s.text:
            return True
        self.samples += 1
        self.mismatches += 1
        at = 0
        if want is not None:
            from toktier_backend.chat.session import common_prefix_length  # (only on a mismatch)

            at = common_prefix_length(want, s.text)
            why = (f"texts differ from char {at} (served {len(s.text)} chars, reference {len(want)}; sha256 of "
                   f"the served window {hashlib.sha256(s.text[at:at + 64].encode('utf-8', 'surrogatepass')).hexdigest()[:16]})")
        log.error(
            "shadow verifier CHAT MISMATCH tokenizer=%s template=%s render route=%s: %s; quarantining incremental "
            "rendering of the template%s", self.name, c.template[:16], c.route, why,
            f"; served {s.text[at:at + 80]!r} reference {(want or '')[at:at + 80]!r}" if self.debug
            else " (text redacted; set the verifier debug flag to log it)",
        )
        self.quarantine_chat(c.template, f"shadow verifier chat mismatch at "
                                         f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {why}")
        if self.on_result is not None:
            try:
                self.on_result(Sample(s.text, s.ids, s.add_special_tokens, "chat:" + c.route.split(":")[0], s.cut,
                                      s.engine, s.key, s.nbytes, s.tag, c), False)
            except Exception:
                log.exception("verifier on_result callback failed")
        return False

    def _on_mismatch(self, s: Sample, want: np.ndarray, offsets) -> None:
        first, got_end, want_end = _diff_window(s.ids, want)
        lo = offsets[min(first, len(offsets) - 1)][0] if len(offsets) else 0
        hi = offsets[max(first, want_end - 1)][1] if want_end > first and len(offsets) else lo
        hi = max(hi, min(len(s.text), lo + 1))
        window = s.text[lo:hi]
        engine_window = self._engine_window(s.text, lo, hi) if s.engine not in ("", "hf", "none") else None
        routes = [s.route] if s.route in FAST_ROUTES else []
        if engine_window is not None:
            routes = list(FAST_ROUTES)  # the engine alone is wrong: no fast route may use it
        if not routes and s.route in ("noop", "encode"):
            routes = ["full"] if s.route == "encode" else list(FAST_ROUTES)
        repro = Repro(
            key=s.key, tokenizer=self.name, route=s.route, cut=s.cut, engine=s.engine, n_got=len(s.ids),
            n_want=len(want), id_window=(first, want_end), char_window=(lo, hi), engine_window=engine_window,
            window_sha256=hashlib.sha256(window.encode("utf-8", "surrogatepass")).hexdigest()[:16],
            quarantined=routes,
        )
        if self.debug:
            repro.text_window = window
            repro.got_window = s.ids[first:got_end].tolist()
            repro.want_window = want[first:want_end].tolist()
        self.repros = (self.repros + [repro])[-16:]
        log.error(
            "shadow verifier MISMATCH tokenizer=%s key=%s route=%s cut=%d engine=%s ids got=%d want=%d "
            "first differing id=%d, differing window ids[%d:%d] chars[%d:%d] (sha256 %s); engine alone %s; "
            "quarantining %s%s",
            self.name, s.key, s.route, s.cut, s.engine, len(s.ids), len(want), first, first, want_end, lo, hi,
            repro.window_sha256,
            f"disagrees on chars[{engine_window[0]}:{engine_window[1]}]" if engine_window else "agrees (suspect the cut/splice)",
            routes,
            f"; text {window!r} got {repro.got_window} want {repro.want_window}" if self.debug
            else " (text redacted; set the verifier debug flag to log it)",
        )
        reason = (f"shadow verifier mismatch at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: route {s.route}, "
                  f"cut {s.cut}, engine {s.engine}, ids[{first}:{want_end}]")
        for route in routes:
            self.quarantine(route, reason)

    def _engine_window(self, text: str, lo: int, hi: int) -> tuple[int, int] | None:
        """The smallest of a few growing windows around ``text[lo:hi]`` on which the tokenizer's fast
        engine alone disagrees with the reference (body ids), or ``None``."""
        eng = self.tokenizer.engine
        ref = self.tokenizer.reference
        for pad in (0, 16, 64, 256, 1024, 4096):
            a, b = max(0, lo - pad), min(len(text), hi + pad)
            piece = text[a:b]
            try:
                got = np.asarray(eng.encode(piece), dtype=np.int32).tolist()
            except Exception:
                return a, b
            if got != ref.encode(piece, add_special_tokens=False).ids:
                return a, b
            if a == 0 and b == len(text):
                break
        return None


__all__ = ["CHAT_KEY_PREFIX", "CHAT_ROUTE", "FAST_ROUTES", "ChatCheck", "QuarantineFile", "Repro", "Sample", "Verifier",
           "build_key", "chat_template_key"]
