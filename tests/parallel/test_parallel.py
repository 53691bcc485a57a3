"""Chunked full encode (``toktier_backend.pipeline.chunked``) against the HF reference, and the shared pool.

Every chunked result is compared with ``Tokenizer.from_file(path).encode(text, add_special_tokens=...)
.ids`` (``tests/conftest.py`` ``reference(name)``, loaded independently of our code), on all nine files:
real SWE-agent trajectories, texts built to defeat naive cuts, added tokens at chunk edges, every chunk
count 1..16, guarded code points, and the pathological runs (1M-char runs are checked in
``bench/full_encode.py --pathological``; here they are 60K chars, where HF takes ~0.1 s each).
Chunk sizes are forced small (``chunk_chars`` 64..8K, ``min_chars=0``) so short texts take many chunks.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time

import numpy as np
import pytest

import toktier_backend as tt
from toktier_backend import corpus
from toktier_backend.pipeline import chunked as parallel
from toktier_backend.pipeline.chunked import ChunkedEncoder
from toktier_backend.runtime import pool as runtime_pool
from toktier_backend.runtime.pool import CHUNK, REPAIR, CpuPool

from ..conftest import NAMES, load, reference, tokenizer_path

@pytest.fixture(scope="module")
def pool():
    p = CpuPool(2, name="test-parallel")
    yield p
    p.shutdown()


def make(tok, pool=None, *, engine=None, **kw) -> ChunkedEncoder:
    """A ChunkedEncoder for ``tok``'s engine (or ``engine``), reference, guard set and cuts, on ``pool``."""
    return ChunkedEncoder(engine or tok.engine, reference=tok.chunked.reference, guard=tok.admission,
                          cuts=tok.cuts, pool=pool, **kw)


class SpyEngine:
    """An ``Engine`` around another one (same capabilities): records the length of every input it is given
    and raises ``RuntimeError`` on the input ``fail_on``."""

    def __init__(self, inner, fail_on=None):
        self.inner, self.fail_on = inner, fail_on
        self.name, self.version = inner.name, inner.version
        self.releases_gil, self.accepts_utf8 = inner.releases_gil, inner.accepts_utf8
        self.calls: list[int] = []

    def encode(self, text):
        self.calls.append(len(text))
        if self.fail_on is not None and text == self.fail_on:
            raise RuntimeError("injected")
        return self.inner.encode(text)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def reserve(self, n: int) -> None:
        self.inner.reserve(n)


@pytest.fixture(scope="module")
def corpus_text(corpus_texts) -> str:
    """~150K chars of real trajectories (several files, so several ChatML sessions)."""
    return "".join(corpus_texts)[:150_000]


def hf_ids(name: str, text: str, add_special_tokens: bool = False) -> list[int]:
    return reference(name).encode(text, add_special_tokens=add_special_tokens).ids


def check(name: str, enc: ChunkedEncoder, text: str, *, min_chunks: int = 1) -> tuple[np.ndarray, str]:
    ids, engine = enc.encode(text)
    assert ids.dtype == np.int32
    want = hf_ids(name, text)
    if ids.tolist() != want:
        got = ids.tolist()
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        b = enc.bounds(text)
        pytest.fail(f"{name}: chunked ids differ from HF at id {at} (len {len(got)} vs {len(want)}); "
                    f"{len(b) - 1} chunks, cuts near: {[c for c in b if abs(c - at * 3) < 2000][:5]}")
    assert len(enc.bounds(text)) - 1 >= min_chunks
    return ids, engine


# ---------------------------------------------------------------------------------------------- texts


