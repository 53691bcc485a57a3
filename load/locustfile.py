"""Locust users replaying real agent sessions against the toktier Triton models (gRPC or HTTP).

Routes (one Locust user = one agent session at a time, holding its own correlation ID):

- ``session`` (:class:`SessionUser`): ``toktier_session``. The open sends the whole text with START; each
  later turn sends ``MODE=delta`` (the turn's new text; ``--mode full``: the whole text) and asks for
  ``REPLY=patch`` (``--reply full``: all ids); the session's last turn carries END. The ids are rebuilt as
  ``ids[:KEEP] + INPUT_ID`` and checked against ``REQUEST_INPUT_LEN``.
- ``stateless`` (:class:`StatelessUser`): the same traffic to ``toktier_encode``, each turn the whole text.
- ``stateless_hf`` (:class:`StatelessHFUser`): the same traffic to ``toktier_encode_hf`` (``load/models/``):
  a plain stateless CPU frontend, HF ``tokenizers`` ``encode`` per request (``capacity.py`` serves it).
- ``stateless_fast`` (:class:`StatelessFastUser`): the same traffic to ``toktier_encode_fast``
  (``toktier_backend/data/models/``): fastokens on the whole text, no state, no prefix index.
- ``noop`` (:class:`NoopSessionUser`): the session traffic to ``toktier_session_noop`` (``load/models/``),
  which answers a constant: the serving stack's floor (replies counted, never checked).

Pacing (``--arrivals``): ``open`` (default with ``--rates``): Poisson arrivals at the offered rate whatever
the latency, stepped by :class:`StepRateShape`; latency counts from when a request was *due*. ``closed``:
``-u`` users, each with an exponential think time of mean ``--think-s`` after every reply.

Every request fires a Locust request event with its exact response time (float ms) and a
:class:`workload.Sample` in its context; :class:`workload.Recorder` keeps those floats (Locust's own table
rounds them), and at the end the exact per-step table is printed (and written with ``--exact-csv``). A
sampled fraction of replies (``--check-fraction``) is checked against HF ``tokenizers`` when the test
stops, off the timed path.

Run it on its own (a server on 8001 from ``toktier serve --tokenizer default``)::

    locust -f load/locustfile.py --headless --host grpc://127.0.0.1:8001 --route session \\
        --rates 50,100,200 --step-s 20 --exact-csv /tmp/steps.csv

``load/capacity.py`` drives the same users step by step, for all routes in one run.
"""

from __future__ import annotations

import csv
import itertools
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any gRPC object exists: gRPC's I/O must yield to gevent

import gevent  # noqa: E402
import numpy as np  # noqa: E402
from locust import LoadTestShape, User, events, task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload  # noqa: E402
from workload import Pacer, Recorder, ReferenceChecker, Sample, Workload, clock, users_for  # noqa: E402

log = logging.getLogger("toktier.load")

ROUTES = ("session", "stateless", "stateless_hf", "stateless_fast", "noop")
MODELS = {"session": "toktier_session", "stateless": "toktier_encode", "stateless_hf": "toktier_encode_hf",
          "stateless_fast": "toktier_encode_fast", "noop": "toktier_session_noop"}
#: routes whose replies are not tokenizations (never offered to the reference checker)
UNCHECKED = {"noop"}


# ---------------------------------------------------------------- configuration and shared state


@dataclass
class LoadConfig:
    """What the users send. ``capacity.py`` builds one; the Locust CLI fills it from its options."""

    url: str = "127.0.0.1:8001"  # host:port
    protocol: str = "grpc"  # "grpc" | "http"
    tokenizer: str = "default"  # what the server serves (for the reference checks)
    corpus: str | None = None  # folder of *.traj (None: ../shared/corpus/swe-agent, else the bundled sample)
    context_chars: int = 100_000  # base context of each session, chars
    mode: str = "delta"  # session turns: "delta" | "full"
    reply: str = "patch"  # session replies: "patch" | "full"
    add_special_tokens: bool = True
    think_s: float = 0.5  # open loop: sessions = rate * think_s; closed loop: mean think time
    max_sessions: int = 1000  # keep under the sequence batcher's max_candidate_sequences (1024)
    random_start: bool = True  # first session of a user starts at a random turn (steady-state mix)
    check_fraction: float = 0.02
    check_max: int = 64  # most sampled replies kept per check
    timeout_s: float = 60.0  # per-request client timeout
    seed: int = 0


