"""Served repair benchmark: ``MODE=delta`` appends with ``REPLY=patch`` at a ~1M-char context, over gRPC.

One run, on loopback, one face at a time (2 cores: the faces never compete):

- ``native``: our ``model_repository/`` on the ``tritonserver`` shipped in ``nvidia-pytriton``
  (:class:`TritonServer`), session keyed by the correlation ID;
- ``pytriton``: the same handler through PyTriton (:class:`PyTritonServer`), keyed by ``session_id``;
- ``in-process``: the core ``Session.append`` with no server (what serving adds is the difference).

Per face: a :class:`SessionClient` opens the session with the ~1M-char base text (timed once), then
``--warmup`` (40: past the shadow verifier's first 32 samples per instance) + ``--samples`` appends of whole agent turns of 1.0K-2.5K chars (~1.5K mean) from the bundled
SWE-agent trajectories (``../shared/corpus/swe-agent``, else the bundled sample; consecutive turns
joined up to that size), each timed with ``perf_counter_ns`` on the client (request to rebuilt ids). The
**no-op floor** is the p50 of an empty ``delta`` on a one-word session through the same model (transport,
batcher, Python-backend IPC and handler; no tokenization); ``noop@ctx`` is an empty delta on the 1M session
(the same floor, like for like with the appends' context). By default one of each is sent after every timed
append (``--no-interleave``: in blocks after the appends), so that all three see the same moments of a busy
machine, and before the timed appends the bench waits (``--settle-s``) until the server is idle: the shadow
verifier's first samples, queued during the warmup, each re-encode the whole text with HF. Printed per face:
append p50 minus each floor p50, and the median of the per-step differences (append - floor).

Where the time goes: per native append, the ms inside tritonclient's ``infer`` (round trip) vs the client's
own work around it (``SessionClient`` rebuilding text and ids), and Triton's per-model statistics (queue,
compute_input, compute_infer, compute_output; ``get_inference_statistics``) for the appends and the floor.
``--faces handler`` adds the ``Handler`` in this process with Triton-shaped tensors (no server): what the
handler adds above ``Session.append``. ``--param KEY=VALUE`` sets a model parameter (e.g. ``verifier_first_n=0``).
See ``docs/design/served_path.md``.

Exactness first: every face's final ids (rebuilt from the patches) must equal HF
``Tokenizer.from_file(path).encode(text, add_special_tokens=True).ids`` of the final text; each reply is
also checked against ``REQUEST_INPUT_LEN``. Output: a table on stdout and ``<out>/served.json``.

Usage:
    python bench/served.py                                 # bundled GPT-2, 1M chars, 60 appends
    python bench/served.py --tokenizer ../shared/tokenizers/qwen3/tokenizer.json --samples 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import toktier_backend as tt  # noqa: E402
from toktier_backend import corpus  # noqa: E402


def session_base(n_chars: int) -> str:
    """About ``n_chars`` chars of rendered sessions, cut back to a turn boundary."""
    text = corpus.long_session_text(n_chars)
    end = text.rfind("<|im_end|>\n")
    return text[: end + len("<|im_end|>\n")] if end > 0 else text


def turn_deltas(n: int, folder: Path | None = None, lo: int = 1000, hi: int = 2500) -> list[str]:
    """``n`` appends of ``lo..hi`` chars: consecutive whole turns of the trajectories in ``folder``
    (bundled sample when ``None``) joined until at least ``lo`` chars (over ``hi``: skipped), cycled."""
    pool = []
    for f in corpus.trajectory_files(folder):
        turns = corpus.load_turns(f)
        acc = ""
        for a, b in zip(turns, turns[1:]):
            acc += b[len(a):]
            if len(acc) >= lo:
                if len(acc) <= hi:
                    pool.append(acc)
                acc = ""
    if not pool:
        raise RuntimeError(f"no appends of {lo}..{hi} chars in the trajectories of {folder or 'the bundled sample'}")
    return [pool[i % len(pool)] for i in range(n)]


def pct(ms: list[float]) -> dict:
    a = np.asarray(ms, dtype=np.float64)
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def timed_ms(fn) -> tuple[float, object]:
    t = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - t) / 1e6, out


class _InferTimer:
    """Wraps a tritonclient's ``infer``: the ms of each call (gRPC round trip: client (de)serialization,
    loopback, Triton), so that the client's own work (``SessionClient`` rebuilding text and ids) is the rest."""

    def __init__(self, client):
        self._client, self.ms = client, []

    def infer(self, *a, **kw):
        t = time.perf_counter_ns()
        try:
            return self._client.infer(*a, **kw)
        finally:
            self.ms.append((time.perf_counter_ns() - t) / 1e6)

    def __getattr__(self, name):
        return getattr(self._client, name)


