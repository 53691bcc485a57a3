"""Char classes the cut predicates use. Deliberately ASCII-only: for ASCII the regex classes ``\\p{L}``,
``\\p{N}``, ``\\s`` and the NFC boundary property are the same in every Unicode version, so a proof does
not depend on which Unicode tables Oniguruma, PCRE2 or Python ship. Non-ASCII chars never form a seam."""

ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
#: Printable, non-whitespace ASCII (0x21..0x7E): ``\\S`` in every regex flavour, never an NFC combiner.
GRAPH = frozenset(chr(i) for i in range(0x21, 0x7F))
