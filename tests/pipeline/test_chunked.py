"""Chunked full encode (``toktier_backend.pipeline.chunked``) against the HF reference.

Every chunked result is compared with ``Tokenizer.from_file(path).encode(text, add_special_tokens=...)
.ids`` (``tests/conftest.py`` ``reference(name)``, loaded independently of our code), on all nine files:
real SWE-agent trajectories, texts built to defeat naive cuts, added tokens at chunk edges, every chunk
count 1..16, guarded code points, and the pathological runs (1M-char runs are checked in
``bench/full_encode.py --pathological``; here they are 60K chars, where HF takes ~0.1 s each).
Chunk sizes are forced small (``chunk_chars`` 64..8K, ``min_chars=0``) so short texts take many chunks.
"""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest

import toktier_backend as tt
from toktier_backend import corpus
from toktier_backend.pipeline import chunked as parallel
from toktier_backend.pipeline.chunked import ChunkedEncoder
from toktier_backend.runtime.pool import CpuPool

from ..conftest import NAMES, load, reference, tokenizer_path
from .chunked_helpers import make


@pytest.fixture(scope="module")
def pool():
    p = CpuPool(2, name="test-parallel")
    yield p
    p.shutdown()


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


# ---------------------------------------------------------------------------------------------- on the pool


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


