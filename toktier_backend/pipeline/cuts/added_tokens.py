"""Added-token seams, shared by every family.

HF ``tokenizers`` extracts added tokens *before* normalization and pre-tokenization
(``AddedVocabulary::extract_and_normalize``: Aho-Corasick, leftmost-longest), and every segment between
them is normalized, pre-tokenized and modeled on its own. Two facts follow:

* **Crossing.** An occurrence of added token ``T`` covering chars ``c-1`` and ``c`` makes ``c`` unusable.
  Such an occurrence needs ``text[c-j:c+1] == T[:j+1]`` for some ``1 <= j < len(T)``. We reject ``c``
  whenever that holds — reading only ``text[c-j:c+1]`` — which is conservative (the rest of ``T`` may not
  follow) and catches ``"<|endo" + "ftext|>"`` before the second half arrives.
* **Segment start.** If an added token occurs at ``c`` (entirely inside the known text) and none crosses
  ``c``, the leftmost-longest scan starts a match at ``c``: nothing earlier can cover ``c`` without
  crossing it. So a segment ends at ``c`` in the whole text and in the prefix ``text[:c]`` alike, and
  ``c`` is a stable cut for *any* normalizer and pre-tokenizer that act per segment.
"""

from __future__ import annotations

from collections import defaultdict


class AddedTokenSeams:
    """Index of the added tokens of one file.

    Args:
        contents: the added tokens' texts.
    """

    def __init__(self, contents: list[str]):
        contents = [c for c in contents if c]
        #: (x, y) char pair -> lengths L such that some token has a prefix of length L ending in x, y.
        self._cross: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._prefixes: set[str] = set()
        for t in contents:
            for j in range(1, len(t)):
                p = t[: j + 1]
                if p not in self._prefixes:
                    self._prefixes.add(p)
                    self._cross[(p[-2], p[-1])].append(j + 1)
        for k in self._cross:
            self._cross[k] = sorted(set(self._cross[k]))
        #: first char -> sorted distinct lengths of tokens starting with it
        self._starts: dict[str, list[int]] = defaultdict(list)
        self._tokens = set(contents)
        for t in contents:
            self._starts[t[0]].append(len(t))
        for k in self._starts:
            self._starts[k] = sorted(set(self._starts[k]))
        self.first_chars = "".join(sorted(self._starts))
        self.max_len = max((len(t) for t in contents), default=1)

    def crosses(self, text: str, c: int) -> bool:
        """Could an added-token occurrence cover both ``text[c-1]`` and ``text[c]``? Reads
        ``text[c-max_len+1 : c+1]`` only. Requires ``1 <= c < len(text)``."""
        lengths = self._cross.get((text[c - 1], text[c]))
        if not lengths:
            return False
        for n in lengths:
            if n > c + 1:
                break
            if text[c + 1 - n : c + 1] in self._prefixes:
                return True
        return False

    def starts_at(self, text: str, c: int, end: int) -> bool:
        """Does a whole added token occur at ``c`` and end at or before ``end``?"""
        for n in self._starts.get(text[c], ()):
            if c + n > end:
                break
            if text[c : c + n] in self._tokens:
                return True
        return False