def trap_text(name: str, rng: random.Random, n_pieces: int = 60) -> str:
    """Runs that defeat naive cuts (whitespace, CRLF, digits, one letter, ``-``/``_``, no spaces at all,
    CJK, newlines + punctuation), the file's added tokens, and a little real-looking text between them."""
    added = [a.content for a in load(name).spec.added if a.content][:12]
    runs = [
        lambda: " " * rng.randint(1, 3000),
        lambda: "\r\n" * rng.randint(1, 1500),
        lambda: "\n" * rng.randint(1, 2000),
        lambda: "\t \n " * rng.randint(1, 300),
        lambda: "7" * rng.randint(1, 3000),
        lambda: "1234567890" * rng.randint(1, 200),
        lambda: "a" * rng.randint(1, 3000),
        lambda: "-" * rng.randint(1, 2000),
        lambda: "_" * rng.randint(1, 2000),
        lambda: "".join(rng.choice("abcXYZ09./:=") for _ in range(rng.randint(1, 2500))),  # no spaces
        lambda: "你好世界，中文字符测试。日本語のテキスト" * rng.randint(1, 100),
        lambda: "e\u0301 a\u0308 \U0001F468\u200d\U0001F469 " * rng.randint(1, 50),
        lambda: "it's 'll DON'T x = f(y) -> z;\n" * rng.randint(1, 40),
        lambda: "word " * rng.randint(1, 400),
        lambda: "a.\n/b\nc \n\nd\n" * rng.randint(1, 100),
        lambda: rng.choice(added) if added else "<|x|>",
        lambda: "".join(rng.choice(added) for _ in range(rng.randint(1, 5))) if added else "",
    ]
    return "".join(rng.choice(runs)() for _ in range(n_pieces))


