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

``--device-check`` runs the staged check of ``bench/gpu_device_check.sh`` instead (exactness on four
families, 1M-char singles, 8/32/128 x 100K batches, crossover, served GPU vs CPU instances; one JSON; see
``device_check``), ``--dry-run`` with it on the simulator.

Usage:
    python bench/gpu.py --tokenizers gpt2,llama3_1,qwen3,deepseek_v3 --sizes 10000,100000,1000000
    NUMBA_ENABLE_CUDASIM=1 python bench/gpu.py --sim
    bash bench/gpu_device_check.sh [--dry-run]
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


def timed(fn, repeats: int, *, warm: bool = True) -> list[float]:
    if warm:
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
    ap.add_argument("--device-check", action="store_true",
                    help="the staged device check (bench/gpu_device_check.sh): one JSON at --out")
    ap.add_argument("--dry-run", action="store_true", help="with --device-check: simulator, tiny sizes")
    args = ap.parse_args(argv)
    if args.device_check:
        if args.dry_run:
            if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
                ap.error("--dry-run needs NUMBA_ENABLE_CUDASIM=1 in the environment (before numba is imported)")
            sys.setswitchinterval(2e-4)
        return device_check(args)
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



# ====================================================================================== device check
#
# ``bench/gpu_device_check.sh`` runs this (``python bench/gpu.py --device-check --out FILE``): the stages
# below in one process (the kernels compile once), each with its own time budget in seconds. A stage that
# reaches its budget stops between measurements and is recorded as ``{"status": "skipped", "reason": ...}``
# with what it measured so far; the JSON is rewritten after every stage, so a run killed by the script's
# overall timeout still leaves every finished stage. ``--dry-run`` runs every stage on numba's CUDA
# simulator at tiny sizes (checks the script end to end, not the speed).

FAMILIES = ["gpt2", "llama3_1", "qwen3", "deepseek_v3"]
BUDGETS_S = {"exactness": 100, "single_1m": 60, "batches": 60, "crossover": 45, "served": 150}
DRY_BUDGETS_S = {"exactness": 60, "single_1m": 15, "batches": 15, "crossover": 15, "served": 60}


class _Budget(Exception):
    pass


class _Stage:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def check(self, what: str) -> None:
        spent = time.perf_counter() - self.t0
        if spent > self.seconds:
            raise _Budget(f"time budget {self.seconds:g} s reached after {spent:.1f} s (before {what})")


def _traps() -> list[str]:
    return ["It's 'S 'll x'Re  \n\n 12345 a.b ..c\t.d é\u00a0x", "def f(x):\n    return x->y + 2025  # it's\r\n\r\n",
            "中文字符测试，日本語のテキスト。한국어", "ſ ' \u200dab 👍🏽 «»$ .aé !Ab \u3000z", " " * 40 + "z" + "=" * 37,
            "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<｜User｜>x<|begin_of_text|>", "cafe\u0301"]