@dataclass
class Runtime:
    cfg: LoadConfig
    workload: Workload
    recorder: Recorder
    checker: ReferenceChecker
    pacers: dict[str, Pacer] = field(default_factory=dict)
    conns: dict[str, "Connection"] = field(default_factory=dict)
    sessions: itertools.count = field(default_factory=lambda: itertools.count(0))
    in_flight: int = 0
    users: list = field(default_factory=list)  # live ReplayUser instances (capacity.py drains them)

    def pacer(self, route: str) -> Pacer:
        if route not in self.pacers:
            self.pacers[route] = Pacer(None, 1, think_s=self.cfg.think_s, seed=self.cfg.seed + len(self.pacers))
        return self.pacers[route]

    def connection(self, route: str) -> "Connection":
        if route not in self.conns:
            self.conns[route] = Connection(self.cfg)
        return self.conns[route]

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        self.conns.clear()


RUNTIME: Runtime | None = None


def configure(cfg: LoadConfig) -> Runtime:
    """Build the shared state (sessions, recorder, checker) for ``cfg``; users read it on start."""
    global RUNTIME
    if RUNTIME is not None:
        RUNTIME.close()
    spec = cfg.tokenizer
    if spec in ("", "default"):
        import toktier_backend as tt

        spec = str(tt.default_tokenizer_path())
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    RUNTIME = Runtime(
        cfg=cfg,
        workload=Workload(cfg.corpus, context_chars=cfg.context_chars, seed=cfg.seed),
        recorder=Recorder(),
        checker=ReferenceChecker(path, fraction=cfg.check_fraction, max_pending=cfg.check_max, seed=cfg.seed),
    )
    return RUNTIME


def runtime() -> Runtime:
    if RUNTIME is None:
        raise RuntimeError("load.locustfile: configure(LoadConfig(...)) first (the Locust CLI does it on init)")
    return RUNTIME


# ---------------------------------------------------------------- transport


class Connection:
    """One ``tritonclient`` client shared by a route's users (gRPC: one channel, HTTP/2 streams; HTTP: a
    geventhttpclient pool)."""

    def __init__(self, cfg: LoadConfig):
        self.protocol = cfg.protocol
        self.timeout_s = cfg.timeout_s
        if cfg.protocol == "grpc":
            import tritonclient.grpc as mod

            self.client = mod.InferenceServerClient(cfg.url)
        elif cfg.protocol == "http":
            import tritonclient.http as mod

            self.client = mod.InferenceServerClient(
                cfg.url, concurrency=64, network_timeout=cfg.timeout_s, connection_timeout=cfg.timeout_s
            )
        else:
            raise ValueError(f"protocol={cfg.protocol!r}: use 'grpc' or 'http'")
        self.mod = mod

    def _input(self, name: str, value: np.ndarray, dtype: str):
        t = self.mod.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    def infer(self, model: str, inputs: dict[str, object], outputs: tuple[str, ...], **kwargs):
        tensors = []
        for name, value in inputs.items():
            if isinstance(value, bool):
                tensors.append(self._input(name, np.array([[value]], dtype=np.bool_), "BOOL"))
            else:
                raw = value.encode("utf-8") if isinstance(value, str) else value
                tensors.append(self._input(name, np.array([[raw]], dtype=np.object_), "BYTES"))
        outs = [self.mod.InferRequestedOutput(n) for n in outputs]
        if self.protocol == "grpc":
            kwargs["client_timeout"] = self.timeout_s
        result = self.client.infer(model, tensors, outputs=outs, **kwargs)
        return {n: result.as_numpy(n) for n in outputs}

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


# ---------------------------------------------------------------- users


