"""GPU full-encode benchmark: exactness first, then single requests, batches, runs, and the crossover.

Per tokenizer (``shared/tokenizers/<name>``):

1. **Exactness**: every text below is encoded by ``GpuEngine`` and compared with HF
   ``encode(text, add_special_tokens=False).ids``; a mismatch marks the row ``INEXACT`` (and the exit
   code is 1). The whole agent corpus is also checked as one batch.
2. **Single requests** at ``--sizes`` chars (``corpus.long_session_text``): wall time of
   ``GpuEngine.encode`` (``perf_counter_ns``: host prep, H2D, kernels, D2H) and device time between CUDA
   events around the launch sequence, with and without CUDA graphs (graphs need CuPy), p50/p90 over
   ``--repeats`` after a warm-up; the same texts through gigatoken (``GigatokenEngine``) and HF.
3. **Batches**: ``--batch`` texts of ``--batch-chars`` chars in one ``encode_batch`` (one device pass).
4. **Runs**: 1M spaces, 1M ``=``, 1M ``a``, 500K ``ab`` (one pre-token each: the block / overflow
   kernel) — exact and timed.
5. **Crossover**: ``routing.measure_crossover`` over the size ladder against gigatoken (HF where gigatoken
   is not installed): the value for
   ``GpuRouter(crossover_chars=...)``.
6. **Stages** (``--stages``): per-stage device ms at the largest size (no graphs).

Writes a table to stdout and JSON to ``--out``. ``--sim`` runs a tiny version on numba's CUDA simulator
(checks the script, not the speed).

Usage:
    python bench/gpu.py --tokenizers gpt2,llama3_1,qwen3,deepseek_v3 --sizes 10000,100000,1000000
    NUMBA_ENABLE_CUDASIM=1 python bench/gpu.py --sim
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up (kernel load, graph capture, size-class allocation)
    out = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e6)
        gc.enable()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizers", default="gpt2,llama3_1,qwen3,deepseek_v3")
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-chars", type=int, default=16000)
    ap.add_argument("--run-chars", type=int, default=1_000_000)
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--shared", default=os.environ.get("TOKTIER_SHARED", str(REPO.parent / "shared")))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "gpu.json"))
    ap.add_argument("--sim", action="store_true", help="tiny sizes on the CUDA simulator")
    args = ap.parse_args(argv)
    if args.sim:
        if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
            ap.error("--sim needs NUMBA_ENABLE_CUDASIM=1 in the environment (before numba is imported)")
        sys.setswitchinterval(2e-4)
        args.sizes, args.repeats, args.batch, args.batch_chars, args.run_chars = "200", 1, 2, 100, 60
        args.tokenizers = args.tokenizers.split(",")[0]

    import tokenizers

    from toktier_backend.corpus import load_turns, long_session_text, trajectory_files
    from toktier_backend.engines.hf import HFEngine
    from toktier_backend.errors import EngineUnavailable
    from toktier_backend.gpu.engine import GpuEngine, _cupy
    from toktier_backend.gpu.routing import measure_crossover

    shared = Path(args.shared)
    sizes = [int(x) for x in args.sizes.split(",")]
    corpus = [load_turns(f)[-1] for f in trajectory_files(shared / "corpus" / "swe-agent")]
    results = {"machine": platform.node(), "python": platform.python_version(), "rows": []}
    try:
        from numba import cuda

        results["device"] = str(cuda.get_current_device().name) if not args.sim else "simulator"
    except Exception as e:  # report, continue: GpuEngine raises the real error below
        results["device"] = f"unavailable: {e}"
    exact_all = True
    for name in args.tokenizers.split(","):
        path = str(shared / "tokenizers" / name / "tokenizer.json")
        ref = tokenizers.Tokenizer.from_file(path)
        gpu = GpuEngine(path)
        try:  # the CPU engine the router would use; the HF reference where gigatoken is not installed
            from toktier_backend.engines.gigatoken import GigatokenEngine

            giga, cpu_name = GigatokenEngine(path), "gigatoken"
        except (ImportError, EngineUnavailable):
            giga, cpu_name = HFEngine(path), "hf"
        want = lambda t: ref.encode(t, add_special_tokens=False).ids  # noqa: E731
        texts = {n: long_session_text(n, shared / "corpus" / "swe-agent") for n in sizes}
        runs = {"spaces": " " * args.run_chars, "equals": "=" * args.run_chars, "a": "a" * args.run_chars,
                "ab": "ab" * (args.run_chars // 2)}
        # 1. exactness
        bad = [k for k, t in {**{str(n): t for n, t in texts.items()}, **runs}.items()
               if gpu.encode(t).tolist() != want(t)]
        batch_ok = True
        if not args.sim:
            got = gpu.encode_batch(corpus)
            batch_ok = all(g.tolist() == want(t) for g, t in zip(got, corpus))
        exact = not bad and batch_ok
        exact_all &= exact
        print(f"\n{name}: {gpu.tables.reason}; exact={'yes' if exact else 'INEXACT ' + str(bad)} corpus-batch={batch_ok}")
        # 2. single requests
        for n, t in texts.items():
            row = {"tokenizer": name, "kind": "single", "chars": n, "exact": exact}
            for graphs in ([False, True] if (not args.sim and _cupy() is not None) else [False]):
                gpu.use_graphs = graphs
                gpu.time_device = True
                dev = []

                def once():
                    gpu.encode(t)
                    dev.append(gpu.last_device_ms)

                wall = timed(once, args.repeats)
                tag = ("graph" if gpu.use_graphs else "graph_failed") if graphs else "direct"
                row[f"gpu_{tag}_wall_p50_ms"], row[f"gpu_{tag}_wall_p90_ms"] = pct(wall, 50), pct(wall, 90)
                row[f"gpu_{tag}_device_p50_ms"] = pct(dev[1:], 50)
                gpu.time_device = False
            gpu.use_graphs = False
            g = timed(lambda: giga.encode(t), args.repeats)
            h = timed(lambda: ref.encode(t, add_special_tokens=False), max(1, args.repeats // 3))
            row.update(cpu_engine=cpu_name, cpu_p50_ms=pct(g, 50), hf_p50_ms=pct(h, 50),
                       mb_per_s_gpu=len(t.encode()) / 1e3 / row["gpu_direct_wall_p50_ms"])
            results["rows"].append(row)
            print(f"  single {n:>9} chars: gpu {row['gpu_direct_wall_p50_ms']:8.2f} ms (device {row['gpu_direct_device_p50_ms']:.2f})"
                  + (f"  graph {row.get('gpu_graph_wall_p50_ms', float('nan')):8.2f} ms (device {row.get('gpu_graph_device_p50_ms', float('nan')):.2f})")
                  + f"  {cpu_name} {row['cpu_p50_ms']:8.2f}  hf {row['hf_p50_ms']:8.2f}")
        # 3. batch
        base = long_session_text(args.batch * args.batch_chars, shared / "corpus" / "swe-agent")
        batch = [base[k * args.batch_chars : (k + 1) * args.batch_chars] for k in range(args.batch)]
        assert all(g.tolist() == want(t) for g, t in zip(gpu.encode_batch(batch), batch)), "batch INEXACT"
        w = timed(lambda: gpu.encode_batch(batch), args.repeats)
        g = timed(lambda: [giga.encode(t) for t in batch], args.repeats)
        results["rows"].append({"tokenizer": name, "kind": "batch", "batch": args.batch, "chars": args.batch_chars,
                                "gpu_wall_p50_ms": pct(w, 50), "cpu_engine": cpu_name, "cpu_serial_p50_ms": pct(g, 50)})
        print(f"  batch {args.batch} x {args.batch_chars} chars: gpu {pct(w, 50):8.2f} ms  {cpu_name} (serial) {pct(g, 50):8.2f} ms")
        # 4. runs
        for k, t in runs.items():
            w = timed(lambda: gpu.encode(t), max(1, args.repeats // 3))
            results["rows"].append({"tokenizer": name, "kind": "run", "run": k, "chars": len(t), "gpu_wall_p50_ms": pct(w, 50)})
            print(f"  run {k:>6} x {len(t)}: gpu {pct(w, 50):8.2f} ms")
        # 5. crossover against gigatoken
        ladder = {n: long_session_text(n, shared / "corpus" / "swe-agent") for n in sorted({*sizes, *(s // 4 for s in sizes)}) if n}
        try:
            cross = measure_crossover(giga, gpu, ladder, repeats=max(1, args.repeats // 2))
        except AssertionError as e:
            cross, exact_all = None, False
            print("  crossover: INEXACT", e)
        results["rows"].append({"tokenizer": name, "kind": "crossover", "cpu_engine": cpu_name, "crossover_chars": cross})
        print(f"  crossover vs {cpu_name}: {cross} chars")
        # 6. stages
        if args.stages:
            gpu.use_graphs, gpu.time_device = False, True
            gpu.encode(texts[max(sizes)])
            results["rows"].append({"tokenizer": name, "kind": "stages", "chars": max(sizes), **gpu.last_stage_ms})
            print("  stages (ms):", {k: round(v, 3) for k, v in gpu.last_stage_ms.items()})
            gpu.time_device = False
        results["rows"].append({"tokenizer": name, "kind": "stats", **gpu.stats})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}; exact: {exact_all}")
    return 0 if exact_all else 1


if __name__ == "__main__":
    sys.exit(main())
