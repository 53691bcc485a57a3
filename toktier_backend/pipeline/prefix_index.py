"""Cross-session prefix reuse by content: long shared prefixes (system prompts, tool definitions, an
earlier version of the same document) are tokenized once.

**Cuts.** A text is cut on a grid: cut ``i`` is the first stable cut in ``[i*step, (i+1)*step)``
(``CutFinder.grid_cut``). It depends only on the text before ``(i+1)*step``, so two texts sharing a prefix
share its cuts, and cut ``i`` of a new text is computed directly, without scanning from the start.

**Nodes.** Each chunk between consecutive cuts is a node of a hash-trie, content-addressed by a chained
BLAKE2b digest of the whole prefix up to its cut::

    key_i = blake2b(key_{i-1} || utf8(text[c_{i-1}:c_i]))

A node stores its chunk's text and body ids, so a prefix shared by many texts is stored once, and because
each cut is stable, ``encode(text) == concat(chunk ids along the chain) + encode(text[c:])``.

**Lookup.** From the last grid window of the new text backwards: compute cut ``i``, find a node ending
there by a cheap fingerprint (the cut and the 32 chars before it), then **confirm** the whole chain against
the new text (``str.startswith`` at each chunk's offset: a memory comparison). A hit therefore never rests
on a digest or fingerprint: a collision costs a miss, never a wrong id. Nothing of the reused prefix is
hashed at lookup, so reuse costs one memory comparison of it.

**Memory.** Nodes are evicted LRU within a byte budget; a lookup touches the chain root first, so leaves
go before the prefixes they hang from. (Dynamo's tokenizer cache reuses prefixes at special tokens and
fastokens' segment cache at added-token segments; this reuses them at any stable cut.)
"""

from __future__ import annotations

import hashlib
import logging
import queue
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

#: Default grid step (chars) and byte budget.
STEP = 16384
BUDGET = 256 * 1024 * 1024
_FP = 32  # chars of fingerprint before a cut
#: Longest the background indexer waits for a running chunked encode before each chunk (seconds): under a
#: stream of long requests it still makes progress (its queue is bounded; a full queue drops inserts).
YIELD_S = 0.05


