"""Fleet throughput: requests/s and latency percentiles of 1, 2 and 3 replicas behind nginx, on loopback.

Per configuration: :class:`~toktier_backend.deploy.fleet.Fleet` starts N replicas and nginx; ``--procs``
client processes x ``--threads`` threads (one ``SessionClient`` each, gRPC, through nginx) run agent sessions
back to back: open with a system line and the first turn of a bundled SWE-agent trajectory, then
``--steps`` appends of the next turns (``MODE=delta``, ``REPLY=patch``), END, next session (a new key, so
the keys spread over the ring). Each request is timed on the client with ``perf_counter_ns`` (request to
rebuilt ids); the first ``--warmup`` seconds are not counted, then ``--seconds`` are. A ``direct`` row runs
the same load against one replica without nginx (what the proxy costs).

Exactness first: at the end of every session its ids are compared with HF
``Tokenizer.from_file(path).encode(text, add_special_tokens=True).ids`` (off the clock); any mismatch is
printed and the exit status is 1. Per-replica shares come from each replica's Triton metrics
(``nv_inference_request_success{model="toktier_session"}``).

Usage:
    python bench/fleet.py                          # direct, 1, 2, 3 replicas; 4 procs x 4 threads; 20 s each
    python bench/fleet.py --replicas 1,2 --seconds 10
Output: a table on stdout and ``<out>/fleet.json``. Each row also gives the CPU used during the measured
window, in cores, by this run (clients, replicas with their stubs, nginx) and by other jobs on the machine
(busy CPU from ``/proc/stat`` minus ours): on a shared machine, trust rows whose "other jobs" is near 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOKENIZER = REPO / "toktier_backend" / "data" / "gpt2" / "tokenizer.json"


def _pieces() -> list[list[str]]:
    from toktier_backend import corpus

    out = []
    for f in corpus.trajectory_files():
        turns = corpus.load_turns(f)
        out.append([turns[0]] + [b[len(a):] for a, b in zip(turns, turns[1:])])
    return out


def _client_proc(url: str, threads: int, steps: int, t_start: float, t_end: float, q) -> None:
    """One client process: ``threads`` threads running sessions until ``t_end``; latencies (ms) of requests
    that started after ``t_start`` go back through ``q`` with the session and mismatch counts."""
    import tokenizers

    from toktier_backend.client import SessionClient

    ref = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    trajectories = _pieces()
    lat: list[float] = []
    stats = {"sessions": 0, "mismatches": 0, "reopens": 0, "errors": 0}
    lock = threading.Lock()

    def worker(k: int) -> None:
        mine: list[float] = []
        n = 0
        while time.time() < t_end:
            pieces = trajectories[(k + n) % len(trajectories)]
            c = SessionClient(url, session_id=f"bench-{os.getpid()}-{k}-{n}-{uuid.uuid4().hex[:6]}")
            try:
                for i in range(min(steps + 1, len(pieces))):
                    if time.time() >= t_end:
                        break
                    t0 = time.time()
                    t = time.perf_counter_ns()
                    if i == 0:
                        c.open(f"<|im_start|>system\nbench session {c.session_id}<|im_end|>\n" + pieces[0])
                    else:
                        c.append(pieces[i])
                    if t0 >= t_start:
                        mine.append((time.perf_counter_ns() - t) / 1e6)
                ok = c.ids.tolist() == ref.encode(c.text, add_special_tokens=True).ids
                c.close()
                with lock:
                    stats["sessions"] += 1
                    stats["mismatches"] += not ok
                    stats["reopens"] += c.reopens
            except Exception:  # noqa: BLE001  (counted; a benchmark never hides it)
                with lock:
                    stats["errors"] += 1
            n += 1
        with lock:
            lat.extend(mine)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.put((lat, stats))


def _success(url: str) -> float:
    from toktier_backend.serving.metrics import metric, scrape

    s = scrape(url)
    return sum(metric(s, n, model="toktier_session")
               for n in ("nv_inference_request_success", "nv_inference_request_success_total"))


def _cpu_snapshot() -> tuple[float, float]:
    """(CPU seconds used so far by this process and all its descendants, busy CPU seconds of the machine)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(fields[1])
        cpu[int(d)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    ours, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        ours.add(pid)
        todo += [c for c, pp in parent.items() if pp == pid and c not in ours]
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(v) - v[3] - v[4]) / tick  # all but idle and iowait
    return sum(cpu[p] for p in ours if p in cpu), busy


