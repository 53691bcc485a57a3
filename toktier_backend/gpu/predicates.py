"""Pre-token boundaries without a sequential regex: per-position predicates in plain NumPy.

Each family's pre-tokenizer regex is replaced by a predicate ``start[p]`` ("a pre-token starts at code
point ``p``") that reads a bounded window around ``p`` plus a few *run scans* (start/end of the whitespace
run holding ``p``, last ``\\r``/``\\n`` of that run, start of the digit run, ...). Every scan is a prefix
max or suffix min over marker positions, so the whole predicate is data-parallel; ``kernels.py`` evaluates
the same rules per position on the GPU and must equal this module exactly.

Inputs are code points (``int32[n]``) plus ``seg_start`` (``bool[n]``): where a *segment* starts. Segments
are the pieces between added tokens (HF pre-tokenizes each piece on its own, so a segment end behaves
like the end of the text: ``\\s+(?!\\S)`` succeeds there). ``seg_start[0]`` must be True.

Source of truth: ``tokenizers.Tokenizer.from_file(p).pre_tokenizer.pre_tokenize_str(text)`` — the
spans of its pre-tokens are exactly the runs between consecutive ``start`` positions (``tests/gpu``
checks this exhaustively on short strings and on the agent corpus). Class membership (``\\p{L}``, ``\\s``,
...) comes from HF's own regex engine (``unicode_tables.py``), so no Unicode-version gap.

Notation for the proofs: ``W`` whitespace (``\\s``), ``R`` ``[\\r\\n]``, ``Wn = W - R``, ``Sp`` U+0020,
``L``/``N`` letters/numbers, ``O = not (W or L or N)``. A whitespace run is ``[i, j)``; ``at_end`` means
``j`` is the segment end. All three regexes match every char (no gaps) except DeepSeek's split 3.
"""

from __future__ import annotations

import numpy as np

from toktier_backend.gpu import unicode_tables as ut

FAMILIES = ("gpt2", "cl100k", "qwen2", "deepseek_v3")


# ---------------------------------------------------------------------------------------------- scans
def _prev(a: np.ndarray, same: np.ndarray) -> np.ndarray:
    """``a[p-1]`` where ``p-1`` is in ``p``'s segment, else False."""
    r = np.zeros_like(a)
    r[1:] = a[:-1]
    return r & same


def _next(a: np.ndarray, brk: np.ndarray) -> np.ndarray:
    """``a[p+1]`` where ``p+1`` is in ``p``'s segment (``brk[p+1]`` False), else False."""
    r = np.zeros_like(a)
    r[:-1] = a[1:] & ~brk[1:]
    return r


def run_start(mask: np.ndarray, brk: np.ndarray) -> np.ndarray:
    """Index of the first position of the ``mask`` run holding ``p`` (runs break at ``brk``); a prefix
    max over run-start markers. Meaningful where ``mask``."""
    n = len(mask)
    idx = np.arange(n, dtype=np.int64)
    marker = mask & (brk | ~_prev(mask, ~brk))
    return np.maximum.accumulate(np.where(marker, idx, -1))


def run_end(mask: np.ndarray, brk: np.ndarray) -> np.ndarray:
    """One past the last position of the ``mask`` run holding ``p``; a suffix min. Meaningful where
    ``mask``."""
    n = len(mask)
    idx = np.arange(n, dtype=np.int64)
    marker = mask & ~_next(mask, brk)
    return np.minimum.accumulate(np.where(marker, idx + 1, n)[::-1])[::-1]


def next_at_or_after(mask: np.ndarray) -> np.ndarray:
    """Smallest ``q >= p`` with ``mask[q]`` (``n`` if none): suffix min."""
    n = len(mask)
    return np.minimum.accumulate(np.where(mask, np.arange(n), n)[::-1])[::-1]


def last_at_or_before(mask: np.ndarray) -> np.ndarray:
    """Largest ``q <= p`` with ``mask[q]`` (``-1`` if none): prefix max."""
    return np.maximum.accumulate(np.where(mask, np.arange(len(mask)), -1))


def _is_end(j: np.ndarray, brk: np.ndarray) -> np.ndarray:
    n = len(brk)
    return (j >= n) | brk[np.minimum(j, n - 1)] & (j < n)