def triton_stats(client, model: str) -> dict:
    """Triton's cumulative per-model statistics: ``{success, queue, compute_input, compute_infer,
    compute_output: (count, ns)}`` (``get_inference_statistics``; compute_infer = the Python backend's
    ``execute`` incl. its IPC to the stub process)."""
    st = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    return {k: (int(st.get(k, {}).get("count", 0)), int(st.get(k, {}).get("ns", 0)))
            for k in ("success", "queue", "compute_input", "compute_infer", "compute_output")}


def stats_delta(a: dict, b: dict) -> dict:
    """Mean ms per request of each Triton phase between two :func:`triton_stats` snapshots."""
    out = {}
    for k in a:
        n, ns = b[k][0] - a[k][0], b[k][1] - a[k][1]
        out[k + "_ms"] = ns / n / 1e6 if n else None
    return out


def wait_idle(server, max_s: float, *, below: float = 0.05, window_s: float = 0.5) -> float | None:
    """Wait until the server's process tree (tritonserver and its Python backend stubs) uses under ``below``
    of one core over ``window_s``, for at most ``max_s`` seconds: the shadow verifier's first samples
    (``verifier_first_n`` per instance, each a whole-text HF re-encode) queue up during the warmup and would
    otherwise run on the same cores as the timed appends. Returns the seconds waited (``None``: no psutil
    or no server process; ``max_s``: never went idle)."""
    try:
        import psutil
    except ImportError:
        return None
    proc = getattr(server, "process", None)
    if proc is None or max_s <= 0:
        return None
    root = psutil.Process(proc.pid)

    def cpu() -> float:
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    t0 = time.monotonic()
    while time.monotonic() - t0 < max_s:
        a = cpu()
        time.sleep(window_s)
        if cpu() - a < below * window_s:
            return time.monotonic() - t0
    return max_s


def run_face(face: str, server, base: str, deltas: list[str], warmup: int, floor_n: int, *,
             interleave: bool = True, settle_s: float = 180.0) -> dict:
    """Appends on a ~1M-char session and the two no-op floors, through ``SessionClient``.

    ``interleave``: after each timed append, one empty delta on the one-word floor session and one on the
    1M session (noop@ctx), so the three are sampled at the same moments of a busy machine (Triton's phase
    statistics are then of the mixed window; the floor's alone are taken after). Otherwise: the appends, then
    ``floor_n`` noop@ctx, then ``floor_n`` floor requests, each block with its own statistics.
    """
    from toktier_backend.client import SessionClient

    kind = "native" if face == "native" else "pytriton"
    c = SessionClient(server.grpc_url, face=kind, reply="patch")
    timer = c._client = _InferTimer(c._client)
    f = SessionClient(server.grpc_url, face=kind, reply="patch")
    ftimer = f._client = _InferTimer(f._client)
    if kind == "native":
        import tritonclient.grpc as grpcclient

        stats_client = grpcclient.InferenceServerClient(server.grpc_url)
        stats = lambda: triton_stats(stats_client, "toktier_session")  # noqa: E731
    else:
        stats = lambda: None  # noqa: E731
    f.open("floor")
    for _ in range(5):  # warmup
        f.append("")
    open_ms, _ = timed_ms(lambda: c.open(base))
    times, infer_ms, routes, patch_len, floor, floor_infer, noop_big = [], [], Counter(), [], [], [], []
    waited = None
    for i, d in enumerate(deltas):
        if i == warmup:
            waited = wait_idle(server, settle_s)
            s0 = stats()
        ms, ids = timed_ms(lambda: c.append(d))
        if i >= warmup:
            times.append(ms)
            infer_ms.append(timer.ms[-1])
            routes[c.last.route] += 1
            patch_len.append(c.last.n - c.last.keep)
            if interleave:
                floor.append(timed_ms(lambda: f.append(""))[0])
                floor_infer.append(ftimer.ms[-1])
                noop_big.append(timed_ms(lambda: c.append(""))[0])
    s1 = stats()
    if not interleave:
        noop_big = [timed_ms(lambda: c.append(""))[0] for _ in range(floor_n)]
    final_ids, final_text = c.ids.copy(), c.text
    reopens = c.reopens
    c.close()
    s2 = stats()
    alone = [timed_ms(lambda: f.append(""))[0] for _ in range(floor_n)]
    s3 = stats()
    if not interleave:
        floor, floor_infer = alone, ftimer.ms[-floor_n:]
    f.close()
    out = {
        "open_ms": open_ms, "append": pct(times), "noop_floor": pct(floor), "noop_at_context": pct(noop_big),
        "append_infer": pct(infer_ms), "noop_floor_infer": pct(floor_infer),
        "append_client_only": pct([a - b for a, b in zip(times, infer_ms)]),
        "routes": dict(routes), "patch_ids_mean": float(np.mean(patch_len)), "reopens": reopens,
        "interleaved": interleave, "settle_waited_s": waited,
        "_ids": final_ids, "_text": final_text,
    }
    if interleave:
        out["append_minus_floor_paired"] = pct([a - b for a, b in zip(times, floor)])
        out["noop_floor_alone"] = pct(alone)
    if kind == "native":
        out["triton_append" if not interleave else "triton_mixed"] = stats_delta(s0, s1)
        out["triton_floor"] = stats_delta(s2, s3)
    return out


