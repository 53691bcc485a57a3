"""Stable cuts for the GPT-2 / r50k pre-tokenizer (HF ``ByteLevel`` with ``use_regex=True``).

Regex (openai/gpt-2 ``encoder.py``; HF ``pre_tokenizers/byte_level.rs``)::

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

A cut ``c`` is stable when the pre-tokens of ``text`` are those of ``text[:c]`` followed by those of
``text[c:]``. The regex has no look-behind and no anchors, so matching from ``c`` depends only on
``text[c:]``; what must be shown is that the match holding ``x = text[c-1]`` ends at ``c`` both in the
whole text and in the prefix, i.e. that no path of any alternative can step from ``x`` to ``y = text[c]``
and that no look-ahead is evaluated at ``c``.

Rule A — ``x`` ASCII letter or digit, ``y == ' '``: a space can only *begin* a match (`` ?``) or sit in a
whitespace run; letters/digits never precede a space inside one match. ``x`` is not whitespace, so no
``\\s+(?!\\S)`` path ends at ``c``. (``"pipe"+"line"`` has ``y = 'l'``: no cut.)

Rule B — ``x == '\\n'``, ``w = text[c-2]`` and ``y`` printable non-space ASCII: the whitespace run is the
single ``\\n``. In the whole text ``\\s+(?!\\S)`` fails on it (``y`` is ``\\S``) and ``\\s+`` takes it; in
the prefix ``\\s+(?!\\S)`` takes it at end of text: the same span ``[c-1, c)``. A longer run is *not*
safe: ``"x \\n\\n" + "y"`` splits as ``" \\n"|"\\n"`` in the whole text but stays one pre-token alone; a
space after the newline is not safe either (`` ?\\p{L}+`` and ``\\s+(?!\\S)`` move the space).
"""

from __future__ import annotations

import re

from toktier_backend.pipeline.cuts._chars import ALNUM, GRAPH

NAME = "gpt2"
#: Candidate seams (superset of the rules; the predicate decides).
SEAM = re.compile(r"(?<=[A-Za-z0-9])(?= )|(?<=[!-~]\n)(?=[!-~])")


def is_stable_cut(text: str, c: int, end: int) -> bool:
    """Rule A or B at ``c``; reads ``text[c-2 : c+1]`` and needs ``c + 1 <= end``."""
    if not (2 <= c < end):
        return False
    x, y = text[c - 1], text[c]
    if y == " ":
        return x in ALNUM
    return x == "\n" and y in GRAPH and text[c - 2] in GRAPH
