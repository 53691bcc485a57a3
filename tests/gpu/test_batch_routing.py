"""``GpuRouter.encode_many`` and ``Handler.handle_encode_batch``: a Triton batch as one GPU pass, in process.

The GPU engine here is a stand-in whose ``encode_batch`` returns HF ids and records each call, so these
tests check the batching (which requests share the pass, which stay on the CPU, per-request errors,
backpressure), not the kernels: the real ``GpuEngine.encode_batch`` on numba's CUDA simulator is
``test_batch_simulator.py``. Expected ids come from HF ``tokenizers`` (``tests/conftest.reference``).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import toktier_backend as tt
from toktier_backend.errors import InvalidRequest
from toktier_backend.gpu import routing
from toktier_backend.gpu.routing import GpuRouter

from ..conftest import reference, tokenizer_path
from ..serving.fake_pb_utils import encode_request, load_model

FAMILIES = ["gpt2", "llama3_1", "qwen3", "deepseek_v3"]
CROSSOVER = 12
#: mixed sizes around CROSSOVER (chars): the short ones stay on the CPU
TEXTS = ["hi", "It's 12345 pipeline\r\n\r\n  x", "def f(x):\n\treturn x # café", "中文字符测试，日本語", "ok!",
         "  \n\n" * 5 + "z", "<|endoftext|> a.b ..c", "x" * 11, "y" * 12, "Ab" * 20]


def body(name, text):
    return reference(name).encode(text, add_special_tokens=False).ids


class RefEngine:
    """HF body ids; ``encode_batch`` records the texts of each call; ``fail`` raises on every batch."""

    name = "gpu"

    def __init__(self, name, *, fail=False, gate=None):
        self.ref, self.fail, self.gate = reference(name), fail, gate
        self.batches: list[list[str]] = []

    def accepts(self, text):
        return True

    def encode(self, text):
        return self.encode_batch([text])[0]

    def encode_batch(self, texts):
        self.batches.append(list(texts))
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED (injected)")
        return [np.asarray(self.ref.encode(t, add_special_tokens=False).ids, dtype=np.int32) for t in texts]


class RefCpu:
    """HF body ids on the CPU; raises ``InvalidRequest`` for texts in ``bad``."""

    name = "cpu"

    def __init__(self, name, bad=()):
        self.ref, self.bad = reference(name), set(bad)

    def encode(self, text):
        if text in self.bad:
            raise InvalidRequest(f"rejected {text!r} (injected)")
        return np.asarray(self.ref.encode(text, add_special_tokens=False).ids, dtype=np.int32)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("size", [1, 2, 5, 16])
def test_batch_is_one_pass_and_exact(name, size):
    texts = (TEXTS * 2)[:size]
    gpu = RefEngine(name)
    r = GpuRouter(RefCpu(name), gpu, crossover_chars=CROSSOVER, max_queue=32)
    got = r.encode_many(texts)
    big = [t for t in texts if len(t) >= CROSSOVER]
    assert gpu.batches == ([big] if big else [])  # one encode_batch, in request order
    for text, (ids, route) in zip(texts, got):
        assert ids.tolist() == body(name, text), text
        assert route == ("gpu" if len(text) >= CROSSOVER else "cpu_small")
    assert r.counts == {k: v for k, v in {"gpu": len(big), "cpu_small": size - len(big)}.items() if v}


def test_bad_requests_get_their_own_error_others_exact():
    name = "llama3_1"
    surrogate = "bad \ud800 text, long enough"
    cpu_fails = "the CPU engine rejects this one"
    texts = [TEXTS[1], surrogate, "hi", TEXTS[2], cpu_fails, "\udfff"]
    gpu = RefEngine(name)
    r = GpuRouter(RefCpu(name, bad=[cpu_fails]), gpu, crossover_chars=CROSSOVER, max_queue=1)
    got = r.encode_many(texts)
    assert isinstance(got[1], InvalidRequest) and "lone surrogate" in str(got[1]) and "char 4" in str(got[1])
    assert isinstance(got[4], InvalidRequest) and "injected" in str(got[4])  # queue full: CPU, which raised
    assert isinstance(got[5], Exception)  # under the crossover: the CPU engine's own error (HF's here)
    for k in (0, 2, 3):
        assert got[k][0].tolist() == body(name, texts[k])
    assert gpu.batches == [[TEXTS[1], TEXTS[2]]]  # the bad one never reached the device
    assert [g[1] for g in (got[0], got[2], got[3])] == ["gpu", "cpu_small", "gpu"]
    assert r._slots.acquire(blocking=False) and r._slots.acquire(blocking=False)  # both slots given back
    r._slots.release(), r._slots.release()


def test_device_failure_retries_each_on_cpu():
    name = "qwen3"
    gpu = RefEngine(name, fail=True)
    r = GpuRouter(RefCpu(name), gpu, crossover_chars=CROSSOVER)
    texts = [TEXTS[1], "hi", TEXTS[3] * 2, TEXTS[5]]
    got = r.encode_many(texts)
    for text, (ids, route) in zip(texts, got):
        assert ids.tolist() == body(name, text)
        assert route == ("cpu_small" if len(text) < CROSSOVER else "cpu_gpu_error")
    assert len(gpu.batches) == 1 and "LAUNCH_FAILED" in r.last_error
    assert r.counts == {"cpu_gpu_error": 3, "cpu_small": 1}


def test_backpressure_mid_batch():
    """max_queue=2 gives 3 slots; one is held by a concurrent request still on the device, so 2 of the
    batch's 5 GPU-sized requests share the pass and 3 overflow to the CPU, all exact."""
    name = "deepseek_v3"
    gate = threading.Event()
    gpu = RefEngine(name, gate=gate)
    r = GpuRouter(RefCpu(name), gpu, crossover_chars=CROSSOVER, max_queue=2)
    other = threading.Thread(target=r.encode, args=(TEXTS[9],))
    other.start()
    while not gpu.batches:  # the concurrent request holds its slot, waiting on the device
        threading.Event().wait(0.005)
    big = [TEXTS[k] for k in (1, 2, 5, 6, 8)]
    texts = [big[0], "hi", *big[1:]]
    done = []
    t = threading.Thread(target=lambda: done.append(r.encode_many(texts)))
    t.start()
    threading.Event().wait(0.2)
    gate.set()
    t.join(10)
    other.join(10)
    got = done[0]
    for text, (ids, _) in zip(texts, got):
        assert ids.tolist() == body(name, text)
    routes = [g[1] for g in got]
    assert routes == ["gpu", "cpu_small", "gpu", "cpu_queue_full", "cpu_queue_full", "cpu_queue_full"]
    assert gpu.batches[1] == [big[0], big[1]]
    assert r.counts == {"gpu": 3, "cpu_small": 1, "cpu_queue_full": 3}
    r.close()


