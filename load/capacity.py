"""Capacity under a P99 SLO: the highest offered request rate (Poisson arrivals) whose P99 latency stays under
``--slo-p99-ms`` with no error, for our session route and the stateless baselines, in one run.

    python load/capacity.py --out load/out                    # starts tritonserver itself, all routes
    python load/capacity.py --url 127.0.0.1:8001 --routes session,stateless --out /tmp/cap   # a running server

Per route, the offered rate steps up geometrically from ``--start-rps`` (x ``--growth``) until a step fails
(down instead when the first one fails), then ``--refine`` bisection steps between the last pass and the
first failure. Each step: fresh sessions (users = rate x ``--think-s``, at most ``--max-sessions``), opened
over the first part of ``--warmup-s``; the step's window is the ``--step-s`` seconds after the warmup.
Every request due in the window counts, with its latency from when it was due: those still unfinished
after ``--drain-s`` count as infinitely late. A step passes when P99 <= SLO, no error, no unfinished
request and no reference mismatch. Between steps (off the timed path) the sampled replies are checked
against HF ``tokenizers``.

Routes: ``session`` (``toktier_session``: delta turns, patch replies), ``stateless`` (``toktier_encode``,
whole text every turn; it reuses indexed prefixes by content), ``stateless_hf`` (``toktier_encode_hf`` from
``load/models``: HF ``tokenizers`` encode per request, the plain CPU frontend), ``stateless_fast``
(``toktier_encode_fast`` from ``toktier_backend/data/models``: fastokens on the whole text, no state, no prefix
index: what a user would deploy instead), ``noop`` (``toktier_session_noop`` from ``load/models``: the session
traffic to a model that answers a constant: the serving stack's own floor; ``session / noop`` is our
capacity as a fraction of it). The extra models are only served when this script starts the server.

Outputs in ``--out``: ``steps.csv`` (every step, exact percentiles, CPU use), ``capacity.json``,
``capacity.md`` (the table), ``p99_vs_offered.png``, ``throughput_vs_offered.png``, ``tritonserver.log``.

One process, gevent (Locust as a library): on a 2-core machine the load generator shares the CPUs with
the server, so ``steps.csv`` records the generator's and the server's CPU per step (and the whole
machine's, to show other tenants).
"""

from __future__ import annotations

from locust import events  # noqa: I001 - first: locust monkey-patches the standard library for gevent
from locust.env import Environment

import argparse
import csv
import logging
import json
import math
import os
import itertools
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import gevent

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import locustfile  # noqa: E402  (initialises gRPC for gevent)
from locustfile import MODELS, USER_CLASSES, LoadConfig, configure  # noqa: E402
from workload import REPO, StepStats, clock, users_for  # noqa: E402

EXTRA_MODELS = HERE / "models"
#: models shipped with the package (``toktier demo`` serves toktier_encode_fast too)
PACKAGE_MODELS = REPO / "toktier_backend" / "data" / "models"

# all of a step's sessions start at once (their first arrivals are spread over the warmup)
logging.getLogger("locust.runners").addFilter(lambda r: "spawn rate is very high" not in r.getMessage())


# ---------------------------------------------------------------- server


