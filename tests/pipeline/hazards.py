"""Seam hazards and random text for the differential tests (not a test module)."""

from __future__ import annotations

import random

#: Pairs whose naive concatenation of separately encoded halves is wrong for some family.
SEAM_TRAPS = [
    ("pipe", "line"), ("x  ", "y"), ("1234", "5"), ("a.", "\n"), ("it'", "s"), ("e", "\u0301"),
    ("<|endo", "ftext|>"), ("<|im_", "start|>"), ("a\n", "\n"), ("x \n\n", "y"), ("foo\n", "/bar"),
    ("12", "34"), ("123", "4"), ("\r", "\n"), ("a ", " b"), ("word", " next"), ("\n", "  x"),
    ("你好", "世界"), ("👨\u200d", "👩"), ("\t", " x"), ("DON", "'T"), ("x", "'ll"), ("<start_of_", "turn>"),
    ("\n\n", "\n"), ("a\n", "b"), ("a\n", " b"), ("(", "foo"), ("foo", "("), ("x/", "\n"), ("1", " 2"),
]

_PIECES = [
    "a", "Z", "s", "t", "'", "'s", "'ll", "1", "23", "456", " ", "  ", "\n", "\n\n", "\r\n", "\t", ".", "/",
    "->", "()", "é", "e\u0301", "\u0308", "\u0338", ">\u0338", "中", "日本", "ー", "한", "👍", "👨\u200d👩", "\u200d", "\u00a0",
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|endo", "ftext|>", "<|begin_of_text|>", "<bos>",
    "<start_of_turn>", "<｜User｜>", "\ufffd", "\U0001d400", "word", " word", "Word", "x=1", "\\n", "```",
]


def random_text(rng: random.Random, n: int) -> str:
    """``n`` pieces of hazard-rich text: ASCII, runs, CJK, combining marks, emoji, added-token halves and
    random scalar values from the whole code space."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.8:
            out.append(rng.choice(_PIECES))
        elif r < 0.9:
            out.append(chr(rng.randrange(0x20, 0x3000)))
        else:
            cp = rng.randrange(0x110000)
            out.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x")
    return "".join(out)