def edge_text(name: str, step: int) -> str:
    """Added tokens placed around grid points ``k * step``: ending just before one, crossing it at each
    inner position, starting at it, starting just after it."""
    added = [a.content for a in load(name).spec.added if a.content]
    # first the tokens with a family seam or an added-token start inside (Gemma 3's newline runs): a cut
    # there is refused only by the crossing rule; then a few ordinary ones
    finder = load(name).cuts
    inner = [t for t in added if any(finder.family.is_stable_cut(t + " x", c, len(t) + 2)
                                     or finder.seams.starts_at(t, c, len(t)) for c in range(1, len(t)))]
    added = inner[:4] + added[:3]
    filler = "word x=1 it's\n" * (step // 4 + 4)  # > 3 steps long
    text = ""
    for tok in added:
        for off in range(-len(tok) - 1, 3):
            g = (len(text) // step + 1) * step  # the next grid point
            if g + off < len(text):
                g += step
            text += filler[: g + off - len(text)] + tok
    return text + filler[:step]


# ---------------------------------------------------------------------------------------------- exactness


#: The default engine (fastokens, chunks handed over as ``str``; gigatoken for cl100k/o200k) and gigatoken
#: everywhere (chunks converted to UTF-8 by the caller).
ENGINES = ("auto", "gigatoken")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", NAMES)
def test_real_trajectories(name, engine, pool, corpus_text):
    tok = load(name, engine)
    for cc in (1000, 8192):
        enc = make(tok, pool, chunk_chars=cc, min_chars=0)
        _, engine = check(name, enc, corpus_text, min_chunks=len(corpus_text) // cc // 2)
        assert engine == tok.engine.name  # the corpus holds no guarded code point


@pytest.mark.parametrize("name", NAMES)
def test_trap_texts(name, pool):
    tok = load(name)
    rng = random.Random(f"trap-{name}")
    for cc in (64, 257, 1000, 4096):
        enc = make(tok, pool, chunk_chars=cc, min_chars=0, search_chars=rng.choice([64, 1024]))
        check(name, enc, trap_text(name, rng))


@pytest.mark.parametrize("name", NAMES)
def test_added_tokens_at_chunk_edges(name, pool):
    tok = load(name)
    for cc in (97, 500):
        enc = make(tok, pool, chunk_chars=cc, min_chars=0, search_chars=cc)
        check(name, enc, edge_text(name, cc), min_chunks=2)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", NAMES)
def test_every_chunk_count_1_to_16(name, engine, pool, corpus_text):
    tok = load(name, engine)
    text = corpus_text[:40_000]
    want = hf_ids(name, text)
    for k in range(1, 17):
        enc = make(tok, pool, chunk_chars=math.ceil(len(text) / k), min_chars=0)
        assert len(enc.bounds(text)) - 1 == k, f"{name}: {k} chunks wanted"
        ids, _ = enc.encode(text)
        assert ids.tolist() == want, f"{name}: {k} chunks"


@pytest.mark.parametrize("name", NAMES)
def test_public_api_and_session_full_route(name, pool, corpus_text, monkeypatch):
    """``Tokenizer.encode`` (post-processor applied once, to the whole text) and a session's full encode
    take the chunked path when the text is long enough."""
    tok = load(name)
    monkeypatch.setattr(tok.chunked, "min_chars", 1)
    monkeypatch.setattr(tok.chunked, "chunk_chars", 2000)
    monkeypatch.setattr(tok.chunked, "pool", pool)
    text = corpus_text[:30_000]
    before = tok.chunked.stats["encodes"]
    for flag in (True, False):
        assert tok.encode(text, add_special_tokens=flag).tolist() == hf_ids(name, text, flag)
    s = tok.session(add_special_tokens=True)
    assert s.update(text).tolist() == hf_ids(name, text, True)
    assert s.last_repair.route == "full"
    assert tok.chunked.stats["encodes"] > before or not tok.chunked.available


# gemma3 is left out: gigatoken agrees with HF on every code point there (its guard set is empty), as
# fastokens does on every file it loads: the str path is checked with a guard set of its own below.
@pytest.mark.parametrize("name", [n for n in NAMES if n != "gemma3"])
def test_guarded_chunk_goes_to_reference_alone(name, pool, corpus_text):
    tok = load(name, "gigatoken")
    assert tok.admission.guarded, f"{name}: expected a non-empty guard set for {tok.engine.name}"
    cp = chr(tok.admission.guarded[len(tok.admission.guarded) // 2])
    text = corpus_text[:20_000]
    text = text[:10_000] + f" x{cp}y " + text[10_000:]
    enc = make(tok, pool, chunk_chars=2000, min_chars=0)
    _, engine = check(name, enc, text, min_chunks=8)
    assert engine == f"{tok.engine.name}+hf"
    assert enc.stats["reference_chunks"] == 1 and enc.stats["chunks"] >= 8


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_guarded_piece_goes_to_reference_alone_on_the_str_path(name, pool, corpus_text, monkeypatch):
    """fastokens' guard sets are empty; with one code point guarded (as a future engine build could need),
    only the piece that holds it goes to the reference, and the ids still equal HF's."""
    from toktier_backend.engines.admission import Admission

    tok = tt.load_tokenizer(tokenizer_path(name), engine="fastokens")
    assert not tok.admission.guarded and not tok.engine.accepts_utf8
    tok.admission = Admission(True, [ord("é")])
    monkeypatch.setattr(parallel, "PIECE_CHARS", 1000)
    text = corpus_text[:20_000]
    text = text[:10_000] + " café " + text[10_000:]
    enc = make(tok, pool, chunk_chars=5000, min_chars=0)
    _, engine = check(name, enc, text, min_chunks=4)
    assert engine == "fastokens+hf"
    assert enc.stats["reference_chunks"] == 1


@pytest.mark.parametrize("engine", ["fastokens", "gigatoken"])
def test_engine_error_sends_only_that_chunk_to_reference(engine, pool, corpus_text):
    tok = load("qwen3", engine)
    text = corpus_text[:20_000]
    b = make(tok, pool, chunk_chars=2000, min_chars=0).bounds(text)
    target = text[b[2]:b[3]]  # the third chunk fails
    if tok.engine.accepts_utf8:
        target = target.encode()
    enc = make(tok, pool, engine=SpyEngine(tok.engine, fail_on=target), chunk_chars=2000, min_chars=0)
    _, got_engine = check("qwen3", enc, text, min_chunks=8)
    assert got_engine == f"{engine}+hf"
    assert enc.stats["engine_errors"] == enc.stats["reference_chunks"] == 1


def test_fastokens_helper_thread_is_off_unless_the_process_asks_and_exact_either_way(corpus_texts):
    """Importing the engine sets ``FASTOKENS_BPE_THREADS=1`` unless the process set it, so fastokens starts
    no helper thread and a long text's pieces run on the pool alone (``docs/design/parallel.md``); a value
    the process set is kept, fastokens' helper thread then runs, and a long text (chunked on the pool,
    pieces handed partly to that helper) still equals HF's ids. Each case in a fresh process: fastokens
    reads the variable once per process."""
    import subprocess
    import sys

    code = (
        "import os, sys, tokenizers, toktier_backend as tt\n"
        "text = open(sys.argv[1], encoding='utf-8').read()\n"
        "t = tt.load_tokenizer(engine='fastokens')\n"
        "assert t.chunked.wants(text), len(text)\n"
        "ids = t.encode(text, add_special_tokens=False).tolist()\n"
        "want = tokenizers.Tokenizer.from_file(str(tt.default_tokenizer_path()))"
        ".encode(text, add_special_tokens=False).ids\n"
        "names = [open(f'/proc/self/task/{x}/comm').read() for x in os.listdir('/proc/self/task')]\n"
        "print(os.environ['FASTOKENS_BPE_THREADS'], sum(n.startswith('fastokens') for n in names),"
        " ids == want, t.chunked.stats['chunks'] > 1)\n"
    )
    text = corpus.long_session_text(1_200_000)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"toktier-helper-{os.getpid()}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    try:
        for given, want in ((None, "1 0 True True"), ("2", "2 1 True True")):
            env = {k: v for k, v in os.environ.items() if k != "FASTOKENS_BPE_THREADS"}
            if given is not None:
                env["FASTOKENS_BPE_THREADS"] = given
            out = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True,
                                 timeout=300)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split("\n")[-2] == want, (given, out.stdout, out.stderr)
    finally:
        os.unlink(path)


def test_lone_surrogate_names_its_index(pool):
    tok = load("gpt2")
    enc = make(tok, pool, chunk_chars=100, min_chars=0)
    text = "word " * 200 + "\ud800" + " more" * 10
    with pytest.raises(tt.InvalidRequest, match="at char 1000"):
        enc.encode(text)
    with pytest.raises(tt.InvalidRequest, match="lone surrogate"):
        tok.encode(text)


@pytest.mark.parametrize("name", NAMES)
def test_chunks_converted_in_pieces_are_exact_and_surrogates_named(name, corpus_text, monkeypatch):
    """Chunks longer than ``PIECE_CHARS`` are converted piece by piece (releasing the GIL between pieces
    while a repair is active): same ids as HF, and a lone surrogate in a later piece names its index."""
    monkeypatch.setattr(parallel, "PIECE_CHARS", 1000)
    tok = load(name)
    p = CpuPool(2, name="test-pieces")
    enc = make(tok, p, chunk_chars=7000, min_chars=0)
    text = corpus_text[:30_000] + " caf\u00e9 \u4e2d\u6587 \U0001F600 " + corpus_text[30_000:40_000]
    for active in (0, 1):
        p._repairs_running = active  # as if a repair were running: sleep(0) between pieces
        check(name, enc, text, min_chunks=5)
    p._repairs_running = 0
    bad = text[:12_345] + "\udc80" + text[12_345:]
    with pytest.raises(tt.InvalidRequest, match="at char 12345"):
        enc.encode(bad)
    p.shutdown()


def test_not_chunked_without_gil_free_engine_or_cut_family():
    hf_only = tt.load_tokenizer(tt.default_tokenizer_path(), engine="hf")
    assert not hf_only.chunked.available and not hf_only.chunked.wants("x " * 10**6)
    tok = load("gpt2")
    assert tok.chunked.available and not tok.chunked.wants("x" * (tok.chunked.min_chars - 1))


@pytest.mark.parametrize("name", NAMES)
def test_pathological_runs(name, pool):
    """60K-char runs with no stable cut: exact through full encodes and through sessions (append to a
    run: every widening finds no cut, then a full encode). 1M chars and the 250K-vs-1M scaling are in
    ``bench/full_encode.py --pathological``."""
    tok = load(name)
    enc = make(tok, pool, chunk_chars=4096, min_chars=0)
    for ch in ("a", "-", " ", "\n", "7"):
        text = ch * 60_000
        ids, _ = check(name, enc, text)
        s = tok.session(add_special_tokens=False)
        assert s.update(text).tolist() == ids.tolist()
        assert s.append(ch).tolist() == hf_ids(name, text + ch), f"{name}: append to a {ch!r} run"


# ---------------------------------------------------------------------------------------------- the pool


def test_pool_runs_repairs_before_queued_chunks():
    p = CpuPool(1, name="test-order")
    gate = threading.Event()
    order: list[str] = []
    first = p.submit(gate.wait, priority=CHUNK)  # occupies the only worker
    while p.in_flight == 0:
        time.sleep(0.001)
    futs = [p.submit(order.append, f"c{i}", priority=CHUNK) for i in range(3)]
    futs.append(p.submit(order.append, "r0", priority=REPAIR))
    futs.append(p.submit(order.append, "c3", priority=CHUNK))
    futs.append(p.submit(order.append, "r1", priority=REPAIR))
    st = p.stats()
    assert st["queue_depth"] == 6 and st["in_flight"] == 1
    assert st["by_priority"]["repair"]["queued"] == 2 and st["by_priority"]["chunk"]["queued"] == 4
    gate.set()
    for f in [first, *futs]:
        f.result(timeout=10)
    assert order == ["r0", "r1", "c0", "c1", "c2", "c3"]
    st = p.stats()
    assert st["queue_depth"] == 0 and st["in_flight"] == 0
    assert st["by_priority"]["chunk"]["completed"] == 5 and st["by_priority"]["repair"]["completed"] == 2
    assert st["by_priority"]["repair"]["wait_ms_max"] > 0
    p.shutdown()


def test_express_thread_runs_a_repair_while_every_worker_is_busy():
    p = CpuPool(1, express=1, nice=5, name="test-express")
    gate = threading.Event()
    chunk = p.submit(gate.wait, 10, priority=CHUNK)  # the only general worker is busy
    while p.in_flight == 0:
        time.sleep(0.001)
    queued = p.submit(lambda: threading.current_thread().name, priority=REPAIR)  # a queued repair
    assert queued.result(timeout=10).startswith("test-express-express")
    assert not chunk.done()
    with pytest.raises(TimeoutError):  # an express thread never takes a chunk
        p.submit(lambda: None, priority=CHUNK).result(timeout=0.2)
    gate.set()
    assert chunk.result(timeout=10) is True
    st = p.stats()
    assert st["express"] == 1 and st["by_priority"]["repair"]["completed"] == 1
    assert CpuPool(1, express=1, fifo=True).express == 0  # the FIFO baseline has none
    p.shutdown()


def test_call_runs_a_repair_on_the_callers_thread_and_counts_it():
    """``CpuPool.call`` runs a repair inline (no hand-off to a pool thread), visible to ``repairs_active``
    while it runs and in the stats after; a FIFO pool queues it like any task."""
    p = CpuPool(1, express=1, name="test-inline")
    seen = p.call(lambda: (threading.current_thread(), p.repairs_active, p.in_flight), priority=REPAIR)
    assert seen == (threading.current_thread(), 1, 1)
    assert p.repairs_active == 0 and p.in_flight == 0
    st = p.stats()["by_priority"]["repair"]
    assert st["submitted"] == st["completed"] == 1 and st["wait_ms_max"] == 0.0
    with pytest.raises(KeyError):
        p.call(lambda: {}["x"])
    assert p.repairs_active == 0 and p.stats()["by_priority"]["repair"]["completed"] == 2
    # a queued repair counts while it waits
    gate = threading.Event()
    p2 = CpuPool(1, fifo=True, name="test-inline-fifo")
    blocker = p2.submit(gate.wait, 10)
    while p2.in_flight == 0:
        time.sleep(0.001)
    fut = p2.submit(threading.current_thread, priority=REPAIR)
    assert p2.repairs_active == 1
    gate.set()
    assert fut.result(timeout=10) is not threading.current_thread() and blocker.result(timeout=10)
    assert p2.call(threading.current_thread, priority=REPAIR) is not threading.current_thread()  # FIFO: queued
    p.shutdown(), p2.shutdown()


def test_fifo_pool_ignores_priority():
    p = CpuPool(1, fifo=True, name="test-fifo")
    gate = threading.Event()
    order: list[str] = []
    p.submit(gate.wait)
    while p.in_flight == 0:
        time.sleep(0.001)
    futs = [p.submit(order.append, "c0"), p.submit(order.append, "r0", priority=REPAIR)]
    gate.set()
    for f in futs:
        f.result(timeout=10)
    assert order == ["c0", "r0"]
    p.shutdown()


def test_pool_errors_and_nested_map_do_not_deadlock():
    p = CpuPool(1, name="test-nested")
    with pytest.raises(ZeroDivisionError):
        p.call(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        p.submit(lambda: 1 / 0, priority=REPAIR).result(timeout=10)
    # a repair on the only worker that needs a chunked encode: it runs its own chunks
    nested = p.submit(lambda: p.map(lambda x: x * x, list(range(20))), priority=REPAIR)
    assert nested.result(timeout=10) == [x * x for x in range(20)]
    with pytest.raises(ValueError):
        p.submit(print, priority=7)
    p.shutdown()
    with pytest.raises(RuntimeError):
        p.submit(print)


@pytest.mark.parametrize("express", [0, 1])
def test_repair_submitted_during_long_encode_finishes_first(corpus_texts, express):
    """The Delta Tokenizer property: a session repair submitted while a long full encode is running
    finishes before it, waiting at most about one chunk (here a chunk is ~20K chars, ~0.1 ms of the
    engine; the bound is loose for a loaded CI machine)."""
    tok = load("qwen3")
    p = CpuPool(2, express=express, name="test-delta")
    enc = make(tok, p, chunk_chars=20_000, min_chars=0)
    enc.prepare()  # (its warm-up is one chunk task per worker)
    warm = p.stats()["by_priority"]["chunk"]["completed"]
    text = corpus.long_session_text(3_000_000)
    n_chunks = len(enc.bounds(text)) - 1
    assert n_chunks >= 100
    s = tok.session(add_special_tokens=False)
    s.update("".join(corpus_texts)[:50_000])
    done: dict[str, float] = {}

    def long_encode():
        enc.encode(text)
        done["encode"] = time.perf_counter()

    t = threading.Thread(target=long_encode)
    t.start()
    while p.stats()["by_priority"]["chunk"]["completed"] < warm + 4:  # the encode is under way
        time.sleep(0.0005)
    t0 = time.perf_counter()
    ids = p.call(s.append, "\n<|im_start|>user\nnext turn, please<|im_end|>\n", priority=REPAIR)
    done["repair"] = time.perf_counter()
    t.join()
    assert s.last_repair.route == "append" and len(ids) > 0
    assert done["repair"] < done["encode"], "the repair waited for the whole encode"
    st = p.stats()
    assert st["by_priority"]["repair"]["completed"] == 1
    assert st["by_priority"]["chunk"]["completed"] == warm + n_chunks
    # it overtook the queued chunks: far fewer than all of them ran before it
    assert st["by_priority"]["repair"]["wait_ms_max"] < (done["encode"] - t0) * 1e3
    p.shutdown()


def test_shared_pool_is_one_per_process():
    assert runtime_pool.shared_pool() is runtime_pool.shared_pool()
    assert make(load("gpt2")).pool is runtime_pool.shared_pool()


def test_pool_nice_lowers_only_worker_threads():
    import os

    p = CpuPool(1, nice=5, name="test-nice")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    worker_nice = p.call(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), priority=CHUNK)
    assert worker_nice == min(19, base + 5)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
    p.shutdown()


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2,
                    reason="pinning needs sched_getaffinity and 2+ CPUs")
def test_pin_holds_chunk_workers_on_distinct_cpus_only_while_they_run_chunks():
    cpus = sorted(os.sched_getaffinity(0))
    p = CpuPool(2, express=1, pin=True, name="test-pin")
    assert p.pin
    seen: dict[str, set[int]] = {}
    barrier = threading.Barrier(2)

    def chunk_task(_):
        barrier.wait(timeout=10)  # both workers hold a chunk at once
        seen[threading.current_thread().name] = os.sched_getaffinity(0)
        return True

    p.map(chunk_task, [0, 1], priority=CHUNK)
    assert sorted(seen.values(), key=min) == [{cpus[0]}, {cpus[1]}]  # one CPU each, distinct
    # a repair is never pinned (the express thread, or a general worker); after a chunk, the whole set again
    for _ in range(4):
        assert p.submit(lambda: os.sched_getaffinity(0), priority=REPAIR).result(timeout=10) == set(cpus)
    assert os.sched_getaffinity(0) == set(cpus)  # the caller's own affinity is untouched
    p.shutdown()
    assert not CpuPool(2).pin and not CpuPool(1, pin=True).pin


def test_default_step_is_one_chunk_per_worker_up_to_chunk_chars():
    """Engines that take UTF-8 (gigatoken): one chunk per worker, at most CHUNK_CHARS each. Engines that
    take ``str`` (fastokens): every PIECE_CHARS piece is a task of its own."""
    fk = load("gpt2")
    assert not fk.engine.accepts_utf8
    text = corpus.long_session_text(300_000)
    spy = SpyEngine(fk.engine)
    enc = make(fk, CpuPool(2, name="test-step-str"), engine=spy, min_chars=0)
    assert enc.step(4_000_000) == parallel.PIECE_CHARS
    assert len(enc.bounds(text)) - 1 == -(-len(text) // parallel.PIECE_CHARS)
    assert enc.encode(text)[0].tolist() == hf_ids("gpt2", text)
    # one engine call per piece: a span a few chars over PIECE_CHARS (its cut fell before its grid point,
    # the next one on it) is not re-cut into a piece and a sliver
    text = corpus.long_session_text(1_100_000)
    b = enc.bounds(text)
    assert any(y - x > parallel.PIECE_CHARS for x, y in zip(b[:-1], b[1:])), b
    spy.calls.clear()
    assert enc.encode(text)[0].tolist() == hf_ids("gpt2", text)
    assert sorted(spy.calls) == sorted(y - x for x, y in zip(b[:-1], b[1:]))
    enc.pool.shutdown()
    tok = load("gpt2", engine="gigatoken")
    for workers in (1, 2, 3):
        p = CpuPool(workers, name="test-step")
        enc = make(tok, p)
        assert enc.step(2_000_000) == -(-2_000_000 // workers)  # <= CHUNK_CHARS: one chunk per worker
        n = 5 * parallel.CHUNK_CHARS + 1  # more chunks than workers past CHUNK_CHARS each
        assert enc.step(n) == -(-n // max(workers, 6))
        assert make(tok, p, chunk_chars=777).step(10**6) == 777
        p.shutdown()
    text = corpus.long_session_text(300_000)
    enc = make(tok, CpuPool(3, name="test-step3"), min_chars=0)
    assert len(enc.bounds(text)) - 1 == 3
    assert enc.encode(text)[0].tolist() == hf_ids("gpt2", text)
    enc.pool.shutdown()


def test_handler_runs_sessions_and_chunks_on_its_pool(corpus_text):
    from toktier_backend.faces.triton import Handler

    tok = tt.load_tokenizer(tt.default_tokenizer_path())
    p = CpuPool(2, name="test-handler")
    h = Handler(tok, max_text_bytes=1 << 22, pool=p)
    assert tok.chunked.pool is p
    tok.chunked.min_chars, tok.chunked.chunk_chars = 10_000, 4096
    text = corpus_text[:40_000]
    out = h.handle_session(1, text.encode(), start=True)
    assert out["INPUT_ID"].tolist() == hf_ids("gpt2", text, True)
    out = h.handle_session(1, b" and more", mode="delta")
    assert out["INPUT_ID"].tolist() == hf_ids("gpt2", text + " and more", True)
    assert h.handle_encode(text.encode())["INPUT_ID"].tolist() == hf_ids("gpt2", text, True)
    st = p.stats()["by_priority"]
    assert st["repair"]["completed"] == 2  # the two session steps
    # the session's first turn was chunked (40K chars / 4096); the stateless encode of the same text may
    # reuse it through the prefix index
    assert st["chunk"]["completed"] >= 9


def test_engine_calls_from_other_threads_during_chunks(corpus_text):
    """gigatoken's own ``Tokenizer.encode`` takes a mutable borrow: called while a chunk runs GIL-free it
    raised ``Already borrowed`` (and the chunk fell back to the reference). Every engine's encode must be
    safe from any number of threads at once."""
    for engine in ("fastokens", "gigatoken"):
        _engine_calls_during_chunks(load("qwen3", engine), corpus_text)


def _engine_calls_during_chunks(tok, corpus_text):
    p = CpuPool(2, name="test-borrow")
    enc = make(tok, p, chunk_chars=8192, min_chars=0)
    text = corpus.long_session_text(600_000)
    errors: list[BaseException] = []
    done = threading.Event()

    def short_encodes():
        while not done.is_set():
            try:
                tok.engine.encode(corpus_text[:2000])
            except BaseException as e:  # noqa: BLE001 - collected for the assert
                errors.append(e)

    t = threading.Thread(target=short_encodes)
    t.start()
    try:
        for _ in range(3):
            enc.encode(text)
    finally:
        done.set()
        t.join()
        p.shutdown()
    assert not errors, errors[:1]
    assert enc.stats["engine_errors"] == 0 and enc.stats["reference_chunks"] == 0


def test_lone_surrogate_on_every_route_is_invalid_request(corpus_text, monkeypatch):
    """``Tokenizer.encode`` leaves the surrogate check of a chunked text to the chunks; every other route
    (short text, prefix-index tail, quarantined route, reference-only flag) still raises InvalidRequest."""
    tok = tt.load_tokenizer(tt.default_tokenizer_path())
    tok.chunked.min_chars, tok.chunked.chunk_chars = 20_000, 4096
    base = corpus_text[:60_000]
    tok.encode(base)  # indexed as a prefix
    if tok.prefix_index is not None and hasattr(tok.prefix_index, "drain"):
        tok.prefix_index.drain()
    for text in (base[:100] + "\udfff",                       # short: whole-text check
                 base[:30_000] + "\ud800" + base[30_000:],     # chunked
                 base + " tail \ud800 x"):                     # a prefix hit, then a short tail
        with pytest.raises(tt.InvalidRequest, match="lone surrogate"):
            tok.encode(text)
    tok.quarantine("full", "test")
    with pytest.raises(tt.InvalidRequest, match="lone surrogate"):
        tok.encode(base[:30_000] + "\ud800" + base[30_000:])


def test_run_on_each_worker_runs_once_on_every_worker():
    p = CpuPool(3, express=1, name="test-each")
    try:
        names = p.run_on_each_worker(lambda: threading.current_thread().name)
        assert sorted(names) == [f"test-each-worker-{i}" for i in range(3)]
        with pytest.raises(RuntimeError, match="from one of its workers"):
            p.call(lambda: p.run_on_each_worker(lambda: None), priority=CHUNK)
    finally:
        p.shutdown()


def test_prepare_warms_the_engine_on_every_pool_worker_once_per_pool():
    """An engine's first call on a thread builds per-thread state; ``prepare`` makes that call on each worker
    (``docs/design/parallel.md``): every worker encodes once, a new pool is warmed again, and the ids of a
    chunked encode afterwards still equal HF's."""
    tok = load("qwen3")
    seen: list[str] = []

    class Recording(SpyEngine):
        def encode(self, text):
            seen.append(threading.current_thread().name)
            return super().encode(text)

    p = CpuPool(2, name="test-warm")
    try:
        enc = make(tok, p, engine=Recording(tok.engine), min_chars=0)
        enc.prepare()
        assert sorted(seen) == ["test-warm-worker-0", "test-warm-worker-1"]
        text = corpus.long_session_text(600_000)
        assert enc.encode(text)[0].tolist() == hf_ids("qwen3", text)
        assert len(seen) == 2 + enc.stats["chunks"]  # no second warm-up for the same pool
        p2 = CpuPool(2, name="test-warm2")
        enc.pool = p2
        seen.clear()
        enc.encode(text)
        assert sorted(seen[:2]) == ["test-warm2-worker-0", "test-warm2-worker-1"]
        p2.shutdown()
    finally:
        p.shutdown()


def test_prefix_indexer_waits_while_chunks_run_and_lookups_do_not_wait_for_it(corpus_texts, monkeypatch):
    """The background indexer calls ``yield_to`` before each chunk (the tokenizer passes its pool's
    ``wait_chunks_idle``): while a chunk task runs, no chunk of a queued insert is hashed; once the pool is
    idle the insert completes, and its chain serves a later lookup exactly."""
    from toktier_backend.pipeline import prefix_index

    monkeypatch.setattr(prefix_index, "YIELD_S", 30.0)  # (shipped: at most 50 ms per chunk)
    tok = tt.load_tokenizer(tokenizer_path("qwen3"))
    idx = tok.prefix_index
    p = CpuPool(1, name="test-yield")
    tok.chunked.pool = p
    hashed: list[bool] = []
    real = idx.digest
    idx.digest = lambda parent, chunk: hashed.append(p.wait_chunks_idle(0)) or real(parent, chunk)
    gate = threading.Event()
    try:
        blocker = p.submit(gate.wait, 10, priority=CHUNK)  # a chunk task "runs"
        text = "".join(corpus_texts)[:200_000]
        body, _ = tok.encode_fresh(text)
        assert not p.wait_chunks_idle(0)
        time.sleep(0.2)
        assert hashed == []  # the indexer waits
        t0 = time.perf_counter()
        assert idx.lookup(text + "x") is None  # not indexed yet, and the lookup did not wait on the insert
        assert time.perf_counter() - t0 < 0.05
        gate.set()
        blocker.result(timeout=10)
        idx.drain()
        assert hashed and all(hashed)  # every chunk hashed with no chunk task queued or running
        hit = idx.lookup(text + " more")
        assert hit is not None and hit.ids.tolist() == hf_ids("qwen3", text[:hit.cut])
    finally:
        gate.set()
        p.shutdown()
