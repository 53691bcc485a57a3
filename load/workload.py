"""What the load tests send and how they judge it: replayed agent sessions with long contexts, open-loop
(Poisson) pacing, exact latency samples, and reference checks off the timed path.

Pure Python + numpy (no locust, gevent or tritonclient import), so :mod:`capacity` and the tests can use it
anywhere. :mod:`locustfile` drives Triton with it.

Sessions
    A trajectory (``*.traj``) is a list of cumulative turn texts (:func:`toktier_backend.corpus.load_turns`).
    Real single trajectories end at 7K-57K chars, but the agent sessions a frontend serves carry ~100K+
    chars, and the stateless baseline's cost grows with the context. So every replayed session starts
    from a **base context**: other trajectories, rendered as ChatML and concatenated (rotated per session,
    repeated if needed) up to ``context_chars`` (default 100K), cut back to the end of a message
    (``<|im_end|>\\n``). Request ``i`` of a session carries ``base + turns[i]``: the first one (the open)
    the whole text, each later one the turn's new text (``delta``) or the whole text again (``full``).
"""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from toktier_backend import corpus  # noqa: E402

DEFAULT_CORPUS = REPO.parent / "shared" / "corpus" / "swe-agent"
END_OF_MESSAGE = "<|im_end|>\n"


def default_corpus() -> Path | None:
    """``../shared/corpus/swe-agent`` when it exists, else ``None`` (the bundled sample)."""
    return DEFAULT_CORPUS if DEFAULT_CORPUS.is_dir() else None


# ---------------------------------------------------------------- sessions


@dataclass(frozen=True)
class Trajectory:
    name: str
    turns: tuple[str, ...]  # cumulative: turns[i] is a prefix of turns[i + 1]


class Workload:
    """The sessions to replay.

    Args:
        folder: a folder of ``*.traj`` files (``None``: ``../shared/corpus/swe-agent``, else the bundled sample).
        context_chars: length of each session's base context, in chars (0: none).
        seed: for the random start turns.
    """

    def __init__(self, folder: str | Path | None = None, *, context_chars: int = 100_000, seed: int = 0):
        folder = default_corpus() if folder is None else folder
        self.folder = Path(folder) if folder is not None else None
        self.trajectories = [
            Trajectory(f.stem, tuple(t)) for f in corpus.trajectory_files(folder) if len(t := corpus.load_turns(f)) >= 2
        ]
        if not self.trajectories:
            raise ValueError(f"no trajectory with 2+ turns in {folder}")
        self.context_chars = int(context_chars)
        self._rng = random.Random(seed)
        self._bases: dict[int, str] = {}
        self._lock = threading.Lock()

    def base(self, k: int) -> str:
        """Base context ``k``: the final texts of trajectories ``k+1, k+2, ...`` (cycled) concatenated up to
        ``context_chars`` chars, cut back to the last ``<|im_end|>\\n`` (so it is whole messages)."""
        if self.context_chars <= 0:
            return ""
        n = len(self.trajectories)
        k %= n
        with self._lock:
            if k not in self._bases:
                parts, size, j = [], 0, k + 1
                while size < self.context_chars:
                    part = self.trajectories[j % n].turns[-1]
                    parts.append(part)
                    size += len(part)
                    j += 1
                text = "".join(parts)[: self.context_chars]
                end = text.rfind(END_OF_MESSAGE)
                self._bases[k] = text[: end + len(END_OF_MESSAGE)] if end > 0 else text
            return self._bases[k]

    def session(self, k: int, *, random_start: bool = False) -> "SessionScript":
        """Session ``k``: base context ``k`` + trajectory ``k`` (cycled). ``random_start`` begins at a random
        turn (a session met mid-life, as in a steady state) instead of the first."""
        traj = self.trajectories[k % len(self.trajectories)]
        start = self._rng.randrange(len(traj.turns) - 1) if random_start else 0
        return SessionScript(self.base(k), traj, start)


@dataclass
class SessionScript:
    """One replayed session: request ``i`` carries ``base + trajectory.turns[i]``."""

    base: str
    trajectory: Trajectory
    position: int  # index of the turn the next request carries

    @property
    def done(self) -> bool:
        return self.position >= len(self.trajectory.turns)

    @property
    def last(self) -> bool:
        """The next request is the session's last (it carries the sequence END flag)."""
        return self.position == len(self.trajectory.turns) - 1

    def text(self, i: int | None = None) -> str:
        """The whole session text after request ``i`` (default: the next one)."""
        return self.base + self.trajectory.turns[self.position if i is None else i]

    def delta(self) -> str:
        """What the next request appends to the previous one's text."""
        turns, i = self.trajectory.turns, self.position
        return turns[i][len(turns[i - 1]):] if i > 0 else self.text(0)


# ---------------------------------------------------------------- open-loop pacing


