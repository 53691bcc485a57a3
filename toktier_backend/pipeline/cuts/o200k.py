"""Stable cuts for o200k_base (GPT-4o): case-class words with attached contractions.

Regex (openai/tiktoken ``o200k_base``)::

    [^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
    [^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
    \\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

Rule A — ``x`` ASCII letter or digit, ``y == ' '``: inside a match a letter is followed only by letters,
marks or a contraction tail (``'s``...), a digit only by digits; never by a space.

Rule B — ``x == '\\n'``, ``y`` printable non-space ASCII **other than** ``/``: as in ``cl100k.py``, except
that the punctuation alternative's tail is ``[\\r\\n/]*``, so ``".\\n" + "/"`` would be one pre-token.
"""

from __future__ import annotations

import re

from toktier_backend.pipeline.cuts._chars import ALNUM, GRAPH

NAME = "o200k"
SEAM = re.compile(r"(?<=[A-Za-z0-9])(?= )|(?<=\n)(?=[!-.0-~])")
PATTERN = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def is_stable_cut(text: str, c: int, end: int) -> bool:
    """Rule A or B at ``c``; reads ``text[c-1 : c+1]`` and needs ``c + 1 <= end``."""
    if not (1 <= c < end):
        return False
    x, y = text[c - 1], text[c]
    if y == " ":
        return x in ALNUM
    return x == "\n" and y in GRAPH and y != "/"
