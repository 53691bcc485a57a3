"""Every registered engine implements ``engines.protocol.Engine`` (the GPU engine ``DeviceEngine``), and the
chunked encoder needs nothing of an engine beyond that protocol.

Expected ids come from the HF reference (``tests/conftest.reference``), loaded independently of our code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import toktier_backend as tt
from toktier_backend import corpus
from toktier_backend.engines import registry
from toktier_backend.engines.protocol import DeviceEngine, Engine
from toktier_backend.gpu.routing import FreshCpuEngine
from toktier_backend.pipeline.chunked import ChunkedEncoder
from toktier_backend.runtime.pool import CpuPool

from ..conftest import load, reference, tokenizer_path
from ..faulty_engine import FaultyEngine

CPU_ENGINES = [n for n in registry.names() if n != "gpu"]
TEXTS = ["hello world", "it's 1234567 ok\r\n\r\n  \tx", "中文 café e\u0301 👍🏽", "<|endoftext|>a<|endoftext|>", ""]


def hf(name: str, text: str) -> list[int]:
    return reference(name).encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_every_cpu_engine_satisfies_the_protocol_and_equals_hf(engine):
    eng = registry.create(engine, str(tokenizer_path("gpt2")))
    assert isinstance(eng, Engine)
    assert eng.name == engine and isinstance(eng.version, str) and eng.version
    assert isinstance(eng.releases_gil, bool) and isinstance(eng.accepts_utf8, bool)
    assert eng.encode("hello world").tolist() == [31373, 995]  # HF gpt2, add_special_tokens=False
    for text in TEXTS:
        ids = eng.encode(text)
        assert ids.dtype == np.int32 and ids.tolist() == hf("gpt2", text), text
        if eng.accepts_utf8:
            assert eng.encode(text.encode("utf-8")).tolist() == hf("gpt2", text), text
    assert [x.tolist() for x in eng.encode_batch(TEXTS)] == [hf("gpt2", t) for t in TEXTS]
    eng.reserve(3)
    assert eng.encode(TEXTS[2]).tolist() == hf("gpt2", TEXTS[2])


@pytest.mark.parametrize("engine", [n for n in CPU_ENGINES if n != "hf"])
def test_engines_that_release_the_gil_are_safe_from_many_threads(engine):
    """``releases_gil`` promises calls from any number of threads at once: four threads, each its own text
    of ~200K chars, eight times; every result equals HF's."""
    eng = registry.create(engine, str(tokenizer_path("qwen3")))
    assert eng.releases_gil
    eng.reserve(4)
    base = corpus.long_session_text(800_000)
    texts = [base[k * 200_000:(k + 1) * 200_000] for k in range(4)]
    want = [hf("qwen3", t) for t in texts]
    got: dict[int, list[bool]] = {k: [] for k in range(4)}

    def run(k):
        for _ in range(8):
            got[k].append(eng.encode(texts[k]).tolist() == want[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(all(v) and len(v) == 8 for v in got.values()), got


def test_hf_holds_the_gil_and_is_never_chunked():
    tok = tt.load_tokenizer(tokenizer_path("gpt2"), engine="hf")
    assert isinstance(tok.engine, Engine) and not tok.engine.releases_gil
    assert not tok.chunked.available and not tok.chunked.wants("x " * 10**6)


def test_missing_member_is_not_an_engine():
    class NoCapabilities:  # the protocol before capabilities were declared: name, version, encode
        name, version = "old", "0"

        def encode(self, text):
            return np.zeros(0, np.int32)

    assert not isinstance(NoCapabilities(), Engine)


def test_test_and_serving_wrappers_are_engines():
    tok = load("gpt2")
    faulty = FaultyEngine(tok.engine, tok.spec.token_nbytes)
    assert isinstance(faulty, Engine) and faulty.encode("hello world").tolist() == [31373, 995]
    fresh = FreshCpuEngine(tok)
    assert isinstance(fresh, Engine) and fresh.version == tok.engine.version
    assert [x.tolist() for x in fresh.encode_batch(["hello world", "x"])] == [[31373, 995], hf("gpt2", "x")]


class ListEngine:
    """A pure-Python engine: the HF reference behind the protocol, claiming ``releases_gil`` (it does not,
    but the chunked encoder must work with any engine that says so) and counting its calls."""

    name, version, accepts_utf8 = "list", "test", False

    def __init__(self, name: str, releases_gil: bool):
        self.ref, self.releases_gil, self.calls, self.reserved = reference(name), releases_gil, 0, 0

    def encode(self, text: str) -> np.ndarray:
        self.calls += 1
        return np.asarray(self.ref.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def reserve(self, n: int) -> None:
        self.reserved = max(self.reserved, n)


@pytest.mark.parametrize("name", ["gpt2", "llama3_1", "qwen3"])
def test_chunked_encoder_needs_only_the_protocol(name, corpus_texts):
    """A fake ``Engine`` drives the chunked encoder: chunks (``releases_gil``) or one call (not), ids equal
    HF's either way; with chunks, ``reserve`` for the pool's workers plus the caller and one warm-up call on
    each worker (``ChunkedEncoder.prepare``)."""
    tok = load(name)
    text = "".join(corpus_texts)[:60_000]
    pool = CpuPool(2, name="test-protocol")
    try:
        for gil_free in (True, False):
            eng = ListEngine(name, gil_free)
            assert isinstance(eng, Engine)
            enc = ChunkedEncoder(eng, reference=tok.chunked.reference, guard=tok.admission, cuts=tok.cuts,
                                 pool=pool, chunk_chars=5000, min_chars=0)
            ids, label = enc.encode(text)
            assert ids.tolist() == hf(name, text) and label == "list"
            if gil_free:
                assert enc.stats["chunks"] >= 10 and eng.reserved == 3
                assert eng.calls == enc.stats["chunks"] + pool.workers
            else:
                assert eng.calls == 1 and enc.stats["chunks"] == 0 and eng.reserved == 0
            # from a stable cut (a prefix-index hit): the rest of the text only
            cut = enc.bounds(text)[3]
            assert enc.encode(text, cut)[0].tolist() == hf(name, text[cut:])
    finally:
        pool.shutdown()


_GPU_CHECK = r"""
import json, sys
from toktier_backend.engines.protocol import DeviceEngine, Engine
from toktier_backend.gpu.engine import GpuEngine
from toktier_backend.gpu.routing import _OnDevice
eng = GpuEngine(sys.argv[1])
wrapped = _OnDevice(eng, 0)
texts = json.loads(sys.argv[2])
print(json.dumps({
    "isinstance": [isinstance(e, DeviceEngine) and isinstance(e, Engine) for e in (eng, wrapped)],
    "caps": [[e.name, e.version == eng.version, e.releases_gil, e.accepts_utf8] for e in (eng, wrapped)],
    "ids": [eng.encode(t).tolist() for t in texts],
    "batch": [x.tolist() for x in wrapped.encode_batch(texts)],
    "accepts": wrapped.accepts(texts[0]),
}))
"""


def test_gpu_engine_satisfies_the_device_protocol_on_the_simulator():
    """``GpuEngine`` and its per-device wrapper are ``DeviceEngine``s (on numba's CUDA simulator, in a
    process of its own: the simulator is chosen at numba's import); ids equal HF's."""
    texts = ["hello world", "it's 12 ok<|endoftext|>"]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    out = subprocess.run([sys.executable, "-c", _GPU_CHECK, str(tokenizer_path("gpt2")), json.dumps(texts)],
                         env=env, capture_output=True, text=True, timeout=600,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["isinstance"] == [True, True]
    assert r["caps"] == [["gpu", True, False, False]] * 2
    assert r["ids"] == r["batch"] == [hf("gpt2", t) for t in texts]
    assert r["ids"][0] == [31373, 995] and r["accepts"] is True
