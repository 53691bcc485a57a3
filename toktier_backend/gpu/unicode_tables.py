"""Per-code-point class tables for the parallel pre-token predicates, taken from HF's own regex engine.

HF ``tokenizers`` runs its Split/ByteLevel regexes on Oniguruma, whose Unicode tables need not match
Python's ``unicodedata`` (Python 3.11 ships Unicode 14). The tables here are therefore *probed* from the
installed ``tokenizers``: each class is a ``Split(Regex(cls), "removed")`` over every Unicode scalar value
(U+0000..U+10FFFF without surrogates), and the code points that disappear are the members. So a predicate
built on these tables agrees with the real regex split on every code point, not only on the ones two
Unicode versions agree on. Only single-code-point classes are probed; the predicates' proofs
(``predicates.py``) cover how runs of them combine.

Tables for the ``tokenizers`` versions in ``_class_data.PROBED`` ship with the package; for any other
version they are computed once (time: ``docs/design/gpu.md``) and cached as range lists under
``$TOKTIER_CACHE_DIR/gpu`` (default ``~/.cache/toktier_backend/gpu``), written atomically.

Bits of :func:`class_table` (``uint16[0x110000]``):

=========  ==========================================================================
``L``      ``\\p{L}``                ``N``   ``\\p{N}``          ``WS``  ``\\s``
``P``      ``\\p{P}``                ``S``   ``\\p{S}``          ``M``   ``\\p{M}``
``CJK``    DeepSeek-V3 split 2: ``[一-龥぀-ゟ゠-ヿ]``
``CRLF``   ``\\r`` or ``\\n``      ``SPACE``  U+0020         ``APOS``  ``'``
``AP``     ``[!"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~]``     ``AL``  ``[A-Za-z]``
=========  ==========================================================================

:func:`fold_table` (``uint8[0x110000]``): bit ``k`` set when ``(?i:c)`` for ``c = "strevmld"[k]`` matches
the code point under Oniguruma's case folding (e.g. U+017F LATIN SMALL LETTER LONG S matches ``s``).
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

L, N, WS, P, S, M, CJK, CRLF, SPACE, APOS, AP, AL = (1 << k for k in range(12))
FOLD_LETTERS = "strevmld"
NCP = 0x110000

_PROBES = {"L": r"\p{L}", "N": r"\p{N}", "WS": r"\s", "P": r"\p{P}", "S": r"\p{S}", "M": r"\p{M}"}
_BITS = {"L": L, "N": N, "WS": WS, "P": P, "S": S, "M": M}
_ASCII_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


def _scalar_values() -> np.ndarray:
    cps = np.arange(NCP, dtype=np.uint32)
    return cps[(cps < 0xD800) | (cps > 0xDFFF)]


def _probe(pattern: str, cps: np.ndarray) -> np.ndarray:
    """Code points (subset of ``cps``) that the Oniguruma regex ``pattern`` matches as a single char."""
    from tokenizers import Regex, pre_tokenizers

    text = cps.tobytes().decode("utf-32-le")
    split = pre_tokenizers.Split(Regex(pattern), behavior="removed")
    keep = np.zeros(len(cps), dtype=bool)
    for _, (a, b) in split.pre_tokenize_str(text):  # char offsets of the *non*-matching runs
        keep[a:b] = True
    return cps[~keep]


def _ranges(cps: np.ndarray) -> list[list[int]]:
    if len(cps) == 0:
        return []
    cps = np.sort(cps.astype(np.int64))
    brk = np.flatnonzero(np.diff(cps) != 1) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [len(cps)]]) - 1
    return [[int(cps[a]), int(cps[b])] for a, b in zip(starts, ends)]


def _from_ranges(ranges: list[list[int]]) -> np.ndarray:
    mask = np.zeros(NCP, dtype=bool)
    for a, b in ranges:
        mask[a : b + 1] = True
    return mask


def _cache_path() -> Path:
    import tokenizers

    from toktier_backend.config import cache_dir

    return cache_dir() / "gpu" / f"classes-tokenizers{tokenizers.__version__}.json"


def compute_probes() -> dict[str, list[list[int]]]:
    """Probe every class of :data:`_PROBES` and the case-folded contraction letters (range lists)."""
    cps = _scalar_values()
    out = {name: _ranges(_probe(pat, cps)) for name, pat in _PROBES.items()}
    cand = _probe("(?i:[" + FOLD_LETTERS + "])", cps)  # everything that folds to one of the letters
    for ch in FOLD_LETTERS:
        out["fold_" + ch] = _ranges(_probe(f"(?i:{ch})", cand))
    return out


@lru_cache(maxsize=1)
def _probed() -> dict[str, list[list[int]]]:
    import tokenizers

    from toktier_backend.gpu._class_data import PROBED

    if tokenizers.__version__ in PROBED:  # shipped, probed from this very version
        return PROBED[tokenizers.__version__]
    path = _cache_path()
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass
    data = compute_probes()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f)
        os.replace(f.name, path)
    except OSError:  # read-only home: keep the in-process copy
        pass
    return data


@lru_cache(maxsize=1)
def class_table() -> np.ndarray:
    """``uint16[0x110000]`` class bits per code point (see module docstring). Read-only."""
    data = _probed()
    t = np.zeros(NCP, dtype=np.uint16)
    for name, bit in _BITS.items():
        t[_from_ranges(data[name])] |= bit
    for a, b in ((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)):
        t[a : b + 1] |= CJK
    t[[0x0A, 0x0D]] |= CRLF
    t[0x20] |= SPACE
    t[ord("'")] |= APOS
    t[[ord(c) for c in _ASCII_PUNCT]] |= AP
    t[ord("A") : ord("Z") + 1] |= AL
    t[ord("a") : ord("z") + 1] |= AL
    t.flags.writeable = False
    return t


@lru_cache(maxsize=1)
def fold_table() -> np.ndarray:
    """``uint8[0x110000]``: bit ``k`` when the code point matches ``(?i:"strevmld"[k])``. Read-only."""
    data = _probed()
    t = np.zeros(NCP, dtype=np.uint8)
    for k, ch in enumerate(FOLD_LETTERS):
        t[_from_ranges(data["fold_" + ch])] |= 1 << k
    t.flags.writeable = False
    return t


def fold_bit(ch: str) -> int:
    return 1 << FOLD_LETTERS.index(ch)
