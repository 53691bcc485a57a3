"""Host-side tables of one tokenizer file for the GPU path, and the NumPy twin of the whole pipeline.

:class:`GpuTables` checks that the file is one the GPU path reproduces exactly (byte-level BPE, a family
with a proven parallel predicate, no ``lstrip``/``rstrip``/``single_word`` added tokens, no byte
fallback/dropout/subword affixes) and builds flat arrays the kernels read:

* ``byte_ids`` ``int32[256]``: id of each byte's byte-level char (the BPE's initial symbols).
* merge hash (open addressing, linear probing): ``mk_a``/``mk_b`` (pair, ``-1`` = empty), ``m_rank``,
  ``m_new``; ``(a, b) -> (merge rank, new id)`` exactly as HF builds its ``MergeMap``.
* vocab hash for ``ignore_merges`` (Llama 3): ``vh_key`` (rolling hash of the token bytes, ``-1`` empty),
  ``vh_id``; token bytes ``blob``/``boff`` to verify a hit byte by byte.

:func:`encode_numpy` runs the same algorithm on the CPU (added-token split, :mod:`predicates`,
:func:`bpe_rounds`); it is the oracle the kernels are checked against, and is itself checked against HF.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from toktier_backend.errors import UnsupportedTokenizer
from toktier_backend.pipeline.cuts import deepseek_v3 as _ds_cut
from toktier_backend.pipeline.cuts import cl100k as _cl_cut
from toktier_backend.spec import bytes_to_unicode, walk_components
from toktier_backend.gpu import predicates

INF_RANK = 0x7FFFFFFF
HASH_A = 0x9E3779B1
HASH_B = 0x85EBCA77
VHASH_MUL = 1000003
VHASH_MASK = (1 << 40) - 1

FAMILY_CODE = {"gpt2": 0, "cl100k": 1, "qwen2": 2, "deepseek_v3": 3}


# ------------------------------------------------------------------------------------------- hashing
def pair_slot(a, b, mask):
    """Home slot of the pair ``(a, b)``; identical in NumPy, Python and numba (all products < 2**51)."""
    h = (a * HASH_A) ^ (b * HASH_B)
    return (h ^ (h >> 17)) & mask


def vhash_bytes(data: bytes) -> int:
    """Rolling hash of a byte string (40 bits), as the kernels compute it."""
    h = 0
    for x in data:
        h = ((h * VHASH_MUL) ^ x) & VHASH_MASK
    return h


def vhash_slot(h, mask):
    return (h ^ (h >> 17)) & mask


def _build_open_table(home: np.ndarray, size: int) -> np.ndarray:
    """Slot per item under linear probing (parallel insertion: every item sits after a run of occupied
    slots starting at its home, so lookups that probe from home until an empty slot find it)."""
    slot_of = np.full(len(home), -1, dtype=np.int64)
    taken = np.zeros(size, dtype=bool)
    pending = np.arange(len(home))
    cur = home.astype(np.int64).copy()
    while len(pending):
        s = cur[pending]
        free = ~taken[s]
        cand, cs = pending[free], s[free]
        uniq, first = np.unique(cs, return_index=True)
        winners = cand[first]
        slot_of[winners] = uniq
        taken[uniq] = True
        won = np.zeros(len(home), dtype=bool)
        won[winners] = True
        pending = pending[~won[pending]]
        cur[pending] = (cur[pending] + 1) & (size - 1)
    return slot_of


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, int(n - 1).bit_length())


# ------------------------------------------------------------------------------------- added tokens
def _trie_regex(tokens: list[bytes]) -> re.Pattern | None:
    """A bytes regex matching ``tokens`` leftmost-longest (trie: longer continuations are tried first,
    the token end last), which is HF's ``AhoCorasick`` ``MatchKind::LeftmostLongest``."""
    if not tokens:
        return None
    trie: dict = {}
    for t in tokens:
        node = trie
        for x in t:
            node = node.setdefault(x, {})
        node[None] = True

    def emit(node) -> str:
        alts = [re.escape(bytes([k])).decode("latin-1") + emit(v) for k, v in sorted(((k, v) for k, v in node.items() if k is not None))]
        end = None in node
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if end else body

    return re.compile(emit(trie).encode("latin-1"), re.DOTALL)


