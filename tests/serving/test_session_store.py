"""Session store: byte budget with LRU eviction, TTL, eviction causes, and honest memory accounting.

The memory test measures what sessions really allocate (``tracemalloc``) and checks that the store never
charges less than that, and that a session costs at most its text + 9 bytes per token + a small constant
(ASCII text; see ``pipeline/token_buffer.py`` for the id/offset headroom bound).
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

import toktier_backend as tt
from toktier_backend.corpus import load_turns, trajectory_files
from toktier_backend.serving.session_store import ENTRY_OVERHEAD, SessionEntry, SessionStore
from toktier_backend.faces.triton import Handler


REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Sized:
    def __init__(self, n):
        self.nbytes = n


@pytest.fixture(scope="module")
def tok():
    return tt.load_tokenizer(tt.default_tokenizer_path())


def entry(clock, n):
    return SessionEntry(Sized(n), True, 0, clock())


def test_lru_eviction_under_budget():
    clock, gone = Clock(), []
    store = SessionStore(ttl_s=60, max_bytes=3 * (1000 + ENTRY_OVERHEAD), clock=clock,
                         on_evict=lambda k, e, cause: gone.append((k, cause)))
    for k in "abc":
        assert store.put(k, entry(clock, 1000)) == []
    assert store.nbytes == 3 * (1000 + ENTRY_OVERHEAD)
    store.get("a")  # a is now the most recently used: b goes first
    assert store.put("d", entry(clock, 1000)) == ["b"] and gone == [("b", "budget")]
    assert list(store._entries) == ["c", "a", "d"]
    # one session grows: the least recently used others go, it stays
    store._entries["d"].session.nbytes = 2000 + ENTRY_OVERHEAD
    assert store.account("d") == ["c"] and "d" in store and "a" in store
    # alone over the budget: evicted after its reply
    store._entries["d"].session.nbytes = 10**6
    assert store.account("d") == ["a", "d"] and len(store) == 0 and store.nbytes == 0
    assert store.evictions == {"budget": 4}


def test_ttl_and_causes():
    clock = Clock()
    store = SessionStore(ttl_s=5, clock=clock)
    store.put(1, entry(clock, 10))
    store.put(2, entry(clock, 10))
    clock.t += 6
    assert store.get(1) is None and store.evictions["idle"] == 1
    assert store.expire(force=True) == 1 and store.expired == 2 and store.nbytes == 0
    store.put(3, entry(clock, 10))
    store.pop(3, "start")
    store.put(4, entry(clock, 10))
    store.pop(4)  # END: not an eviction
    assert store.evictions == {"idle": 2, "start": 1}


def test_handler_evicted_session_rebuilds_from_full_text_and_delta_gets_not_found(tok):
    turns = load_turns(trajectory_files(None)[0])[:4]
    h = Handler(tok, session_budget_bytes=60_000)
    for i in range(1, 13):
        h.handle_session(i, turns[1].encode(), start=True)
    assert h.store.evictions["budget"] > 0 and h.store.nbytes <= 60_000
    evicted = next(i for i in range(1, 13) if i not in h.store)
    with pytest.raises(tt.UnknownSession, match="evicted under the session memory budget.*MODE='full'"):
        h.handle_session(evicted, b" more", mode="delta")
    out = h.handle_session(evicted, (turns[1] + " more").encode(), mode="full")
    assert out["INPUT_ID"].tolist() == tok.reference.encode(turns[1] + " more").ids


def _measure(build, k):
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    sessions = [build(i) for i in range(k)]
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return sessions, used / k


def _replay(mode: str) -> dict:
    """Replay a real session (delta or full-text mode) into a store, 8 times; what tracemalloc sees per
    session, what the store charges, and the session's text bytes and tokens."""
    tok = tt.load_tokenizer(tt.default_tokenizer_path())
    turns = [t for t in load_turns(trajectory_files(None)[0]) if t.isascii()]
    clock = Clock()
    store = SessionStore(clock=clock)  # one store: its own fixed cost is not per session

    def build(i):
        s = tok.session()
        prev = ""
        for t in turns:
            t = t + f" {i}"  # distinct texts per session: nothing shared between them
            if mode == "delta" and t.startswith(prev):
                s.append(t[len(prev):])
            else:
                s.update(t)
            prev = t
        store.put(i, SessionEntry(s, True, len(s.text), clock()))
        return s

    k = 8
    _, measured = _measure(build, k)
    e = store._entries[0]
    return {"measured": measured, "charged": store.nbytes / k, "chars": len(e.session.text),
            "text_bytes": len(e.session.text.encode()), "n": len(e.session.ids)}