def run_handler(spec: str, base: str, deltas: list[str], warmup: int, floor_n: int) -> dict:
    """The served path without Triton: ``Handler.handle_session_tensors`` in this process with the tensors a
    Triton request carries ([1, 1] object arrays), as the model's ``execute`` calls it, plus the batch
    dimension of the outputs. ``handler - core`` is what the handler adds above ``Session.append``."""
    from toktier_backend.faces import triton_io
    from toktier_backend.faces.triton import Handler

    def tensors(text: str) -> dict:
        return {"TEXT": np.array([[text.encode("utf-8")]], dtype=np.object_),
                "MODE": np.array([[b"delta"]], dtype=np.object_), "REPLY": np.array([[b"patch"]], dtype=np.object_),
                "ADD_SPECIAL_TOKENS": np.array([[True]], dtype=np.bool_)}

    h = Handler.from_parameters({"tokenizer": spec}, model="toktier_session")
    try:
        h.handle_session_tensors(1, {**tensors(base), "MODE": np.array([[b"full"]], dtype=np.object_)},
                                 start=True, end=False)
        times = []
        for i, d in enumerate(deltas):
            x = tensors(d)
            ms, out = timed_ms(lambda: triton_io.with_batch_dim(h.handle_session_tensors(1, x, start=False, end=False), True))
            if i >= warmup:
                times.append(ms)
        entry = h.store.get(1, touch=False)
        final_ids, final_text = entry.session.ids.copy(), entry.session.text
        noop = [timed_ms(lambda: h.handle_session_tensors(1, tensors(""), start=False, end=False))[0]
                for _ in range(floor_n)]
    finally:
        h.close()
    return {"append": pct(times), "noop_at_context": pct(noop), "routes": {}, "open_ms": float("nan"),
            "_ids": final_ids, "_text": final_text}


def _appends(tok, base: str, deltas: list[str], warmup: int, sleep_s: float):
    """A new session over ``base``, then every delta (sleeping ``sleep_s`` before each): the session, the
    open's ms, the timed appends' ms and their routes."""
    s = tok.session()
    open_ms, _ = timed_ms(lambda: s.update(base))
    times, routes = [], Counter()
    for i, d in enumerate(deltas):
        if sleep_s:
            time.sleep(sleep_s)
        ms, _ = timed_ms(lambda: s.append(d))
        if i >= warmup:
            times.append(ms)
            routes[s.last_repair.route] += 1
    return s, open_ms, times, routes


