"""Admission of a fast engine for one tokenizer file: a startup canary, then a per-code-point guard set.

A fast engine (gigatoken, fastokens) is only ever used where it has been shown to agree with the frozen HF
reference:

1. **Canary** (:data:`CANARY`): contractions, digit runs, whitespace/CRLF runs, CJK, combining marks,
   emoji/ZWJ sequences, agent-style code, and *every* added token alone and between letters. One
   disagreement and the engine is refused for this file (every request then takes the reference).
2. **Guard set**: every Unicode scalar value (U+0000..U+10FFFF without surrogates) is encoded by both in
   several contexts (:data:`CONTEXTS`), by group testing over blocks of code points; code points of a
   disagreeing block are re-tested one by one. A text holding a guarded code point goes to the
   reference. The table is cached per (file sha256, engine, engine version, ``tokenizers`` version) under
   ``$TOKTIER_CACHE_DIR`` (default ``~/.cache/toktier_backend``), written atomically. Tables for the
   nine files of ``shared/tokenizers`` under the pinned engine versions ship in ``data/guard/`` (made by
   ``toktier guard-tables FILE...``; its run time: ``docs/design/engines.md``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from toktier_backend.config import cache_dir
from toktier_backend.engines.protocol import Engine
from toktier_backend.spec import TokenizerSpec

log = logging.getLogger(__name__)

CANARY: tuple[str, ...] = (
    "it's I'M we'll they'd you've She'S don't",
    "1 12 123 1234 12345 1234567890 3.14159 -0.5e10 0x7fff 2025-11-30",
    "a  b   c\n\n\n  d\r\n\r\n\t\te   \n  ",
    "x  \n\n\ty \u00a0\u3000z\u2028w\x0b\x0c\x1c\x85",
    "中文字符测试，日本語のテキスト。한국어 텍스트",
    "e\u0301 a\u0308 n\u0303 \u1100\u1161\u11a8 Åström café",
    "👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 ❤️ 🇺🇸",
    "def f(x):\n    return x->y + 2025  # it's\n\n\tif (a.b[0] != '/tmp'):\n        pass\r\n",
    "<div class=\"x\">Hello, World!</div>\n```python\nprint('hi')\n```",
    "\ufeffBOM \u200b zero\u200cwidth \ufffd replacement \U0001d400 math",
)

#: Contexts each code point is probed in; ``{}`` is the code point.
#: ``" \u0308{}b"`` puts a mark of combining class 230 *before* the code point, on a base it cannot compose
#: with: canonical reordering under NFC/NFD moves a lower-class mark (e.g. U+1715, class 9 since Unicode 14)
#: in front of it, so an engine and the reference with different Unicode tables disagree there (found by the
#: session fuzz on qwen2_5: ``"  \u0308\u1715word"``).
CONTEXTS: tuple[str, ...] = ("a{}b", " {}{}", "1{}\u0301", " \u0308{}b", "\n{}'s ")
#: Added for files whose normalizer reorders or composes (NFC/NFD/NFKC/NFKD): a mark of combining class 1
#: (U+0334) *after* the code point. With ``" \u0308{}b"`` (class 230 before) this makes any difference in a
#: code point's combining class between the engine's and the reference's Unicode tables visible: a class
#: in (0, 230) reorders against U+0308, a class above 1 against U+0334 (found by the session fuzz on
#: qwen2_5: ``"\u1acd\u0591"``, U+1ACD class 230 since Unicode 14, reordered by gigatoken only).
NORMALIZER_CONTEXTS: tuple[str, ...] = (" {}\u0334b",)


def contexts_for(spec: TokenizerSpec) -> tuple[str, ...]:
    """The probe contexts of ``spec``'s guard set (:data:`CONTEXTS`, plus :data:`NORMALIZER_CONTEXTS` when
    the normalizer holds a Unicode normalization form)."""
    return CONTEXTS + NORMALIZER_CONTEXTS if spec.unicode_normalizer else CONTEXTS


def guard_key(spec: TokenizerSpec, engine: Engine) -> str:
    """Cache file name of a guard table: file, engine build, reference version and the probe contexts."""
    ctx = hashlib.sha256("|".join(contexts_for(spec)).encode()).hexdigest()[:8]
    return f"{spec.sha256[:32]}-{engine.name}-{engine.version}-tokenizers{tokenizers.__version__}-ctx{ctx}.json"

_BLOCK = 1024
#: Texts at least this long (chars) are checked for guarded code points in numpy, not with the regex.
_SCAN_CHARS = 512
_SEP = "\n\n"


@dataclass
class Admission:
    """Outcome for one (file, engine) pair.

    Attributes:
        admitted: the engine may serve texts without guarded code points.
        guarded: sorted guarded code points.
        reason: why it was refused, when it was.
    """

    admitted: bool
    guarded: list[int]
    reason: str = ""

    def __post_init__(self):
        self._re = _char_class(self.guarded)
        self._sorted = np.asarray(sorted(self.guarded), dtype=np.uint32)
        # UTF-8 prefilter: the (first byte, second byte) pairs that start a guarded multi-byte code point
        self._pairs = np.zeros(1 << 16, dtype=bool)
        for cp in self.guarded:
            b = chr(cp).encode("utf-8", "surrogatepass")
            if len(b) > 1:
                self._pairs[b[0] << 8 | b[1]] = True
        self._lead_min = min((chr(cp).encode("utf-8", "surrogatepass")[0] for cp in self.guarded if cp >= 0x80),
                             default=0xFF)

    def has_guarded(self, text: str) -> bool:
        """Does ``text`` hold a guarded code point? O(len(text)); free for ASCII when none is guarded.

        Texts of :data:`_SCAN_CHARS` chars or more are checked as UTF-32 code points in numpy instead of
        with the regex (Python ``re`` over a large character class is far slower per char; numbers:
        ``docs/design/engines.md``).
        """
        if self._re is None:
            return False
        if text.isascii() and not self.ascii_guarded:
            return False
        if len(text) >= _SCAN_CHARS:
            # surrogatepass: callers validate first; a lone surrogate is never guarded either way
            return self.has_guarded_cps(np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32))
        return self._re.search(text) is not None

    def has_guarded_cps(self, cps: np.ndarray) -> bool:
        """:meth:`has_guarded` on code points: ``cps`` is ``uint32[n]`` (a text's UTF-32 code units)."""
        g = self._sorted
        if not len(g):
            return False
        hi = cps[cps >= g[0]]  # guarded code points start at U+088F here: agent text has few above
        if not len(hi):
            return False
        at = np.minimum(np.searchsorted(g, hi), len(g) - 1)
        return bool((g[at] == hi).any())

    def has_guarded_utf8(self, data: bytes) -> bool:
        """:meth:`has_guarded` on a text's UTF-8 bytes (``data`` must be valid UTF-8, e.g. from
        ``str.encode``). Decodes only the lead bytes of multi-byte sequences, in numpy."""
        if not len(self._sorted):
            return False
        u = np.frombuffer(data, dtype=np.uint8)
        if self.ascii_guarded and self.has_guarded_cps(u[u < 0x80].astype(np.uint32)):
            return True
        lead = _non_ascii_at(u)  # agent text has few non-ASCII chars (docs/design/engines.md)
        lead = lead[u[lead] >= self._lead_min]
        if not len(lead):
            return False
        # a lead byte is followed by its continuation bytes: lead + 1 is in range
        lead = lead[self._pairs[(u[lead].astype(np.uint16) << 8) | u[lead + 1]]]
        if not len(lead):
            return False
        last = len(u) - 1
        b0 = u[lead].astype(np.uint32)
        b1, b2, b3 = ((u[np.minimum(lead + k, last)] & 0x3F).astype(np.uint32) for k in (1, 2, 3))
        cps = np.where(b0 >= 0xF0, ((b0 & 0x07) << 18) | (b1 << 12) | (b2 << 6) | b3,
                       np.where(b0 >= 0xE0, ((b0 & 0x0F) << 12) | (b1 << 6) | b2, ((b0 & 0x1F) << 6) | b1))
        return self.has_guarded_cps(cps)

    @property
    def ascii_guarded(self) -> bool:
        """Is an ASCII code point guarded (then even an all-ASCII text must be checked)?"""
        return bool(self.guarded) and self.guarded[0] < 128


#: Every byte's top bit, eight bytes at a time.
_HIGH_BITS = np.uint64(0x8080808080808080)
_BYTE_AT = np.arange(8, dtype=np.intp)


def _non_ascii_at(u: np.ndarray) -> np.ndarray:
    """Positions of the bytes >= 0x80 in ``u`` (``np.ndarray[uint8] (n,)``), ascending, as
    ``np.ndarray[intp]``. Scans eight bytes per step (one ``uint64`` AND), then looks only inside the words
    that hold such a byte (against ``flatnonzero(u >= 0x80)``: ``docs/design/engines.md``)."""
    n8 = len(u) & ~7
    words = u[:n8].view(np.uint64)
    hot = np.flatnonzero((words & _HIGH_BITS) != 0)  # words holding a byte >= 0x80
    at = (hot[:, None] * 8 + _BYTE_AT).ravel()
    if n8 < len(u):
        at = np.concatenate([at, np.arange(n8, len(u), dtype=np.intp)])
    return at[u[at] >= 0x80]


def _char_class(cps: list[int]) -> re.Pattern | None:
    if not cps:
        return None
    ranges, start, prev = [], cps[0], cps[0]
    for cp in cps[1:] + [-1]:
        if cp == prev + 1:
            prev = cp
            continue
        ranges.append(re.escape(chr(start)) + ("-" + re.escape(chr(prev)) if prev > start else ""))
        start = prev = cp
    return re.compile("[" + "".join(ranges) + "]")


def canary_texts(spec: TokenizerSpec) -> list[str]:
    """The canary for this file: :data:`CANARY` plus every added token alone, between letters, and
    joined (joined in groups so files with thousands of added tokens stay fast)."""
    texts = list(CANARY)
    contents = [a.content for a in spec.added if a.content]
    for i in range(0, len(contents), 64):
        group = contents[i : i + 64]
        texts.append("x" + " a".join(group) + "y")
        texts.append("".join(group))
    texts += [f"a{t}b" for t in contents[:512]] + contents[:512]
    return texts


def run_canary(spec: TokenizerSpec, engine: Engine) -> str:
    """Compare ``engine`` with the reference on the canary; ``""`` when they agree, else a reason."""
    ref = spec.reference
    for text in canary_texts(spec):
        want = ref.encode(text, add_special_tokens=False).ids
        try:
            got = engine.encode(text).tolist()
        except Exception as e:  # an engine that raises is refused, not trusted
            return f"canary raised {type(e).__name__}: {e} on {text[:40]!r}"
        if got != want:
            return f"canary mismatch on {text[:60]!r}"
    return ""


def check_offsets(spec: TokenizerSpec) -> None:
    """Prove ``spec.token_nbytes`` on the canary: ids' byte lengths must sum to the normalized text's
    UTF-8 length. Disables offsets (``token_nbytes = None``) otherwise."""
    if spec.token_nbytes is None:
        return
    for text in canary_texts(spec):
        ids = spec.reference.encode(text, add_special_tokens=False).ids
        if int(spec.token_nbytes[ids].sum()) != spec.normalized_nbytes(text):
            spec.notes.append(f"token byte lengths disagree with the normalizer on {text[:40]!r}: no offsets")
            spec.token_nbytes = None
            return


def _probe(cps: list[int], contexts: tuple[str, ...] = CONTEXTS) -> str:
    return _SEP.join(ctx.format(chr(cp), chr(cp)) for cp in cps for ctx in contexts)


def _scalar_values() -> list[int]:
    return [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]


def compute_guard_set(spec: TokenizerSpec, engine: Engine, block: int = _BLOCK) -> list[int]:
    """Code points on which ``engine`` and the reference disagree in any context (exhaustive)."""
    ref = spec.reference
    contexts = contexts_for(spec)
    cps = _scalar_values()
    blocks = [cps[i : i + block] for i in range(0, len(cps), block)]
    guarded: list[int] = []
    batch = 32
    for i in range(0, len(blocks), batch):
        group = blocks[i : i + batch]
        texts = [_probe(b, contexts) for b in group]
        wants = ref.encode_batch(texts, add_special_tokens=False)
        for b, text, want in zip(group, texts, wants):
            if engine.encode(text).tolist() == want.ids:
                continue
            singles = [_probe([cp], contexts) for cp in b]
            for cp, t, w in zip(b, singles, ref.encode_batch(singles, add_special_tokens=False)):
                if engine.encode(t).tolist() != w.ids:
                    guarded.append(cp)
    return guarded


def admit(spec: TokenizerSpec, engine: Engine, *, cache: bool = True) -> Admission:
    """Canary then guard set (cached). Never raises for a bad engine: it is refused with a reason."""
    reason = run_canary(spec, engine)
    if reason:
        log.warning("engine %s refused for %s: %s", engine.name, spec.path, reason)
        return Admission(False, [], reason)
    key = guard_key(spec, engine)
    path = cache_dir() / "guard" / key
    bundled = Path(__file__).parents[1] / "data" / "guard" / key  # precomputed for the files we test
    if cache and bundled.is_file():
        path = bundled
    if cache and path.is_file():
        try:
            return Admission(True, json.loads(path.read_text())["guarded"])
        except (ValueError, KeyError):
            log.warning("ignoring unreadable guard cache %s", path)
    guarded = compute_guard_set(spec, engine)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"file": str(spec.path), "engine": engine.name, "guarded": guarded}, f)
        os.replace(f.name, path)
    return Admission(True, guarded)


