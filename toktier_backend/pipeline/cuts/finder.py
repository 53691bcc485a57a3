"""Find the last provably stable cut in a window, for the family of a tokenizer file.

A *stable cut* ``c`` of ``text`` is a char index such that::

    encode(text) == encode(text[:c]) + encode(text[c:])     (body ids, no post-processor)

for **every** continuation of the text after ``end`` — the predicates read only ``text[: end]``. The
family is derived from the file's own normalizer and pre-tokenizer structure (the literal regexes each
predicate module proves itself against), never from a list of file hashes.
"""

from __future__ import annotations

import re
from types import ModuleType

from toktier_backend.spec import TokenizerSpec, walk_components
from toktier_backend.pipeline.cuts import cl100k, deepseek_v3, gpt2, o200k, segments
from toktier_backend.pipeline.cuts.added_tokens import AddedTokenSeams

#: Normalizer leaves under which an ASCII seam stays a seam (ASCII is NFC/NFD-stable).
_ASCII_STABLE_NORMALIZERS = {"NFC", "NFD"}


def _isolating(leaf: dict) -> bool:
    """A Split that keeps every match as its own pre-token (regexes here match every char)."""
    return leaf.get("behavior") == "Isolated" and not leaf.get("invert") or (
        leaf.get("behavior") == "Removed" and leaf.get("invert") is True
    )


def _regex(leaf: dict) -> str | None:
    pat = leaf.get("pattern") or {}
    return pat.get("Regex") if isinstance(pat, dict) else None


def detect_family(spec: TokenizerSpec) -> tuple[ModuleType | None, str]:
    """The cut-predicate module for ``spec`` and a one-line reason.

    Returns ``(None, reason)`` when no cut can be proven at all (then every request is a full encode).
    """
    if spec.token_nbytes is None:
        return None, "ids cannot be mapped to text offsets: " + "; ".join(spec.notes)
    if any(a.lstrip or a.rstrip or a.single_word for a in spec.added):
        return None, "added tokens with lstrip/rstrip/single_word: their whitespace rules are not proven"
    norm = [leaf.get("type") for leaf in walk_components(spec.config.get("normalizer"))]
    if norm and any(a.normalized for a in spec.added):
        return None, "added tokens matched on normalized text under a non-trivial normalizer"
    pre = walk_components(spec.config.get("pre_tokenizer"))
    types = [leaf.get("type") for leaf in pre]
    for leaf in pre:
        if leaf.get("type") == "ByteLevel" and leaf.get("add_prefix_space"):
            return None, "ByteLevel add_prefix_space=True inserts a space per segment"
        if leaf.get("type") == "Metaspace":
            return None, "Metaspace prepends to the first segment only"
    if any(t not in ("Split", "ByteLevel") for t in types):
        return segments, f"pre-tokenizer {types} has no cut proof inside segments: added-token seams only"
    regex_ok = all(t in _ASCII_STABLE_NORMALIZERS for t in norm)
    splits = [leaf for leaf in pre if leaf["type"] == "Split"]
    tail_ok = bool(types) and types[-1] == "ByteLevel" and types.count("ByteLevel") == 1
    if regex_ok and tail_ok and all(_isolating(s) for s in splits):
        pats = [_regex(s) for s in splits]
        if not splits and pre[-1].get("use_regex", True):
            return gpt2, "ByteLevel GPT-2 regex"
        if len(pats) == 1 and pats[0] in cl100k.PATTERNS.values() and pre[-1].get("use_regex") is False:
            return cl100k, "cl100k-style Split regex"
        if len(pats) == 1 and pats[0] == o200k.PATTERN and pre[-1].get("use_regex") is False:
            return o200k, "o200k Split regex"
        if tuple(pats) == deepseek_v3.PATTERNS and pre[-1].get("use_regex") is False:
            return deepseek_v3, "DeepSeek-V3 Split sequence"
    return segments, "no proven regex family: added-token seams only"