def run_load(url: str, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t_start = time.time() + 3.0 + args.warmup  # processes start (spawn) and warm up first
    t_end = t_start + args.seconds
    procs = [ctx.Process(target=_client_proc, args=(url, args.threads, args.steps, t_start, t_end, q))
             for _ in range(args.procs)]
    for p in procs:
        p.start()
    time.sleep(max(0.0, t_start - time.time()))
    ours0, busy0 = _cpu_snapshot()
    time.sleep(max(0.0, t_end - time.time()))
    ours1, busy1 = _cpu_snapshot()  # clients, replicas, their stubs and nginx are all alive until t_end
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    lat = np.concatenate([np.asarray(r[0], dtype=np.float64) for r in results])
    stats = {k: sum(r[1][k] for r in results) for k in results[0][1]}
    return {"requests": int(lat.size), "rps": lat.size / args.seconds,
            "p50_ms": float(np.percentile(lat, 50)), "p90_ms": float(np.percentile(lat, 90)),
            "p99_ms": float(np.percentile(lat, 99)), "mean_ms": float(lat.mean()),
            "cpu_cores_this_run": round((ours1 - ours0) / args.seconds, 2),
            "cpu_cores_other_jobs": round(max(0.0, (busy1 - busy0) - (ours1 - ours0)) / args.seconds, 2), **stats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="direct,1,2,3", help="comma list of replica counts; 'direct' = no nginx")
    ap.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--threads", type=int, default=4, help="threads (concurrent sessions) per process (default 4)")
    ap.add_argument("--steps", type=int, default=8, help="appends per session (default 8)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per configuration (default 20)")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first (default 3)")
    ap.add_argument("--nginx-workers", default="1")
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    args = ap.parse_args(argv)

    from toktier_backend.deploy.fleet import Fleet
    from toktier_backend.deploy.server import TritonServer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
               "load": {"procs": args.procs, "threads": args.threads, "steps": args.steps, "seconds": args.seconds,
                        "warmup": args.warmup, "protocol": "grpc", "reply": "patch"},
               "rows": {}}
    failed = False
    for name in args.replicas.split(","):
        name = name.strip()
        if name == "direct":
            server = TritonServer(str(TOKENIZER), http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=2,
                                  log_path=out_dir / "fleet-direct.log")
            server.start().wait_ready(300)
            try:
                row = run_load(server.grpc_url, args)
            finally:
                server.stop()
            row["share"] = [1.0]
        else:
            fleet = Fleet(str(TOKENIZER), int(name), http_port=0, grpc_port=0, log_dir=out_dir / f"fleet-{name}",
                          nginx_workers=args.nginx_workers, access_log=False, exit_timeout_s=2)
            fleet.start(300)
            try:
                before = [_success(fleet.metrics_url(i)) for i in range(int(name))]
                row = run_load(fleet.grpc_url, args)
                served = [_success(fleet.metrics_url(i)) - before[i] for i in range(int(name))]
            finally:
                fleet.stop()
            row["share"] = [round(s / max(1.0, sum(served)), 3) for s in served]
        results["rows"][name] = row
        failed |= row["mismatches"] > 0
        print(f"{name:>6}: {row['rps']:7.1f} req/s  p50 {row['p50_ms']:6.2f} ms  p90 {row['p90_ms']:6.2f} ms  "
              f"p99 {row['p99_ms']:7.2f} ms  sessions {row['sessions']}  mismatches {row['mismatches']}  "
              f"reopens {row['reopens']}  errors {row['errors']}  share {row['share']}  CPU cores: this run "
              f"{row['cpu_cores_this_run']}, other jobs {row['cpu_cores_other_jobs']}", flush=True)
    print()
    print("| replicas | req/s | p50 ms | p90 ms | p99 ms | sessions checked | mismatches | share per replica "
          "| CPU cores: this run / other jobs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results["rows"].items():
        label = "1, no nginx" if name == "direct" else name
        print(f"| {label} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} | "
              f"{r['sessions']} | {r['mismatches']} | {' / '.join(f'{s:.2f}' for s in r['share'])} | "
              f"{r['cpu_cores_this_run']:.2f} / {r['cpu_cores_other_jobs']:.2f} |")
    path = out_dir / "fleet.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
