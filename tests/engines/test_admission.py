"""Admission (``toktier_backend.engines.admission``): the guard set routes to the reference the code points
an engine disagrees with HF on, and its UTF-8 check equals its ``str`` check. Expected ids come from the HF
reference (``tests/conftest.reference``), loaded independently of our code."""

from __future__ import annotations

import numpy as np
import pytest

from ..conftest import NAMES, load, reference


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3"])
def test_canonical_reordering_around_newer_marks(name):
    """Found by the session fuzz on qwen2_5: U+1715 (combining class 9 since Unicode 14) after U+0308
    (class 230) is reordered by NFC; gigatoken and HF disagree there, so the guard set must route it. And
    (seed 59278) U+1ACD (class 230 since Unicode 14) before U+0591 (class 220): gigatoken reorders, HF's
    tables do not (``admission.NORMALIZER_CONTEXTS``)."""
    tok, ref = load(name), reference(name)
    for text in ["147()aa  \u0308\u1715worde\u03011\ud55c\r\n", "\u00e4\u1715w", "a\u0308\u1715b x",
                 "\u1acd\u0591", " = SECON\u03b0'll\u00e9\u0338\u1acd\t\r\n\u0ddd\\n\U000de98a\u059123"]:
        assert tok.encode(text, add_special_tokens=False).tolist() == ref.encode(text, add_special_tokens=False).ids
        s = tok.session()
        s.update("if value is None:\r\n")
        assert s.append(text).tolist() == ref.encode("if value is None:\r\n" + text).ids


@pytest.mark.parametrize("name", NAMES)
def test_guard_check_on_utf8_equals_the_check_on_str(name):
    """``Admission.has_guarded_utf8`` (what chunks and tails use: non-ASCII bytes found eight at a time)
    against ``has_guarded`` on the ``str`` (regex / UTF-32 scan), on random texts that mix ASCII, non-ASCII
    of every UTF-8 length and the file's own guarded code points at every offset modulo 8."""
    import random

    from toktier_backend.engines import admission

    adm = load(name).admission
    rng = random.Random(name)
    guarded = [chr(c) for c in adm.guarded if not 0xD800 <= c < 0xE000]
    alphabet = ["a", " ", "\n", "7", "é", "\u4e00", "\U0001F600", "\u0301"] + [
        chr(c) for c in range(0x80, 0x3000, 97) if not 0xD800 <= c < 0xE000]
    for i in range(2000):
        chars = [rng.choice(alphabet) for _ in range(rng.randrange(0, 48))]
        if guarded and i % 3 == 0:
            chars.insert(rng.randrange(len(chars) + 1), rng.choice(guarded))
        s = "".join(chars)
        data = s.encode()
        assert adm.has_guarded_utf8(data) == adm.has_guarded(s), (name, s)
        u = np.frombuffer(data, dtype=np.uint8)
        assert admission._non_ascii_at(u).tolist() == [k for k, b in enumerate(data) if b >= 0x80]