@dataclass
class AddedSplitter:
    """HF ``AddedVocabulary.extract_and_normalize`` for files without ``lstrip``/``rstrip``/
    ``single_word`` and with an identity normalizer on the texts we accept: non-normalized tokens are
    split out of the raw text first, then normalized ones out of the remaining pieces, each pass
    leftmost-longest."""

    raw: re.Pattern | None
    normalized: re.Pattern | None
    ids: dict[bytes, int]

    @classmethod
    def from_config(cls, added: list[dict]) -> "AddedSplitter":
        ids, raw, norm = {}, [], []
        for a in added:
            b = a["content"].encode("utf-8")
            if not b:
                continue
            ids[b] = int(a["id"])
            (norm if a.get("normalized") else raw).append(b)
        return cls(_trie_regex(raw), _trie_regex(norm), ids)

    def spans(self, data: bytes) -> list[tuple[int, int, int]]:
        """``(byte_start, byte_end, id)`` of the added tokens in ``data`` (UTF-8), in order."""
        out: list[tuple[int, int, int]] = []
        if self.raw is None and self.normalized is None:
            return out
        first = [(m.start(), m.end()) for m in self.raw.finditer(data)] if self.raw is not None else []
        if self.normalized is None:
            return [(a, b, self.ids[data[a:b]]) for a, b in first]
        pos = 0
        for a, b in first + [(len(data), len(data))]:
            for m in self.normalized.finditer(data, pos, a):
                out.append((m.start(), m.end(), self.ids[m.group()]))
            if a < b:
                out.append((a, b, self.ids[data[a:b]]))
            pos = b
        return out


# ------------------------------------------------------------------------------------------ family
def _regex(leaf: dict) -> str | None:
    pat = leaf.get("pattern") or {}
    return pat.get("Regex") if isinstance(pat, dict) else None


def _isolating(leaf: dict) -> bool:
    return (leaf.get("behavior") == "Isolated" and not leaf.get("invert")) or (
        leaf.get("behavior") == "Removed" and leaf.get("invert") is True
    )


def detect_gpu_family(config: dict) -> tuple[str | None, bool, str]:
    """``(family, needs_nfc_check, reason)`` from the file's own structure; ``family`` is ``None`` when the
    GPU path cannot reproduce the file exactly (then every request takes the CPU engine)."""
    model = config.get("model") or {}
    if model.get("type", "BPE") != "BPE" or "merges" not in model:
        return None, False, "model is not BPE"
    if model.get("byte_fallback"):
        return None, False, "byte_fallback BPE is not implemented on the GPU path"
    if model.get("dropout") not in (None, 0, 0.0):
        return None, False, "BPE dropout is not deterministic"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, False, "subword prefix/suffix affixes are not implemented on the GPU path"
    for a in config.get("added_tokens") or []:
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            return None, False, "added tokens with lstrip/rstrip/single_word"
    norm = [leaf.get("type") for leaf in walk_components(config.get("normalizer"))]
    if any(t != "NFC" for t in norm):
        return None, False, f"normalizer {norm} is not implemented on the GPU path"
    nfc = bool(norm)
    pre = walk_components(config.get("pre_tokenizer"))
    if not pre or pre[-1].get("type") != "ByteLevel" or pre[-1].get("add_prefix_space"):
        return None, nfc, "pre-tokenizer does not end in ByteLevel(add_prefix_space=False)"
    splits, last = pre[:-1], pre[-1]
    if any(leaf.get("type") != "Split" or not _isolating(leaf) for leaf in splits):
        return None, nfc, "pre-tokenizer holds more than isolating Split regexes"
    pats = tuple(_regex(s) for s in splits)
    if not splits and last.get("use_regex", True):
        family = "gpt2"
    elif last.get("use_regex", True):
        return None, nfc, "ByteLevel regex after a Split"
    elif pats == (_cl_cut.PATTERNS["cl100k"],):
        family = "cl100k"
    elif pats == (_cl_cut.PATTERNS["qwen2"],):
        family = "qwen2"
    elif pats == _ds_cut.PATTERNS:
        family = "deepseek_v3"
    else:
        return None, nfc, "no parallel predicate for this Split regex"
    return family, nfc, f"{family} predicate" + (" (NFC: identity texts only)" if nfc else "")


# ------------------------------------------------------------------------------------------- NFC
_NFC_UNSAFE: np.ndarray | None = None


