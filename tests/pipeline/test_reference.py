"""pipeline/reference.py, the slow twin of the repair: its ids equal HF's on the seam traps, split at every
position, and it picks the cuts the rules say (literal cuts)."""

from __future__ import annotations

import pytest

from toktier_backend.pipeline import reference as twin
from toktier_backend.pipeline.repair import WIDENINGS

from ..conftest import load, reference
from .hazards import SEAM_TRAPS


def _twin(name):
    tok, ref = load(name), reference(name)
    rule = tok.cuts.is_stable_cut if tok.cuts.supported else None
    return (lambda t: ref.encode(t, add_special_tokens=False).ids), rule


@pytest.mark.parametrize("name", ["gpt2", "llama3_1", "o200k_base", "deepseek_v3", "gemma3"])
def test_twin_equals_hf_on_every_split_of_the_seam_traps(name):
    encode, rule = _twin(name)
    for a, b in SEAM_TRAPS:
        s = "word " + a + b + " tail"
        for i in range(len(s) + 1):
            got = twin.repair(s[:i], encode(s[:i]), s, encode=encode, is_stable_cut=rule)
            assert got.body == encode(s), (name, s, i)
            edited = s[:i] + "Q" + s[i + 1 :]
            assert twin.repair(s, encode(s), edited, encode=encode, is_stable_cut=rule).body == encode(edited)


def test_twin_routes_and_cuts_gpt2():
    encode, rule = _twin("gpt2")
    base = "hello world"
    got = twin.repair(base, encode(base), base + "!", encode=encode, is_stable_cut=rule)
    assert got == (encode("hello world!"), "append", 5, 1, 0)  # "hello| world": keep [31373]
    assert twin.repair(base, encode(base), base, encode=encode, is_stable_cut=rule).route == "noop"
    got = twin.repair(base, encode(base), "hello", encode=encode, is_stable_cut=rule)
    assert got.route == "full" and got.body == [31373]  # no cut before d = 5 ("hello| world" is at 5)
    got = twin.repair(base + " again", encode(base + " again"), base, encode=encode, is_stable_cut=rule)
    assert got == (encode(base), "edit", 5, 1, 0)
    run = "x" * 40_000
    got = twin.repair(run, encode(run), run + "y", encode=encode, is_stable_cut=rule)
    assert (got.route, got.widenings, got.body) == ("full", WIDENINGS + 1, encode(run + "y"))


def test_a_cut_that_is_no_token_boundary_is_skipped():
    """A predicate that accepts every position: the twin still keeps only ids that are a true prefix."""
    encode, _ = _twin("gpt2")
    got = twin.repair("pipe", encode("pipe"), "pipeline", encode=encode, is_stable_cut=lambda t, c, e: True)
    assert got.body == encode("pipeline") and got.route == "full"  # no prefix of [pipe] is encode("p"...)