class Pacer:
    """Offered load, shared by all users of a route: open loop (Poisson) or closed loop.

    Open loop: each of the ``users`` sessions draws its arrivals as a Poisson process of rate
    ``rate / users`` on its own schedule (the next arrival is drawn from the previous *scheduled* time,
    never from the reply), so the sum is a Poisson process of rate ``rate`` whatever the latency. A request
    whose session is still busy when it is due is sent as soon as the session is free, and its latency is
    counted from when it was due (no coordinated omission).

    Closed loop (``rate=None``): a user sends its next turn an exponential think time of mean ``think_s``
    after the reply.

    Args:
        rate: offered requests/s over all users (``None``: closed loop).
        users: sessions sharing it.
        think_s: mean think time of the closed loop, in seconds.
    """

    def __init__(self, rate: float | None = None, users: int = 1, *, think_s: float = 0.5, seed: int = 0):
        self.rate = rate
        self.users = max(1, int(users))
        self.think_s = think_s
        self.end = math.inf  # arrivals at or after this clock time are not sent (step end)
        self.abandon = False  # stop sending overdue arrivals (drain timeout)
        self.first_by = 0.0  # open loop: first arrivals spread uniformly over this many seconds
        self._rng = random.Random(seed)

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    def set(self, rate: float | None, users: int) -> None:
        self.rate, self.users = rate, max(1, int(users))

    def first(self, now: float) -> float:
        """A new user's first arrival time."""
        if not self.open_loop:
            return now
        if self.first_by > 0:
            return now + self._rng.uniform(0, self.first_by)
        return now + self._rng.expovariate(self.rate / self.users)

    def next_after(self, scheduled: float, done: float) -> float:
        """The next arrival after one scheduled at ``scheduled`` whose reply came at ``done``."""
        if self.open_loop:
            return scheduled + self._rng.expovariate(self.rate / self.users)
        return done + self._rng.expovariate(1.0 / self.think_s) if self.think_s > 0 else done


def users_for(rate: float, think_s: float, max_sessions: int) -> int:
    """Sessions needed to offer ``rate`` req/s with a mean gap of ``think_s`` seconds per session (at least
    1, at most ``max_sessions``: keep it under the sequence batcher's ``max_candidate_sequences``)."""
    return max(1, min(int(max_sessions), math.ceil(rate * think_s)))


# ---------------------------------------------------------------- exact samples


@dataclass
class Sample:
    route: str
    kind: str  # "open", "turn", "reopen" (session); "encode" (stateless)
    scheduled: float  # clock time the request was due (perf_counter seconds)
    sent: float
    done: float
    ok: bool
    chars: int  # chars sent
    error: str = ""
    context: int = 0  # chars of the whole session text after this request

    @property
    def latency_ms(self) -> float:
        """Due -> reply, in ms (what the SLO judges; queueing at the client included)."""
        return (self.done - self.scheduled) * 1e3

    @property
    def service_ms(self) -> float:
        """Sent -> reply, in ms."""
        return (self.done - self.sent) * 1e3


class Recorder:
    """Every request's exact times (Locust's own table rounds response times; this keeps the floats).

    ``due(t)`` counts an arrival scheduled at ``t`` and ``add(sample)`` its completion, so the arrivals of a
    window that never completed are known (``unfinished``) and judged as SLO misses.
    """

    def __init__(self):
        self.samples: list[Sample] = []
        self._due: list[float] = []

    def clear(self) -> None:
        self.samples, self._due = [], []

    def due(self, scheduled: float) -> None:
        self._due.append(scheduled)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    def window(self, route: str, t0: float, t1: float) -> "StepStats":
        """Stats of the requests of ``route`` due in ``[t0, t1)``."""
        inside = [s for s in self.samples if s.route == route and t0 <= s.scheduled < t1]
        due = sum(1 for t in self._due if t0 <= t < t1)
        answered = sum(1 for s in self.samples if s.route == route and s.ok and t0 <= s.done < t1)
        return StepStats.of(inside, due=due, seconds=t1 - t0, answered=answered)


def percentile(values: np.ndarray, q: float) -> float:
    """Exact percentile (numpy "linear"), ``nan`` for none; ``inf`` values (unfinished) sort last and make
    any percentile that reaches them ``inf``."""
    if not values.size:
        return float("nan")
    a = np.where(np.isinf(values), 1e300, values)
    p = float(np.percentile(a, q))
    return math.inf if p >= 1e299 else p


