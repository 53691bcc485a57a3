"""Cross-session prefix reuse: every reply equals the HF reference, reuse actually happens, and the
background indexer yields to chunk tasks on the pool."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import toktier_backend as tt
from toktier_backend.pipeline.prefix_index import PrefixIndex
from toktier_backend.runtime.pool import CHUNK, CpuPool

from ..conftest import load, reference, tokenizer_path


def fresh_index(tok, step=512, budget=64 << 20, digest=None):
    kw = {"digest": digest} if digest else {}
    tok.prefix_index = PrefixIndex(tok.cuts, tok.spec.token_nbytes, tok.spec.normalized_nbytes,
                                   step=step, budget_bytes=budget, **kw)
    return tok.prefix_index


def check(tok, ref, text, flag=False):
    got = tok.encode(text, add_special_tokens=flag)
    assert got.tolist() == ref.encode(text, add_special_tokens=flag).ids
    tok.prefix_index.drain()  # the background indexer has seen this text before the next request


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "llama3_1", "deepseek_v3", "gemma3", "o200k_base"])
def test_shared_system_prompt_across_sessions(name, corpus_texts):
    tok, ref = load(name), reference(name)
    idx = fresh_index(tok)
    system = corpus_texts[0][:6000]  # a long shared system prompt + tool definitions
    for i, other in enumerate(corpus_texts[1:9]):
        text = system + other[: 1500 + 300 * i]
        check(tok, ref, text, flag=bool(i % 2))
        s = tok.session()
        assert np.array_equal(s.update(text + " more"), ref.encode(text + " more").ids)
        idx.drain()
    assert idx.hits >= 7 and idx.chars_reused >= 7 * 5000, idx.stats()


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "gemma3"])
def test_prefix_shared_up_to_one_char_around_a_cut(name, corpus_texts):
    tok, ref = load(name), reference(name)
    idx = fresh_index(tok)
    base = corpus_texts[2][:8000]
    check(tok, ref, base)
    cuts = tok.cuts.grid_cuts(base, idx.step)
    assert cuts, "no grid cut to test around"
    for c in cuts[1:6]:
        for d in (-2, -1, 0, 1, 2):
            for insert in ("X", " ", "\n", "<|endoftext|>", "1"):
                check(tok, ref, base[: c + d] + insert + base[c + d :])
    assert idx.hits > 0


def test_forced_digest_collisions_are_caught():
    tok, ref = load("qwen3"), reference("qwen3")
    idx = fresh_index(tok, digest=lambda parent, chunk: b"same")  # every prefix collides
    a = "alpha beta gamma\n" * 400
    b = "delta epsilon zeta\n" * 400
    for text in (a, b, a + "tail", b + "tail"):
        check(tok, ref, text)
    assert idx.collisions > 0


def test_forced_fingerprint_collision_is_caught():
    tok, ref = load("gpt2"), reference("gpt2")
    idx = fresh_index(tok)
    base = "".join(f"line {i} of the shared prompt\n" for i in range(300))
    check(tok, ref, base)
    # same length, same text right before every cut, different text earlier: fingerprints match, content not
    forged = "LINE" + base[4:]
    check(tok, ref, forged)
    assert idx.collisions > 0


def test_eviction_under_a_small_budget(corpus_texts):
    tok, ref = load("llama3_1"), reference("llama3_1")
    idx = fresh_index(tok, budget=40_000)
    for t in corpus_texts[:6]:
        check(tok, ref, t[:9000])
        check(tok, ref, t[:9000] + " again")
    assert idx.evictions > 0 and idx.nbytes <= 40_000


def test_eviction_takes_leaves_before_the_prefixes_they_hang_from(corpus_texts):
    """Node by node eviction (the shared budget's LRU) never leaves a held node whose ancestor is gone, after
    inserts and after lookups of shorter prefixes (which touch only the head of a chain); every reply stays
    exact while the index shrinks to nothing."""
    tok, ref = load("qwen3"), reference("qwen3")
    idx = fresh_index(tok, step=512)
    base = "".join(corpus_texts[:3])[:9000]
    check(tok, ref, base)
    check(tok, ref, base[:2600] + "\nbranch")  # a hit on the head, then a new branch under it
    check(tok, ref, base[:1200] + "\nshort")  # touches only the first nodes

    def held_chains_intact():
        for node in idx._nodes.values():
            x = node.parent
            while x is not None:
                assert idx._nodes.get(x.key) is x, "a held node hangs from an evicted one"
                x = x.parent

    assert len(idx) >= 8
    text = base + "\nmore"
    while len(idx):
        held_chains_intact()
        hit = idx.lookup(text)  # (a lookup touches the chain it confirms)
        if hit is not None:
            assert np.concatenate(hit.parts).tolist() == ref.encode(text[:hit.cut], add_special_tokens=False).ids
        idx.evict_oldest()
    assert idx.nbytes == 0
    check(tok, ref, text)


def test_regions_bytes_accounting_and_multi_region_chains(corpus_texts):
    """A chain built by several inserts (one region each) is confirmed run by run, a hit may end inside a
    region, and ``nbytes`` is exactly the live nodes' bytes plus each region still pointed into once."""
    tok, ref = load("qwen3"), reference("qwen3")
    idx = fresh_index(tok, step=512)
    base = "".join(corpus_texts[:3])[:12_000] + " é中"  # non-ASCII: the request texts are not ASCII strings
    check(tok, ref, base[:4000])            # region 1
    check(tok, ref, base[:8000])            # region 2, chained under region 1
    check(tok, ref, base[:8000] + "\nXYZ")  # hit across both regions (a full and a partial run)
    check(tok, ref, base[:6100] + "\n€ edit")  # hit ending inside region 2
    regions = {id(n.region): n.region for n in idx._nodes.values()}
    assert len(regions) >= 2 and idx.hits >= 2
    assert idx.nbytes == sum(n.nbytes for n in idx._nodes.values()) + sum(r.nbytes for r in regions.values())
    idx.budget_bytes = 0
    idx._evict()
    assert len(idx) == 0 and idx.nbytes == 0
    check(tok, ref, base[:8000] + "\nafter eviction")  # a miss, still exact


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
        assert hit is not None
        assert hit.ids.tolist() == reference("qwen3").encode(text[:hit.cut], add_special_tokens=False).ids
    finally:
        gate.set()
        p.shutdown()
