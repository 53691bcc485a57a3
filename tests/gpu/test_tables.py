"""Host half of the GPU path: BPE rounds, the NumPy twin of the whole pipeline, NFC gate, added tokens.

Every id is checked against HF ``encode(text, add_special_tokens=False).ids``.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from toktier_backend.gpu.tables import (AddedSplitter, GpuTables, bpe_rounds, bpe_sequential, detect_gpu_family,
                                        encode_numpy, nfc_unsafe_table)

from ..conftest import reference, tokenizer_path

GPU_FILES = ["gpt2", "llama3", "llama3_1", "qwen2_5", "qwen3", "deepseek_v3", "cl100k_base"]
TRAPS = ["hello world", "pipeline", "1234" + "5", "a." + "\n", "it'" + "s", "e\u0301", "<|endo" + "ftext|>",
         "<|endoftext|>x<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n", "<｜User｜>hi<｜Assistant｜>",
         "x  \n\n\ty \u00a0\u3000z\u2028w", " " * 300, "=" * 500, "a" * 1000, "中文字符测试，日本語のテキスト。",
         "👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽", "It's 'S 'LL 'ſ", "\ufeffBOM \u200b zero"]


@pytest.fixture(scope="module")
def tables():
    return {n: GpuTables.from_file(tokenizer_path(n)) for n in GPU_FILES}


def test_hello_world_literal(tables):
    assert encode_numpy(tables["gpt2"], "hello world").tolist() == [31373, 995]  # HF gpt2, tokenizers 0.23.3


@pytest.mark.parametrize("name", GPU_FILES)
def test_numpy_twin_equals_hf(name, tables, corpus_texts):
    t, ref = tables[name], reference(name)
    texts = TRAPS + [s[:20_000] for s in corpus_texts[::4]]
    checked = 0
    for s in texts:
        if not t.accepts(s):
            continue
        assert encode_numpy(t, s).tolist() == ref.encode(s, add_special_tokens=False).ids, s[:60]
        checked += 1
    assert checked >= len(texts) - 3


def test_family_detection():
    want = {"gpt2": "gpt2", "llama3": "cl100k", "llama3_1": "cl100k", "qwen2_5": "qwen2", "qwen3": "qwen2",
            "deepseek_v3": "deepseek_v3", "cl100k_base": "cl100k", "gemma3": None, "o200k_base": None}
    for name, fam in want.items():
        got, nfc, reason = detect_gpu_family(json.loads(tokenizer_path(name).read_text()))
        assert got == fam, (name, reason)
        assert nfc == name.startswith("qwen")


def test_rounds_equal_sequential_adversarial():
    """Random merge tables with shuffled ranks (merges that create pairs of lower rank than their parts)."""
    rng = random.Random(1)
    for _ in range(2000):
        nsym = rng.randint(2, 4)
        merges, toks, nxt = {}, list(range(nsym)), nsym
        ranks = list(range(200))
        rng.shuffle(ranks)
        for r in range(rng.randint(1, 25)):
            a, b = rng.choice(toks), rng.choice(toks)
            if (a, b) not in merges:
                merges[(a, b)] = (ranks[r], nxt)
                toks.append(nxt)
                nxt += 1
        for _ in range(4):
            ids = [rng.randrange(nsym) for _ in range(rng.randint(1, 30))]
            assert bpe_rounds(ids, merges) == bpe_sequential(ids, merges), (ids, merges)


def test_merge_hash_table_roundtrip(tables):
    t = tables["llama3_1"]
    items = list(t.merges.items())
    for (a, b), v in random.Random(2).sample(items, 2000):
        assert t.lookup_merge(a, b) == v
    assert t.lookup_merge(t.byte_ids[0], t.byte_ids[0])[1] == t.merges.get((t.byte_ids[0], t.byte_ids[0]), (0, -1))[1]


def test_added_tokens_leftmost_longest():
    sp = AddedSplitter.from_config([{"content": c, "id": i} for i, c in enumerate(["<a>", "<a>b", "<", "ab"])])
    data = "x<a>b<<a>ab".encode()
    assert sp.spans(data) == [(1, 5, 1), (5, 6, 2), (6, 9, 0), (9, 11, 3)]
    two = AddedSplitter.from_config([{"content": "ab", "id": 0}, {"content": "b", "id": 1, "normalized": True}])
    assert two.spans(b"abb") == [(0, 2, 0), (2, 3, 1)]  # raw tokens first, then normalized ones in the gaps


def test_nfc_gate_against_hf_normalizer():
    """Texts of code points the gate calls safe are NFC-identity for HF's normalizer (newer Unicode)."""
    norm = reference("qwen3").normalizer
    unsafe = nfc_unsafe_table()
    safe = np.flatnonzero(~unsafe[: 0x30000])
    rng = np.random.default_rng(0)
    for _ in range(50):
        s = "".join(map(chr, rng.choice(safe, 4000)))
        assert norm.normalize_str(s) == s
    assert unsafe[0x301] and unsafe[0x1161] and not unsafe[ord("é")]


def test_nfc_gate_routes_decomposed_text(tables):
    t = tables["qwen3"]
    assert t.accepts("café") and not t.accepts("cafe\u0301")
    assert t.accepts("plain ascii")
    n = t.nfc_full_checks
    assert t.accepts("x\u1879y")  # unassigned for Python 3.11: HF's normalizer decides (identity)
    assert not t.accepts("\U00016d67\U00016d67") or t._normalizer().normalize_str("\U00016d67\U00016d67") == "\U00016d67\U00016d67"
    assert t.nfc_full_checks == n + 2