def nfc_unsafe_table() -> np.ndarray:
    """``bool[0x110000]``: code points that may make NFC differ from the identity.

    Safe = assigned in Python's Unicode (14.0 on 3.11), canonical combining class 0, NFC of itself,
    and not the second half of any canonical pair (NFC_QC=Maybe, Hangul V/T jamo). A text of safe code
    points passes the NFC quick check (UAX #15), so it is NFC; by Unicode's normalization stability
    policy it stays NFC under the newer tables HF ships. Everything else (including code points new since
    14.0) is unsafe and takes the CPU path.
    """
    global _NFC_UNSAFE
    if _NFC_UNSAFE is None:
        import unicodedata

        unsafe = np.zeros(0x110000, dtype=bool)
        unsafe[0xD800:0xE000] = True
        for cp in range(0x80, 0x110000):
            if unsafe[cp]:
                continue
            ch = chr(cp)
            if unicodedata.category(ch) == "Cn" or unicodedata.combining(ch) or not unicodedata.is_normalized("NFC", ch):
                unsafe[cp] = True
                continue
            d = unicodedata.decomposition(ch)
            if d and not d.startswith("<"):
                parts = d.split()
                if len(parts) == 2:
                    unsafe[int(parts[1], 16)] = True
        unsafe[0x1161:0x1176] = True
        unsafe[0x11A8:0x11C3] = True
        _NFC_UNSAFE = unsafe
    return _NFC_UNSAFE