class ReplayUser(User):
    """One agent session at a time, replayed turn by turn; the next session starts when one ends."""

    abstract = True
    route = "session"

    def wait_time(self) -> float:
        return 0.0  # pacing is done in the task (open loop: the arrival schedule; closed: think time)

    def on_start(self) -> None:
        self.rt = runtime()
        self.cfg = self.rt.cfg
        self.pacer = self.rt.pacer(self.route)
        self.conn = self.rt.connection(self.route)
        self.script = self.rt.workload.session(next(self.rt.sessions), random_start=self.cfg.random_start)
        self.next_t = self.pacer.first(clock())
        self.busy = False
        self.rt.users.append(self)

    def idle(self) -> bool:
        """Nothing in flight and nothing due before the pacer's end."""
        return not self.busy and (self.next_t >= self.pacer.end or self.pacer.abandon)

    @task
    def arrive(self) -> None:
        p = self.pacer
        if self.next_t >= p.end or p.abandon:
            if p.abandon and p.open_loop:  # drain timed out: what was due and never sent is unfinished
                while self.next_t < p.end:
                    self.rt.recorder.due(self.next_t)
                    self.next_t = p.next_after(self.next_t, self.next_t)
            gevent.sleep(0.05)  # idle until the step ends
            return
        delay = self.next_t - clock()
        if delay > 0:
            gevent.sleep(delay)
            if self.next_t >= p.end or p.abandon:
                return
        scheduled = self.next_t
        self.rt.recorder.due(scheduled)
        if self.script.done:
            self.script = self.rt.workload.session(next(self.rt.sessions))
        self.busy = True
        self.rt.in_flight += 1
        try:
            sample = self.send(scheduled)
        finally:
            self.rt.in_flight -= 1
            self.busy = False
        self.next_t = p.next_after(scheduled, sample.done)

    def fire(self, sample: Sample, n_ids: int) -> None:
        self.environment.events.request.fire(
            request_type=self.cfg.protocol,
            name=f"{self.route}:{sample.kind}",
            response_time=sample.latency_ms,  # exact float ms; workload.Recorder keeps it unrounded
            response_length=n_ids,
            exception=None if sample.ok else RuntimeError(sample.error),
            context={"sample": sample},
        )

    def send(self, scheduled: float) -> Sample:
        raise NotImplementedError


class SessionUser(ReplayUser):
    """``toktier_session``: correlation ID per session, START on the open, END on the last turn."""

    route = "session"
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        self.sid: str | None = None  # correlation ID of the open sequence
        self.ids = np.zeros(0, dtype=np.int32)
        self.dirty = False  # a request failed: resend the whole text (full reply) next
        self.need_start = False

    def send(self, scheduled: float) -> Sample:
        s, cfg = self.script, self.cfg
        text = s.text()
        start = self.sid is None or self.need_start
        if self.sid is None:
            self.sid = f"lt{os.getpid()}-{next(_ids)}"
        if start or self.dirty:
            kind = "open" if not self.dirty else "reopen"
            payload, mode, reply = text, "full", "full"
        else:
            kind = "turn"
            mode, reply = cfg.mode, cfg.reply
            payload = s.delta() if mode == "delta" else text
        end = s.last
        sent = clock()
        try:
            out = self.conn.infer(
                MODELS[self.route],
                {"TEXT": payload, "MODE": mode, "REPLY": reply, "ADD_SPECIAL_TOKENS": cfg.add_special_tokens},
                ("INPUT_ID", "REQUEST_INPUT_LEN", "KEEP"),
                sequence_id=self.sid, sequence_start=start, sequence_end=end,
            )
            patch = out["INPUT_ID"].reshape(-1)
            n = int(out["REQUEST_INPUT_LEN"].reshape(-1)[0])
            keep = int(out["KEEP"].reshape(-1)[0])
            done = clock()
            ids = np.concatenate([self.ids[:keep], patch]) if reply == "patch" and keep else patch
            if len(ids) != n or keep > len(self.ids):
                raise RuntimeError(f"reply does not add up: KEEP={keep}, held {len(self.ids)}, "
                                   f"INPUT_ID {len(patch)}, REQUEST_INPUT_LEN {n}")
        except Exception as e:  # noqa: BLE001 - every failure is an error sample
            done = clock()
            msg = f"{type(e).__name__}: {e}"
            self.dirty, self.need_start = True, "START flag" in msg
            sample = Sample(self.route, kind, scheduled, sent, done, False, len(payload), msg, len(text))
            self.fire(sample, 0)
            return sample
        sample = Sample(self.route, kind, scheduled, sent, done, True, len(payload), "", len(text))
        self.fire(sample, len(ids))
        if self.route not in UNCHECKED:
            self.rt.checker.offer(self.route, text, cfg.add_special_tokens, ids)  # after timing: refs only
        self.ids, self.dirty, self.need_start = ids, False, False
        s.position += 1
        if end:
            self.sid, self.ids = None, np.zeros(0, dtype=np.int32)
        return sample

    def on_stop(self) -> None:
        if getattr(self, "sid", None) is None or not hasattr(self, "conn"):
            return
        try:  # free the server's state; untimed, not recorded
            self.conn.infer(MODELS[self.route], {"TEXT": "", "MODE": "delta"}, ("REQUEST_INPUT_LEN",),
                            sequence_id=self.sid, sequence_end=True)
        except Exception:  # noqa: BLE001 - the server may have dropped it already
            pass
        self.sid = None