def reference_only(reason: str) -> Admission:
    return Admission(False, [], reason)


__all__ = ["Admission", "admit", "canary_texts", "check_offsets", "compute_guard_set", "main", "reference_only",
           "run_canary"]


def main(argv: list[str] | None = None) -> None:
    """Precompute guard tables into ``data/guard/`` (or the user cache with ``--cache``)."""
    import argparse
    import time

    from toktier_backend.engines.registry import FAST_ENGINE_ORDER, create
    from toktier_backend.errors import EngineUnavailable
    from toktier_backend.spec import load_spec

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--engine", action="append", default=None,
                    help=f"engine to compute for (repeatable; default: each of {', '.join(FAST_ENGINE_ORDER)} that loads the file)")
    ap.add_argument("--cache", action="store_true", help="write to the user cache instead of data/guard")
    args = ap.parse_args(argv)
    out = cache_dir() / "guard" if args.cache else Path(__file__).parents[1] / "data" / "guard"
    out.mkdir(parents=True, exist_ok=True)
    for f, name in ((f, name) for f in args.files for name in args.engine or FAST_ENGINE_ORDER):
        spec = load_spec(f)
        try:
            engine = create(name, str(spec.path))
        except EngineUnavailable as e:
            print(f"{f}: {name}: skipped ({e})", flush=True)
            continue
        t0 = time.perf_counter()
        reason = run_canary(spec, engine)
        guarded = [] if reason else compute_guard_set(spec, engine)
        key = guard_key(spec, engine)
        if not reason:
            (out / key).write_text(json.dumps({"file": Path(f).parent.name, "engine": engine.name, "guarded": guarded}))
        print(f"{f}: {name}: {reason or f'{len(guarded)} guarded code points'} ({time.perf_counter() - t0:.0f} s)",
              flush=True)