@pytest.mark.parametrize("mode", ["delta", "full"])
def test_memory_per_session_is_bounded_and_charged_honestly(mode):
    """Compare what tracemalloc sees with what the store charges and with text + 8 bytes per token. Measured
    in a fresh interpreter: tracemalloc counts every thread's allocations, and other tests' servers and
    cores (PyTriton in process, verifier and sweeper threads) run threads of their own."""
    import json
    import subprocess
    import sys

    code = f"import json, tests.serving.test_session_store as m; print(json.dumps(m._replay({mode!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    measured, charged, text_bytes, n = r["measured"], r["charged"], r["text_bytes"], r["n"]
    print(f"\n{mode}: {r['chars']} chars, {n} tokens: measured {measured:.0f} B/session, "
          f"charged {charged:.0f} B, text + 8 B/token = {text_bytes + 8 * n} B, "
          f"measured - (text + 8n) = {measured - text_bytes - 8 * n:.0f} B")
    assert measured <= charged * 1.02  # the store never charges less than is held
    assert charged <= text_bytes + 9 * n + ENTRY_OVERHEAD + 512
    assert measured <= text_bytes + 9 * n + ENTRY_OVERHEAD


class FakeIndex:
    """What ``SessionStore.share_budget`` needs from a ``PrefixIndex``: chunks with last-use times."""

    def __init__(self, chunks):
        self.chunks = list(chunks)  # (used, nbytes), least recently used first

    @property
    def nbytes(self):
        return sum(n for _, n in self.chunks)

    def oldest_use(self):
        return self.chunks[0][0] if self.chunks else None

    def evict_oldest(self):
        return self.chunks.pop(0)[1]


def test_shared_budget_evicts_least_recently_used_across_sessions_and_index():
    clock = Clock()
    size = 20 + ENTRY_OVERHEAD  # what a session of 20 bytes is charged
    store = SessionStore(clock=clock, max_bytes=2 * size + 60)
    index = FakeIndex([(50.0, 30), (120.0, 30)])  # one chunk older than every session, one newer
    store.share_budget(index)
    store.put(1, entry(clock, 20))  # t=100
    clock.t = 110
    store.put(2, entry(clock, 20))  # exactly the budget: nothing evicted
    assert index.chunks == [(50.0, 30), (120.0, 30)] and sorted(store._entries) == [1, 2]
    clock.t = 130
    store.put(3, entry(clock, 20))  # over by one session: the t=50 chunk, then session 1 (t=100 < 120)
    assert index.chunks == [(120.0, 30)] and sorted(store._entries) == [2, 3]
    clock.t = 140
    store.put(4, entry(clock, 30))  # session 2 (t=110) is older than the t=120 chunk
    assert index.chunks == [(120.0, 30)] and sorted(store._entries) == [3, 4]
    assert store.evictions["budget"] == 2 and store.nbytes + index.nbytes <= store.max_bytes


def test_handler_charges_the_prefix_index_to_the_session_budget():
    """A real handler: sessions share a system prompt through the prefix index, and sessions plus index
    stay within one budget; every reply equals the HF reference."""
    from toktier_backend.pipeline.prefix_index import PrefixIndex

    tok = tt.load_tokenizer(tt.default_tokenizer_path())  # its own: the handler binds its index
    tok.prefix_index = PrefixIndex(tok.cuts, tok.spec.token_nbytes, tok.spec.normalized_nbytes, step=512)
    clock = Clock()
    budget = 120_000
    h = Handler(tok, session_budget_bytes=budget, clock=clock)
    prompt = "".join(load_turns(trajectory_files(None)[0]))[:12_000]
    for i in range(1, 25):
        clock.t += 1
        text = prompt + f"\nuser {i}: " + "word " * (i * 40)
        out = h.handle_session(i, text.encode(), start=True)
        assert out["INPUT_ID"].tolist() == tok.reference.encode(text).ids
        tok.prefix_index.drain()
        assert h.store.nbytes + tok.prefix_index.nbytes <= budget
    assert tok.prefix_index.hits > 0 and h.store.evictions["budget"] > 0