def test_batch_context_serves_encode_by_identity():
    name = "gpt2"
    gpu = RefEngine(name)
    r = GpuRouter(RefCpu(name), gpu, crossover_chars=CROSSOVER)
    texts = [TEXTS[1], TEXTS[2]]
    with r.batch(texts):
        assert r.encode(texts[0])[0].tolist() == body(name, texts[0])
        copy = "".join(list(texts[1]))  # equal, not the same object: encoded again
        assert r.encode(copy)[0].tolist() == body(name, texts[1])
    assert len(gpu.batches) == 2 and gpu.batches[1] == [copy]
    r.encode(texts[0])  # outside the block: a new pass
    assert len(gpu.batches) == 3


# ---------------------------------------------------------------- through model.py's execute


def test_execute_one_pass_with_bad_requests(tmp_path, monkeypatch):
    """A toktier_encode GPU instance gets one execute() of 9 requests: invalid UTF-8, a lone surrogate
    (CESU-8 bytes), over max_text_bytes, and six good ones of both flags; one device pass holds the good
    GPU-sized ones, each reply equals HF ``encode(text, add_special_tokens=flag).ids``, each bad one gets
    INVALID_ARG."""
    name = "llama3_1"
    gpu = RefEngine(name)
    monkeypatch.setattr(routing, "_new_gpu_engine", lambda path, device_id: gpu)
    model = load_model("toktier_encode", kind="GPU", device_id=0, parameters={
        "tokenizer": str(tokenizer_path(name)), "engine": "hf", "gpu_crossover_chars": str(CROSSOVER),
        "max_text_bytes": "200", "verifier_rate": "0", "verifier_first_n": "0",
        "quarantine_file": str(tmp_path / "q.json"), "pool_workers": "0", "pool_express": "1", "pool_nice": "0"})
    good = [(TEXTS[1], True), ("hi", None), (TEXTS[3], False), (TEXTS[6], True), (TEXTS[9], False), ("x", True)]
    bad = [b"\xff\xfe not utf-8", "\ud83d".encode("utf-8", "surrogatepass") + b" lone", "z" * 201]
    requests = [encode_request(t, f) for t, f in good[:2]] + [encode_request(b) for b in bad] + \
        [encode_request(t, f) for t, f in good[2:]]
    gpu.batches.clear()  # the canary's calls
    responses = model.execute(requests)
    assert len(responses) == len(requests)
    good_resp = responses[:2] + responses[5:]
    for (text, flag), resp in zip(good, good_resp):
        assert not resp.has_error(), resp.error.message()
        want = reference(name).encode(text, add_special_tokens=True if flag is None else flag).ids
        assert resp.output("INPUT_ID").reshape(-1).tolist() == want, text
    for resp in responses[2:5]:
        assert resp.has_error() and resp.error.code() == 3  # INVALID_ARG
    assert "max_text_bytes" in responses[4].error.message()
    assert gpu.batches == [[t for t, _ in good if len(t) >= CROSSOVER]]
    model.finalize()


def test_pytriton_encode_infer_sends_the_call_as_one_batch(tmp_path):
    """The PyTriton face's callable: its requests go to ``handle_encode_batch`` together (one device
    pass for the GPU-sized ones); a bad request raises (PyTriton 0.7 has no per-request error)."""
    from types import SimpleNamespace

    from toktier_backend.faces.pytriton import encode_infer
    from toktier_backend.faces.triton import Handler

    name = "qwen3"
    gpu = RefEngine(name)
    tok = tt.load_tokenizer(tokenizer_path(name), engine="hf")
    handler = Handler(tok, router=GpuRouter(routing.FreshCpuEngine(tok), gpu, crossover_chars=CROSSOVER))
    infer = encode_infer(handler)

    def req(text, flag=None):
        data = {"TEXT": np.array([[text.encode()]], dtype=np.object_)}
        if flag is not None:
            data["ADD_SPECIAL_TOKENS"] = np.array([[flag]], dtype=bool)
        return SimpleNamespace(data=data, parameters={})

    texts = [TEXTS[1], "hi", TEXTS[2]]
    out = infer([req(t, True) for t in texts])
    for text, o in zip(texts, out):
        want = reference(name).encode(text, add_special_tokens=True).ids or [-1]  # EMPTY_PAD for no ids
        assert o["INPUT_ID"].reshape(-1).tolist() == want
    assert gpu.batches == [[TEXTS[1], TEXTS[2]]]
    with pytest.raises(InvalidRequest, match="max_text_bytes|UTF-8"):
        infer([req(TEXTS[1]), SimpleNamespace(data={"TEXT": np.array([[b"\xff"]], dtype=np.object_)}, parameters={})])
    handler.close()