def _ws_runs(W, R, brk, eat_crlf_after):
    """Whitespace-run facts for the cl100k-style tails ``\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+``.

    Returns ``(i, j, e, k, at_end)``: run ``[i, j)``; ``e`` first match start inside the run (after the
    ``[\\r\\n]*`` tail of a preceding punctuation match, when ``eat_crlf_after[i-1]``); ``k`` last ``R`` of
    the run (``< e`` when none counts).
    """
    n = len(W)
    i = run_start(W, brk)
    j = run_end(W, brk)
    at_end = _is_end(j, brk)
    ii = np.maximum(i, 0)
    eaten = (ii > 0) & ~brk[ii] & eat_crlf_after[np.maximum(ii - 1, 0)]
    e = np.where(eaten, np.minimum(next_at_or_after(W & ~R)[ii], j), ii)
    k = last_at_or_before(R)[np.clip(j - 1, 0, n - 1)]
    return i, j, e, k, at_end


def _classes(cps: np.ndarray):
    cls = ut.class_table()[cps]
    return cls, (lambda bit: (cls & bit) != 0)


# ----------------------------------------------------------------------------------------------- gpt2
def starts_gpt2(cps: np.ndarray, seg_start: np.ndarray) -> np.ndarray:
    """HF ``ByteLevel(use_regex=True)``: ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|
    \\s+(?!\\S)|\\s+``.

    Proof sketch. Non-whitespace chars only ever sit in one-class runs (``L+``, ``N+``, ``O+``) or in a
    contraction, and no match holds non-whitespace followed by whitespace; so between two non-W chars a
    pre-token starts exactly at a class change, except inside/after a contraction. A contraction needs
    its apostrophe to be a match start: after ``L``/``N`` (their runs end at ``O``), after a non-space
    ``W``, or at the segment start — never inside an ``O`` run (greedy) nor after a space (`` ?O+`` takes
    the space and the apostrophe). It then ends after 2 or 3 chars, which starts a new pre-token even
    inside a letter run (``"'sa"`` -> ``'s|a``). A whitespace run ``[i, j)`` starts a match (nothing
    non-W swallows whitespace); ``\\s+(?!\\S)`` takes ``[i, j-1)`` when ``j`` is not the segment end and
    the run has 2+ chars, and the last char either is a space that the following ``L``/``N``/``O`` run
    takes (`` ?X+``) or a single ``\\s+``. At the segment end ``\\s+(?!\\S)`` takes the whole run.
    """
    cls, has = _classes(cps)
    n = len(cps)
    idx = np.arange(n)
    brk = seg_start.copy()
    brk[0] = True
    same = ~brk
    W, Lm, Nm = has(ut.WS), has(ut.L), has(ut.N)
    Sp = has(ut.SPACE)
    kind = np.where(W, 0, np.where(Lm, 1, np.where(Nm, 2, 3)))  # W, L, N, O
    pW = _prev(W, same)
    j = run_end(W, brk)
    at_end = _is_end(j, brk)

    start = brk.copy()
    ww = W & pW
    start |= ww & (idx == j - 1) & ~at_end
    start |= W & ~pW & same                       # non-W -> W
    start |= ~W & pW & ~_prev(Sp, same)           # W -> non-W: a space glues
    nn = ~W & same & ~pW
    kprev = np.empty_like(kind)
    kprev[0] = -1
    kprev[1:] = kind[:-1]
    start |= nn & (kind != kprev)
    # contractions (case-sensitive)
    apos_start = has(ut.APOS) & start
    c1 = np.zeros(n, dtype=np.int32)
    c1[:-1] = cps[1:]
    c2 = np.zeros(n, dtype=np.int32)
    c2[:-2] = cps[2:]
    ok1 = _next(np.ones(n, bool), brk)
    ok2 = ok1 & _next(ok1, brk)
    two = ok1 & np.isin(c1, [ord(c) for c in "stmd"])
    three = ok2 & (((c1 == ord("r")) | (c1 == ord("v"))) & (c2 == ord("e")) | (c1 == ord("l")) & (c2 == ord("l")))
    _apply_contractions(start, apos_start & two, apos_start & three & ~two, brk)
    return start


def _apply_contractions(start, two, three, brk):
    n = len(start)
    for a, ln in ((np.flatnonzero(two), 2), (np.flatnonzero(three), 3)):
        for off in range(1, ln):
            start[a + off] = False
        end = a + ln
        end = end[end < n]
        start[end] = True