def device_check(args) -> int:
    """Run the stages; write one JSON to ``args.out``; exit code 1 when an exactness check failed."""
    import tokenizers

    from toktier_backend.corpus import long_session_text
    from toktier_backend.engines.hf import HFEngine
    from toktier_backend.gpu.engine import GpuEngine, _cupy
    from toktier_backend.gpu.routing import FreshCpuEngine, GpuRouter, measure_crossover

    dry = args.dry_run
    shared = Path(args.shared)
    swe = shared / "corpus" / "swe-agent"
    budgets = DRY_BUDGETS_S if dry else BUDGETS_S
    out_path = Path(args.out)
    report: dict = {"kind": "gpu_device_check", "dry_run": dry, "machine": platform.node(),
                    "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "budgets_s": budgets, "stages": {}}
    try:
        from numba import cuda

        report["device"] = "simulator" if dry else str(cuda.get_current_device().name)
    except Exception as e:
        report["device"] = f"unavailable: {type(e).__name__}: {e}"
    report["cupy"] = _cupy() is not None

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1))

    refs, engines = {}, {}

    def ref(name):
        if name not in refs:
            refs[name] = tokenizers.Tokenizer.from_file(str(shared / "tokenizers" / name / "tokenizer.json"))
        return refs[name]

    def engine(name):
        if name not in engines:
            engines[name] = GpuEngine(str(shared / "tokenizers" / name / "tokenizer.json"))
        return engines[name]

    def want(name, text):
        return ref(name).encode(text, add_special_tokens=False).ids

    def run_stage(key, fn):
        st = _Stage(budgets[key])
        data: dict = {}
        print(f"stage {key} (budget {budgets[key]} s)", file=sys.stderr, flush=True)
        try:
            fn(st, data)
            data["status"] = "ok"
        except _Budget as e:
            data.update(status="skipped", reason=str(e))
        except Exception as e:  # recorded, the next stage still runs
            import traceback

            data.update(status="error", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        data["seconds"] = round(time.perf_counter() - st.t0, 1)
        report["stages"][key] = data
        save()
        print(f"  -> {data['status']} in {data['seconds']} s {data.get('reason', '')}", file=sys.stderr, flush=True)

    fams = [f for f in FAMILIES if (shared / "tokenizers" / f / "tokenizer.json").is_file()]
    timed_fams = fams[:1] if dry else [f for f in ("llama3_1", "gpt2", "qwen3", "deepseek_v3") if f in fams]

    # 1. exactness on real text: single, batch (one pass), router batch with a lone surrogate in it
    def exactness(st, data):
        data["families"] = {}
        for name in fams:
            st.check(f"exactness {name}")
            e = engine(name)
            if dry:  # a simulated pass costs seconds per 100 chars: three short texts, one pass
                texts = ["It's 12345 a.b\r\n\r\n x", "中文 é👍🏽<|endoftext|>", long_session_text(24, swe)]
                single = []
            else:
                texts = _traps() + [long_session_text(n, swe) for n in (1000, 100_000, 1_000_000)] + \
                    [long_session_text(300_000, swe)[k * 3000:(k + 1) * 3000] for k in range(40)]
                single = texts[:3] + texts[-4:-1]
            single_bad = [len(t) for t in single if e.encode(t).tolist() != want(name, t)]
            got = [] if dry else e.encode_batch(texts)  # (dry: the router's pass below is the batch pass)
            batch_bad = [len(t) for t, g in zip(texts, got) if g.tolist() != want(name, t)]
            router = GpuRouter(HFEngine(str(shared / "tokenizers" / name / "tokenizer.json")), e, crossover_chars=8,
                               max_queue=len(texts) + 1)
            mixed = (texts[:2] + ["bad \ud800 x"] + texts[2:]) if dry else (texts[:2] + ["bad \ud800 x"] + texts[3:6])
            res = router.encode_many(mixed)
            router.close()
            router_bad = [k for k, (t, r) in enumerate(zip(mixed, res))
                          if (not isinstance(r, Exception) if "\ud800" in t else
                              (isinstance(r, Exception) or r[0].tolist() != want(name, t)))]
            data["families"][name] = {"texts": len(texts), "chars": sum(map(len, texts)), "family": e.tables.family,
                                      "single_mismatch": single_bad, "batch_mismatch": batch_bad,
                                      "router_mismatch": router_bad,
                                      "exact": not (single_bad or batch_bad or router_bad),
                                      # one reply as it came back, for a reader (and a test) to recheck
                                      "sample": {"text": mixed[0], "ids": None if isinstance(res[0], Exception)
                                                 else res[0][0].tolist(), "route": None if isinstance(res[0], Exception)
                                                 else res[0][1]}}
        data["exact"] = all(f["exact"] for f in data["families"].values()) and len(data["families"]) == len(fams)

    run_stage("exactness", exactness)

    # 2. single 1M-char requests: wall p50/p90 (and device ms), direct launches and CUDA graphs
    def single_1m(st, data):
        n = 40 if dry else 1_000_000
        reps = 1 if dry else 10
        data.update(chars=n, repeats=reps, rows=[])
        text = long_session_text(n, swe)
        for name in timed_fams:
            st.check(f"single {name}")
            e = engine(name)
            if e.encode(text).tolist() != want(name, text):
                raise AssertionError(f"{name}: {n}-char request INEXACT")
            row = {"tokenizer": name}
            for graphs in ([False, True] if (not dry and _cupy() is not None) else [False]):
                e.use_graphs, e.time_device = graphs, True
                dev = []

                def once():
                    e.encode(text)
                    dev.append(e.last_device_ms)

                wall = timed(once, reps, warm=not dry)
                tag = ("graph" if e.use_graphs else "graph_failed") if graphs else "direct"
                row.update({f"{tag}_wall_p50_ms": pct(wall, 50), f"{tag}_wall_p90_ms": pct(wall, 90),
                            f"{tag}_device_p50_ms": pct(dev[1:], 50), f"{tag}_n": len(wall)})
                e.time_device = False
                st.check(f"single {name} graphs")
            e.use_graphs = False
            h = timed(lambda: ref(name).encode(text, add_special_tokens=False), max(1, reps // 5))
            row.update(hf_p50_ms=pct(h, 50), hf_n=len(h), ratio_hf_over_gpu=pct(h, 50) / row["direct_wall_p50_ms"])
            if "graph_wall_p50_ms" not in row:
                row["graph_reason"] = "simulator" if dry else "CuPy missing: no CUDA graphs"
            data["rows"].append(row)

    run_stage("single_1m", single_1m)

    # 3. batches of 8/32/128 x 100K chars through GpuRouter.encode_many (one pass each): throughput
    def batches(st, data):
        per = 12 if dry else 100_000
        sizes = [2, 3] if dry else [8, 32, 128]
        reps = 1 if dry else 3
        data.update(chars_per_request=per, rows=[])
        name = timed_fams[0]
        e = engine(name)
        path = str(shared / "tokenizers" / name / "tokenizer.json")
        base = long_session_text(max(sizes) * per, swe)
        for b in sizes:
            st.check(f"batch {b}")
            texts = [base[k * per:(k + 1) * per] for k in range(b)]
            router = GpuRouter(HFEngine(path), e, crossover_chars=1, max_queue=b)
            res = router.encode_many(texts)
            check = texts[:8]
            exact = all(r[1] == "gpu" and r[0].tolist() == want(name, t) for t, r in zip(check, res))
            if not exact:
                raise AssertionError(f"batch {b} x {per}: INEXACT or not on the GPU")
            w = timed(lambda: router.encode_many(texts), reps, warm=not dry)
            router.close()
            mb = sum(len(t.encode()) for t in texts) / 1e6
            data["rows"].append({"tokenizer": name, "batch": b, "wall_p50_ms": pct(w, 50), "wall_p90_ms": pct(w, 90),
                                 "n": len(w), "mb_per_s": mb / (pct(w, 50) / 1e3), "checked_exact": len(check)})
        st.check("CPU anchor")
        b = sizes[0]
        texts = [base[k * per:(k + 1) * per] for k in range(b)]
        hf_batch = getattr(ref(name), "encode_batch_fast", None) or ref(name).encode_batch  # (fast: tokenizers >= 0.21)
        hf = timed(lambda: hf_batch(texts, add_special_tokens=False), 1)
        data["hf_batch"] = {"batch": b, "wall_p50_ms": pct(hf, 50), "n": len(hf),
                            "ratio_hf_over_gpu": pct(hf, 50) / data["rows"][0]["wall_p50_ms"]}

    run_stage("batches", batches)

    # 4. the crossover against the CPU engine a CPU instance runs (the tokenizer's fresh-text encode)
    def crossover(st, data):
        import toktier_backend as tt

        name = timed_fams[0]
        ladder = [30] if dry else [1000, 4000, 16_000, 64_000, 256_000]
        tok = tt.load_tokenizer(str(shared / "tokenizers" / name / "tokenizer.json"))
        cpu = FreshCpuEngine(tok)
        data.update(tokenizer=name, cpu_engine=getattr(tok.engine, "name", "?"), ladder=ladder)
        st.check("crossover")
        data["crossover_chars"] = measure_crossover(cpu, engine(name), {n: long_session_text(n, swe) for n in ladder},
                                                    repeats=1 if dry else 5)

    run_stage("crossover", crossover)

    # 5. toktier_encode served: --encode-gpu-instances 1 against CPU only, same client load
    def served(st, data):
        data["arms"] = {}
        arms = [("cpu_only", 0), ("gpu_instances_1", 1)]
        for arm, gpus in arms:
            if gpus and dry:
                data["arms"][arm] = {"status": "skipped", "reason": "dry run: no CUDA device here for a KIND_GPU "
                                     "instance (the simulator is this process's, not tritonserver's)"}
                continue
            st.check(f"served {arm}")
            data["arms"][arm] = _served_arm(args, shared, timed_fams[0], gpus, dry, st)
        done = [a for a in data["arms"].values() if a.get("status") == "ok"]
        if not done:
            raise RuntimeError("no served arm ran: " + "; ".join(a.get("reason", "") for a in data["arms"].values()))

    run_stage("served", served)

    ex = report["stages"]["exactness"]
    served_ok = [a for a in report["stages"]["served"].get("arms", {}).values() if a.get("status") == "ok"]
    report["exact"] = ex.get("status") == "ok" and ex.get("exact", False) and all(a["exact"] for a in served_ok)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    print(f"wrote {out_path}; exact: {report['exact']}", file=sys.stderr)
    return 0 if report["exact"] else 1


def _served_arm(args, shared: Path, name: str, gpus: int, dry: bool, st: _Stage) -> dict:
    """One tritonserver on loopback (``deploy.server.TritonServer``), ``toktier_encode`` with ``gpus`` GPU
    instances (beside its one CPU instance) or CPU only; a thread pool of gRPC clients sends the same texts;
    ids checked against HF for each text. ``gpu_crossover_chars`` is the request size, so a request the
    scheduler hands to the GPU instance takes the device (the measured crossover is the crossover stage's)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import tokenizers

    try:
        import tritonclient.grpc as grpcclient

        from toktier_backend.corpus import long_session_text
        from toktier_backend.deploy.server import TritonServer, find_triton_dist

        find_triton_dist()
    except Exception as e:
        return {"status": "skipped", "reason": f"no tritonserver / tritonclient here: {type(e).__name__}: {e}"}
    path = str(shared / "tokenizers" / name / "tokenizer.json")
    tmp = Path(tempfile.mkdtemp(prefix="toktier-served-"))
    per, n_req, conc = (200, 8, 2) if dry else (100_000, 64, 8)
    params = {"verifier_rate": "0", "verifier_first_n": "0", "quarantine_file": str(tmp / "q.json"),
              "gpu_max_queue": "16", "gpu_crossover_chars": str(per)}
    server = TritonServer(path, http_port=0, grpc_port=0, metrics_port=0, log_path=tmp / "tritonserver.log",
                          exit_timeout_s=3, parameters=params, encode_gpu_instances=gpus)
    base = long_session_text(per * 16, shared / "corpus" / "swe-agent")
    texts = [base[k * per:(k + 1) * per] for k in range(16)]
    ref = tokenizers.Tokenizer.from_file(path)
    want = [ref.encode(t).ids for t in texts]
    t_start = time.perf_counter()
    try:
        server.start().wait_ready(min(180, max(30, st.seconds - (time.perf_counter() - st.t0) - 10)))
        ready_s = time.perf_counter() - t_start
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

        def one(k):
            text = texts[k % len(texts)]
            inp = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
            t0 = time.perf_counter()
            res = client.infer("toktier_encode", [inp])
            ms = (time.perf_counter() - t0) * 1e3
            return ms, res.as_numpy("INPUT_ID").reshape(-1).tolist() == want[k % len(texts)]

        one(0)  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as ex:
            rows = list(ex.map(one, range(n_req)))
        wall = time.perf_counter() - t0
        lat = [r[0] for r in rows]
        return {"status": "ok", "tokenizer": name, "gpu_instances": gpus, "chars_per_request": per,
                "requests": n_req, "concurrency": conc, "ready_s": round(ready_s, 1), "exact": all(r[1] for r in rows),
                "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90), "p99_ms": pct(lat, 99),
                "requests_per_s": n_req / wall, "mb_per_s": n_req * per / 1e6 / wall,
                "parameters": params}
    except Exception as e:
        logf = tmp / "tritonserver.log"
        log = logf.read_text(errors="replace")[-2000:] if logf.exists() else ""
        return {"status": "error", "reason": f"{type(e).__name__}: {e}", "log_tail": log}
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