# ------------------------------------------------------------------------------------------ tables
@dataclass
class GpuTables:
    """Everything the GPU path needs from one tokenizer.json (see module docstring).

    Raises:
        UnsupportedTokenizer: the file is not one the GPU path reproduces exactly (``reason`` says why).
    """

    path: Path
    family: str
    family_code: int
    needs_nfc: bool
    ignore_merges: bool
    byte_ids: np.ndarray
    merges: dict[tuple[int, int], tuple[int, int]]
    mk_a: np.ndarray
    mk_b: np.ndarray
    m_rank: np.ndarray
    m_new: np.ndarray
    vocab_bytes: dict[bytes, int]
    vh_key: np.ndarray
    vh_id: np.ndarray
    blob: np.ndarray
    boff: np.ndarray
    max_token_bytes: int
    added: AddedSplitter
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_file(cls, path: str | Path) -> "GpuTables":
        path = Path(path)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UnsupportedTokenizer(f"{path}: cannot read tokenizer.json: {e}") from e
        family, nfc, reason = detect_gpu_family(config)
        if family is None:
            raise UnsupportedTokenizer(f"{path}: GPU path unsupported: {reason}")
        model = config["model"]
        vocab: dict[str, int] = model["vocab"]
        u2b = {u: b for b, u in bytes_to_unicode().items()}
        byte_ids = np.empty(256, dtype=np.int32)
        for b, u in bytes_to_unicode().items():
            if u not in vocab:
                raise UnsupportedTokenizer(f"{path}: byte {b:#04x} ({u!r}) is not in the vocabulary")
            byte_ids[b] = vocab[u]
        merges: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, m in enumerate(model["merges"]):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            try:
                merges[(vocab[a], vocab[b])] = (rank, vocab[a + b])  # later duplicates win, as in HF
            except KeyError as e:
                raise UnsupportedTokenizer(f"{path}: merge {a!r} {b!r} refers to a missing token {e}") from e
        keys = np.array(list(merges.keys()), dtype=np.int64).reshape(-1, 2)
        vals = np.array(list(merges.values()), dtype=np.int64).reshape(-1, 2)
        size = _pow2_at_least(2 * len(merges))
        slots = _build_open_table(pair_slot(keys[:, 0], keys[:, 1], size - 1), size)
        mk_a = np.full(size, -1, np.int32)
        mk_b = np.full(size, -1, np.int32)
        m_rank = np.full(size, INF_RANK, np.int32)
        m_new = np.full(size, -1, np.int32)
        mk_a[slots], mk_b[slots] = keys[:, 0], keys[:, 1]
        m_rank[slots], m_new[slots] = vals[:, 0], vals[:, 1]

        vocab_bytes: dict[bytes, int] = {}
        for tok, i in vocab.items():
            if all(ch in u2b for ch in tok):
                vocab_bytes[bytes(u2b[ch] for ch in tok)] = int(i)
        ignore = bool(model.get("ignore_merges"))
        items = sorted(vocab_bytes.items(), key=lambda kv: kv[1])
        boff = np.zeros(len(items) + 1, dtype=np.int32)
        boff[1:] = np.cumsum([len(k) for k, _ in items])
        blob = np.frombuffer(b"".join(k for k, _ in items) or b"\0", dtype=np.uint8).copy()
        if ignore:
            hk = np.array([vhash_bytes(k) for k, _ in items], dtype=np.int64)
            vsize = _pow2_at_least(2 * len(items))
            vslots = _build_open_table(vhash_slot(hk, vsize - 1), vsize)
            vh_key = np.full(vsize, -1, np.int64)
            vh_id = np.full(vsize, -1, np.int32)  # index into items (blob order), not the token id
            vh_key[vslots] = hk
            vh_id[vslots] = np.arange(len(items), dtype=np.int32)
            item_ids = np.array([i for _, i in items], dtype=np.int32)
        else:
            vh_key = np.full(16, -1, np.int64)
            vh_id = np.full(16, -1, np.int32)
            item_ids = np.array([i for _, i in items], dtype=np.int32)
        t = cls(path=path, family=family, family_code=FAMILY_CODE[family], needs_nfc=nfc, ignore_merges=ignore,
                byte_ids=byte_ids, merges=merges, mk_a=mk_a, mk_b=mk_b, m_rank=m_rank, m_new=m_new,
                vocab_bytes=vocab_bytes, vh_key=vh_key, vh_id=vh_id, blob=blob, boff=boff,
                max_token_bytes=int(max((len(k) for k in vocab_bytes), default=0)),
                added=AddedSplitter.from_config(config.get("added_tokens") or []), reason=reason)
        t.item_ids = item_ids
        t._norm = None
        t._last_full = None
        t.nfc_full_checks = 0
        if nfc:
            nfc_unsafe_table()  # built once per process at load, not on the first request (docs/design/gpu.md)
        return t

    # --------------------------------------------------------------------------------- host checks
    def accepts(self, text: str) -> bool:
        """Whether the GPU path is exact for ``text``. Only NFC files restrict it: NFC must be the
        identity. Fast path: no code point of :func:`nfc_unsafe_table`; otherwise the file's own HF
        normalizer decides (exact by definition, slower: ``docs/design/gpu.md``), so texts with
        code points Python 3.11 does not know (new or unassigned) still run on the GPU when NFC leaves
        them alone."""
        if not self.needs_nfc or text.isascii():
            return True
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        if not nfc_unsafe_table()[cps].any():
            return True
        last = self._last_full
        if last is not None and last[0] is text:  # the router asks, then the engine asks again
            return last[1]
        self.nfc_full_checks += 1
        ok = self._normalizer().normalize_str(text) == text
        self._last_full = (text, ok)
        return ok

    def _normalizer(self):
        if self._norm is None:
            import tokenizers

            self._norm = tokenizers.Tokenizer.from_file(str(self.path)).normalizer
        return self._norm

    def lookup_merge(self, a: int, b: int) -> tuple[int, int]:
        """``(rank, new_id)`` through the hash table (as the kernels probe it), ``(INF_RANK, -1)``."""
        a, b = int(a), int(b)
        mask = len(self.mk_a) - 1
        s = pair_slot(a, b, mask)
        while True:
            if self.mk_a[s] == a and self.mk_b[s] == b:
                return int(self.m_rank[s]), int(self.m_new[s])
            if self.mk_a[s] == -1:
                return INF_RANK, -1
            s = (s + 1) & mask


# ---------------------------------------------------------------------------------------- BPE oracle
def bpe_sequential(ids: list[int], merges: dict) -> list[int]:
    """HF ``Word::merge_all`` without dropout: repeatedly merge the adjacent pair with the smallest
    ``(merge rank, position)``. O(n^2); the slow, obviously-right twin."""
    ids = list(ids)
    while len(ids) > 1:
        best = None
        for p in range(len(ids) - 1):
            m = merges.get((ids[p], ids[p + 1]))
            if m is not None and (best is None or m[0] < best[0]):
                best = (m[0], p, m[1])
        if best is None:
            break
        _, p, new = best
        ids[p : p + 2] = [new]
    return ids