class StatelessUser(ReplayUser):
    """The same sessions sent statelessly: every turn carries the whole text to ``toktier_encode``."""

    route = "stateless"
    weight = 1

    def send(self, scheduled: float) -> Sample:
        s, cfg = self.script, self.cfg
        text = s.text()
        sent = clock()
        try:
            out = self.conn.infer(MODELS[self.route], {"TEXT": text, "ADD_SPECIAL_TOKENS": cfg.add_special_tokens},
                                  ("INPUT_ID", "REQUEST_INPUT_LEN"))
            ids = out["INPUT_ID"].reshape(-1)
            n = int(out["REQUEST_INPUT_LEN"].reshape(-1)[0])
            done = clock()
            if len(ids) != n:
                raise RuntimeError(f"reply does not add up: INPUT_ID {len(ids)}, REQUEST_INPUT_LEN {n}")
        except Exception as e:  # noqa: BLE001
            done = clock()
            sample = Sample(self.route, "encode", scheduled, sent, done, False, len(text), f"{type(e).__name__}: {e}",
                            len(text))
            self.fire(sample, 0)
            return sample
        sample = Sample(self.route, "encode", scheduled, sent, done, True, len(text), "", len(text))
        self.fire(sample, len(ids))
        self.rt.checker.offer(self.route, text, cfg.add_special_tokens, ids)
        s.position += 1
        return sample


class StatelessHFUser(StatelessUser):
    """The same stateless traffic to ``toktier_encode_hf``: HF ``tokenizers`` encode per request."""

    route = "stateless_hf"


class StatelessFastUser(StatelessUser):
    """The same stateless traffic to ``toktier_encode_fast``: fastokens on the whole text, no state, no prefix
    index (what a user would deploy instead)."""

    route = "stateless_fast"


class NoopSessionUser(SessionUser):
    """The session traffic (same tensors, flags and sizes) to ``toktier_session_noop``, which answers a
    constant: the serving stack's own floor. Its replies are counted, never checked against the reference."""

    route = "noop"


USER_CLASSES = {"session": SessionUser, "stateless": StatelessUser, "stateless_hf": StatelessHFUser,
                "stateless_fast": StatelessFastUser, "noop": NoopSessionUser}
_ids = itertools.count(1)


@events.request.add_listener
def _record(context=None, **_kwargs) -> None:
    """Keep every request's exact sample (Locust's own stats round response times)."""
    sample = (context or {}).get("sample")
    if sample is not None and RUNTIME is not None:
        RUNTIME.recorder.add(sample)


# ---------------------------------------------------------------- Locust CLI: options, stepped shape, report


