"""pipeline/repair.py on its own: the widening search, the routes, the offset check, against HF ids computed
here. The encoders are handed in, so a fake one (a wrong engine) can be given without touching the tokenizer."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from toktier_backend.pipeline import repair as R
from toktier_backend.pipeline.text_store import TextStore
from toktier_backend.pipeline.token_buffer import TokenBuffer

from ..conftest import load, reference


class FakeEncoders:
    """An :class:`Encoders` on the HF reference alone; ``over`` replaces any method (a wrong engine)."""

    def __init__(self, name: str, **over):
        tok, self.ref = load(name), reference(name)
        self.cuts, self.token_nbytes = tok.cuts, tok.spec.token_nbytes
        self.normalized_nbytes = tok.spec.normalized_nbytes
        self.__dict__.update(over)

    def hf(self, t: str) -> np.ndarray:
        return np.asarray(self.ref.encode(t, add_special_tokens=False).ids, dtype=np.int32)

    def encode_body(self, t, *, route):
        return self.hf(t), "hf"

    def encode_fresh(self, t):
        return self.hf(t), "hf"

    def encode_reference(self, t):
        return self.hf(t)

    def fallback_reason(self, t, route):
        return ""


def _state(name: str, text: str, **over):
    """A store, a buffer and encoders of file ``name`` (body ids, no post-processor), holding ``text``."""
    enc = FakeEncoders(name, **over)
    store, buf = TextStore(), TokenBuffer(np.zeros(0, np.int32), np.zeros(0, np.int32))
    buf.splice(0, enc.hf(text), enc.token_nbytes)
    store.replace(text)
    return store, buf, enc, enc.ref


def test_append_takes_the_last_cut_before_the_departure_point():
    text = "def main():\n    print('hello world')\n" * 40
    store, buf, enc, ref = _state("gpt2", text)
    info = R.repair(enc, store, buf, " pipe", whole=False, d=len(text), force_reference=False, quarantined=(),
                    first=False)
    assert store.text == text + " pipe" and buf.ids().tolist() == ref.encode(text + " pipe").ids
    assert (info.route, info.departure, info.widenings) == ("append", len(text), 0)
    assert info.cut == text.rfind(" world") and info.reused + info.reencoded == len(buf.ids())  # "hello| world"


def test_no_cut_widens_every_time_then_encodes_in_full():
    text = "x" * (R.WINDOW * 2**R.WIDENINGS + 10)  # gpt2: no stable cut inside a run of letters
    store, buf, enc, ref = _state("gpt2", text)
    assert R.find_cut(enc, store, buf, len(text)) is None
    info = R.repair(enc, store, buf, "y", whole=False, d=len(text), force_reference=False, quarantined=(),
                    first=False)
    assert (info.route, info.widenings, info.fallback) == ("full", R.WIDENINGS + 1, "no_cut")
    assert buf.ids().tolist() == ref.encode(text + "y").ids
    # a cut 3K chars back: found after two doublings (1K, 2K, 4K)
    text = "ab c" + "x" * 3000
    store, buf, enc, ref = _state("gpt2", text)
    assert R.find_cut(enc, store, buf, len(text)) == (2, len(ref.encode("ab").ids), 2, text[2:], 2)  # "ab| cxxx..."


@pytest.mark.parametrize("gap", [0, 1, 30, 31, 32, 33, 159, 160, 161, 672, 673, 1000])
def test_the_last_cut_is_found_across_the_search_slices(gap):
    # last_cut scans back in slices of 32, 128, 512... chars: a cut just inside and just past each slice edge
    text = "ab c" + "x" * gap
    store, buf, enc, ref = _state("gpt2", text)
    c, keep, _, kept, nb = R.find_cut(enc, store, buf, len(text))
    # "ab| cxxx...": no cut inside the run of letters; the kept tokens end at byte 2
    assert (c, keep, kept, nb) == (2, len(ref.encode("ab").ids), text[2:], len("ab".encode()))
    R.repair(enc, store, buf, " y", whole=False, d=len(text), force_reference=False, quarantined=(), first=False)
    assert buf.ids().tolist() == ref.encode(text + " y").ids


@pytest.mark.parametrize("whole", [False, True])
def test_an_edit_inside_the_text_re_encodes_the_kept_text_before_its_departure(whole):
    # departure inside a run of letters: the cut is the last one before it ("ab| cxxx..."), the kept text is
    # the stored text between the cut and the departure point, and the text after the departure is dropped
    text = "ab c" + "x" * 50 + " tail after the departure"
    d = 30
    store, buf, enc, ref = _state("gpt2", text)
    assert R.find_cut(enc, store, buf, d) == (2, len(ref.encode("ab").ids), 0, text[2:d], 2)
    new = text[:d] + "y end" if whole else "y end"
    info = R.repair(enc, store, buf, new, whole=whole, d=d, force_reference=False, quarantined=(), first=False,
                    splice=not whole)
    assert (info.route, info.cut) == ("edit", 2)
    assert store.text == text[:d] + "y end"
    assert buf.ids().tolist() == ref.encode(text[:d] + "y end").ids


def test_offset_check_rebuilds_from_the_reference():
    text = "the quick brown fox jumps over the lazy dog\n" * 20
    wrong = lambda t, *, route: (np.asarray(reference("qwen3").encode(t + "!").ids, np.int32), "fake")  # noqa: E731
    store, buf, enc, ref = _state("qwen3", text, encode_body=wrong)
    info = R.repair(enc, store, buf, "and more", whole=False, d=len(text), force_reference=False, quarantined=(),
                    first=False)
    assert (info.route, info.fallback, info.engine) == ("full", "offset_check", "hf")
    assert buf.ids().tolist() == ref.encode(text + "and more", add_special_tokens=False).ids
    assert store.text == text + "and more"


def test_quarantined_route_and_edit_route():
    text = "alpha beta gamma delta\n" * 30
    store, buf, enc, ref = _state("qwen3", text)
    edited = text[:50] + "Z" + text[51:]
    info = R.repair(enc, store, buf, edited, whole=True, d=R.departure(store, edited, whole=True),
                    force_reference=False, quarantined=("append",), first=False)
    assert (info.route, info.departure) == ("edit", 50) and info.cut < 50
    assert buf.ids().tolist() == ref.encode(edited, add_special_tokens=False).ids
    info = R.repair(enc, store, buf, edited + "x", whole=True, d=len(edited), force_reference=False,
                    quarantined=("append",), first=False)
    assert (info.route, info.fallback) == ("full", "quarantined")
    assert buf.ids().tolist() == ref.encode(edited + "x", add_special_tokens=False).ids


def test_an_encoder_error_leaves_the_state_unchanged():
    text = "one two three four\n" * 10
    store, buf, enc, _ = _state("gpt2", text)

    def boom(t, *, route):
        raise RuntimeError("engine down")

    before = buf.ids()
    enc.encode_body = boom
    try:
        R.repair(enc, store, buf, " five", whole=False, d=len(text), force_reference=False, quarantined=(),
                 first=False)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the engine error was swallowed")
    assert store.text == text and buf.ids().tolist() == before.tolist()


def test_pure_pipeline_modules_do_not_import_the_tokenizer():
    """No import cycle: repair, reference, token_buffer and text_store never import toktier_backend.tokenizer."""
    root = Path(R.__file__).parent
    for mod in ("repair.py", "reference.py", "token_buffer.py", "text_store.py"):
        tree = ast.parse((root / mod).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.startswith("toktier_backend.tokenizer")], (mod, names)
        assert "threading" not in names and "open" not in {getattr(n.func, "id", "") for n in ast.walk(tree)
                                                           if isinstance(n, ast.Call)}, mod