@dataclass
class StepStats:
    n: int  # requests due in the window that completed (ok or not)
    due: int  # requests due in the window
    errors: int
    unfinished: int  # due in the window, never completed (drain timeout)
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float  # over all due requests; unfinished ones count as infinitely late
    max_ms: float
    service_p50_ms: float  # sent -> reply
    service_p99_ms: float
    lag_p99_ms: float  # due -> sent: the session still busy, or the generator late (starved of CPU)
    mean_chars: float  # chars sent per request
    mean_context: float  # chars of the session text per request
    kinds: dict[str, dict] = field(default_factory=dict)  # per request kind: n, p50_ms, p99_ms
    first_error: str = ""
    answered: int | None = None  # successful replies that arrived within the window (throughput)

    @classmethod
    def of(cls, samples: list[Sample], *, due: int, seconds: float, answered: int | None = None) -> "StepStats":
        unfinished = max(0, due - len(samples))
        lat = np.array([s.latency_ms for s in samples] + [math.inf] * unfinished, dtype=np.float64)
        svc = np.array([s.service_ms for s in samples], dtype=np.float64)
        errors = [s for s in samples if not s.ok]
        kinds: dict[str, dict] = {}
        for kind in sorted({s.kind for s in samples}):
            k = np.array([s.latency_ms for s in samples if s.kind == kind])
            kinds[kind] = {"n": int(k.size), "p50_ms": round(percentile(k, 50), 3), "p99_ms": round(percentile(k, 99), 3)}
        return cls(
            n=len(samples), due=max(due, len(samples)), errors=len(errors), unfinished=unfinished, seconds=seconds,
            p50_ms=percentile(lat, 50), p90_ms=percentile(lat, 90), p99_ms=percentile(lat, 99),
            max_ms=float(lat.max()) if lat.size else float("nan"), service_p50_ms=percentile(svc, 50),
            service_p99_ms=percentile(svc, 99),
            lag_p99_ms=percentile(np.array([(s.sent - s.scheduled) * 1e3 for s in samples]), 99),
            mean_chars=float(np.mean([s.chars for s in samples])) if samples else 0.0,
            mean_context=float(np.mean([s.context for s in samples])) if samples else 0.0,
            kinds=kinds, first_error=errors[0].error[:300] if errors else "", answered=answered,
        )

    @property
    def achieved_rps(self) -> float:
        """Throughput: successful replies that arrived within the window, per second (without ``answered``:
        the successful replies to requests due in it)."""
        ok = self.answered if self.answered is not None else self.n - self.errors
        return ok / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------- reference checks (off the timed path)


class ReferenceChecker:
    """Checks a sampled fraction of replies against the frozen reference, HF
    ``tokenizers.Tokenizer.from_file(path).encode(text, add_special_tokens=flag).ids``.

    Users call :meth:`offer` after the reply is timed (it only keeps references, reservoir-sampled up to
    ``max_pending``); :meth:`check` encodes them between load steps, off the timed path.

    Args:
        tokenizer_path: the ``tokenizer.json`` the server serves.
        fraction: share of replies sampled (0..1).
        max_pending: most replies kept per check (reservoir), bounding memory and check time.
    """

    def __init__(self, tokenizer_path: str | Path, *, fraction: float = 0.02, max_pending: int = 64, seed: int = 0):
        import tokenizers

        self.path = str(tokenizer_path)
        self.reference = tokenizers.Tokenizer.from_file(self.path)
        self.fraction = float(fraction)
        self.max_pending = int(max_pending)
        self._rng = random.Random(seed)
        self._pending: list[tuple[str, str, bool, np.ndarray]] = []
        self._seen = 0  # sampled since the last check (reservoir denominator)
        self.checked = 0
        self.mismatches = 0
        self.first_mismatch = ""

    def offer(self, route: str, text: str, add_special_tokens: bool, ids: np.ndarray) -> None:
        if self.fraction <= 0 or self._rng.random() >= self.fraction:
            return
        self._seen += 1
        item = (route, text, add_special_tokens, ids)
        if len(self._pending) < self.max_pending:
            self._pending.append(item)
        else:
            j = self._rng.randrange(self._seen)
            if j < self.max_pending:
                self._pending[j] = item

    def check(self) -> tuple[int, int]:
        """Check what was sampled since the last call. Returns (checked, mismatches) of this call."""
        pending, self._pending, self._seen = self._pending, [], 0
        bad = 0
        for flag in (True, False):
            group = [p for p in pending if p[2] is flag]
            if not group:
                continue
            refs = self.reference.encode_batch([p[1] for p in group], add_special_tokens=flag)
            for (route, text, _, ids), ref in zip(group, refs):
                want = np.asarray(ref.ids, dtype=np.int64)
                got = np.asarray(ids, dtype=np.int64)
                if got.shape != want.shape or not np.array_equal(got, want):
                    bad += 1
                    if not self.first_mismatch:
                        m = min(len(got), len(want))
                        diff = np.flatnonzero(got[:m] != want[:m])
                        k = int(diff[0]) if diff.size else m
                        self.first_mismatch = (
                            f"{route}: {len(got)} ids vs reference {len(want)} for a {len(text)}-char text; "
                            f"first difference at id {k}"
                        )
        self.checked += len(pending)
        self.mismatches += bad
        return len(pending), bad


def clock() -> float:
    return time.perf_counter()
