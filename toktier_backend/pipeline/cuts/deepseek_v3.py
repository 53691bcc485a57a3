"""Stable cuts for DeepSeek-V3: a ``Sequence`` of three ``Split`` pre-tokenizers (all ``Isolated``).

1. ``\\p{N}{1,3}`` — digit groups.   2. ``[一-龥぀-ゟ゠-ヿ]+`` — CJK/kana runs.
3. ``[!"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|
   ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+``

Each split acts on each piece of the previous one, and unmatched gaps stay pieces. So ``c`` is stable when
no match of any of the three regexes can hold both ``x = text[c-1]`` and ``y = text[c]`` and no look-ahead
is evaluated at ``c``; then every piece boundary of the whole text at ``c`` is one of the prefix too.

Rule A — ``x`` ASCII letter or digit, ``y == ' '``: split 1 never holds a space; split 2 holds only CJK;
in split 3 letters are followed only by letters/marks (``[\\p{L}\\p{M}]+``, ``[A-Za-z]+``), and a digit
reaching split 3 has already been isolated by split 1.

Rule B — ``x == '\\n'`` and ``y`` printable non-space ASCII: in split 3 the match holding ``x`` is the
``[\\r\\n]*`` tail of a punctuation/symbol match or ``\\s*[\\r\\n]+`` over the whole whitespace run, tried
before ``\\s+(?!\\S)`` (as in ``cl100k.py``); the optional prefix ``[^\\r\\n\\p{L}\\p{P}\\p{S}]?`` excludes
``\\n``; the first alternative starts with punctuation, not ``\\n``.
"""

from __future__ import annotations


from toktier_backend.pipeline.cuts import cl100k

NAME = "deepseek_v3"
SEAM = cl100k.SEAM
PATTERNS = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)


# The rules coincide with the cl100k family's (A: alnum then space; B: newline then printable ASCII);
# the proof above is what differs. One implementation serves both.
is_stable_cut = cl100k.is_stable_cut