class CutFinder:
    """Last stable cut in a window, for one tokenizer file.

    Args:
        spec: the loaded file.
    """

    def __init__(self, spec: TokenizerSpec):
        self.family, self.reason = detect_family(spec)
        #: a family's rules are proven for this file (else no cut is ever taken)
        self.supported: bool = self.family is not None
        self.name = self.family.NAME if self.family is not None else "none"
        self.seams = AddedTokenSeams([a.content for a in spec.added])
        starts = "".join(re.escape(ch) for ch in self.seams.first_chars)
        self._start_re = re.compile(f"(?=[{starts}])") if starts else None
        # One zero-width pattern for every candidate seam (family rule or added-token start), so the
        # forward scan takes candidates one C-level search at a time.
        parts = [p.pattern for p in (self.family.SEAM if self.family else None, self._start_re) if p is not None]
        self._any_re = re.compile("|".join(f"(?:{p})" for p in parts)) if parts else None
        #: ``.*`` then any candidate, then one more char: matched from a slice's start, its end is the slice's
        #: last candidate position (:meth:`last_cut`).
        self._last_re = re.compile(f"(?s:.*)(?:{self._any_re.pattern})(?=(?s:.))") if parts else None
        #: chars of left context the predicates read before a cut.
        self.left_context = max(2, self.seams.max_len)

    def is_stable_cut(self, text: str, c: int, end: int) -> bool:
        """The predicate: family rule or added-token segment start at ``c``, and no added token crossing.

        Reads only ``text[c - left_context : end]``; ``0 < c < end <= len(text)``.
        """
        if not (0 < c < end):
            return False
        if self.seams.crosses(text, c):
            return False
        return self.family.is_stable_cut(text, c, end) or self.seams.starts_at(text, c, end)

    def last_cut(self, text: str, lo: int, hi: int, end: int) -> int | None:
        """The largest stable cut ``c`` with ``lo <= c <= hi`` (and ``c < end``), or ``None``.

        Searches backwards in slices of 32, 128, 512, ... chars, so the usual case (a cut within a few
        dozen chars) reads a few dozen chars. In each slice ``[bottom, top]`` one anchored match of
        ``.*`` followed by the candidate pattern (:attr:`_last_re`) finds the slice's *last* candidate in one
        call: the greedy ``.*`` runs to the slice's end and gives back one char at a time until a candidate
        position matches, and the trailing ``(?=.)`` keeps that position ``<= top`` (the candidate's own
        look-ahead needs ``text[c]``, which must lie before the end of the slice, as in the forward scan).
        The look-behinds read the text before ``bottom``, as they do in a forward ``finditer`` from
        ``bottom``. When that candidate is not a stable cut (an added token may cover it), the slice's
        remaining candidates are taken from the forward scan, largest first, so a text dense with rejected
        candidates costs no more than one forward scan per slice.
        """
        if not self.supported or self._last_re is None:
            return None
        hi = min(hi, end - 1)
        lo = max(lo, 1)
        span = 32
        top = hi
        match = self._last_re.match
        while top >= lo:
            bottom = max(lo, top - span + 1)
            m = match(text, bottom, top + 1)
            if m is not None:
                c = m.end()
                if self.is_stable_cut(text, c, end):
                    return c
                # the zero-width union yields each candidate position once, ascending
                for c in reversed([x.start() for x in self._any_re.finditer(text, bottom, c)]):
                    if self.is_stable_cut(text, c, end):
                        return c
            top = bottom - 1
            span *= 4
        return None

    def cuts(self, text: str, step: int) -> list[int]:
        """Stable cuts of a whole text, about ``step`` chars apart: the first stable cut at or after
        each previous cut plus ``step``. Used to split a long text into independently encodable chunks."""
        out: list[int] = []
        n = len(text)
        pos = step
        while self.supported and pos < n:
            c = self.first_cut(text, pos, min(n - 1, pos + step - 1), n)
            if c is None:
                pos += step
                continue
            out.append(c)
            pos = c + step
        return out

    def grid_cuts(self, text: str, step: int, lo_index: int = 1, hi_index: int | None = None) -> list[int]:
        """The first stable cut in each grid window ``[i*step, (i+1)*step)`` (none when the window has
        none), for ``lo_index <= i <= hi_index``, deduplicated, ascending.

        Cut ``i`` depends only on ``text[: (i+1)*step]``, so any two texts that share a prefix share its
        grid cuts: the prefix index keys on them, and can compute cut ``i`` without scanning from 0.
        """
        n = len(text)
        hi_index = (n - 1) // step if hi_index is None else hi_index
        out: list[int] = []
        for i in range(max(1, lo_index), hi_index + 1):
            c = self.grid_cut(text, i, step)
            if c is not None and (not out or c != out[-1]):
                out.append(c)
        return out

    def grid_cut(self, text: str, i: int, step: int) -> int | None:
        """First stable cut in ``[i*step, min((i+1)*step, len(text)) - 1]``, reading ``text[: (i+1)*step]``."""
        end = min(len(text), (i + 1) * step)
        return self.first_cut(text, i * step, end - 1, end)

    def first_cut(self, text: str, lo: int, hi: int, end: int) -> int | None:
        """The smallest stable cut in ``[lo, hi]`` (``c < end``)."""
        if not self.supported or self._any_re is None:
            return None
        hi = min(hi, end - 1)
        pos = max(lo, 1)
        search = self._any_re.search
        while pos <= hi:
            m = search(text, pos, hi + 1)
            if m is None:
                return None
            c = m.start()
            if self.is_stable_cut(text, c, end):
                return c
            pos = c + 1
        return None