# --------------------------------------------------------------------------------------------- cl100k
def starts_cl100k(cps: np.ndarray, seg_start: np.ndarray, digits: int = 3) -> np.ndarray:
    """cl100k / Llama 3 (``digits=3``: ``\\p{N}{1,3}``) and Qwen2 (``digits=1``: ``\\p{N}``)::

        (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|
        \\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

    Proof sketch (alternatives 1..7). ``O`` chars sit in alt 4 runs (greedy, then the ``[\\r\\n]*`` tail
    eats the leading ``R`` chars of the next whitespace run), or are the one-char prefix of alt 2, or a
    contraction's apostrophe; so an ``O`` right after an ``O`` never starts a pre-token, and an ``L`` after
    an ``O`` starts one iff that ``O`` did *not* (a match-starting ``O`` followed by ``L`` is a one-char
    ``O`` run: alt 1 or 2 keep it with the letters; ``".."+"b"`` -> ``..|b``). Digits start a pre-token at
    each run start and every ``digits`` chars (greedy ``\\p{N}{1,3}``); nothing glues to a digit. Inside a
    whitespace run ``[i, j)`` the first match starts at ``e`` (``i``, or after the ``R`` chars eaten by a
    preceding ``O`` match); from ``e``, alt 5 takes up to the last ``R`` ``k`` (backtracking ``\\s*``), then
    alt 6 takes ``[.., j-1)`` unless ``j`` is the segment end, and the last char — always a match start
    when it is not ``R`` — is glued to a following letter run by alt 2 (any ``Wn``) or to an ``O`` run by
    alt 4 (a space only); otherwise it is alone (alt 7). Contractions are case-insensitive under
    Oniguruma's folding (``fold_table``) and follow the gpt2 rule for when the apostrophe starts a match.
    """
    cls, has = _classes(cps)
    fold = ut.fold_table()[cps]
    n = len(cps)
    idx = np.arange(n)
    brk = seg_start.copy()
    brk[0] = True
    same = ~brk
    W, R, Lm, Nm = has(ut.WS), has(ut.CRLF), has(ut.L), has(ut.N)
    Wn, Sp = W & ~R, has(ut.SPACE)
    O = ~(W | Lm | Nm)
    pW, pO, pL, pN = _prev(W, same), _prev(O, same), _prev(Lm, same), _prev(Nm, same)
    i, j, e, k, at_end = _ws_runs(W, R, brk, O)

    start = brk.copy()
    ww = W & pW
    start |= ww & ((idx == e) | (k >= e) & (idx == k + 1) | (idx == j - 1) & ~at_end & ~R)
    start |= W & same & ~pW & ~(pO & R)
    glue = _prev(Wn, same) & Lm | _prev(Sp, same) & O
    start |= ~W & pW & ~glue
    # non-W after non-W (O -> L handled below; it reads start[p-1])
    start |= Lm & pN
    start |= Nm & (pL | pO)
    start |= O & (pL | pN)
    if digits == 1:
        start |= Nm & pN
    else:
        nst = run_start(Nm, brk)
        start |= Nm & pN & ((idx - nst) % digits == 0)
    ol = Lm & pO
    prev_start = np.zeros(n, dtype=bool)
    prev_start[1:] = start[:-1]
    start |= ol & ~prev_start
    # contractions (case-insensitive)
    apos_start = has(ut.APOS) & start
    f1 = np.zeros(n, dtype=np.uint8)
    f1[:-1] = fold[1:]
    f2 = np.zeros(n, dtype=np.uint8)
    f2[:-2] = fold[2:]
    b = ut.fold_bit
    ok1 = _next(np.ones(n, bool), brk)
    ok2 = ok1 & _next(ok1, brk)
    two = ok1 & ((f1 & (b("s") | b("t") | b("m") | b("d"))) != 0)
    three = ok2 & ((((f1 & (b("r") | b("v"))) != 0) & ((f2 & b("e")) != 0)) | (((f1 & b("l")) != 0) & ((f2 & b("l")) != 0)))
    _apply_contractions(start, apos_start & two, apos_start & three & ~two, brk)
    return start


# ---------------------------------------------------------------------------------------- deepseek_v3
def pieces_deepseek_v3(cps: np.ndarray, seg_start: np.ndarray) -> np.ndarray:
    """Piece starts after DeepSeek-V3's splits 1 (``\\p{N}{1,3}``) and 2 (``[一-龥぀-ゟ゠-ヿ]+``), both
    ``Isolated``: runs of digits cut every 3 chars from the run start, runs of the CJK ranges, and the
    runs of everything else (no digit is in the CJK ranges)."""
    cls, has = _classes(cps)
    n = len(cps)
    brk = seg_start.copy()
    brk[0] = True
    Nm, C = has(ut.N), has(ut.CJK)
    grp = np.where(Nm, 1, np.where(C, 2, 0))
    gprev = np.empty_like(grp)
    gprev[0] = -1
    gprev[1:] = grp[:-1]
    nst = run_start(Nm, brk)
    return brk | (grp != gprev) | Nm & ((np.arange(n) - nst) % 3 == 0)