def combined_repository(routes: list[str]) -> Path:
    """A model repository with the models ``routes`` need: ours from the project's ``model_repository/``,
    ``toktier_encode_hf`` and ``toktier_session_noop`` from ``load/models/``, ``toktier_encode_fast`` from
    ``toktier_backend/data/models/``."""
    from toktier_backend.deploy.server import DEFAULT_MODEL_REPOSITORY

    dst = Path(tempfile.mkdtemp(prefix="toktier-load-models-"))
    for route in routes:
        model = MODELS[route]
        src = next((d / model for d in (EXTRA_MODELS, PACKAGE_MODELS) if (d / model).is_dir()),
                   DEFAULT_MODEL_REPOSITORY / model)
        shutil.copytree(src, dst / model, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def start_server(args, routes: list[str], out: Path):
    from toktier_backend.deploy.server import TritonServer

    repo = combined_repository(routes)
    server = TritonServer(
        args.tokenizer, model_repository=repo, http_port=0, grpc_port=0, metrics_port=0,
        log_path=out / "tritonserver.log", exit_timeout_s=5,
    )
    server.start().wait_ready(args.ready_timeout_s)
    server._load_repo = repo
    return server


class CpuMeter:
    """CPU seconds of this process (the generator), the server's process tree, and the whole machine."""

    def __init__(self, server_pid: int | None):
        import psutil

        self.psutil = psutil
        self.me = psutil.Process(os.getpid())
        self.server = psutil.Process(server_pid) if server_pid else None

    def _server_seconds(self) -> float:
        if self.server is None:
            return math.nan
        total = 0.0
        try:
            for p in [self.server, *self.server.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except self.psutil.Error:
                    pass
        except self.psutil.Error:
            return math.nan
        return total

    def snapshot(self) -> tuple[float, float, float, float]:
        t = self.me.cpu_times()
        m = self.psutil.cpu_times()
        busy = sum(m) - m.idle - getattr(m, "iowait", 0.0)
        return clock(), t.user + t.system, self._server_seconds(), busy

    @staticmethod
    def percent(a, b) -> tuple[float, float, float]:
        """(generator, server, machine) CPU use between two snapshots, in % of one core."""
        dt = max(b[0] - a[0], 1e-9)
        return tuple(100.0 * (b[i] - a[i]) / dt for i in (1, 2, 3))


# ---------------------------------------------------------------- one step


@dataclass
class Step:
    route: str
    index: int
    offered_rps: float
    users: int
    achieved_rps: float
    n: int
    errors: int
    unfinished: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    service_p50_ms: float
    service_p99_ms: float
    lag_p99_ms: float
    mean_chars_sent: float
    mean_context_chars: float
    checked: int
    mismatches: int
    generator_cpu_pct: float
    server_cpu_pct: float
    machine_cpu_pct: float
    settle_s: float  # waited before the step for the server to work off earlier backlog
    passed: bool
    why: str
    first_error: str
    kinds: str  # JSON: per request kind (open, turn, reopen, encode): n, p50_ms, p99_ms


_settle_ids = itertools.count(1)


def settle(route: str, args, rt) -> float:
    """Wait until the server has worked off what an earlier step left queued (a client timeout does not
    cancel a request inside Triton): tiny requests to the route's model until two in a row answer within
    25 ms, for at most ``--settle-s``. Returns the seconds it took."""
    conn = rt.connection(route)
    t0, good = clock(), 0
    while good < 2 and clock() - t0 < args.settle_s:
        t = clock()
        try:
            if route in ("session", "noop"):
                conn.infer(MODELS[route], {"TEXT": "hello", "MODE": "full"}, ("REQUEST_INPUT_LEN",),
                           sequence_id=f"settle-{os.getpid()}-{next(_settle_ids)}", sequence_start=True,
                           sequence_end=True)
            else:
                conn.infer(MODELS[route], {"TEXT": "hello"}, ("REQUEST_INPUT_LEN",))
            good = good + 1 if clock() - t < 0.025 else 0
        except Exception:  # noqa: BLE001 - e.g. a client timeout while the backlog drains
            good = 0
        if good < 2:
            gevent.sleep(0.1)
    return clock() - t0


def run_step(route: str, rate: float | None, index: int, args, rt, meter: CpuMeter, *, window_s: float | None = None) -> Step:
    """Offer ``rate`` req/s of ``route`` for warmup + window, drain, check, judge. ``rate=None``: the probe,
    one session sending back to back (closed loop, no think time): the unloaded latency."""
    settled_s = settle(route, args, rt)
    users = users_for(rate, args.think_s, args.max_sessions) if rate is not None else 1
    pacer = rt.pacer(route)
    pacer.set(rate, users)
    pacer.think_s = 0.0 if rate is None else args.think_s
    pacer.abandon = False
    pacer.first_by = 0.6 * args.warmup_s  # opens spread over the warmup, then Poisson
    rt.users.clear()
    rt.recorder.clear()
    env = Environment(user_classes=[USER_CLASSES[route]], events=events, host=args.url or "")
    runner = env.create_local_runner()
    t0 = clock()
    if window_s is None:  # enough requests for a P99 that is not just the maximum
        window_s = min(max(args.step_s, args.min_samples / rate), max(args.step_s, args.max_step_s))
    w0, w1 = t0 + args.warmup_s, t0 + args.warmup_s + window_s
    pacer.end = w1
    runner.start(users, spawn_rate=max(users, 1) * 100, wait=False)
    gevent.sleep(max(0.0, w0 - clock()))
    c0 = meter.snapshot()
    gevent.sleep(max(0.0, w1 - clock()))
    c1 = meter.snapshot()
    # drain: what was due in the window is sent and answered, or abandoned after --drain-s
    deadline = clock() + args.drain_s
    while clock() < deadline and not all(u.idle() for u in rt.users):
        gevent.sleep(0.05)
    if not all(u.idle() for u in rt.users):
        pacer.abandon = True
    deadline = clock() + args.timeout_s + 5
    while rt.in_flight and clock() < deadline:
        gevent.sleep(0.05)
    gevent.sleep(0.1)  # abandoned users count what they never sent
    stats: StepStats = rt.recorder.window(route, w0, w1)
    runner.stop()  # session users END their sequences (untimed)
    runner.quit()
    gevent.sleep(0)
    checked, bad = rt.checker.check()  # off the timed path
    gen, srv, machine = CpuMeter.percent(c0, c1)
    why = []
    if stats.n == 0:
        why.append("no request completed")
    if not stats.p99_ms <= args.slo_p99_ms:
        why.append(f"P99 {stats.p99_ms:.1f} ms > {args.slo_p99_ms:g} ms")
    if stats.errors:
        why.append(f"{stats.errors} errors")
    if stats.unfinished:
        why.append(f"{stats.unfinished} unfinished")
    if bad:
        why.append(f"{bad} reference mismatches")
    return Step(
        route=route, index=index, offered_rps=round(rate, 3) if rate is not None else 0.0, users=users, achieved_rps=round(stats.achieved_rps, 3),
        n=stats.n, errors=stats.errors, unfinished=stats.unfinished, p50_ms=stats.p50_ms, p90_ms=stats.p90_ms,
        p99_ms=stats.p99_ms, max_ms=stats.max_ms, service_p50_ms=stats.service_p50_ms,
        service_p99_ms=stats.service_p99_ms, lag_p99_ms=stats.lag_p99_ms,
        mean_chars_sent=round(stats.mean_chars, 1), mean_context_chars=round(stats.mean_context, 1),
        checked=checked, mismatches=bad, generator_cpu_pct=round(gen, 1), server_cpu_pct=round(srv, 1),
        machine_cpu_pct=round(machine, 1), settle_s=round(settled_s, 2), passed=not why, why="; ".join(why), first_error=stats.first_error,
        kinds=json.dumps(stats.kinds),
    )


def search(route: str, args, rt, meter: CpuMeter, log, unloaded: dict) -> list[Step]:
    """Probe the unloaded latency (into ``unloaded``), then step the offered rate and bisect; returns the
    rate steps run."""
    steps: list[Step] = []

    def run(rate: float) -> bool:
        s = run_step(route, rate, len(steps), args, rt, meter)
        steps.append(s)
        log(s)
        return s.passed

    probe = run_step(route, None, -1, args, rt, meter, window_s=args.probe_s)
    log(probe, probe=True)
    unloaded[route] = probe
    if args.rates:
        for r in args.rates:
            run(r)
        return steps
    rate, best, worst = args.start_rps, None, None
    if run(rate):
        best = rate
        while rate * args.growth <= args.max_rps:
            rate *= args.growth
            if run(rate):
                best = rate
            else:
                worst = rate
                break
    else:
        worst = rate
        while rate / args.growth >= args.min_rps and not hopeless(probe, args):
            rate /= args.growth
            if run(rate):
                best = rate
                break
            worst = rate
    lo, hi = best, worst
    for _ in range(args.refine if lo is not None and hi is not None else 0):
        mid = math.sqrt(lo * hi)
        if run(mid):
            lo = mid
        else:
            hi = mid
    return steps


def hopeless(probe: Step, args) -> bool:
    """No rate can pass: unloaded (one request at a time), over 10 % of the requests already took longer than the
    SLO (a P99 bound cannot hold at any rate; P90, not P99, so that a few stalls of a busy machine do not
    decide it)."""
    if probe.p90_ms > args.slo_p99_ms:
        print(f"  {probe.route}: unloaded P90 {probe.p90_ms:.1f} ms > SLO {args.slo_p99_ms:g} ms: no rate can pass; "
              f"stopping", flush=True)
        return True
    return False


# ---------------------------------------------------------------- outputs


def capacity_of(steps: list[Step], probe: Step | None = None) -> dict:
    ok = [s for s in steps if s.passed]
    best = max(ok, key=lambda s: s.offered_rps) if ok else None
    failed_above = [s for s in steps if not s.passed and (best is None or s.offered_rps > best.offered_rps)]
    return {
        "max_rps": best.offered_rps if best else 0.0,
        "achieved_rps_at_max": best.achieved_rps if best else 0.0,
        "p99_ms_at_max": best.p99_ms if best else None,
        "p50_ms_at_max": best.p50_ms if best else None,
        "first_failing_rps": min((s.offered_rps for s in failed_above), default=None),
        "mean_context_chars": best.mean_context_chars if best else None,
        "unloaded_p50_ms": probe.p50_ms if probe else None,  # one session, back to back
        "unloaded_p99_ms": probe.p99_ms if probe else None,
        "steps": len(steps),
        "checked": sum(s.checked for s in steps) + (probe.checked if probe else 0),
        "mismatches": sum(s.mismatches for s in steps) + (probe.mismatches if probe else 0),
    }


def write_outputs(out: Path, all_steps: dict[str, list[Step]], args, meta: dict, unloaded: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(s) for r, steps in all_steps.items() for s in ([unloaded[r]] if r in unloaded else []) + steps]
    if rows:
        with open(out / "steps.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    routes = {r: capacity_of(steps, unloaded.get(r)) for r, steps in all_steps.items()}
    base = routes.get("stateless", {}).get("max_rps")
    ours = routes.get("session", {}).get("max_rps")
    ratio = (ours / base) if ours is not None and base else None
    ratios = {r: (ours / c["max_rps"]) if ours is not None and c["max_rps"] else None
              for r, c in routes.items() if r not in ("session", "noop")}
    floor = routes.get("noop", {}).get("max_rps")
    of_floor = (ours / floor) if ours is not None and floor else None
    result = {
        "slo_p99_ms": args.slo_p99_ms,
        "routes": routes,
        "ratio": ratio,  # session / stateless (toktier_encode)
        "ratios": ratios,  # session / each baseline
        "of_floor": of_floor,  # session / noop: our capacity as a fraction of the serving stack's floor
        "config": meta,
    }
    (out / "capacity.json").write_text(json.dumps(_clean(result), indent=1) + "\n")
    (out / "capacity.md").write_text(table(result))
    plot(out, all_steps, args.slo_p99_ms)
    return result


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def table(result: dict) -> str:
    lines = [
        f"Capacity at P99 <= {result['slo_p99_ms']:g} ms (Poisson arrivals, 0 errors, 0 mismatches)",
        "",
        "| route | model | max req/s | P99 at max (ms) | P50 at max (ms) | first failing req/s | unloaded P50 (ms) | mean context (chars) | replies checked | mismatches |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, c in result["routes"].items():
        f = lambda v, p=1: "–" if v is None else f"{v:,.{p}f}"  # noqa: E731
        lines.append(
            f"| {r} | {MODELS[r]} | {f(c['max_rps'])} | {f(c['p99_ms_at_max'], 2)} | {f(c['p50_ms_at_max'], 2)} | "
            f"{f(c['first_failing_rps'])} | {f(c['unloaded_p50_ms'], 2)} | {f(c['mean_context_chars'], 0)} | "
            f"{c['checked']} | {c['mismatches']} |"
        )
    lines.append("")
    for r, v in result["ratios"].items():
        if v is not None:
            lines.append(f"session / {r}: {v:.1f}x")
        elif result["routes"][r]["max_rps"] == 0 and result["routes"].get("session", {}).get("max_rps"):
            lines.append(f"session / {r}: unbounded ({r} meets the SLO at no offered rate)")
        else:
            lines.append(f"session / {r}: –")
    if "noop" in result["routes"]:
        v = result.get("of_floor")
        lines.append(f"session / noop (the serving floor, {MODELS['noop']}): "
                     + (f"{v:.2f} ({100 * v:.0f} % of the floor's capacity)" if v is not None else "–"))
    return "\n".join(lines) + "\n"


def plot(out: Path, all_steps: dict[str, list[Step]], slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"session": "tab:green", "stateless": "tab:blue", "stateless_hf": "tab:red",
              "stateless_fast": "tab:purple", "noop": "tab:gray"}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    finite = [s.p99_ms for steps in all_steps.values() for s in steps if math.isfinite(s.p99_ms)]
    ceiling = max(finite + [slo]) * 2  # where an infinite P99 (unfinished requests) is drawn
    for route, steps in all_steps.items():
        pts = sorted((s.offered_rps, s.p99_ms, s.passed) for s in steps)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [p[1] if math.isfinite(p[1]) else ceiling for p in pts]
        for x, p in zip(xs, pts):
            if not math.isfinite(p[1]):
                ax.annotate("inf", (x, ceiling), textcoords="offset points", xytext=(4, 4), fontsize=8,
                            color=colors.get(route))
        ax.plot(xs, ys, "-", color=colors.get(route), label=f"{route} ({MODELS[route]})")
        ax.scatter([x for x, p in zip(xs, pts) if p[2]], [y for y, p in zip(ys, pts) if p[2]], color=colors.get(route),
                   marker="o", zorder=3)
        ax.scatter([x for x, p in zip(xs, pts) if not p[2]], [y for y, p in zip(ys, pts) if not p[2]],
                   color=colors.get(route), marker="x", zorder=3)
    ax.axhline(slo, color="k", ls="--", lw=1, label=f"SLO: P99 = {slo:g} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (req/s, Poisson)")
    ax.set_ylabel("P99 latency (ms, due -> reply)")
    ax.set_title("P99 vs offered load (o pass, x fail; inf: requests left unanswered)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "p99_vs_offered.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    hi = 1.0
    for route, steps in all_steps.items():
        pts = sorted((s.offered_rps, s.achieved_rps) for s in steps)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors.get(route), label=route)
            hi = max(hi, max(p[0] for p in pts))
    lo = min((s.offered_rps for steps in all_steps.values() for s in steps), default=1.0)
    ax.plot([lo / 1.25, hi * 1.25], [lo / 1.25, hi * 1.25], "k:", lw=1, label="throughput = offered")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (req/s, Poisson)")
    ax.set_ylabel("throughput (successful replies/s in the window)")
    ax.set_title("Throughput vs offered load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_offered.png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "out"), help="output folder")
    p.add_argument("--url", default="", help="host:port of a running server (default: start one here)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--tokenizer", default="default", help="tokenizer spec to serve (and to check against)")
    p.add_argument("--routes", default="session,noop,stateless_fast,stateless,stateless_hf",
                   help="comma-separated: session, noop (the serving floor), stateless_fast (fastokens, no state), "
                        "stateless (toktier_encode), stateless_hf (HF baseline)")
    p.add_argument("--slo-p99-ms", type=float, default=50.0)
    p.add_argument("--start-rps", type=float, default=20.0)
    p.add_argument("--growth", type=float, default=1.5, help="rate factor between steps")
    p.add_argument("--max-rps", type=float, default=20000.0)
    p.add_argument("--min-rps", type=float, default=0.5)
    p.add_argument("--refine", type=int, default=2, help="bisection steps after the first failure")
    p.add_argument("--rates", default="", help="explicit offered rates (comma-separated): no search")
    p.add_argument("--step-s", type=float, default=15.0, help="measured seconds per step")
    p.add_argument("--min-samples", type=int, default=300,
                   help="lengthen a step's window to offer this many requests (up to --max-step-s)")
    p.add_argument("--max-step-s", type=float, default=60.0)
    p.add_argument("--warmup-s", type=float, default=5.0, help="seconds before each step's window (sessions open)")
    p.add_argument("--probe-s", type=float, default=4.0, help="seconds of the unloaded probe per route")
    p.add_argument("--settle-s", type=float, default=180.0,
                   help="most seconds to wait before a step for the server to finish earlier backlog")
    p.add_argument("--drain-s", type=float, default=15.0, help="most seconds to finish what the window offered")
    p.add_argument("--corpus", default=None, help="folder of *.traj (default ../shared/corpus/swe-agent)")
    p.add_argument("--context-chars", type=int, default=100_000, help="base context of every session, chars")
    p.add_argument("--mode", choices=("delta", "full"), default="delta", help="session turns")
    p.add_argument("--reply", choices=("patch", "full"), default="patch", help="session replies")
    p.add_argument("--think-s", type=float, default=0.5, help="mean gap between a session's turns (s)")
    p.add_argument("--max-sessions", type=int, default=1000)
    p.add_argument("--check-fraction", type=float, default=0.02, help="share of replies checked against HF")
    p.add_argument("--check-max", type=int, default=64, help="most replies checked per step")
    p.add_argument("--timeout-s", type=float, default=30.0, help="per-request client timeout")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    for r in args.routes:
        if r not in MODELS:
            p.error(f"unknown route {r!r}: use {', '.join(MODELS)}")
    args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started (finally below)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = None
    if not args.url:
        print(f"capacity: starting tritonserver ({', '.join(MODELS[r] for r in args.routes)}, tokenizer "
              f"{args.tokenizer}) ...", flush=True)
        server = start_server(args, args.routes, out)
        args.url = server.grpc_url if args.protocol == "grpc" else server.http_url
    try:
        rt = configure(LoadConfig(
            url=args.url, protocol=args.protocol, tokenizer=args.tokenizer, corpus=args.corpus,
            context_chars=args.context_chars, mode=args.mode, reply=args.reply, think_s=args.think_s,
            max_sessions=args.max_sessions, check_fraction=args.check_fraction, check_max=args.check_max,
            timeout_s=args.timeout_s, seed=args.seed,
        ))
        meter = CpuMeter(server.process.pid if server else None)
        wl = rt.workload
        meta = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "url": args.url, "protocol": args.protocol, "server": "started here" if server else "given",
            "tokenizer": args.tokenizer, "corpus": str(wl.folder or "bundled sample"),
            "trajectories": len(wl.trajectories), "context_chars": args.context_chars, "mode": args.mode,
            "reply": args.reply, "think_s": args.think_s, "max_sessions": args.max_sessions,
            "step_s": args.step_s, "min_samples": args.min_samples, "max_step_s": args.max_step_s, "warmup_s": args.warmup_s, "check_fraction": args.check_fraction,
            "arrivals": "open loop, Poisson", "generator": "one process, gevent (Locust as a library)",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "commit": _git_head(),
        }
        print(f"capacity: {args.url} over {args.protocol}; SLO P99 <= {args.slo_p99_ms:g} ms; contexts "
              f"{args.context_chars:,} chars + a trajectory from {meta['corpus']}", flush=True)

        def log(s: Step, probe: bool = False) -> None:
            if probe:
                print(f"  {s.route:<12} unloaded (1 session, back to back): {s.n} requests, p50 {s.p50_ms:.2f} ms, "
                      f"p99 {s.p99_ms:.2f} ms, checked {s.checked} bad {s.mismatches}", flush=True)
                return
            print(f"  {s.route:<12} {s.offered_rps:>9.1f} req/s offered  {s.achieved_rps:>9.1f} done  users {s.users:>4}"
                  f"  p50 {s.p50_ms:8.2f}  p99 {s.p99_ms:8.2f} ms  err {s.errors} unf {s.unfinished}"
                  f"  checked {s.checked} bad {s.mismatches}  cpu gen/srv/all {s.generator_cpu_pct:.0f}/"
                  f"{s.server_cpu_pct:.0f}/{s.machine_cpu_pct:.0f}%  {'PASS' if s.passed else 'FAIL: ' + s.why}",
                  flush=True)

        all_steps: dict[str, list[Step]] = {}
        unloaded: dict[str, Step] = {}
        for route in args.routes:
            print(f"capacity: route {route} ({MODELS[route]})", flush=True)
            all_steps[route] = search(route, args, rt, meter, log, unloaded)
            write_outputs(out, all_steps, args, meta, unloaded)  # partial results survive an interrupted run
        result = write_outputs(out, all_steps, args, meta, unloaded)
        rt.close()
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(getattr(server, "_load_repo", ""), ignore_errors=True)
    print()
    print(table(result), end="")
    print(f"capacity: wrote {out}/capacity.json, steps.csv, capacity.md, p99_vs_offered.png, throughput_vs_offered.png")
    mismatches = sum(c["mismatches"] for c in result["routes"].values())
    if mismatches:
        print(f"capacity: {mismatches} replies differ from the reference: {rt.checker.first_mismatch}", file=sys.stderr)
        return 3
    return 0


def _git_head() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gRPC's gevent integration can keep the interpreter from exiting
