"""NumPy pre-token predicates (``toktier_backend.gpu.predicates``) against the real HF pre-tokenizer.

Source of truth: ``Tokenizer.from_file(p).pre_tokenizer.pre_tokenize_str(text)`` (char offsets). Checked
exhaustively on all strings of up to 4 units over each family's hazard alphabet, on every agent session
of ``shared/corpus/swe-agent``, and on random mixed-script strings; literal spans below were printed by
``tokenizers`` 0.23.3 from the shared files.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from toktier_backend.gpu import predicates as P

from ..conftest import reference

FAMILY = {"gpt2": "gpt2", "llama3_1": "cl100k", "cl100k_base": "cl100k", "qwen3": "qwen2", "deepseek_v3": "deepseek_v3"}

#: Hazard alphabets: class kinds, contraction letters (incl. U+017F, which folds to 's' under
#: Oniguruma's (?i)), whitespace kinds incl. non-ASCII, glue prefixes, CJK-range P, marks, format chars.
UNITS = {
    "gpt2": ["a", "s", "l", "e", "1", ".", "'", " ", "\n", "\t", "é", "\u00a0"],
    "cl100k_base": ["a", "s", "L", "e", "1", ".", "'", " ", "\n", "\r", "\t", "é", "\u00a0", "ſ"],
    "llama3_1": ["a", "T", "1", ".", "'", " ", "\n", "\r", "\u3000", "中"],
    "qwen3": ["a", "s", "1", ".", "'", " ", "\n", "\t", "é"],
    "deepseek_v3": ["a", "é", "\u0301", "1", ".", "»", "$", "'", " ", "\t", "\n", "中", "・", "\u200d"],
}

LITERAL = [  # (file, text, HF pre-token spans)
    ("gpt2", "It's  1234 x\n\n y", [(0, 2), (2, 4), (4, 5), (5, 10), (10, 12), (12, 14), (14, 16)]),
    ("llama3_1", "héllo  wörld's\n\n 123456 ..x",
     [(0, 5), (5, 6), (6, 12), (12, 14), (14, 16), (16, 17), (17, 20), (20, 23), (23, 26), (26, 27)]),
    ("qwen3", "a 1234 'LL\t.b", [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 8), (8, 10), (10, 11), (11, 13)]),
    ("deepseek_v3", ".aé 1234中文 \u200dab", [(0, 2), (2, 3), (3, 4), (4, 7), (7, 8), (8, 10), (10, 11), (11, 14)]),
]


def mismatches(name: str, strings: list[str]) -> list[tuple]:
    """Strings whose predicate spans differ from HF's; all strings evaluated in one call, each its own
    segment (``seg_start`` at each string start)."""
    pt = reference(name).pre_tokenizer
    strings = [s for s in strings if s]
    cps_list = [np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32) for s in strings]
    lens = np.array([len(c) for c in cps_list])
    offs = np.concatenate([[0], np.cumsum(lens)])
    seg = np.zeros(offs[-1], dtype=bool)
    seg[offs[:-1]] = True
    st = P.starts(FAMILY[name], np.concatenate(cps_list), seg)
    bad = []
    for s, a, b in zip(strings, offs[:-1], offs[1:]):
        idx = np.flatnonzero(st[a:b])
        ours = [(int(x), int(y)) for x, y in zip(idx, np.append(idx[1:], b - a))]
        want = [o for _, o in pt.pre_tokenize_str(s)]
        if ours != want:
            bad.append((s, ours, want))
    return bad


@pytest.mark.parametrize("name,text,spans", LITERAL)
def test_literal_spans(name, text, spans):
    assert P.spans(FAMILY[name], text) == spans
    assert [o for _, o in reference(name).pre_tokenizer.pre_tokenize_str(text)] == spans


@pytest.mark.parametrize("name", sorted(UNITS))
def test_exhaustive_short_strings(name):
    units = UNITS[name]
    strings = ["".join(t) for k in range(1, 5) for t in itertools.product(units, repeat=k)]
    assert len(strings) > 5000
    assert mismatches(name, strings) == []


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_agent_corpus(name, corpus_texts):
    assert sum(map(len, corpus_texts)) > 500_000
    assert mismatches(name, corpus_texts) == []


@pytest.mark.parametrize("name", ["gpt2", "llama3_1", "qwen3", "deepseek_v3"])
def test_random_mixed_scripts(name):
    rng = random.Random(0)
    pool = ([chr(c) for c in range(0x20, 0x7F)] * 20 + [chr(c) for c in range(0x80, 0x3100, 3)]
            + [chr(c) for c in range(0x4E00, 0x4E40)] + list("\t\n\r\x0b\x0c\x85\u00a0\u1680\u2028\u3000\u200d\ufeff\u017f\u212a")
            * 40 + ["\U0001f600", "\U0001f3fb", "\ue000", "\U0010ffff", "\U000e0001"] * 20)
    strings = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(5000)]
    assert mismatches(name, strings) == []


SWEEP = ["gpt2", "llama3_1", "qwen3", "deepseek_v3"]
#: Where the literal (not probed) class bits live, swept for every file: all of ASCII (CRLF, SPACE, APOS,
#: AP, AL) and each end of DeepSeek-V3's CJK ranges with its neighbours.
LITERAL_EDGES = np.array(sorted(set(range(0x80)) | {e + d for e in (0x4E00, 0x9FA5, 0x3040, 0x309F, 0x30A0, 0x30FF)
                                                    for d in (-1, 0, 1)}), dtype=np.uint32)


@pytest.mark.parametrize("name", SWEEP)
def test_every_code_point_in_context(name):
    """Every scalar value in 7 contexts, in every run: each of the four files takes every 4th of the
    1,112,064 from its own offset (so together they check each one once) plus :data:`LITERAL_EDGES`. A
    code point enters the predicates only through its class bits: the probed ones are checked for every
    code point by the next test, and the per-family rules over the bits exhaustively on the hazard
    alphabets above."""
    from toktier_backend.gpu.unicode_tables import _scalar_values

    pt = reference(name).pre_tokenizer
    cps = np.union1d(_scalar_values()[SWEEP.index(name)::len(SWEEP)], LITERAL_EDGES).astype(np.uint32)
    for ctx in ["a{}b", " {}{}", "1{}\u0301", "\n{}'s ", ".{} x", "{}\t{}a", "中{}"]:
        for part in np.array_split(cps, 8):
            s = "".join(ctx.format(c, c) for c in part.tobytes().decode("utf-32-le"))
            assert P.spans(FAMILY[name], s) == [o for _, o in pt.pre_tokenize_str(s)], ctx


def test_shipped_class_tables_match_installed_tokenizers():
    """The shipped tables (``_class_data``) against a fresh probe of every class and case-folded letter,
    over every scalar value, with this ``tokenizers``."""
    from toktier_backend.gpu import unicode_tables as ut

    fresh, shipped = ut.compute_probes(), ut._probed()
    assert sorted(fresh) == sorted(shipped) and len(fresh) > len(ut._PROBES)
    for name in fresh:
        assert fresh[name] == shipped[name], name