def run_in_process(tok, base: str, deltas: list[str], warmup: int, idle_ms: float = 0.0) -> dict:
    """``Session.append`` of every delta, back to back; with ``idle_ms``, also a second session over the same
    base and deltas that sleeps ``idle_ms`` before each append (as a served model instance sits idle while
    the reply travels and the next request comes), timed as ``append_after_idle``."""
    s, open_ms, times, routes = _appends(tok, base, deltas, warmup, 0.0)
    out = {"open_ms": open_ms, "append": pct(times), "routes": dict(routes), "_ids": s.ids.copy(), "_text": s.text}
    if idle_ms:
        s, _, times, _ = _appends(tok, base, deltas, warmup, idle_ms / 1e3)
        out.update(append_after_idle=pct(times), idle_ms=idle_ms, _ids_after_idle=s.ids.copy())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=str(tt.default_tokenizer_path()), help="tokenizer.json (default: bundled GPT-2)")
    ap.add_argument("--context", type=int, default=1_000_000, help="session context before the appends (chars)")
    ap.add_argument("--samples", type=int, default=60, help="timed appends per face (>= 50 for a p99)")
    ap.add_argument("--warmup", type=int, default=40, help="appends before the timed ones (default 40: past the "
                    "shadow verifier's first_n=32 per instance, whose samples re-encode the whole text)")
    ap.add_argument("--floor", type=int, default=60, help="no-op requests per face")
    ap.add_argument("--faces", default="native,pytriton", help="comma list of native, pytriton, handler (the "
                    "Handler in this process, no Triton)")
    ap.add_argument("--no-interleave", dest="interleave", action="store_false",
                    help="time the no-op floors in blocks after the appends instead of one of each after every append")
    ap.add_argument("--settle-s", type=float, default=180.0, help="after the warmup, wait up to this long for the "
                    "server to go idle (the shadow verifier's first samples); 0: do not wait")
    ap.add_argument("--corpus", default=None, help="folder of *.traj for the appends (default: ../shared/corpus/"
                    "swe-agent if present, else the bundled sample)")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="model parameter for the native server (repeatable), e.g. verifier_first_n=0")
    ap.add_argument("--idle-ms", type=float, default=1.5, help="in-process: also time appends that each follow "
                    "an idle of this long (ms; about a served round trip), on a second session (0: skip)")
    ap.add_argument("--out", default=str(REPO / "bench" / "out"))
    args = ap.parse_args(argv)

    from toktier_backend.deploy.server import PyTritonServer, TritonServer

    t0 = time.time()
    base = session_base(args.context)
    folder = args.corpus
    if folder is None and (REPO.parent / "shared" / "corpus" / "swe-agent").is_dir():
        folder = REPO.parent / "shared" / "corpus" / "swe-agent"
    deltas = turn_deltas(args.warmup + args.samples, Path(folder) if folder else None)
    print(f"tokenizer {args.tokenizer}\ncontext {len(base):,} chars; {args.samples} timed appends "
          f"(+{args.warmup} warmup), mean {np.mean([len(d) for d in deltas]):.0f} chars", flush=True)
    tok = tt.load_tokenizer(args.tokenizer)
    results: dict = {"tokenizer": args.tokenizer, "context_chars": len(base), "samples": args.samples,
                     "corpus": str(folder or "bundled"),
                     "delta_chars_mean": float(np.mean([len(d) for d in deltas])),
                     "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "faces": {}}
    results["faces"]["in-process"] = run_in_process(tok, base, deltas, args.warmup, args.idle_ms)
    logs = Path(args.out)
    logs.mkdir(parents=True, exist_ok=True)
    for face in [f.strip() for f in args.faces.split(",") if f.strip()]:
        if face == "handler":
            results["faces"]["handler"] = run_handler(args.tokenizer, base, deltas, args.warmup, args.floor)
            continue
        cls = TritonServer if face == "native" else PyTritonServer
        kw = {"parameters": dict(p.split("=", 1) for p in args.param)} if face == "native" and args.param else {}
        server = cls(args.tokenizer, http_port=0, grpc_port=0, metrics_port=0, log_path=logs / f"served-{face}.log", **kw)
        server.start().wait_ready(300)
        try:
            results["faces"][face] = run_face(face, server, base, deltas, args.warmup, args.floor,
                                              interleave=args.interleave, settle_s=args.settle_s)
        finally:
            server.stop()

    # exactness first
    final_text = base + "".join(deltas)
    want = np.asarray(tok.reference.encode(final_text, add_special_tokens=True).ids, dtype=np.int32)
    for name, r in results["faces"].items():
        r["exact"] = bool(r.pop("_text") == final_text and np.array_equal(r.pop("_ids"), want)
                          and np.array_equal(r.pop("_ids_after_idle", want), want))
    results["wall_s"] = time.time() - t0

    native_floor = results["faces"].get("native", {}).get("noop_floor", {}).get("p50")
    print(f"\n{'face':<11} {'exact':<6} {'append p50':>11} {'p90':>9} {'p99':>9} {'no-op floor p50':>16} "
          f"{'no-op@ctx p50':>14} {'open (full)':>12}  routes")
    for name, r in results["faces"].items():
        a = r["append"]
        floor = r.get("noop_floor", {}).get("p50")
        at_ctx = r.get("noop_at_context", {}).get("p50")
        f = lambda v: f"{v:9.2f}" if v is not None else f"{'-':>9}"  # noqa: E731
        print(f"{name:<11} {'yes' if r['exact'] else 'NO':<6} {a['p50']:9.2f}ms {f(a['p90'])} {f(a['p99'])} "
              f"{f(floor):>14}ms {f(at_ctx):>12}ms {r['open_ms']:10.1f}ms  {r['routes']}")
    for name in ("native", "pytriton"):
        r = results["faces"].get(name)
        if r:
            a, fl = r["append_infer"], r["noop_floor_infer"]
            print(f"{name}: inside infer() p50 {a['p50']:.3f} ms (floor {fl['p50']:.3f}); client rebuild p50 "
                  f"{r['append_client_only']['p50']:.3f} ms")
        if r and ("triton_append" in r or "triton_mixed" in r):
            what = "append" if "triton_append" in r else "append+2 no-ops (interleaved)"
            ta, tf = r.get("triton_append") or r["triton_mixed"], r["triton_floor"]
            print(f"{name}: Triton mean ms per request, {what} / floor: " + ", ".join(
                f"{k[:-3]} {ta[k]:.3f}/{tf[k]:.3f}" for k in ta if ta[k] is not None and tf[k] is not None))
    ip = results["faces"]["in-process"]
    if "append_after_idle" in ip:
        print(f"in-process: Session.append p50 {ip['append']['p50']:.3f} ms back to back, "
              f"{ip['append_after_idle']['p50']:.3f} ms after a {ip['idle_ms']:g} ms idle each (p90 "
              f"{ip['append_after_idle']['p90']:.3f}; caches go cold while a served instance waits)")
    if "handler" in results["faces"] and "in-process" in results["faces"]:
        h, c = results["faces"]["handler"]["append"]["p50"], results["faces"]["in-process"]["append"]["p50"]
        print(f"handler in process: append p50 {h:.3f} ms, core Session.append p50 {c:.3f} ms: the handler adds "
              f"{h - c:.3f} ms")
    for name in ("native", "pytriton"):
        r = results["faces"].get(name)
        if r:
            a, fl, ctx = r["append"], r["noop_floor"], r["noop_at_context"]
            r["above_floor_ms"] = {"p50": a["p50"] - fl["p50"], "p50_vs_noop_at_context": a["p50"] - ctx["p50"]}
            paired = r.get("append_minus_floor_paired")
            print(f"{name}: append p50 - no-op floor p50 = {a['p50'] - fl['p50']:+.3f} ms (vs no-op@ctx "
                  f"{a['p50'] - ctx['p50']:+.3f} ms" + (f"; paired, median of per-step differences "
                  f"{paired['p50']:+.3f} ms" if paired else "") + f"); append p99 {a['p99']:.2f} ms; n {a['n']} "
                  f"appends, {fl['n']} no-ops each ({'interleaved' if r.get('interleaved') else 'in blocks'}; "
                  f"waited {r.get('settle_waited_s') or 0:.1f} s for an idle server after the warmup)")
    if native_floor:
        for name in ("native", "pytriton"):
            if name in results["faces"]:
                p50 = results["faces"][name]["append"]["p50"]
                print(f"{name}: append p50 / native no-op floor p50 = {p50 / native_floor:.1f}x")
    out = Path(args.out) / "served.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out} ({results['wall_s']:.0f} s)")
    return 0 if all(r["exact"] for r in results["faces"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
