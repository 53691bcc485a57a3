"""Unit tests of the request handler and tensor helpers: no Triton, no network.

Every id is checked against the HF reference computed here (``hf_ids``).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import toktier_backend as tt
from toktier_backend.faces import triton_io
from toktier_backend.faces.triton import Handler, SessionStore

from ..serving.conftest import BUNDLED, REPO, hf_ids


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def tok():
    return tt.load_tokenizer(BUNDLED)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def handler(tok, clock):
    return Handler(tok, name="bundled-gpt2", max_text_bytes=1000, session_ttl_s=10, clock=clock)


def ids(out):
    return out["INPUT_ID"].tolist()


def scalar(out, k):
    return out[k].reshape(-1)[0]


# ---------------------------------------------------------------- exact values


def test_encode_literal_ids(handler):
    # provenance: HF tokenizers 0.23.3, openai-community/gpt2 tokenizer.json (bundled)
    out = handler.handle_encode(b"hello world")
    assert ids(out) == [31373, 995] == hf_ids("bundled", "hello world")
    assert out["INPUT_ID"].dtype == np.int32 and out["REQUEST_INPUT_LEN"].tolist() == [2]


def test_session_full_then_delta_patch(handler):
    a = handler.handle_session(7, b"hello", start=True)
    assert ids(a) == [31373] and scalar(a, "KEEP") == 0 and scalar(a, "REQUEST_INPUT_LEN") == 1
    b = handler.handle_session(7, b" world", mode="delta", reply="patch")
    keep = int(scalar(b, "KEEP"))
    assert [31373][:keep] + ids(b) == hf_ids("bundled", "hello world") == [31373, 995]
    assert scalar(b, "REQUEST_INPUT_LEN") == 2
    assert isinstance(scalar(b, "ROUTE"), bytes)


def test_pipe_line_trap_patch_is_exact(handler):
    # "pipe" + "line": the last id of the previous reply is not kept
    text, full = "", []
    for i, piece in enumerate(["x = pipe", "line", "(1)\n", " pipeline"]):
        text += piece
        out = handler.handle_session("s", piece.encode(), mode="full" if i == 0 else "delta", reply="patch", start=i == 0)
        full = full[: int(scalar(out, "KEEP"))] + ids(out)
        assert full == hf_ids("bundled", text)
        assert scalar(out, "REQUEST_INPUT_LEN") == len(full)


def test_full_mode_edit_and_string_vs_int_ids(handler):
    handler.handle_session(17, b"alpha beta", start=True)
    handler.handle_session("17", b"gamma", start=True)
    out = handler.handle_session(17, b"alpha bet", reply="full")  # truncation in full mode
    assert ids(out) == hf_ids("bundled", "alpha bet")
    assert ids(handler.handle_session("17", b"", mode="delta")) == hf_ids("bundled", "gamma")


def test_add_special_tokens_flag(tok, clock):
    # qwen-style files add nothing; gpt2 adds nothing either: check the flag reaches the session and sticks
    h = Handler(tok, max_text_bytes=1000, session_ttl_s=10, clock=clock)
    out = h.handle_session(1, b"hi", add_special=False, start=True)
    assert ids(out) == hf_ids("bundled", "hi", False)
    with pytest.raises(tt.InvalidRequest, match="ADD_SPECIAL_TOKENS"):
        h.handle_session(1, b"!", mode="delta", add_special=True)
    assert ids(h.handle_session(1, b"!", mode="delta")) == hf_ids("bundled", "hi!", False)


# ---------------------------------------------------------------- START / END / TTL


def test_delta_unknown_session_is_not_found(handler):
    with pytest.raises(tt.UnknownSession, match="MODE='full'"):
        handler.handle_session(99, b"x", mode="delta")


def test_start_with_delta_rejected(handler):
    with pytest.raises(tt.InvalidRequest, match="START"):
        handler.handle_session(5, b"x", mode="delta", start=True)


def test_failed_first_update_holds_nothing(tok, clock):
    class Refusing:  # a core session that refuses its first text (as the core does over its size limit)
        def session(self, *, add_special_tokens=True):
            s = tok.session(add_special_tokens=add_special_tokens)

            def update(text):
                raise tt.InvalidRequest("refused")

            s.update = update
            return s

    h = Handler(Refusing(), max_text_bytes=1000, session_ttl_s=10, clock=clock)
    with pytest.raises(tt.InvalidRequest):
        h.handle_session(12, b"some text", start=True)
    assert 12 not in h.store
    with pytest.raises(tt.UnknownSession):
        h.handle_session(12, b"x", mode="delta")


def test_end_frees_state_even_on_error(handler):
    handler.handle_session(3, b"one", start=True)
    handler.handle_session(3, b" two", mode="delta", end=True)
    assert 3 not in handler.store
    handler.handle_session(4, b"one", start=True)
    with pytest.raises(tt.InvalidRequest):
        handler.handle_session(4, b"\xff", mode="delta", end=True)
    assert 4 not in handler.store


def test_start_drops_previous_state_even_on_bad_tensors(handler):
    handler.handle_session(8, b"old text", start=True)
    with pytest.raises(tt.InvalidRequest):
        handler.handle_session_tensors(8, {"TEXT": np.array([[b"a"], [b"b"]], dtype=object)}, start=True, end=False)
    assert 8 not in handler.store
    with pytest.raises(tt.UnknownSession):
        handler.handle_session(8, b"x", mode="delta")


def test_ttl_expires_idle_sessions(handler, clock):
    handler.handle_session(1, b"a", start=True)
    clock.t += 9.9
    handler.handle_session(1, b"b", mode="delta")  # still alive: TTL counts from the last request
    clock.t += 10.1
    with pytest.raises(tt.UnknownSession):
        handler.handle_session(1, b"c", mode="delta")
    assert handler.store.expired == 1


def test_store_sweep(clock):
    store = SessionStore(ttl_s=5, clock=clock)
    from toktier_backend.faces.triton import SessionEntry

    for k in range(3):
        store.put(k, SessionEntry(session=None, add_special_tokens=True, text_bytes=0, last_used=clock()))
    clock.t += 6
    assert store.expire(force=True) == 3 and len(store) == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "raw, why",
    [(b"\xff\xfe", "UTF-8"), (b"ok \xed\xa0\x80", "UTF-8"), (b"\xc3", "UTF-8"), ("lone \ud800 surrogate", "surrogate")],
)
def test_bad_text_is_invalid_request_and_state_kept(handler, raw, why):
    handler.handle_session(2, b"keep me", start=True)
    with pytest.raises(tt.InvalidRequest, match=why):
        handler.handle_session(2, raw, mode="delta")
    with pytest.raises(tt.InvalidRequest, match=why):
        handler.handle_encode(raw)
    assert ids(handler.handle_session(2, b"", mode="delta")) == hf_ids("bundled", "keep me")


def test_oversize(handler):
    with pytest.raises(tt.InvalidRequest, match="max_text_bytes=1000"):
        handler.handle_encode(b"a" * 1001)
    handler.handle_session(6, b"a" * 600, start=True)
    with pytest.raises(tt.InvalidRequest, match="would grow to 1200 bytes"):
        handler.handle_session(6, b"b" * 600, mode="delta")
    assert scalar(handler.handle_session(6, b"", mode="delta"), "REQUEST_INPUT_LEN") == len(hf_ids("bundled", "a" * 600))


@pytest.mark.parametrize("field, value", [("mode", "append"), ("reply", "diff")])
def test_bad_mode_reply(handler, field, value):
    with pytest.raises(tt.InvalidRequest, match=value):
        handler.handle_session(1, b"x", start=True, **{field: value})


def test_zero_correlation_id_rejected(handler):
    with pytest.raises(tt.InvalidRequest, match="correlation ID"):
        handler.handle_session(0, b"x", start=True)


# ---------------------------------------------------------------- tensor helpers


def test_tensor_inputs_batched_and_not(handler):
    for shape in ([1], [1, 1]):
        inputs = {
            "TEXT": np.array([b"hello world"], dtype=object).reshape(shape),
            "MODE": np.array([b"full"], dtype=object).reshape(shape),
            "REPLY": None,
            "ADD_SPECIAL_TOKENS": np.array([True]).reshape(shape),
        }
        out = handler.handle_session_tensors(11, inputs, start=True, end=True)
        assert ids(out) == [31373, 995]
        batched = triton_io.with_batch_dim(out, True)
        assert batched["INPUT_ID"].shape == (1, 2) and batched["ROUTE"].shape == (1, 1)


def test_missing_text(handler):
    with pytest.raises(tt.InvalidRequest, match="'TEXT' is required"):
        handler.handle_encode_tensors({"TEXT": None})


def test_error_codes():
    assert triton_io.error_code(tt.InvalidRequest("x")) == "INVALID_ARG"
    assert triton_io.error_code(tt.UnknownSession("x")) == "NOT_FOUND"
    assert triton_io.error_code(tt.EngineUnavailable("x")) == "UNAVAILABLE"
    assert triton_io.error_code(RuntimeError("x")) == "INTERNAL"
    assert triton_io.error_message(tt.UnknownSession("gone")) == "UnknownSession: gone"


def test_model_config_helpers():
    cfg = {
        "max_batch_size": 8,
        "parameters": {"tokenizer": {"string_value": "/x/tokenizer.json"}},
        "sequence_batching": {"max_sequence_idle_microseconds": "2500000"},
    }
    assert triton_io.model_parameters(cfg) == {"tokenizer": "/x/tokenizer.json"}
    assert triton_io.sequence_idle_seconds(cfg, 1.0) == 2.5
    assert triton_io.sequence_idle_seconds({}, 1.0) == 1.0
    assert triton_io.is_batched(cfg)


def test_import_hygiene():
    """Importing the serving modules pulls in neither tritonclient nor pytriton (lazy imports)."""
    code = (
        "import sys\n"
        "import toktier_backend.faces.triton, toktier_backend.faces.triton_io\n"
        "import toktier_backend.deploy.server, toktier_backend.client, toktier_backend.deploy.cli_serve\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tritonclient', 'pytriton', 'triton_python_backend_utils')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