def starts_deepseek_v3(cps: np.ndarray, seg_start: np.ndarray) -> np.ndarray:
    """DeepSeek-V3: splits 1 and 2 (:func:`pieces_deepseek_v3`), then split 3 on each piece::

        [!"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|
         ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

    Classes: ``LM`` (L or M), ``PS`` (P or S), ``W``, and ``X`` = the rest (C*, and digits, which only
    occur in digit pieces). Proof sketch: as in :func:`starts_cl100k` with ``LM`` for ``L``, ``PS`` for
    ``O`` and the piece end as the segment end, plus: alt 1 glues a match-starting ASCII punctuation char
    to the ASCII letters that follow (so a letter run entered that way is cut where its ASCII prefix
    ends, ``".aé"`` -> ``.a|é``); the alt 2 prefix takes any ``Wn`` or ``X`` (never ``P``/``S``); an ``X``
    not followed by ``LM`` matches nothing, so runs of those are gap pieces (``Isolated`` keeps gaps), and
    an ``X`` followed by ``LM`` always starts a match (nothing else can hold an ``X``).
    """
    cls, has = _classes(cps)
    n = len(cps)
    idx = np.arange(n)
    brk = pieces_deepseek_v3(cps, seg_start)
    same = ~brk
    W, R = has(ut.WS), has(ut.CRLF)
    LM, PS = has(ut.L) | has(ut.M), has(ut.P) | has(ut.S)
    Wn, Sp, AP, AL = W & ~R, has(ut.SPACE), has(ut.AP), has(ut.AL)
    X = ~(LM | PS | W)
    pW, pPS, pLM, pX = _prev(W, same), _prev(PS, same), _prev(LM, same), _prev(X, same)
    i, j, e, k, at_end = _ws_runs(W, R, brk, PS)

    start = brk.copy()
    ww = W & pW
    start |= ww & ((idx == e) | (k >= e) & (idx == k + 1) | (idx == j - 1) & ~at_end & ~R)
    start |= W & same & ~pW & ~(pPS & R)
    glue = _prev(Wn, same) & LM | _prev(Sp, same) & PS
    start |= ~W & pW & ~glue
    start |= (PS | X) & pLM
    start |= PS & pX
    start |= X & pPS
    start |= X & pX & _next(LM, brk)
    # PS -> LM: glued by alt 1 iff the PS char starts a match, is ASCII punctuation and LM is [A-Za-z]
    prev_start = np.zeros(n, dtype=bool)
    prev_start[1:] = start[:-1]
    glue1 = _prev(AP, same) & prev_start & AL
    start |= LM & pPS & ~glue1
    # LM -> LM: the ASCII-letter tail of an alt 1 match ends inside the letter run
    lm0 = run_start(LM, brk)
    al0 = run_start(AL, brk)
    q = np.maximum(lm0, 0)
    start |= LM & pLM & _prev(AL, same) & ~AL & (np.roll(al0, 1) == np.roll(lm0, 1)) & glue1[q]
    return start


# ------------------------------------------------------------------------------------------ dispatch
def starts(family: str, cps: np.ndarray, seg_start: np.ndarray | None = None) -> np.ndarray:
    """``bool[n]``: pre-token starts of ``cps`` (``int32[n]`` code points) for ``family``."""
    cps = np.asarray(cps, dtype=np.int64)
    n = len(cps)
    if n == 0:
        return np.zeros(0, dtype=bool)
    if seg_start is None:
        seg_start = np.zeros(n, dtype=bool)
    seg_start = np.asarray(seg_start, dtype=bool).copy()
    seg_start[0] = True
    if family == "gpt2":
        return starts_gpt2(cps, seg_start)
    if family == "cl100k":
        return starts_cl100k(cps, seg_start, 3)
    if family == "qwen2":
        return starts_cl100k(cps, seg_start, 1)
    if family == "deepseek_v3":
        return starts_deepseek_v3(cps, seg_start)
    raise ValueError(f"no parallel predicate for family {family!r}; known: {FAMILIES}")


def spans(family: str, text: str) -> list[tuple[int, int]]:
    """Pre-token char spans of ``text`` (one segment): the HF ``pre_tokenize_str`` offsets."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    st = np.flatnonzero(starts(family, cps))
    ends = np.append(st[1:], len(cps))
    return [(int(a), int(b)) for a, b in zip(st, ends)]
