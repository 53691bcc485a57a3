"""Soak: N minutes of replayed agent sessions at a steady rate against a tritonserver this script starts.

Reports, and writes as JSON: tritonserver's RSS over time (the server and its Python-backend stubs) next to
the sessions' charged memory and the budget, the error count, client-side reference checks, and the shadow
verifier's samples / mismatches / drops (from the ``toktier_*`` metrics). Pass: no error, no mismatch, and
RSS flat after warm-up (the last third's median within ``--flat-tolerance`` of the middle third's).

Sessions replay SWE-agent trajectories turn by turn (``toktier_backend.corpus``; the bundled sample, or
``--corpus DIR``): START with the first turn's whole text, then each turn's new text as a delta with a patch
reply, through :class:`~toktier_backend.client.SessionClient` (which re-opens evicted sessions by
resending the whole text). ``--abandon`` of the sessions end without END, so the idle timeout frees them; the
small ``--budget-bytes`` makes the LRU evict under pressure. Requests are paced globally at ``--rate`` per
second by a token bucket shared by ``--sessions`` worker threads.

    python load/soak.py --minutes 10 --out load/out/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from toktier_backend.corpus import load_turns, trajectory_files  # noqa: E402


# ---------------------------------------------------------------- process memory


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def role(pid: int) -> str:
    """``tritonserver`` or the model instance a Python backend stub serves (e.g. ``toktier_session_0_1``)."""
    try:
        args = open(f"/proc/{pid}/cmdline").read().split("\0")
    except OSError:
        return "?"
    if args and args[0].endswith("triton_python_backend_stub") and len(args) > 8:
        return args[8]
    return Path(args[0]).name if args and args[0] else "?"


def tree_rss(root: int) -> dict[int, int]:
    """RSS in bytes of ``root`` and all its descendants (``/proc/<pid>/status`` VmRSS)."""
    kids, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[pid] = int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
        todo += kids.get(pid, [])
    return out


# ---------------------------------------------------------------- pacing


class TokenBucket:
    """``rate`` permits per second, shared by threads; ``take`` sleeps until one is free."""

    def __init__(self, rate: float):
        self.interval = 1.0 / rate
        self.next = time.monotonic()
        self.lock = threading.Lock()

    def take(self, stop: threading.Event) -> bool:
        with self.lock:
            now = time.monotonic()
            slot = max(self.next, now)
            self.next = slot + self.interval
        wait = slot - time.monotonic()
        return not (wait > 0 and stop.wait(wait))


# ---------------------------------------------------------------- the soak


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second, all sessions together")
    ap.add_argument("--sessions", type=int, default=16, help="concurrent sessions (worker threads)")
    ap.add_argument("--tokenizer", default="default")
    ap.add_argument("--corpus", default=None, help="folder of SWE-agent *.traj files (default: bundled sample)")
    ap.add_argument("--budget-bytes", type=int, default=1 << 20, help="session budget per instance (small: evicts)")
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="sequence idle timeout = session TTL")
    ap.add_argument("--abandon", type=float, default=0.2, help="share of sessions left without END")
    ap.add_argument("--verifier-rate", type=float, default=0.05)
    ap.add_argument("--check-rate", type=float, default=0.25, help="share of replies checked against HF here")
    ap.add_argument("--sample-seconds", type=float, default=5.0, help="RSS / metrics sampling period")
    ap.add_argument("--flat-tolerance", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "load" / "out" / "soak.json"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import tokenizers
    import tritonclient.grpc as grpcclient

    from toktier_backend.tokenizer import default_tokenizer_path
    from toktier_backend.client import SessionClient
    from toktier_backend.serving.metrics import metric, scrape  # needs prometheus_client (serve extra)
    from toktier_backend.deploy.server import TritonServer
    from toktier_backend.spec import resolve_path

    path = default_tokenizer_path() if args.tokenizer in ("", "default") else resolve_path(args.tokenizer)
    reference = tokenizers.Tokenizer.from_file(str(path))
    sessions = [t for t in (load_turns(f) for f in trajectory_files(args.corpus)) if len(t) >= 2]
    tmp = Path(tempfile.mkdtemp(prefix="toktier-soak-"))
    server = TritonServer(
        str(path), http_port=0, grpc_port=0, metrics_port=0, toktier_metrics_port=0,
        session_idle_s=args.idle_seconds, log_path=tmp / "tritonserver.log", exit_timeout_s=5,
        parameters={"session_budget_bytes": str(args.budget_bytes), "verifier_rate": str(args.verifier_rate),
                    "quarantine_file": str(tmp / "quarantine.json")},
    )
    t0 = time.monotonic()
    server.start().wait_ready(300)
    print(f"soak: tritonserver pid {server.process.pid} ready in {time.monotonic() - t0:.1f} s; "
          f"{args.minutes:g} min at {args.rate:g} req/s, {args.sessions} sessions, budget "
          f"{args.budget_bytes / 2**20:.1f} MiB/instance, {len(sessions)} trajectories", flush=True)

    stop = threading.Event()
    bucket = TokenBucket(args.rate)
    lock = threading.Lock()
    counts: Counter = Counter()
    errors: list[str] = []
    latencies: list[float] = []
    shared = grpcclient.InferenceServerClient(server.grpc_url)

    def worker(k: int):
        rng = random.Random(args.seed * 1000 + k)
        n = 0
        while not stop.is_set():
            turns = sessions[(k + n) % len(sessions)]
            n += 1
            c = SessionClient(server.grpc_url, client=shared, session_id=f"soak-{k}-{n}", timeout_s=60)
            prev = ""
            for i, text in enumerate(turns):
                if not bucket.take(stop):
                    return
                t1 = time.perf_counter()
                try:
                    ids = c.open(text) if i == 0 else (
                        c.append(text[len(prev):]) if text.startswith(prev) else c.update(text))
                except Exception as e:  # noqa: BLE001 - every failure is an error of the soak
                    with lock:
                        counts["errors"] += 1
                        errors.append(f"{type(e).__name__}: {str(e)[:300]}")
                    break
                dt = time.perf_counter() - t1
                checked = rng.random() < args.check_rate
                bad = checked and ids.tolist() != reference.encode(text).ids
                with lock:
                    counts["requests"] += 1
                    counts["checked"] += checked
                    counts["client_mismatches"] += bad
                    latencies.append(dt)
                prev = text
            with lock:
                counts["sessions"] += 1
                counts["reopens"] += c.reopens
            if rng.random() >= args.abandon:
                try:
                    c.close()
                except Exception as e:  # noqa: BLE001
                    with lock:
                        counts["errors"] += 1
                        errors.append(f"close: {type(e).__name__}: {str(e)[:300]}")
            else:
                with lock:
                    counts["abandoned"] += 1

    series: list[dict] = []

    def sample():
        rss = tree_rss(server.process.pid)
        m = scrape(server.toktier_metrics_url)
        with lock:
            point = {
                "t_s": round(time.monotonic() - start, 1), "rss_bytes": sum(rss.values()), "processes": len(rss),
                "rss_by_process": {f"{role(pid)}[{pid}]": b for pid, b in sorted(rss.items())},
                "requests": counts["requests"], "errors": counts["errors"],
                "sessions_held": metric(m, "toktier_sessions"),
                "session_memory_bytes": metric(m, "toktier_session_memory_bytes"),
                "prefix_index_bytes": metric(m, "toktier_prefix_index_bytes"),
                "verifier_samples": metric(m, "toktier_verifier_samples_total"),
                "verifier_mismatches": metric(m, "toktier_verifier_samples_total", result="mismatch"),
                "verifier_dropped": metric(m, "toktier_verifier_dropped_total"),
                "evictions": {c: metric(m, "toktier_session_evictions_total", cause=c)
                              for c in ("idle", "budget", "start", "error")},
            }
        series.append(point)
        print(f"  t={point['t_s']:6.0f}s rss={point['rss_bytes'] / 2**20:7.1f} MiB sessions={point['sessions_held']:4.0f} "
              f"charged={point['session_memory_bytes'] / 2**20:6.2f} MiB prefix_index={point['prefix_index_bytes'] / 2**20:6.2f} MiB "
              f"req={point['requests']:6d} "
              f"err={point['errors']} verified={point['verifier_samples']:.0f} "
              f"mismatch={point['verifier_mismatches']:.0f} evict={point['evictions']}", flush=True)

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.sessions)]
    for t in threads:
        t.start()
    deadline = start + args.minutes * 60
    try:
        sample()
        while time.monotonic() < deadline:
            time.sleep(min(args.sample_seconds, max(0.0, deadline - time.monotonic())))
            if not server.is_alive():
                errors.append("tritonserver exited")
                counts["errors"] += 1
                break
            sample()
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        time.sleep(2)  # let the verifier drain
        if server.is_alive():
            sample()
        shared.close()
        server.stop()

    rss = np.array([p["rss_bytes"] for p in series], dtype=float)
    ts = np.array([p["t_s"] for p in series], dtype=float)
    warm = ts >= ts[-1] / 3  # after warm-up: RSS slope by least squares, MiB per minute
    slope = float(np.polyfit(ts[warm] / 60, rss[warm] / 2**20, 1)[0]) if warm.sum() >= 2 else 0.0
    thirds = np.array_split(rss, 3)
    middle, last = float(np.median(thirds[1])), float(np.median(thirds[2]))
    final = series[-1]
    lat = np.array(latencies) * 1e3
    summary = {
        "minutes": args.minutes, "requests": counts["requests"], "sessions_completed": counts["sessions"],
        "abandoned": counts["abandoned"], "reopens": counts["reopens"], "errors": counts["errors"],
        "client_checked": counts["checked"], "client_mismatches": counts["client_mismatches"],
        "verifier_samples": final["verifier_samples"], "verifier_mismatches": final["verifier_mismatches"],
        "verifier_dropped": final["verifier_dropped"], "evictions": final["evictions"],
        "rss_mib": {"first": rss[0] / 2**20, "max": rss.max() / 2**20, "median_middle_third": middle / 2**20,
                    "median_last_third": last / 2**20},
        "rss_slope_mib_per_min_after_warmup": slope,
        "prefix_index_max_mib": max(p["prefix_index_bytes"] for p in series) / 2**20,
        "rss_flat": bool(abs(last - middle) <= args.flat_tolerance * middle),
        "session_memory_max_mib": max(p["session_memory_bytes"] for p in series) / 2**20,
        "session_budget_mib": 2 * args.budget_bytes / 2**20,  # two toktier_session instances
        "latency_ms": {"p50": float(np.percentile(lat, 50)), "p90": float(np.percentile(lat, 90)),
                       "p99": float(np.percentile(lat, 99))} if len(lat) else {},
        "achieved_rate": counts["requests"] / max(1e-9, (series[-1]["t_s"] or 1)),
    }
    summary["pass"] = (summary["errors"] == 0 and summary["client_mismatches"] == 0
                       and summary["verifier_mismatches"] == 0 and summary["rss_flat"]
                       and summary["session_memory_max_mib"] <= summary["session_budget_mib"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "args": vars(args), "errors": errors[:50], "series": series},
                              indent=1))
    print(json.dumps(summary, indent=1))
    print(f"soak: wrote {out}")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
