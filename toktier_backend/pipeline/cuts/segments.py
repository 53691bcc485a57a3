"""Cuts only at added-token segment starts: Gemma 3 (no regex pre-tokenizer; BPE runs over the whole
segment between added tokens, so no cut *inside* a segment can be proven without the merge table) and any
byte-level file whose pre-tokenizer regex we have no proof for.

Gemma 3 declares newline runs (``"\\n"`` ... 31 newlines) and tab runs as added tokens, so every newline
run starts a segment: source code and chat text have one every line. The rule itself (an added token
occurs at ``c``, none crosses ``c``) lives in ``added_tokens.py``; this family adds no rule of its own.
"""

from __future__ import annotations

NAME = "segments"
SEAM = None


def is_stable_cut(text: str, c: int, end: int) -> bool:  # noqa: ARG001 - protocol
    return False