def bpe_rounds(ids: list[int], merges: dict) -> list[int]:
    """The GPU algorithm (one *round* at a time), equal to :func:`bpe_sequential`.

    Round: ``r`` = smallest rank among the current pairs; its occurrences are all the same pair
    ``(A, B)``; take them left to right, skipping one that overlaps the previous (only when ``A == B``:
    every other in a run). Merging occurrence ``o`` creates the pairs ``(left, AB)`` and ``(AB, right)``
    (``left`` already merged when it was the previous occurrence, ``right`` not yet). If none of those
    has rank ``< r`` the sequential algorithm would take exactly these occurrences next, in this order;
    so merge them all, but stop after the first occurrence that creates a pair of rank ``< r`` (the
    sequential algorithm merges that pair next). Each round merges at least one pair.

    Proof that a queue entry never revalidates (so "min over current pairs" is HF's heap order): the
    span a pair at position ``p`` covers only grows, and a merge's new token is the concatenation.
    """
    ids = list(ids)
    while len(ids) > 1:
        n = len(ids)
        info = [merges.get((ids[p], ids[p + 1])) for p in range(n - 1)]
        r = min((m[0] for m in info if m is not None), default=None)
        if r is None:
            break
        occ = [m is not None and m[0] == r for m in info]
        sel = [False] * (n - 1)
        for p in range(n - 1):
            sel[p] = occ[p] and not (p > 0 and sel[p - 1])
        new = next(m[1] for m in info if m is not None and m[0] == r)
        chosen = []
        for p in range(n - 1):
            if not sel[p]:
                continue
            chosen.append(p)
            left = new if (p >= 2 and sel[p - 2]) else (ids[p - 1] if p >= 1 else None)
            right = ids[p + 2] if p + 2 < n else None
            inv = (left is not None and merges.get((left, new), (INF_RANK,))[0] < r) or (
                right is not None and merges.get((new, right), (INF_RANK,))[0] < r)
            if inv:
                break
        out, p = [], 0
        cs = set(chosen)
        while p < n:
            if p in cs:
                out.append(new)
                p += 2
            else:
                out.append(ids[p])
                p += 1
        ids = out
    return ids


def pretokenize_numpy(tables: GpuTables, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the device computes before BPE, in NumPy: ``(cps, start, addid)`` over code points.

    ``start`` (``bool[n]``) marks pre-token and added-token starts; ``addid`` is the added token's id at
    its first code point, ``-2`` inside it, ``-1`` elsewhere. Added tokens cut the text into segments
    (HF pre-tokenizes each piece on its own), which the predicates receive as ``seg_start``.
    """
    data = text.encode("utf-8")
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    n = len(cps)
    seg = np.zeros(n, dtype=bool)
    addid = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return cps, seg, addid
    seg[0] = True
    spans = tables.added.spans(data)
    if spans:
        raw = np.frombuffer(data, dtype=np.uint8)
        cpidx = np.cumsum((raw & 0xC0) != 0x80) - 1
        for a, b, tid in spans:
            qs = int(cpidx[a])
            qe = int(cpidx[b]) if b < len(data) else n
            seg[qs] = True
            addid[qs] = tid
            addid[qs + 1 : qe] = -2
            if qe < n:
                seg[qe] = True
    start = predicates.starts(tables.family, cps, seg)
    start[addid == -2] = False
    start[addid >= 0] = True
    return cps, start, addid


def encode_numpy(tables: GpuTables, text: str) -> np.ndarray:
    """The GPU algorithm on the CPU: added tokens, :mod:`predicates`, ``ignore_merges``, :func:`bpe_rounds`.

    Returns ``int32[n]``; equals HF ``encode(text, add_special_tokens=False).ids`` when
    ``tables.accepts(text)``.
    """
    cps, start, addid = pretokenize_numpy(tables, text)
    st = np.flatnonzero(start)
    ends = np.append(st[1:], len(cps))
    out: list[int] = []
    for a, b in zip(st, ends):
        if addid[a] >= 0:
            out.append(int(addid[a]))
            continue
        piece = text[a:b].encode("utf-8")
        if tables.ignore_merges and piece in tables.vocab_bytes:
            out.append(tables.vocab_bytes[piece])
            continue
        out.extend(bpe_rounds([int(tables.byte_ids[x]) for x in piece], tables.merges))
    return np.asarray(out, dtype=np.int32)
