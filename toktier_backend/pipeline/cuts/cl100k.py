"""Stable cuts for the cl100k family of Split regexes: cl100k_base, Llama 3 / 3.1 (digits ``\\p{N}{1,3}``)
and Qwen2 / 2.5 / 3 (single digits ``\\p{N}``, NFC normalizer).

Regex (openai/tiktoken ``cl100k_base``; meta-llama/llama3 ``tokenizer.py``)::

    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|
    \\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

Same obligation as ``gpt2.py``: the match holding ``x = text[c-1]`` must end at ``c`` in the whole
text and in ``text[:c]``.

Rule A — ``x`` ASCII letter or digit, ``y == ' '``: letters/digits are only followed inside a match by
letters (``\\p{L}+``), digits (``\\p{N}{1,3}``) or a contraction tail; a space never. No whitespace
alternative holds ``x``. Digit runs are never cut (``"1234"+"5"`` → ``123|45``: ``y`` is a digit).

Rule B — ``x == '\\n'`` and ``y`` printable non-space ASCII: the match holding ``x`` is either the
``[\\r\\n]*`` tail of a punctuation match (greedy, stops at ``y`` or at the end: ``"a."+"\\n"`` keeps
``".\\n"`` whole because the cut comes only *after* the newline) or ``\\s*[\\r\\n]+`` over the whole
whitespace run ending in ``x``, which is tried before ``\\s+(?!\\S)`` and succeeds in both texts with the
same span, so the look-ahead is never evaluated. The optional prefix of ``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+``
excludes ``\\n``, so ``y`` cannot be glued to ``x``.

NFC (Qwen): ``x`` and ``y`` are ASCII, which never compose with a neighbour, so
``NFC(text) == NFC(text[:c]) + NFC(text[c:])`` (UAX #15: ASCII chars are stable code points).
"""

from __future__ import annotations

import re

from toktier_backend.pipeline.cuts._chars import ALNUM, GRAPH

NAME = "cl100k"
SEAM = re.compile(r"(?<=[A-Za-z0-9])(?= )|(?<=\n)(?=[!-~])")

#: The exact regex strings this module's proof covers (family detection matches them literally).
PATTERNS = {
    "cl100k": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def is_stable_cut(text: str, c: int, end: int) -> bool:
    """Rule A or B at ``c``; reads ``text[c-1 : c+1]`` and needs ``c + 1 <= end``."""
    if not (1 <= c < end):
        return False
    x, y = text[c - 1], text[c]
    if y == " ":
        return x in ALNUM
    return x == "\n" and y in GRAPH