class StepRateShape(LoadTestShape):
    """Open loop: offers each rate of ``--rates`` for ``--step-s`` seconds (users = rate x ``--think-s``,
    capped by ``--max-sessions``), then stops. Closed loop: ``-u`` users until ``--run-time``."""

    use_common_options = True  # -u, -r and --run-time reach tick() (closed loop)
    steps: list[tuple[float, float]] = []  # (clock time the step started, rate)

    def tick(self):
        opts = self.runner.environment.parsed_options
        cls = USER_CLASSES[opts.route]
        if opts.arrivals == "closed" or not opts.rates:
            if opts.run_time and self.get_run_time() >= opts.run_time:
                return None
            return (opts.num_users or 1, opts.spawn_rate or 1, [cls])
        rates = _rates(opts.rates)
        i = int(self.get_run_time() // opts.step_s)
        if i >= len(rates):
            return None
        rate = rates[i]
        users = users_for(rate, opts.think_s, opts.max_sessions)
        if len(StepRateShape.steps) <= i:
            runtime().pacer(opts.route).set(rate, users)
            StepRateShape.steps.append((clock(), rate))
        return (users, max(users, 1), [cls])


def _rates(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("toktier load")
    g.add_argument("--route", choices=ROUTES, default="session", help="which model the users drive")
    g.add_argument("--arrivals", choices=("open", "closed"), default="open",
                   help="open: Poisson arrivals at each --rates step; closed: -u users with --think-s")
    g.add_argument("--rates", default="", help="offered req/s per step, comma-separated (open loop)")
    g.add_argument("--step-s", type=float, default=20.0, help="seconds per rate step")
    g.add_argument("--warmup-s", type=float, default=5.0, help="start of each step left out of the exact table")
    g.add_argument("--tokenizer", default="default", help="tokenizer the server serves (reference checks)")
    g.add_argument("--corpus", default=None, help="folder of *.traj (default ../shared/corpus/swe-agent)")
    g.add_argument("--context-chars", type=int, default=100_000, help="base context per session, chars")
    g.add_argument("--mode", choices=("delta", "full"), default="delta")
    g.add_argument("--reply", choices=("patch", "full"), default="patch")
    g.add_argument("--think-s", type=float, default=0.5)
    g.add_argument("--max-sessions", type=int, default=1000)
    g.add_argument("--check-fraction", type=float, default=0.02)
    g.add_argument("--check-max", type=int, default=256)
    g.add_argument("--request-timeout", type=float, default=60.0)
    g.add_argument("--exact-csv", default="", help="write the exact per-step table here")


def parse_host(host: str) -> tuple[str, str]:
    """``grpc://h:p`` / ``http://h:p`` / ``h:p`` (gRPC) -> (protocol, "h:p")."""
    host = (host or "grpc://127.0.0.1:8001").rstrip("/")
    if "://" in host:
        scheme, rest = host.split("://", 1)
        return ("http" if scheme in ("http", "https") else "grpc"), rest
    return "grpc", host


@events.init.add_listener
def _init(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    if opts is None or RUNTIME is not None:  # capacity.py configured it already
        return
    protocol, url = parse_host(environment.host or opts.host)
    configure(LoadConfig(
        url=url, protocol=protocol, tokenizer=opts.tokenizer, corpus=opts.corpus, context_chars=opts.context_chars,
        mode=opts.mode, reply=opts.reply, think_s=opts.think_s, max_sessions=opts.max_sessions,
        check_fraction=opts.check_fraction, check_max=opts.check_max, timeout_s=opts.request_timeout,
    ))
    if opts.arrivals == "closed":
        runtime().pacer(opts.route).set(None, opts.num_users or 1)


@events.quitting.add_listener
def _report(environment, **_kwargs) -> None:
    """CLI runs: the exact per-step table, then the reference checks (off the timed path)."""
    opts = environment.parsed_options
    if opts is None or RUNTIME is None or not StepRateShape.steps and opts.arrivals == "open":
        return
    rows = []
    bounds = StepRateShape.steps + [(clock(), math.nan)]
    if opts.arrivals == "closed" or not StepRateShape.steps:
        samples = RUNTIME.recorder.samples
        bounds = [(min((s.scheduled for s in samples), default=0.0), math.nan), (clock(), math.nan)]
    for (t0, rate), (t1, _) in zip(bounds, bounds[1:]):
        st = RUNTIME.recorder.window(opts.route, t0 + opts.warmup_s, t1)
        rows.append({"route": opts.route, "offered_rps": rate, "achieved_rps": round(st.achieved_rps, 2),
                     "n": st.n, "errors": st.errors, "unfinished": st.unfinished, "p50_ms": round(st.p50_ms, 3),
                     "p99_ms": round(st.p99_ms, 3), "max_ms": round(st.max_ms, 3)})
    checked, bad = RUNTIME.checker.check()
    for r in rows:
        log.info("exact: %s", r)
    log.info("reference checks: %d replies checked, %d mismatches %s", checked, bad, RUNTIME.checker.first_mismatch)
    if opts.exact_csv and rows:
        with open(opts.exact_csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if bad:
        environment.process_exit_code = 3
    RUNTIME.close()


__all__ = ["LoadConfig", "configure", "runtime", "SessionUser", "StatelessUser", "StatelessHFUser", "StatelessFastUser",
           "NoopSessionUser",
           "StepRateShape", "USER_CLASSES", "workload"]
