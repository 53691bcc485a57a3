"""Each cut predicate against the real reference, exhaustively on short strings.

For every string ``s`` over a hazard alphabet (up to a length bound) and every ``c`` where the family's
predicate says "stable" while reading only ``s[:c+1]``, the HF reference must satisfy
``encode(s) == encode(s[:c]) + encode(s[c:])``. Because the predicate never reads past ``c + 1``, the
enumerated ``s[c+1:]`` ranges over all continuations up to the bound.
"""

from __future__ import annotations

import itertools

import pytest

from ..conftest import NAMES, load, reference

# Alphabet units: regex classes (letters incl. contraction letters, digits, whitespace kinds, punctuation,
# '/', non-ASCII letter, combining mark, CJK) and added-token halves.
UNITS = ["a", "s", "'", "1", " ", "\n", "\r", "\t", ".", "/", "é", "\u0301", "中", "A"]
SPECIAL_UNITS = ["a", " ", "\n", "<|endo", "ftext|>", "<|im_", "start|>", "<|", "|>", "<start_of_", "turn>", "<bos>"]
EXPECTED_FAMILY = {
    "gpt2": "gpt2", "llama3": "cl100k", "llama3_1": "cl100k", "qwen2_5": "cl100k", "qwen3": "cl100k",
    "deepseek_v3": "deepseek_v3", "gemma3": "segments", "cl100k_base": "cl100k", "o200k_base": "o200k",
}


@pytest.mark.parametrize("name", NAMES)
def test_family_detected_from_structure(name):
    assert load(name).family == EXPECTED_FAMILY[name]


def _check_exhaustive(name: str, units: list[str], max_units: int) -> int:
    finder = load(name).cuts
    ref = reference(name)
    checks = []
    for k in range(2, max_units + 1):
        for tup in itertools.product(units, repeat=k):
            s = "".join(tup)
            for c in range(1, len(s)):
                if finder.is_stable_cut(s, c, c + 1):
                    checks.append((s, c))
    flat = [piece for s, c in checks for piece in (s, s[:c], s[c:])]
    enc = [e.ids for e in ref.encode_batch(flat, add_special_tokens=False)]
    bad = [checks[i // 3] for i in range(0, len(enc), 3) if enc[i] != enc[i + 1] + enc[i + 2]]
    assert bad == [], f"{name}: unstable cuts accepted: {bad[:5]}"
    return len(checks)


@pytest.mark.parametrize("name", NAMES)
def test_predicate_exhaustive_short_strings(name):
    n = _check_exhaustive(name, UNITS, 4)
    assert n > 300  # the predicate does accept cuts: a predicate that never fires would pass vacuously


@pytest.mark.parametrize("name", NAMES)
def test_predicate_exhaustive_added_token_halves(name):
    _check_exhaustive(name, SPECIAL_UNITS, 4)


@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen3", "deepseek_v3", "o200k_base"])
def test_traps_are_not_cuts(name):
    finder = load(name).cuts
    for text, c in [("pipeline", 4), ("x  y", 3), ("12345", 4), ("it's", 3), ("e\u0301", 1),
                    ("<|endoftext|>", 6), ("x \n\ny", 4) if name == "gpt2" else ("a.\n", 2)]:
        assert not finder.is_stable_cut(text, c, len(text)), (text, c)


def test_o200k_newline_slash_is_not_a_cut():
    # o200k's punctuation alternative ends in [\r\n/]*: ".\n/" is one pre-token.
    assert not load("o200k_base").cuts.is_stable_cut("a.\n/x", 3, 5)
    assert load("cl100k_base").cuts.is_stable_cut("a.\n/x", 3, 5)


def test_gemma_cuts_only_at_newline_segments():
    finder = load("gemma3").cuts
    text = "def f(x):\n    return x\n\nprint(f(1))"
    cuts = [c for c in range(1, len(text)) if finder.is_stable_cut(text, c, len(text))]
    assert cuts == [9, 22]  # starts of the "\n" and "\n\n" runs (added tokens), nothing inside words


def test_lookahead_never_past_end():
    # The predicate must not see the char at `end`: a cut just before the departure point is refused.
    finder = load("gpt2").cuts
    assert finder.is_stable_cut("ab cd", 2, 3)
    assert not finder.is_stable_cut("ab cd", 2, 2)


@pytest.mark.parametrize("name", NAMES)
def test_last_cut_is_the_largest_stable_cut_in_the_window(name):
    # last_cut searches backwards (slices, one anchored match per slice, then the forward scan): whatever the
    # window, it must return the largest c in [lo, min(hi, end - 1)] the predicate accepts, or None
    import random

    finder = load(name).cuts
    rnd = random.Random(7)
    units = UNITS + SPECIAL_UNITS + ["<", "<|im_end|>", "<|endoftext|>", "<end_of_turn>", "xxxxxxxx" * 8]
    for _ in range(400):
        s = "".join(rnd.choice(units) for _ in range(rnd.randint(1, 120)))
        end = rnd.randint(1, len(s))
        lo, hi = sorted(rnd.randint(0, len(s)) for _ in range(2))
        want = next((c for c in range(min(hi, end - 1), max(lo, 1) - 1, -1) if finder.is_stable_cut(s, c, end)), None)
        assert finder.last_cut(s, lo, hi, end) == want, (s, lo, hi, end)
