"""Public API (``toktier_backend.tokenizer``: ``load_tokenizer``, ``Tokenizer``, ``Session``): encode/session
values against the reference, errors, state, routes, the sha256 pin."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

import toktier_backend as tt

from .conftest import NAMES, SHARED, load, reference

GPT2 = tt.default_tokenizer_path()


def test_gpt2_hello_world_literal():
    # openai-community/gpt2: "hello world" -> [31373, 995] (literal ids, also the docstring example)
    tok = tt.load_tokenizer(None)
    assert tok.encode("hello world").tolist() == [31373, 995]
    assert tok.encode("hello world").dtype == np.int32


@pytest.mark.parametrize("spec", ["default", ""])
def test_default_spec_is_the_bundled_file(spec, capsys):
    # "default" is documented for `toktier serve --tokenizer` and the models' parameter: every loader takes it
    # (the CLI's encode/info went to the Hub with it)
    from tokenizers import Tokenizer as HF

    from toktier_backend import cli

    want = HF.from_file(str(GPT2)).encode("hello world").ids
    assert tt.load_tokenizer(spec).path == GPT2
    assert cli.main(["encode", "hello world", "--tokenizer", "default"]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in want]


def test_known_ids_file():
    """``shared/tokenizers/known_ids.json``: public text->ids pairs with provenance; each pair is checked
    on every file it is marked as verified against."""
    entries = json.loads((SHARED / "tokenizers" / "known_ids.json").read_text())["entries"]
    checked = 0
    for item in entries:
        for rel, verified in item["verified_against"].items():
            name = rel.split("/")[0]
            if not verified or name not in NAMES:
                continue
            got = load(name).encode(item["text"], add_special_tokens=item["add_special_tokens"]).tolist()
            assert got == item["ids"], (name, item["text"][:40], item["source"])
            checked += 1
    assert checked >= 100


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("flag", [False, True])
def test_encode_equals_reference_on_corpus(name, flag, corpus_texts):
    tok, ref = load(name), reference(name)
    for text in corpus_texts[:8] + ["", " ", "\n\n", "<|endoftext|>x"]:
        assert tok.encode(text, add_special_tokens=flag).tolist() == ref.encode(text, add_special_tokens=flag).ids


def test_llama3_session_keeps_bos():
    tok, ref = load("llama3_1"), reference("llama3_1")
    s = tok.session(add_special_tokens=True)
    s.update("Hello there, general")
    ids = s.append(" Kenobi\n")
    assert ids[0] == 128000  # <|begin_of_text|>
    assert ids.tolist() == ref.encode("Hello there, general Kenobi\n").ids
    assert s.last_repair.route == "append" and s.last_repair.reused >= 1


def test_ids_are_read_only_views():
    s = load("gpt2").session()
    ids = s.update("read only please")
    with pytest.raises(ValueError):
        ids[0] = 1
    with pytest.raises(ValueError):
        s.ids[0] = 1


@pytest.mark.parametrize("name", ["gpt2", "llama3_1", "qwen3", "deepseek_v3", "gemma3", "o200k_base"])
def test_returned_ids_never_change(name, corpus_texts):
    """``a = s.append(x); b = s.append(y)``: ``a`` keeps the first text's ids, through an append that rewrites
    the last token ("pipe" + "line"), an edit before the end, a truncation and a reset to empty."""
    tok, ref = load(name), reference(name)
    base = corpus_texts[0][:3000]
    s = tok.session()
    a = s.update(base + "pipe")
    b = s.append("line")
    assert a.tolist() == ref.encode(base + "pipe").ids
    assert b.tolist() == ref.encode(base + "pipeline").ids
    text = base + "pipeline"
    replies = [(a, base + "pipe"), (b, text)]
    for op, arg in [("append", " 1234"), ("append", "5\n"), ("update", base[:100] + "X" + base[101:]),
                    ("update", base[:1500]), ("append", " and then some more words"), ("update", "")]:
        text = arg if op == "update" else text + arg
        replies.append((s.update(arg) if op == "update" else s.append(arg), text))
        replies.append((s.ids, text))
    assert s.last_repair.route == "full"
    for got, t in replies:
        assert got.tolist() == ref.encode(t).ids, (name, len(t))


def test_repair_info_fields():
    tok, ref = load("qwen3"), reference("qwen3")
    s = tok.session(add_special_tokens=False)
    base = "def main():\n    print('hello world')\n" * 50
    s.update(base)
    before = len(s.ids)
    ids = s.append("def other():\n    return 1234\n")
    info = s.last_repair
    assert info.route == "append" and info.engine in ("gigatoken", "fastokens", "hf")
    assert 0 < info.cut < len(base) and info.departure == len(base) and info.widenings == 0
    assert info.reused + info.reencoded == len(ids) and info.reused <= before
    assert ids.tolist() == ref.encode(base + "def other():\n    return 1234\n", add_special_tokens=False).ids
    # an edit in the middle
    edited = base[:200] + "X" + base[201:] + "def other():\n    return 1234\n"
    assert s.update(edited).tolist() == ref.encode(edited, add_special_tokens=False).ids
    assert s.last_repair.route == "edit" and s.last_repair.departure == 200
    # a truncation and the no-op
    assert s.update(edited[:100]).tolist() == ref.encode(edited[:100], add_special_tokens=False).ids
    assert s.update(edited[:100]).tolist() == ref.encode(edited[:100], add_special_tokens=False).ids
    assert s.last_repair.route == "noop"


def test_nfc_never_composes_across_an_added_token():
    # Under NFC, ">" + U+0338 composes to "≯", but HF normalizes the segments between added tokens on their
    # own: "<|im_end|>" keeps its ">" and U+0338 starts the next segment. Offsets must agree with that.
    tok, ref = load("qwen3"), reference("qwen3")
    for base, delta in [("hi <|im_end|>", "\u0338 x y"), ("a <|im_start|>user\n", "e\u0301 b"),
                        ("x <|im_end|>\u0338 y\nz ", "more words")]:
        s = tok.session()
        s.update(base)
        assert s.append(delta).tolist() == ref.encode(base + delta).ids
        assert s.append(" and then some").tolist() == ref.encode(base + delta + " and then some").ids
        assert s.last_repair.route == "append"


def test_no_cut_widens_then_full_encode():
    tok, ref = load("gpt2"), reference("gpt2")
    s = tok.session()
    text = "x" * 50_000  # no stable cut anywhere: widen 5 times, then full encode
    s.update(text)
    ids = s.append("y")
    assert s.last_repair.route == "full" and s.last_repair.widenings == tt.tokenizer.WIDENINGS + 1
    assert ids.tolist() == ref.encode(text + "y").ids


def test_append_cost_does_not_copy_the_text():
    s = load("gpt2").session()
    s.update("word " * 200_000)
    blocks_before = len(s._store._blocks)
    for _ in range(50):
        s.append("more words here ")
    assert len(s._store._blocks) <= blocks_before + 51  # appends go to small tail blocks, no re-join
    assert s.text.endswith("more words here " * 50)


@pytest.mark.parametrize("bad", ["\ud800", "ok \udfff tail"])
def test_lone_surrogate_is_rejected_and_session_unchanged(bad):
    s = load("gpt2").session()
    s.update("kept")
    with pytest.raises(tt.InvalidRequest, match="surrogate"):
        s.append(bad)
    with pytest.raises(tt.InvalidRequest):
        s.update("kept" + bad)
    assert s.text == "kept" and s.ids.tolist() == reference("gpt2").encode("kept").ids
    with pytest.raises(tt.InvalidRequest):
        load("gpt2").encode(bad)


def test_invalid_utf8_and_type_and_size():
    with pytest.raises(tt.InvalidRequest, match="offset 2"):
        tt.decode_text(b"ab\xff")
    assert tt.decode_text("é".encode()) == "é"
    with pytest.raises(tt.InvalidRequest):
        load("gpt2").encode(b"bytes")  # type: ignore[arg-type]
    small = tt.load_tokenizer(tt.default_tokenizer_path(), max_chars=10)
    with pytest.raises(tt.InvalidRequest, match="limit"):
        small.encode("x" * 11)
    s = small.session()
    s.update("x" * 8)
    with pytest.raises(tt.InvalidRequest, match="limit"):
        s.append("yyy")
    assert s.text == "x" * 8


def test_sha256_pin():
    digest = hashlib.sha256(GPT2.read_bytes()).hexdigest()
    assert tt.load_tokenizer(GPT2, sha256=digest.upper()).encode("hello world").tolist() == [31373, 995]
    with pytest.raises(tt.UnsupportedTokenizer, match=r"sha256 [0-9a-f]{64} is not the pinned '0+'.*tokenizer_sha256"):
        tt.load_tokenizer(GPT2, sha256="0" * 64)


def test_reference_engine_sessions_are_exact():
    tok = tt.load_tokenizer(SHARED / "tokenizers" / "qwen3" / "tokenizer.json", engine="hf")
    s = tok.session()
    s.update("hello world")
    assert s.append(" and more").tolist() == reference("qwen3").encode("hello world and more").ids
    assert tok.engine.name == "hf"


def test_import_does_not_pull_serving_or_gpu_packages():
    code = "import sys, toktier_backend; print([m for m in ('tritonclient','numba','cupy','pytriton') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"




# ---------------------------------------------------------------- Session.splice(departure, delta)

_SPLICE_BASE = ("def pipeline(x):\n    return 12345 + x  # <|im_end|> inline\n"
                "<|im_start|>user\ncafé e\u0301 naïve 日本語 😀\n<|im_end|>\n<|im_start|>assistant\n"
                "<think>\nplan</think>\n\nanswer   with   spaces\n\n") * 40


def _splice_cases(base: str) -> list[tuple[int, str]]:
    """(departure, delta) at awkward places: inside a pre-token ("pipe|line", "123|45"), inside and right
    before an added token, before a combining mark (NFC composes "e" + U+0301), inside a whitespace run,
    inside the generation prompt, at 0 and at the end (append, truncation)."""
    last = len(base) - len(_SPLICE_BASE) // 40  # the start of the last repeat: far from the beginning
    piece = base[last:]
    cases = []
    for needle, off, delta in [("pipeline", 4, "line(y):\n"), ("12345", 3, "45 + 6"), ("<|im_end|>", 5, "x"),
                               ("<|im_end|>", 0, "<|im_end|>\u0301 more"), ("e\u0301", 1, "\u0301\u0301 end"),
                               ("café", 3, "e\u0301"), ("   spaces", 2, " \n\n  x"),
                               ("<|im_start|>assistant", 12, "assist"), ("<think>", 7, "")]:
        cases.append((last + piece.index(needle) + off, delta))
    cases += [(0, "fresh start"), (len(base), " appended words"), (len(base) - 7, ""), (len(base) // 2, "mid")]
    return cases


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gpt2", "gemma3"])
def test_splice_equals_reference(name):
    """``splice(d, delta)`` gives HF ``encode(text[:d] + delta).ids`` (computed here), one session walked
    through every case in turn, and repairs from a cut (not a full encode) when ``d`` is far from 0."""
    tok, ref = load(name), reference(name)
    for flag in (False, True):
        s = tok.session(add_special_tokens=flag)
        text = _SPLICE_BASE
        s.update(text)
        repaired = 0
        for d, delta in _splice_cases(_SPLICE_BASE):
            d = min(d, len(text))
            want = text[:d] + delta
            got = s.splice(d, delta)
            assert got.tolist() == ref.encode(want, add_special_tokens=flag).ids, (name, flag, d, delta)
            assert s.text == want and len(s) == len(want)
            if s.last_repair.route in ("edit", "append"):
                repaired += 1
                assert s.last_repair.cut <= d
            s.update(_SPLICE_BASE)  # back to the base for the next case
            text = _SPLICE_BASE
        assert repaired >= 8, (name, flag, repaired)


def test_splice_then_append_and_update_stay_exact():
    tok, ref = load("qwen3"), reference("qwen3")
    s = tok.session(add_special_tokens=False)
    text = _SPLICE_BASE
    s.update(text)
    rng = np.random.default_rng(17)
    for _ in range(30):
        d = int(rng.integers(0, len(text) + 1))
        delta = "".join(rng.choice(list("ab e\u0301<|im_end|>\n 12"), size=int(rng.integers(0, 12))))
        text = text[:d] + delta
        assert s.splice(d, delta).tolist() == ref.encode(text, add_special_tokens=False).ids
        text += " tail 99"
        assert s.append(" tail 99").tolist() == ref.encode(text, add_special_tokens=False).ids
    assert s.update(text).tolist() == ref.encode(text, add_special_tokens=False).ids
    assert s.last_repair.route == "noop"


def test_splice_bad_input_leaves_the_session_unchanged():
    s = load("gpt2").session()
    s.update("kept text")
    before = s.ids.tolist()
    for d, delta in [(-1, "x"), (10, "x"), (3.0, "x"), (2, "bad \ud800")]:
        with pytest.raises(tt.InvalidRequest):
            s.splice(d, delta)
    assert s.text == "kept text" and s.ids.tolist() == before == reference("gpt2").encode("kept text").ids
    assert s.splice(9, "").tolist() == before and s.last_repair.route == "noop"