def blake2b_chain(parent: bytes, chunk: str) -> bytes:
    """Chained content digest of a prefix: BLAKE2b-128 over the parent's digest and the chunk's UTF-8."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(chunk.encode("utf-8"))
    return h.digest()


@dataclass(eq=False)
class _Region:
    """The text of the nodes one :meth:`PrefixIndex.insert` added, as one ``str`` (nodes hold offsets into
    it). One string, not one per chunk, so that a confirmation compares long runs with a single
    ``str.startswith``: CPython compares two strings of the same kind with ``memcmp``, but a 16K-char ASCII
    chunk against a text that holds any non-ASCII char char by char (numbers:
    ``docs/design/prefix_index.md``)."""

    text: str
    live: int = 0  # nodes still indexed that point into it
    nbytes: int = 0


@dataclass(eq=False)
class _Node:
    key: bytes
    parent: "_Node | None"
    start: int  # chars
    length: int  # chars of the chunk
    region: _Region
    off: int  # chars: the chunk is region.text[off : off + length]
    ids: np.ndarray  # body ids of the chunk, int32
    n_tokens: int  # body ids of the whole prefix up to this node's end
    nbytes: int  # ids and bookkeeping (the region's text is counted once, on the region)
    used: float = 0.0  # clock time of the last hit or insert that touched it (shared-budget LRU)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def chunk(self) -> str:
        return self.region.text[self.off : self.off + self.length]


@dataclass
class PrefixHit:
    """The deepest confirmed indexed prefix of a text.

    Attributes:
        cut: chars covered (``text[:cut]``).
        parts: body ids of ``text[:cut]``, one ``np.ndarray[int32]`` per chunk, root first (concatenate them
            together with what follows in one copy: each extra copy of the ids is O(n)).
        node: the deepest node of the confirmed chain.
    """

    cut: int
    parts: list[np.ndarray]
    node: _Node

    @property
    def n_tokens(self) -> int:
        """Body ids of ``text[:cut]``."""
        return self.node.n_tokens

    @property
    def ids(self) -> np.ndarray:
        """``np.ndarray[int32] (n_tokens,)``: body ids of ``text[:cut]`` (a new array)."""
        return np.concatenate(self.parts)


class PrefixIndex:
    """Content-addressed prefix index for one tokenizer.

    Args:
        finder: the tokenizer's ``CutFinder``.
        token_nbytes: per-id normalized byte length (``np.ndarray[int32]``), to split ids at cuts.
        normalized_nbytes: ``str -> int``, normalized UTF-8 bytes of a chunk.
        step: grid step (chars).
        budget_bytes: memory for chunk texts + ids + node overhead; LRU eviction beyond it.
        digest: ``(parent_digest, chunk) -> digest`` (tests inject collisions through it).

    Thread-safe (one lock; lookups and inserts are short).
    """

    def __init__(self, finder, token_nbytes: np.ndarray, normalized_nbytes, *, step: int = STEP,
                 budget_bytes: int = BUDGET, digest=blake2b_chain, queue_size: int = 8):
        self.finder = finder
        self.token_nbytes = token_nbytes
        self.normalized_nbytes = normalized_nbytes
        self.step = step
        self.budget_bytes = budget_bytes
        self.digest = digest
        self._nodes: OrderedDict[bytes, _Node] = OrderedDict()
        self._by_fp: dict[tuple[int, str], _Node] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.collisions = self.evictions = self.dropped = 0
        self.queue_size = queue_size
        #: Clock of :attr:`_Node.used` (seconds); a serving handler sets its session store's clock.
        self.clock = time.monotonic
        #: Called (outside the lock) after an insert added nodes: a serving handler enforces the byte budget
        #: it shares with its sessions there (``SessionStore.account``).
        self.on_grow = None
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self.chars_reused = 0
        #: ``(timeout_s) -> bool``, or ``None``: the background indexer calls it before each chunk and it
        #: blocks while a chunked encode runs (at most ``timeout_s``; the tokenizer passes its pool's
        #: ``CpuPool.wait_chunks_idle``), so an insert never takes a core or GIL turns from the next
        #: request's chunk workers.
        self.yield_to = None

    def __len__(self) -> int:
        return len(self._nodes)

    def clear(self) -> None:
        """Forget every indexed prefix (a route was quarantined: the ids may come from a wrong engine)."""
        with self._lock:
            self._nodes.clear()
            self._by_fp.clear()
            self.nbytes = 0

    def stats(self) -> dict:
        """Counters for metrics: nodes, bytes, hits, misses, collisions, evictions, chars_reused."""
        return {"nodes": len(self._nodes), "bytes": self.nbytes, "hits": self.hits, "misses": self.misses,
                "collisions": self.collisions, "evictions": self.evictions, "chars_reused": self.chars_reused,
                "dropped": self.dropped}

    @staticmethod
    def _fp(text: str, c: int) -> tuple[int, str]:
        return c, text[max(0, c - _FP) : c]

    # ------------------------------------------------------------------ lookup
    def lookup(self, text: str) -> PrefixHit | None:
        """The deepest indexed prefix of ``text`` that equals the text char for char, or ``None`` (a miss).
        Thread-safe.

        Indexed prefixes are prefix-closed (a node exists only under its parent), so the deepest grid window
        of ``text`` whose cut has an indexed node with the same fingerprint is found by binary search over
        windows: O(log(n/step)) cut computations, nothing of the prefix read. That node's whole chain must
        then equal ``text`` char for char (``str.startswith`` at each chunk's offset); if it does not (a
        fingerprint collision, an evicted ancestor), windows below are tried one by one. A hit therefore
        never rests on a digest or a fingerprint.
        """
        top = (len(text) - 1) // self.step
        with self._lock:
            lo, hi, best = 1, top, None  # invariant: windows > hi have no node; best = deepest seen with one
            while lo <= hi:
                mid = (lo + hi) // 2
                node = self._node_at(text, mid)
                if node is not None:
                    best, lo = (mid, node), mid + 1
                else:
                    hi = mid - 1
            if best is not None:
                window, node = best
                for i in range(window, 0, -1):
                    if i != window:
                        node = self._node_at(text, i)
                        if node is None:
                            continue
                    chain = _chain(node)
                    if (chain[0].start != 0 or any(self._nodes.get(x.key) is not x for x in chain)
                            or not _same_text(text, chain)):
                        self.collisions += 1  # fingerprint (or orphaned chain) without the content: keep looking
                        continue
                    self._touch(chain)
                    self.hits += 1
                    self.chars_reused += node.end
                    return PrefixHit(cut=node.end, parts=[x.ids for x in chain], node=node)
            self.misses += 1
            return None

    def _touch(self, chain: list[_Node]) -> None:
        """Mark a root-first ``chain`` used now, leaf first, so every node ends more recent than all of its
        descendants. Proof that eviction then never orphans a live node: the order is changed only here, a
        whole chain at a time, each node moved after its descendants on that chain; so in the LRU order a
        node precedes each of its ancestors, and ``popitem(last=False)`` takes a node no live node hangs
        from. (A lookup also checks that every node of a chain is still held.)"""
        now = self.clock()
        for x in reversed(chain):
            self._nodes.move_to_end(x.key)
            x.used = now

    def _node_at(self, text: str, i: int) -> _Node | None:
        c = self.finder.grid_cut(text, i, self.step)
        return None if c is None else self._by_fp.get(self._fp(text, c))

    # ------------------------------------------------------------------ insert
    def insert(self, text: str, body_ids: np.ndarray, *, after: PrefixHit | None = None) -> int:
        """Index the grid chunks of ``text``, whose body ids are ``body_ids`` (``np.ndarray[int32]``).

        ``after``: a confirmed hit on ``text``: indexing continues from its cut (the reused prefix is
        neither re-hashed nor re-scanned). Returns the number of nodes added.

        The work per chunk (cut, normalized length, digest, a copy of its ids and the region's text) is
        done without the lock; the lock is held only to link the new nodes, so a concurrent
        :meth:`lookup` (the next request) never waits for the hashing.
        """
        return self._insert(text, body_ids, after, background=False)

    def _insert(self, text: str, body_ids: np.ndarray, after: PrefixHit | None, *, background: bool) -> int:
        """:meth:`insert`; ``background`` (the indexer thread): wait for :attr:`yield_to` first and before
        each chunk."""
        pause = self.yield_to if background else None
        if pause is not None:
            pause(YIELD_S)
        key, start, parent, tok = b"", 0, None, 0
        if after is not None:
            key, start, parent, tok = after.node.key, after.cut, after.node, after.n_tokens
        cuts = [c for c in self.finder.grid_cuts(text, self.step, lo_index=start // self.step) if c > start]
        tail_ends = np.cumsum(self.token_nbytes[body_ids[tok:]], dtype=np.int64)
        first = tok  # body ids before `start`
        nb = 0  # normalized bytes from the first `start` to `c`
        plan: list[tuple[bytes, int, int, np.ndarray]] = []  # (digest, start, end, ids) per chunk
        s, t = start, tok
        for c in cuts:
            if pause is not None:
                pause(YIELD_S)
            chunk = text[s:c]
            nb += self.normalized_nbytes(chunk)
            end_tok = int(np.searchsorted(tail_ends, np.int64(nb), side="right"))
            if end_tok == 0 or tail_ends[end_tok - 1] != nb:  # not a token boundary: stop
                break
            k = first + end_tok - t  # ids in this chunk
            key = self.digest(key, chunk)
            plan.append((key, s, c, body_ids[t : t + k].copy()))
            s, t = c, t + k
        if not plan:
            return 0
        whole = text[plan[0][1] : plan[-1][2]]  # the region's text if every planned chunk is new
        added = 0
        with self._lock:
            region = _Region("")  # the text of the nodes added here, set once they are known
            lo = hi = None
            for key, s, c, ids in plan:
                node = self._nodes.get(key)
                if node is not None and (node.start != s or node.length != c - s or node.parent is not parent
                                         or node.chunk != text[s:c]):
                    self.collisions += 1  # a colliding digest: never chain through someone else's node
                    break
                if node is None:
                    node = _Node(key, parent, s, c - s, region, 0, ids, tok + len(ids), ids.nbytes + 300)
                    self._nodes[key] = node
                    self._by_fp[self._fp(text, c)] = node
                    self.nbytes += node.nbytes
                    region.live += 1
                    lo = s if lo is None else lo
                    hi = c
                    added += 1
                parent, tok = node, tok + len(ids)
            if parent is not None and parent is not (after.node if after is not None else None):
                self._touch(_chain(parent))
            if added:
                region.text = whole if (lo, hi) == (plan[0][1], plan[-1][2]) else text[lo:hi]
                region.nbytes = sys.getsizeof(region.text)
                self.nbytes += region.nbytes
                for x in _chain(parent):  # every node added here is on this chain
                    if x.region is region:
                        x.off = x.start - lo
            self._evict()
        if added and self.on_grow is not None:
            self.on_grow()
        return added

    def insert_later(self, text: str, body_ids: np.ndarray, *, after: PrefixHit | None = None) -> bool:
        """Queue :meth:`insert` for the background indexer so the reply does not wait for hashing.

        Returns ``False`` (and counts a drop) when the bounded queue is full: indexing is an
        optimisation, never a reason to block or to grow memory without bound.
        """
        with self._lock:
            if self._worker is None:
                self._queue = queue.Queue(maxsize=self.queue_size)
                self._worker = threading.Thread(target=self._run, name="toktier-prefix-index", daemon=True)
                self._worker.start()
        try:
            self._queue.put_nowait((text, body_ids, after))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def drain(self, timeout: float = 30.0) -> None:
        """Wait (at most ``timeout`` seconds) until queued inserts are done (tests, benchmarks). Waits on the
        queue's own condition: no helper thread, whose exit would contend for the GIL with the caller's next
        request (``docs/design/prefix_index.md``)."""
        q = self._queue
        if q is None:
            return
        with q.all_tasks_done:  # queue.Queue's condition for join(); join() itself has no timeout
            q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def _run(self) -> None:
        while True:
            text, body_ids, after = self._queue.get()
            try:
                self._insert(text, body_ids, after, background=True)
            except Exception:  # an index failure only loses reuse, never a reply
                log.exception("prefix index insert failed")
            finally:
                self._queue.task_done()

    def oldest_use(self) -> float | None:
        """:attr:`clock` time of the least recently used node, ``None`` when empty (shared-budget LRU)."""
        with self._lock:
            return next(iter(self._nodes.values())).used if self._nodes else None

    def evict_oldest(self) -> int:
        """Evict the least recently used node (a leaf before the prefixes it hangs from); bytes freed."""
        with self._lock:
            return self._evict_one() if self._nodes else 0

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self._nodes:
            self._evict_one()

    def _evict_one(self) -> int:
        before = self.nbytes
        _, node = self._nodes.popitem(last=False)
        self.nbytes -= node.nbytes
        self.evictions += 1
        node.region.live -= 1
        if node.region.live == 0:  # its last node: the region's text goes with it
            self.nbytes -= node.region.nbytes
        fp = (node.end, node.chunk[-_FP:] if node.length >= _FP else None)
        if fp[1] is not None and self._by_fp.get(fp) is node:
            del self._by_fp[fp]
        else:  # short chunk: fingerprint reaches into the parent's text; find it by identity
            for k, v in list(self._by_fp.items()):
                if v is node:
                    del self._by_fp[k]
                    break
        node.parent = None  # orphans fail confirmation (chain must start at 0) and age out
        return before - self.nbytes


def _same_text(text: str, chain: list[_Node]) -> bool:
    """Does ``text`` hold every chunk of ``chain`` at its offset? One ``startswith`` per run of chain nodes
    that are adjacent in one region (a whole region is compared without a copy)."""
    i = 0
    while i < len(chain):
        r, j = chain[i].region, i
        while j + 1 < len(chain) and chain[j + 1].region is r and chain[j + 1].off == chain[j].off + chain[j].length:
            j += 1
        o1, o2 = chain[i].off, chain[j].off + chain[j].length
        piece = r.text if o1 == 0 and o2 == len(r.text) else r.text[o1:o2]
        if not text.startswith(piece, chain[i].start):
            return False
        i = j + 1
    return True


def _chain(node: _Node) -> list[_Node]:
    chain = []
    while node is not None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain
