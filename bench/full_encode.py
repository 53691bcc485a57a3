"""Fresh full-encode benchmark: one whole document, no session state, ours (serial and parallel) vs the anchors.

**Fresh encodes** (default). Per tokenizer and size (chars), ``--samples`` different texts (windows of the
SWE-agent corpus rendered as ChatML, each starting ``STRIDE`` chars after the last, so no system can serve
one from a cache) are encoded by each system, one system at a time, in two passes over the two halves of the
samples (the second pass in reverse order: the machine's load drifts); HF runs last, on the first
``--hf-samples``. Every system sleeps the same ``--gap-s`` after each sample (ours after its prefix index is
drained): an idle gap slows the next encode on this VM, so only equal gaps compare fairly:

- ``ours``: ``Tokenizer.encode(text, add_special_tokens=False)`` with none of our parallel machinery
  (``chunked.min_chars`` infinite): validation, guard check, one whole-text engine
  call on the calling thread, serial: in a child process whose fastokens runs on one thread
  (:class:`ChildProcess`);
- ``ours_par``: the same call with the shipped settings (``toktier_backend.pipeline.chunked``): from
  ``chunked.MIN_CHARS`` up, cut at stable cuts into tasks of the shared pool, on workers pinned to distinct
  CPUs while they run one (fastokens: a task per ``chunked.PIECE_CHARS`` piece; gigatoken: one chunk per
  worker);
- ``gigatoken``: ``gigatoken.Tokenizer.encode`` (whole text; serial in 0.10.0, see ``pipeline/chunked.py``);
- ``fastokens``: ``encode_batch_flat([text])``, segment cache off (unsupported for cl100k/o200k), in a
  child process of its own with fastokens' defaults (:class:`ChildProcess`);
- ``toktier_chunked``: toktier 0.3.0 ``toktier.chunked.encode`` (qwen3, deepseek_v3, llama3_1 only);
- ``hf``: HF ``tokenizers`` ``encode(text, add_special_tokens=False)``, serial (the reference).

All columns are the core stream. Exactness first: every column is compared with HF on each sample HF ran
on (the first ``--hf-samples``); ``ours_par`` is also compared with ``ours`` on every sample. A column with
a mismatch is printed as INEXACT. Our tokenizers' prefix index (a separate feature) is drained, untimed,
between samples, and each of ``ours``/``ours_par`` has its own tokenizer, so neither reuses the other's work.

**Mixed load** (``--mixed``): a stream of short session repairs (``Session.append`` of a 1.0K-2.5K-char
turn, submitted at ``REPAIR`` priority) while 4M-char fresh encodes arrive back to back: repair latency
p50/p99 with no encodes (``idle``); with a plain FIFO pool (``fifo``: the encodes' chunk tasks and the repairs
in one first-come queue, one worker per core: a repair waits for every chunk queued before it, i.e. about a
whole encode); with the shipped design (``priority``: the encodes' chunks and the repairs on one pool with
priorities, an express thread for repairs, chunk workers at nice +5 and pinned while they run a chunk, as a
``toktier_session`` process configures its shared pool: a repair waits for no chunk, it only shares the
cores); and, with ``--mixed-processes``, with the encodes in *another process* (as ``toktier_encode``
beside ``toktier_session`` in Triton) whose pool workers run at nice 0 or nice 10.

**Pathological** (``--pathological``): runs of 250K and 1M ``a``, ``-``, spaces, newlines, digits through
``ours``, ``ours_par`` and a session (``update`` then a one-char ``append``: five widenings find no cut, then
a full encode); exact against HF at every size; the 1M/250K time ratio shows linear scaling (~4).

**First calls on a thread** (``--only threads``): an engine's first call on a new thread vs its next ones,
with and without a warm-up encode on the thread first (why ``ChunkedEncoder.prepare`` warms every pool
worker).

**Tuning** (``--tune``): chunk size sweep and the whole-vs-chunked crossover, for ``chunked.CHUNK_CHARS``
and ``chunked.MIN_CHARS``.

Usage:
    python bench/full_encode.py --tokenizers qwen3,llama3_1,deepseek_v3,gpt2 --sizes 100000,1000000,4000000
    python bench/full_encode.py --only mixed --mixed-processes
    python bench/full_encode.py --only pathological --tokenizers qwen3,gpt2,gemma3
    python bench/full_encode.py --only threads --tokenizers qwen3,llama3_1 --samples 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchors as A  # noqa: E402
from repair import session_base, summary, timed, turn_deltas  # noqa: E402

A.ensure_repo_on_path()

SYSTEMS = ("ours", "ours_par", "gigatoken", "fastokens", "toktier_chunked", "hf")
LABELS = {
    "ours": "ours serial", "ours_par": "ours parallel", "gigatoken": "gigatoken", "fastokens": "fastokens",
    "toktier_chunked": "toktier chunked", "hf": "HF (reference)",
}
STRIDE = 7919  # chars between the starts of consecutive samples
RUNS = {"a": "a", "dash": "-", "space": " ", "newline": "\n", "digit": "7"}


def sample_texts(size: int, n: int, folder: Path) -> list[str]:
    """``n`` texts of ``size`` chars, each a window of the corpus starting ``STRIDE`` chars after the last.

    The first window starts at an offset that depends on ``size``: otherwise the 1M-char sample ``k`` would
    be a prefix of the 4M-char sample ``k``, and a prefix index (ours has one) would serve it."""
    from toktier_backend import corpus

    base = (size * 7) % 99991 + 1
    big = corpus.long_session_text(base + size + n * STRIDE, folder)
    return [big[base + k * STRIDE: base + k * STRIDE + size] for k in range(n)]


def load_ours(path: Path, *, parallel: bool):
    """A fresh tokenizer for one ``ours`` column (its own prefix index)."""
    import toktier_backend as tt

    tok = tt.load_tokenizer(path)
    if not parallel:
        tok.chunked.min_chars = 1 << 62  # never chunked, never pinned
    return tok


class ChildProcess:
    """One fresh-encode column in a child process of its own: ``encode(text) -> (ms, ids)``.

    Two columns run this way, because fastokens 0.3.5 reads its thread count once per process, from
    ``FASTOKENS_BPE_THREADS``, and shares one helper thread between every fastokens object in it (it hands
    part of a call to that thread on gpt2, llama3_1, deepseek_v3); importing our engine sets the variable to
    1 unless it was set (``engines/fastokens.py``):

    - ``ours``, serial (``kind="ours_serial"``): a process of its own, with ``FASTOKENS_BPE_THREADS=1``
      (our default, set explicitly), no pool threads and no other engine's threads: one call on one thread.
      (Before e27fcfa the helper was on by default: in this process one call then used both cores.)
    - ``fastokens`` (``kind="fastokens"``): fastokens' own defaults (helper on), as a user of fastokens would
      run it: the child drops the variable our engine set in this process before the anchor's first call.
      In this process it would also have shared its helper with ``ours parallel`` when a user turned the
      helper on for ours.

    The child times its own call the same way (a fresh ``str``, GC off; ours: the prefix index drained
    after, untimed) and sends back the ms and the ids. ``reason`` is set (and ``encode`` must not be
    called) when the column cannot run (fastokens cannot load cl100k_base / o200k_base).
    """

    def __init__(self, kind: str, path: Path) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        env = {"FASTOKENS_BPE_THREADS": "1"} if kind == "ours_serial" else {}
        self._proc = ctx.Process(target=_child_main, args=(kind, str(path), env, child), daemon=True)
        self._proc.start()
        self.reason, self.version = self._conn.recv()  # once loaded and warmed up

    def encode(self, text: str) -> tuple[float, np.ndarray]:
        self._conn.send(text)
        ms, ids = self._conn.recv()
        return ms, np.frombuffer(ids, dtype=np.int32)

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=10)


def _child_main(kind: str, path: str, env: dict, conn) -> None:
    os.environ.pop("FASTOKENS_BPE_THREADS", None)  # (inherited: our engine sets it in the parent)
    os.environ.update(env)  # (before the engine's first encode, which reads it)
    A.ensure_repo_on_path()
    tok = None
    if kind == "ours_serial":
        tok = load_ours(Path(path), parallel=False)
        encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
        version = A._version("toktier_backend")
    else:
        anchor = A.fastokens(Path(path))
        if anchor.encode is None:
            conn.send((anchor.reason, anchor.version))
            return
        encode, version = anchor.encode, anchor.version
    encode("warm up " * 40_000)
    conn.send(("", version))
    while (text := conn.recv()) is not None:
        ms, ids = timed(lambda: encode(A.fresh_str(text)))
        if tok is not None:
            drain(tok)  # (the prefix index; the parent sleeps the idle gap)
        conn.send((ms, np.asarray(ids, dtype=np.int32).tobytes()))


def child_column(name: str, kind: str, path: Path) -> A.Anchor:
    """:class:`ChildProcess` as an ``Anchor`` (its ``encode`` is the process object; ``run_size`` asks it
    for its own timing)."""
    proc = ChildProcess(kind, path)
    if proc.reason:
        proc.close()
        return A.Anchor(name, None, proc.reason, proc.version)
    return A.Anchor(name, proc, version=proc.version)


GAP_S = 0.2  # --gap-s
INTERLEAVE = False  # --interleave


def drain(tok) -> None:
    """Let the prefix index's background insert finish (untimed), then stay idle ``GAP_S`` seconds: right
    after ``drain()`` returns, the next 4M-char encode still ran ~5 ms slower (llama3_1: 21-23 vs 16-17 ms).
    (An idle gap has a cost of its own on this VM: back to back, our chunked 4M-char encode took ~12.5 ms,
    after 0.2 s idle ~16-18 ms, waking the pool's threads first or not.)"""
    idx = getattr(tok, "prefix_index", None)
    if idx is not None and hasattr(idx, "drain"):
        idx.drain()
    if GAP_S:  # (also without a prefix index: every system gets the same idle gap)
        time.sleep(GAP_S)


def toktier_chunked(name: str, path: Path) -> A.Anchor:
    """toktier 0.3.0 ``toktier.chunked.encode`` on the toktier tokenizer of ``name`` (core stream)."""
    family = A.TOKTIER_FAMILIES.get(name)
    if family is None:
        return A.Anchor("toktier_chunked", None, f"toktier 0.3.0 has no family for {name}")
    try:
        import toktier.chunked as tc

        tok = A.toktier_tokenizer(family, path)
        tc.encode(tok, "warm up <|im_start|>user\nhello world<|im_end|>\n" * 200)
    except Exception as e:
        return A.Anchor("toktier_chunked", None, f"{type(e).__name__}: {e}", A._version("toktier"))

    def encode(text: str) -> np.ndarray:
        return np.asarray(tc.encode(tok, text).ids, dtype=np.int64)

    return A.Anchor("toktier_chunked", encode, version=A._version("toktier"))


# -- fresh encodes ------------------------------------------------------------------------------------

def run_size(systems: dict, texts: list[str], hf_samples: int, toks: dict) -> dict:
    """Every system but HF, one system at a time (interleaved per sample, gigatoken's ``Tokenizer.encode``
    — whose object keeps a word cache across calls — slowed our next call ~1.5x), in two passes over the two
    halves of the samples, the order reversed in the second (the machine's load drifts); or, with
    ``--interleave``, every sample through every system in turn, the order rotated per sample (drift then
    hits every system alike); then HF on the first ``hf_samples`` (its encode churns hundreds of MB and slows
    whatever runs next); then every check."""
    ms = {k: [] for k in systems}
    got: dict[str, list] = {k: [] for k in systems}
    chunks: list[int] = []
    fast = [k for k in systems if k != "hf"]

    def run(name: str, text: str) -> None:
        tok = toks.get(name)
        before = tok.chunked.stats["chunks"] if tok is not None else 0
        text = A.fresh_str(text)  # a new object per system and sample: no UTF-8 cached by a system before
        if isinstance(systems[name], ChildProcess):  # (it times its own call, in its process)
            t, ids = systems[name].encode(text)
        else:
            t, ids = timed(lambda: systems[name](text))
        ms[name].append(t)
        got[name].append(np.array(ids, dtype=np.int64))
        if name == "ours_par":
            chunks.append(tok.chunked.stats["chunks"] - before)
        if tok is not None:
            drain(tok)
        elif GAP_S:
            time.sleep(GAP_S)  # the same idle gap as ours gets after drain()

    if INTERLEAVE:  # --interleave: every sample through every system, the order rotated per sample
        for i, text in enumerate(texts):
            for name in fast[i % len(fast):] + fast[:i % len(fast)]:
                run(name, text)
    else:
        half = (len(texts) + 1) // 2  # pass 1 on the first half of the samples, pass 2 on the rest: no text twice
        for order, part in ((fast, texts[:half]), (fast[::-1], texts[half:])):
            for name in order:
                for text in part:
                    run(name, text)
    if "hf" in systems:
        for text in texts[:hf_samples]:
            run("hf", text)
    checked = {k: 0 for k in systems}
    bad = {k: 0 for k in systems}
    for name in systems:
        if name == "hf":
            continue
        for k, ids in enumerate(got[name]):
            if "hf" in got and k < len(got["hf"]):
                want, against = got["hf"][k], "hf"
            elif name == "ours_par" and "ours" in got:
                want, against = got["ours"][k], "ours"
            else:
                continue
            checked[name] += 1
            at = A.first_mismatch(ids, want)
            if at is not None:
                bad[name] += 1
                print(f"  MISMATCH {name} vs {against}: sample {k} ({len(texts[k])} chars): first diff at id {at}",
                      flush=True)
    out = {name: dict(summary(v), checked=checked[name], mismatches=bad[name]) for name, v in ms.items() if v}
    if not INTERLEAVE:  # each system's first call after another system ran (one per pass)
        half = (len(texts) + 1) // 2
        for name in fast:
            if name in out:
                out[name]["first_of_pass_ms"] = [ms[name][i] for i in (0, half) if i < len(ms[name])]
    if chunks:
        out["ours_par"]["chunks_p50"] = A.percentile(chunks, 50)
        out["ours_par"]["chunks"] = chunks
    return out


def print_size(name: str, size: int, r: dict) -> dict:
    ours = r.get("ours", {}).get("p50_ms")
    print(f"\n{name} @ {size:,} chars")
    print(f"  {'system':<16} {'n':>3} {'p50 ms':>9} {'p90 ms':>9} {'x ours p50':>11}  exact")
    for key in SYSTEMS:
        if key not in r:
            continue
        v = r[key]
        exact = "reference" if key == "hf" else (
            "unchecked" if not v["checked"] else
            "yes" if not v["mismatches"] else f"INEXACT {v['mismatches']}/{v['checked']}")
        ratio = f"{A.fmt_ratio(v['p50_ms'] / ours):>10}x" if ours and key != "ours" else f"{'':>11}"
        extra = f"  ({v['chunks_p50']:.0f} chunks)" if "chunks_p50" in v else ""
        print(f"  {LABELS[key]:<16} {v['n']:>3} {v['p50_ms']:>9.2f} {v['p90_ms']:>9.2f} {ratio}  {exact}{extra}",
              flush=True)
    firsts = {k: v["first_of_pass_ms"] for k, v in r.items() if v.get("first_of_pass_ms")}
    if firsts:
        print("  first call of each pass, ms: " + ", ".join(
            f"{LABELS[k]} {' / '.join(f'{x:.2f}' for x in v)}" for k, v in firsts.items()), flush=True)
    anchors = {k: v["p50_ms"] for k, v in r.items()
               if k not in ("ours", "ours_par") and v["checked"] and not v["mismatches"] or k == "hf"}
    ratios = {}
    if "ours_par" in r and ours:
        par = r["ours_par"]["p50_ms"]
        ratios["ours_serial_over_par"] = ours / par
        if anchors:
            best = min(anchors, key=anchors.get)
            ratios["fastest_exact_anchor"] = best
            ratios["fastest_anchor_over_par"] = anchors[best] / par
        print(f"  ours parallel: {ratios['ours_serial_over_par']:.2f}x ours serial" + (
            f", {ratios['fastest_anchor_over_par']:.2f}x the fastest exact anchor ({ratios['fastest_exact_anchor']})"
            if anchors else ""), flush=True)
    return ratios


def run_fresh(args, shared: Path, folder: Path, results: dict) -> int:
    bad = 0
    for name in args.tokenizers.split(","):
        path = A.tokenizer_path(name, shared)
        print(f"\n=== {name} ({path})", flush=True)
        tok_p = load_ours(path, parallel=True)
        make = {"ours": lambda: child_column("ours", "ours_serial", path),
                "ours_par": lambda: A.Anchor("ours_par", lambda t, tok=tok_p: tok.encode(t, add_special_tokens=False)),
                "gigatoken": lambda: A.gigatoken(path), "fastokens": lambda: child_column("fastokens", "fastokens", path),
                "toktier_chunked": lambda: toktier_chunked(name, path), "hf": lambda: A.hf(path)}
        anchors = [make[k]() for k in SYSTEMS if k in args.systems.split(",")]
        systems = {a.name: a.encode for a in anchors if a.encode is not None}
        skipped = {a.name: a.reason for a in anchors if a.encode is None}
        for k, why in skipped.items():
            print(f"  {k}: skipped: {why}")
        if args.chunk_chars:
            tok_p.chunked.chunk_chars = args.chunk_chars
        tok_p.chunked.prepare()  # engine objects for the pool's workers, as serving does at load
        print(f"  ours parallel: {tok_p.engine.name}, {tok_p.chunked.pool.workers} pool workers", flush=True)
        tok_p.encode("warm up " * 40_000)  # pool threads, caches
        entry = {"path": str(path), "skipped": skipped, "sizes": {},
                 "chunk_chars": tok_p.chunked.chunk_chars, "min_chars": tok_p.chunked.min_chars,
                 "engine": tok_p.engine.name,
                 "pool_workers": tok_p.chunked.pool.workers}
        for size in (int(x) for x in args.sizes.split(",")):
            r = run_size(systems, sample_texts(size, args.samples, folder), args.hf_samples,
                         {"ours_par": tok_p})
            ratios = print_size(name, size, r)
            entry["sizes"][str(size)] = {"systems": r, "ratios": ratios}
            bad += sum(v["mismatches"] for k, v in r.items() if k in ("ours", "ours_par"))
        results["fresh"][name] = entry
        for a in anchors:
            if isinstance(a.encode, ChildProcess):
                a.encode.close()
    return bad


# -- mixed load ---------------------------------------------------------------------------------------

def _repair_stream(s, deltas: list[str], n: int, pool, rng: random.Random, gap_ms: tuple[float, float],
                   stop: threading.Event | None = None) -> list[float]:
    """``n`` appends, each submitted at REPAIR priority after a random gap; returns their latencies (ms)."""
    from toktier_backend.runtime.pool import REPAIR

    lat = []
    for k in range(n):
        time.sleep(rng.uniform(*gap_ms) / 1e3)
        delta = deltas[k % len(deltas)]
        t0 = time.perf_counter_ns()
        if pool is None:
            s.append(delta)
        else:
            pool.call(s.append, delta, priority=REPAIR)
        lat.append((time.perf_counter_ns() - t0) / 1e6)
    if stop is not None:
        stop.set()
    return lat


def mixed_once(path: Path, folder: Path, *, mode: str, size: int, n: int, base_chars: int, seed: int,
               nice: int = 5) -> dict:
    """One mixed-load run. ``mode``: ``idle`` (no encodes), ``fifo`` (chunks and repairs on a FIFO pool) or
    ``priority`` (shipped settings: chunks and repairs on a priority pool with an express thread)."""
    import tokenizers

    import toktier_backend as tt
    from toktier_backend.runtime.pool import CpuPool

    # fifo: the plain FIFO pool (one worker per core); priority: the shared pool as a toktier_session
    # process configures it (repairs first, one express thread, general workers at nice +5, pinned on chunks)
    pool = (CpuPool(fifo=True, name="bench-fifo") if mode == "fifo" else
            CpuPool(express=1, nice=nice, pin=True, name=f"bench-{mode}"))
    tok = tt.load_tokenizer(path)
    tok.chunked.pool = pool
    tok.prefix_index = None  # scheduling only: no prefix reuse, no background indexer
    texts = sample_texts(size, 3, folder)
    base = session_base(base_chars, folder)
    deltas = turn_deltas(folder)
    s = tok.session(add_special_tokens=False)
    s.update(base)
    for d in deltas[:3]:  # warm
        pool.call(s.append, d)
    tok.encode(texts[0], add_special_tokens=False)
    stop = threading.Event()
    enc_ms: list[float] = []
    first_ids: list[np.ndarray] = []

    def encoder():
        k = 0
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            ids = tok.encode(texts[k % len(texts)], add_special_tokens=False)
            enc_ms.append((time.perf_counter_ns() - t0) / 1e6)
            if not first_ids:
                first_ids.append(np.array(ids))
            k += 1

    th = threading.Thread(target=encoder, daemon=True) if mode != "idle" else None
    if th is not None:
        th.start()
        while not enc_ms:
            time.sleep(0.001)
    lat = _repair_stream(s, deltas[3:], n, pool, random.Random(seed), (1.0, 6.0), stop)
    if th is not None:
        th.join()
    # exactness: the grown session and one 4M encode, against HF
    ref = tokenizers.Tokenizer.from_file(str(path))
    bad = int(A.first_mismatch(s.ids, ref.encode(s.text, add_special_tokens=False).ids) is not None)
    if first_ids:
        bad += int(A.first_mismatch(first_ids[0], ref.encode(texts[0], add_special_tokens=False).ids) is not None)
    st = pool.stats()
    pool.shutdown(wait=False)
    return {"mode": mode, "repairs": summary(lat), "repair_p99_ms": A.percentile(lat, 99),
            "encodes": summary(enc_ms), "mismatches": bad, "pool": st, "session_chars": len(s),
            "loadavg": os.getloadavg()[0]}


def _encoder_process(path: str, folder: str, size: int, nice: int, ready, stop) -> None:
    """Another process looping fresh encodes on its own pool (``toktier_encode`` beside ``toktier_session``)."""
    sys.path.insert(0, str(A.REPO))
    import toktier_backend as tt
    from toktier_backend.runtime import pool as runtime_pool

    runtime_pool.configure_shared_pool(nice=nice)
    tok = tt.load_tokenizer(path)
    tok.prefix_index = None
    texts = sample_texts(size, 3, Path(folder))
    tok.encode(texts[0])
    ready.set()
    k = 0
    while not stop.is_set():
        tok.encode(texts[k % 3])
        k += 1


def mixed_processes(path: Path, folder: Path, *, size: int, n: int, base_chars: int, seed: int) -> dict:
    """Repairs in this process (its own pool, nice 0) while another process encodes with nice 0, 10."""
    import multiprocessing as mp

    import toktier_backend as tt
    from toktier_backend.runtime.pool import CpuPool

    pool = CpuPool(name="bench-session")
    tok = tt.load_tokenizer(path)
    tok.prefix_index = None
    s = tok.session(add_special_tokens=False)
    s.update(session_base(base_chars, folder))
    deltas = turn_deltas(folder)
    out = {}
    ctx = mp.get_context("spawn")
    for label, nice in (("other process idle", None), ("encoder nice 0", 0), ("encoder nice 10", 10)):
        proc = None
        if nice is not None:
            ready, stop = ctx.Event(), ctx.Event()
            proc = ctx.Process(target=_encoder_process, args=(str(path), str(folder), size, nice, ready, stop))
            proc.start()
            ready.wait(120)
        lat = _repair_stream(s, deltas, n, pool, random.Random(seed), (1.0, 6.0))
        if proc is not None:
            stop.set()
            proc.join(60)
        out[label] = {"repairs": summary(lat), "repair_p99_ms": A.percentile(lat, 99)}
        print(f"  {label:<22} repair p50 {A.percentile(lat, 50):7.2f} ms  p99 {A.percentile(lat, 99):7.2f} ms "
              f"(n={len(lat)})", flush=True)
    pool.shutdown(wait=False)
    return out


def run_mixed(args, shared: Path, folder: Path, results: dict) -> int:
    path = A.tokenizer_path(args.mixed_tokenizer, shared)
    print(f"\n=== mixed load: {args.mixed_tokenizer}, {args.mixed_repairs} repairs (1.0K-2.5K-char appends to a "
          f"{args.mixed_base:,}-char session, 1-6 ms apart) while {args.mixed_size:,}-char encodes arrive back to back",
          flush=True)
    runs: list[dict] = []
    bad = 0
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    print(f"  GIL switch interval {sys.getswitchinterval() * 1e3:g} ms", flush=True)
    for mode in args.mixed_modes.split(","):
        r = mixed_once(path, folder, mode=mode, size=args.mixed_size, n=args.mixed_repairs,
                       base_chars=args.mixed_base, seed=args.seed + len(runs), nice=args.mixed_nice)
        runs.append(r)
        bad += r["mismatches"]
        rep, enc = r["repairs"], r["encodes"]
        pr = r["pool"]["by_priority"]["repair"]
        print(f"  {mode:<13} repair p50 {rep['p50_ms']:7.2f} ms  p90 {rep['p90_ms']:7.2f}  p99 {r['repair_p99_ms']:7.2f} "
              f"(n={rep['n']}; in the pool: wait p99 {pr['wait_ms_p99']:.2f}, run p99 {pr['run_ms_p99']:.2f})   "
              f"encode p50 {enc['p50_ms'] or 0:7.2f} ms (n={enc['n']})   "
              f"{'exact' if not r['mismatches'] else 'MISMATCH'}   load {r['loadavg']:.1f}", flush=True)
    pooled = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        lat = [x for r in runs if r["mode"] == mode for x in r["repairs"]["samples_ms"]]
        enc = [x for r in runs if r["mode"] == mode for x in r["encodes"]["samples_ms"]]
        pooled[mode] = {"repairs": summary(lat), "repair_p99_ms": A.percentile(lat, 99), "encodes": summary(enc)}
        print(f"  all {mode:<13} repair p50 {A.percentile(lat, 50):7.2f} ms  p99 {A.percentile(lat, 99):7.2f} (n={len(lat)})"
              f"   encode p50 {A.percentile(enc, 50) or 0:7.2f} ms (n={len(enc)})", flush=True)
    ratio = None
    if "priority" in pooled and "fifo" in pooled:
        ratio = pooled["priority"]["repair_p99_ms"] / pooled["fifo"]["repair_p99_ms"]
        print(f"  repair p99, priority / FIFO: {ratio:.3f} (target <= 0.2)", flush=True)
    results["mixed"] = {"tokenizer": args.mixed_tokenizer, "runs": runs, "pooled": pooled,
                        "p99_priority_over_fifo": ratio}
    if args.mixed_processes:
        print("  -- encodes in another process (Triton: toktier_encode beside toktier_session)", flush=True)
        results["mixed"]["processes"] = mixed_processes(path, folder, size=args.mixed_size, n=args.mixed_repairs,
                                                        base_chars=args.mixed_base, seed=args.seed)
    return bad


# -- pathological inputs ------------------------------------------------------------------------------

def run_pathological(args, shared: Path, results: dict) -> int:
    import tokenizers

    sizes = [int(x) for x in args.patho_sizes.split(",")]
    bad = 0
    for name in args.tokenizers.split(","):
        path = A.tokenizer_path(name, shared)
        ref = tokenizers.Tokenizer.from_file(str(path))
        tok_s, tok_p = load_ours(path, parallel=False), load_ours(path, parallel=True)
        print(f"\n=== pathological: {name}  (p50 ms of {args.patho_repeats} runs; ratio = time at {sizes[-1]:,} / "
              f"time at {sizes[0]:,}; linear ~ {sizes[-1] / sizes[0]:.0f}, quadratic ~ {(sizes[-1] / sizes[0]) ** 2:.0f})",
              flush=True)
        print(f"  {'run':<8} {'system':<14} " + " ".join(f"{s:>11,}" for s in sizes) + "   ratio  exact")
        entry = {}
        for run, ch in RUNS.items():
            rows = {"ours": [], "ours_par": [], "session": [], "hf": []}
            exact = True
            for n in sizes:
                per = {k: [] for k in rows}
                for rep in range(args.patho_repeats):
                    text = ch * (n + rep)  # a different run each time: no engine word cache serves it
                    got = {}
                    for key, tok in (("ours", tok_s), ("ours_par", tok_p)):
                        t, got[key] = timed(lambda: tok.encode(text, add_special_tokens=False))
                        per[key].append(t)
                        drain(tok)
                    s = tok_p.session(add_special_tokens=False)
                    s.update(text)
                    drain(tok_p)
                    t, ids = timed(lambda: s.append(ch))
                    got["session"] = np.array(ids)
                    per["session"].append(t)
                    drain(tok_p)
                    if s.last_repair.route != "full":
                        print(f"  note: session route {s.last_repair.route} on {run}", flush=True)
                    # HF last (its encode churns memory and slows whatever runs next), then the checks
                    t_hf, want = timed(lambda: ref.encode(text + ch, add_special_tokens=False).ids)
                    per["hf"].append(t_hf)
                    if A.first_mismatch(got["session"], want) is not None:
                        exact = False
                    if rep == 0:
                        want_run = ref.encode(text, add_special_tokens=False).ids
                        exact &= all(A.first_mismatch(got[k], want_run) is None for k in ("ours", "ours_par"))
                for key in rows:
                    rows[key].append(A.percentile(per[key], 50))
            bad += 0 if exact else 1
            for key, vals in rows.items():
                ratio = vals[-1] / vals[0] if vals[0] else float("nan")
                label = {"ours": "ours serial", "ours_par": "ours parallel", "session": "session append",
                         "hf": "HF (+1 char)"}[key]
                print(f"  {run:<8} {label:<14} " + " ".join(f"{v:>11.1f}" for v in vals) +
                      f"   {ratio:5.1f}  {'' if key == 'hf' else 'yes' if exact else 'NO'}", flush=True)
            entry[run] = {"sizes": sizes, "p50_ms": rows, "exact": exact, "repeats": args.patho_repeats}
        results["pathological"][name] = entry
    return bad


# -- tuning -------------------------------------------------------------------------------------------

def run_tune(args, shared: Path, folder: Path, results: dict) -> None:
    from toktier_backend.pipeline.chunked import ChunkedEncoder

    out = {}
    for name in args.tokenizers.split(","):
        path = A.tokenizer_path(name, shared)
        tok = load_ours(path, parallel=False)
        tok.prefix_index = None
        print(f"\n=== tune: {name} (p50 ms over {args.samples} samples; chunked = ChunkedEncoder.encode)", flush=True)
        out[name] = {}
        for size in (500_000, 1_000_000, 1_500_000, 2_000_000, 4_000_000):
            texts = sample_texts(size, args.samples, folder)
            row = {"whole": A.percentile([timed(lambda t=A.fresh_str(t): tok.encode_body(t))[0] for t in texts], 50)}
            for cc in (None, 262144, 524288, 1048576):  # None: one chunk per pool worker (the default)
                if cc is not None and cc >= size:
                    continue
                enc = ChunkedEncoder(tok.engine, reference=tok.chunked.reference, guard=tok.admission, cuts=tok.cuts,
                                     chunk_chars=cc, min_chars=0)
                enc.encode(texts[0])
                label = "per worker" if cc is None else f"chunk {cc // 1024}K"
                row[label] = A.percentile([timed(lambda t=A.fresh_str(t): enc.encode(t))[0] for t in texts], 50)
            out[name][str(size)] = row
            print(f"  {size:>9,}  " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    results["tune"] = out


# -- first calls on a thread ----------------------------------------------------------------------------

def run_threads(args, shared: Path, folder: Path, results: dict) -> int:
    """An engine's first call on a new thread vs its next ones (why ``ChunkedEncoder.prepare`` warms every
    pool worker): our engine, warmed on this thread, then ``--samples`` new threads, each encoding three
    ``PIECE_CHARS`` pieces of the corpus (a fresh ``str`` each); and the same with a ``WARM_CHARS`` warm-up
    encode on the thread first. Exact against HF on each piece."""
    import tokenizers

    import toktier_backend as tt
    from toktier_backend.pipeline.chunked import PIECE_CHARS, WARM_CHARS

    bad, out = 0, {}
    text = sample_texts(4 * PIECE_CHARS, 1, folder)[0]
    pieces = [text[i * PIECE_CHARS:(i + 1) * PIECE_CHARS] for i in range(3)]
    warm = text[3 * PIECE_CHARS:3 * PIECE_CHARS + WARM_CHARS]
    for name in args.tokenizers.split(","):
        path = A.tokenizer_path(name, shared)
        eng = tt.load_tokenizer(path).engine
        ref = tokenizers.Tokenizer.from_file(str(path))
        want = [ref.encode(p, add_special_tokens=False).ids for p in pieces]
        eng.encode(A.fresh_str(warm))
        rows = {"cold": [], "warmed": []}
        for k in range(2 * args.samples):
            kind = ("cold", "warmed")[k % 2]
            ms: list[float] = []

            def run():
                if kind == "warmed":
                    eng.encode(A.fresh_str(warm))
                for p, w in zip(pieces, want):
                    t, ids = A.timed(lambda p=A.fresh_str(p): eng.encode(p))  # (no gc.collect: it evicts the caches)
                    ms.append(t)
                    if np.asarray(ids).tolist() != w:
                        ms.append(float("nan"))

            th = threading.Thread(target=run)
            th.start()
            th.join()
            bad += sum(1 for x in ms if x != x)
            rows[kind].append([x for x in ms if x == x])
        entry = {}
        print(f"\n{name} ({eng.name}): {PIECE_CHARS // 1024}K-char pieces on new threads, ms (n={args.samples})")
        for kind, calls in rows.items():
            first = [c[0] for c in calls]
            later = [x for c in calls for x in c[1:]]
            entry[kind] = {"first": summary(first), "later": summary(later)}
            print(f"  {kind:<7} first call p50 {A.percentile(first, 50):.2f} p90 {A.percentile(first, 90):.2f}   "
                  f"later calls p50 {A.percentile(later, 50):.2f} p90 {A.percentile(later, 90):.2f}", flush=True)
        out[name] = entry
    results["threads"] = out
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizers", default="qwen3,llama3_1,deepseek_v3,gpt2")
    p.add_argument("--sizes", default="100000,1000000,4000000", help="document sizes, chars")
    p.add_argument("--samples", type=int, default=8, help="texts per size")
    p.add_argument("--hf-samples", type=int, default=3, help="of those, how many HF encodes (and checks)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="fresh-encode columns to run")
    p.add_argument("--gap-s", type=float, default=0.2, help="idle seconds after our prefix index is drained")
    p.add_argument("--interleave", action="store_true",
                   help="fresh encodes: every sample through every system in turn (order rotated per sample), "
                        "not one system at a time")
    p.add_argument("--chunk-chars", type=int, default=None, help="override chunked.CHUNK_CHARS for ours_par")
    p.add_argument("--only", default="fresh,mixed", help="sections: fresh, mixed, pathological, tune, threads")
    p.add_argument("--pathological", action="store_true", help="add the pathological section")
    p.add_argument("--patho-sizes", default="250000,1000000")
    p.add_argument("--patho-repeats", type=int, default=3, help="runs per size (n, n+1, ...): p50 reported")
    p.add_argument("--mixed", action="store_true", help="add the mixed-load section")
    p.add_argument("--mixed-tokenizer", default="qwen3")
    p.add_argument("--mixed-size", type=int, default=4_000_000, help="chars of each fresh encode")
    p.add_argument("--mixed-repairs", type=int, default=400)
    p.add_argument("--mixed-base", type=int, default=100_000, help="chars of the repaired session")
    p.add_argument("--mixed-modes", default="idle,fifo,priority,fifo,priority",
                   help="runs in this order (each pool mode twice by default: the machine's load drifts)")
    p.add_argument("--mixed-nice", type=int, default=5, help="nice of the shared pool's general workers (priority)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the mixed run, seconds (default: Python's 0.005)")
    p.add_argument("--mixed-processes", action="store_true", help="also: encodes in another process, nice 0 / 10")
    p.add_argument("--tune", action="store_true", help="add the tuning section")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--shared", default=None, help="shared folder (default <repo>/../shared)")
    p.add_argument("--out", default="bench/out")
    args = p.parse_args(argv)
    global GAP_S, INTERLEAVE
    GAP_S, INTERLEAVE = args.gap_s, args.interleave
    sections = set(args.only.split(",")) | {s for s, on in (("pathological", args.pathological),
                                                          ("mixed", args.mixed), ("tune", args.tune)) if on}

    shared = A.shared_dir(args.shared)
    folder = shared / "corpus" / "swe-agent"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "bench": "full_encode",
        "args": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_start": os.getloadavg()},
        "checkout": A.core_revision(),
        "versions": {m: A._version(m) for m in ("toktier_backend", "tokenizers", "gigatoken", "fastokens", "toktier")},
        "fresh": {}, "pathological": {},
    }
    print(f"load average at start: {os.getloadavg()} ({os.cpu_count()} cpus)", flush=True)
    t0 = time.perf_counter()
    bad = 0
    if "fresh" in sections:
        bad += run_fresh(args, shared, folder, results)
    if "mixed" in sections:
        bad += run_mixed(args, shared, folder, results)
    if "pathological" in sections:
        bad += run_pathological(args, shared, results)
    if "tune" in sections:
        run_tune(args, shared, folder, results)
    if "threads" in sections:
        bad += run_threads(args, shared, folder, results)
    results["wall_s"] = time.perf_counter() - t0
    results["machine"]["loadavg_end"] = os.getloadavg()
    name = "full_encode.json" if sections == {"fresh", "mixed"} else f"full_encode-{'-'.join(sorted(sections))}.json"
    (out_dir / name).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out_dir / name} ({results['wall_s']:.0f} s; load average at end {os.getloadavg()})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
