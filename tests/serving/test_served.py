"""L0: the real tritonserver (from nvidia-pytriton) and the PyTriton face on loopback. No mocks of Triton.

Every reply is compared with the HF reference ``Tokenizer.from_file(path).encode(text, add_special_tokens=
flag).ids`` computed in the test.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import urllib.request

import numpy as np
import pytest

from toktier_backend.corpus import load_turns, trajectory_files
from toktier_backend.client import SessionClient

from .conftest import IDLE_S, MAX_TEXT_BYTES, hf_ids

pytestmark = pytest.mark.serving

PROTOCOLS = ["grpc", "http"]


def _mod(protocol):
    if protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        import tritonclient.http as mod
    return mod


def _url(server, protocol):
    return server.grpc_url if protocol == "grpc" else server.http_url


def _inputs(mod, text, mode=None, reply=None, add_special=None):
    def t(name, value, dtype):
        arr = np.array([[value]], dtype=np.object_ if dtype == "BYTES" else np.bool_)
        x = mod.InferInput(name, [1, 1], dtype)
        x.set_data_from_numpy(arr)
        return x

    out = [t("TEXT", text if isinstance(text, bytes) else text.encode(), "BYTES")]
    if mode is not None:
        out.append(t("MODE", mode.encode(), "BYTES"))
    if reply is not None:
        out.append(t("REPLY", reply.encode(), "BYTES"))
    if add_special is not None:
        out.append(t("ADD_SPECIAL_TOKENS", add_special, "BOOL"))
    return out


def _get(result, name):
    return result.as_numpy(name).reshape(-1)


def _status(exc) -> str:
    return str(exc.status())


def _turns(limit_chars: int = 20000) -> list[str]:
    turns = load_turns(trajectory_files(None)[0])
    return [t for t in turns if len(t) <= limit_chars]


# ---------------------------------------------------------------- stateless encode


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_encode(native, protocol):
    mod = _mod(protocol)
    client = mod.InferenceServerClient(_url(native, protocol))
    r = client.infer("toktier_encode", _inputs(mod, "hello world"))
    assert _get(r, "INPUT_ID").tolist() == [31373, 995] == hf_ids("bundled", "hello world")
    assert r.as_numpy("INPUT_ID").dtype == np.int32
    for text in ["", "  spaces\t\ttabs\n\n", "naïve café 東京 🤖", "<|endoftext|> x"]:
        for flag in (True, False):
            r = client.infer("toktier_encode", _inputs(mod, text, add_special=flag))
            assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", text, flag)
            assert _get(r, "REQUEST_INPUT_LEN").tolist() == [len(hf_ids("bundled", text, flag))]
    client.close()


# ---------------------------------------------------------------- sessions, raw protocol


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("corr_id", [4242, "agent-🙂-1"], ids=["int-id", "str-id"])
def test_session_protocol(native, protocol, corr_id):
    mod = _mod(protocol)
    client = mod.InferenceServerClient(_url(native, protocol))
    if isinstance(corr_id, int):
        corr_id += len(protocol)  # distinct per protocol
    else:
        corr_id = f"{corr_id}-{protocol}"
    seq = dict(sequence_id=corr_id)

    # START, full text, full reply
    text = "def pipe"
    r = client.infer("toktier_session", _inputs(mod, text), sequence_start=True, **seq)
    held = _get(r, "INPUT_ID").tolist()
    assert held == hf_ids("bundled", text) and _get(r, "KEEP").tolist() == [0]

    # delta + patch: the "pipe" + "line" trap
    for delta in ["line(x):\n", "    return x  ", "\n\n# done"]:
        text += delta
        r = client.infer("toktier_session", _inputs(mod, delta, mode="delta", reply="patch"), **seq)
        keep = int(_get(r, "KEEP")[0])
        held = held[:keep] + _get(r, "INPUT_ID").tolist()
        assert held == hf_ids("bundled", text)
        assert int(_get(r, "REQUEST_INPUT_LEN")[0]) == len(held)
        assert _get(r, "ROUTE")[0]

    # full mode with an edit in the middle, full reply
    text = text.replace("return x", "return 2 * x")
    r = client.infer("toktier_session", _inputs(mod, text, mode="full", reply="full"), **seq)
    held = _get(r, "INPUT_ID").tolist()
    assert held == hf_ids("bundled", text)

    # END frees the state: the sequence is over for Triton too
    r = client.infer("toktier_session", _inputs(mod, "!", mode="delta", reply="patch"), sequence_end=True, **seq)
    keep = int(_get(r, "KEEP")[0])
    assert held[:keep] + _get(r, "INPUT_ID").tolist() == hf_ids("bundled", text + "!")
    with pytest.raises(Exception, match="START flag"):
        client.infer("toktier_session", _inputs(mod, "?", mode="delta"), **seq)

    # a new START on the same correlation ID begins from nothing
    r = client.infer("toktier_session", _inputs(mod, "fresh"), sequence_start=True, sequence_end=True, **seq)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "fresh") and _get(r, "KEEP").tolist() == [0]
    client.close()


def test_int_and_str_ids_are_distinct_sessions(native):
    mod = _mod("grpc")
    client = mod.InferenceServerClient(native.grpc_url)
    client.infer("toktier_session", _inputs(mod, "integer"), sequence_id=31, sequence_start=True)
    client.infer("toktier_session", _inputs(mod, "string"), sequence_id="31", sequence_start=True)
    a = client.infer("toktier_session", _inputs(mod, "", mode="delta"), sequence_id=31, sequence_end=True)
    b = client.infer("toktier_session", _inputs(mod, "", mode="delta"), sequence_id="31", sequence_end=True)
    assert _get(a, "INPUT_ID").tolist() == hf_ids("bundled", "integer")
    assert _get(b, "INPUT_ID").tolist() == hf_ids("bundled", "string")
    client.close()


def test_add_special_tokens_false_sticks(native):
    mod = _mod("grpc")
    client = mod.InferenceServerClient(native.grpc_url)
    client.infer("toktier_session", _inputs(mod, "a b", add_special=False), sequence_id=55, sequence_start=True)
    r = client.infer("toktier_session", _inputs(mod, " c", mode="delta"), sequence_id=55)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "a b c", False)
    with pytest.raises(Exception, match="INVALID_ARG.*ADD_SPECIAL_TOKENS"):
        client.infer("toktier_session", _inputs(mod, " d", mode="delta", add_special=True), sequence_id=55)
    client.infer("toktier_session", _inputs(mod, "", mode="delta"), sequence_id=55, sequence_end=True)
    client.close()


# ---------------------------------------------------------------- bad input: per-request errors


BAD = [
    pytest.param(b"bad \xff byte", "not valid UTF-8", id="invalid-utf8"),
    pytest.param("lone ".encode() + b"\xed\xa0\x80" + b" surrogate", "not valid UTF-8", id="lone-surrogate"),
    pytest.param(b"a" * (MAX_TEXT_BYTES + 1), "max_text_bytes", id="oversize"),
]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("raw, why", BAD)
def test_bad_input_is_invalid_arg_and_session_survives(native, protocol, raw, why):
    mod = _mod(protocol)
    client = mod.InferenceServerClient(_url(native, protocol))
    sid = f"bad-{protocol}-{why[:6]}-{len(raw)}"
    client.infer("toktier_session", _inputs(mod, "kept text"), sequence_id=sid, sequence_start=True)
    with pytest.raises(Exception) as e:
        client.infer("toktier_session", _inputs(mod, raw, mode="delta"), sequence_id=sid)
    assert _status(e.value) in ("StatusCode.INVALID_ARGUMENT", "400") and why in str(e.value)
    assert "InvalidRequest" in str(e.value) and repr(sid) in str(e.value)
    with pytest.raises(Exception) as e:
        client.infer("toktier_encode", _inputs(mod, raw))
    assert _status(e.value) in ("StatusCode.INVALID_ARGUMENT", "400") and why in str(e.value)
    # the instance lives on and the session is unchanged
    r = client.infer("toktier_session", _inputs(mod, "!", mode="delta"), sequence_id=sid, sequence_end=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "kept text!")
    client.close()


def test_one_bad_request_never_fails_the_batch(native):
    """Many concurrent encode requests, every third one bad: the dynamic batcher mixes them; only the
    bad ones fail."""
    mod = _mod("grpc")
    client = mod.InferenceServerClient(native.grpc_url)
    texts = [b"\xff oops" if i % 3 == 0 else f"request {i} text".encode() for i in range(48)]

    def one(raw):
        try:
            return _get(client.infer("toktier_encode", _inputs(mod, raw)), "INPUT_ID").tolist()
        except Exception as e:  # noqa: BLE001
            return e

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, texts))
    for raw, res in zip(texts, results):
        if raw.startswith(b"\xff"):
            assert isinstance(res, Exception) and "INVALID_ARG" in str(res.status())
        else:
            assert res == hf_ids("bundled", raw.decode())
    client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_delta_for_unheld_session_is_not_found(native, protocol):
    mod = _mod(protocol)
    client = mod.InferenceServerClient(_url(native, protocol))
    sid = f"lost-{protocol}"
    # a START whose text is bad: Triton opens the sequence, the model holds no session for it
    with pytest.raises(Exception):
        client.infer("toktier_session", _inputs(mod, b"\xff"), sequence_id=sid, sequence_start=True)
    with pytest.raises(Exception) as e:
        client.infer("toktier_session", _inputs(mod, "more", mode="delta"), sequence_id=sid)
    assert _status(e.value) in ("StatusCode.NOT_FOUND", "404")
    assert "UnknownSession" in str(e.value) and "MODE='full'" in str(e.value)
    # the way out: the whole text, no START needed
    r = client.infer("toktier_session", _inputs(mod, "whole text"), sequence_id=sid, sequence_end=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "whole text")
    client.close()


# ---------------------------------------------------------------- SessionClient, concurrency, timeout


def test_concurrent_sessions_replay_real_trajectory(native):
    """Six sessions at once (gRPC and HTTP, int and str IDs), each replaying a SWE-agent trajectory turn
    by turn in delta mode with patch replies; every turn equals the HF reference."""
    turns = _turns()
    assert len(turns) >= 5

    def replay(k):
        protocol = PROTOCOLS[k % 2]
        sid = 9000 + k if k % 3 else f"replay-{k}"
        c = SessionClient(_url(native, protocol), protocol=protocol, session_id=sid)
        c.open(turns[0])
        assert c.ids.tolist() == hf_ids("bundled", turns[0])
        routes = []
        for prev, cur in zip(turns, turns[1:]):
            c.append(cur[len(prev):])
            assert c.ids.tolist() == hf_ids("bundled", cur), (k, len(cur))
            assert c.last.keep > 0
            routes.append(c.last.route)
        c.close()
        return routes

    with cf.ThreadPoolExecutor(6) as pool:
        for routes in pool.map(replay, range(6)):
            assert len(routes) == len(turns) - 1


def test_session_client_update_full_mode(native):
    with SessionClient(native.http_url, protocol="http", reply="full") as c:
        for text in ["The quick", "The quick brown fox", "The quick red fox", "The"]:
            assert c.update(text).tolist() == hf_ids("bundled", text)


def test_client_reopens_after_model_lost_session(native):
    mod = _mod("grpc")
    raw = mod.InferenceServerClient(native.grpc_url)
    c = SessionClient(native.grpc_url, session_id="reopen-notfound")
    c.open("first part")
    # make the instance forget the session while Triton's sequence stays live
    with pytest.raises(Exception):
        raw.infer("toktier_session", _inputs(mod, b"\xff"), sequence_id="reopen-notfound", sequence_start=True)
    assert c.append(", second part").tolist() == hf_ids("bundled", "first part, second part")
    assert c.reopens == 1 and c.last.reopened and c.last.keep == 0
    assert c.append("!").tolist() == hf_ids("bundled", "first part, second part!")
    c.close()
    raw.close()


def test_client_lost_reply_resends_whole_text(native):
    """The server applied a delta but the reply was lost (simulated on the client side, after the real
    request): the next request must not build on ids the client never got."""
    c = SessionClient(native.grpc_url, session_id="lost-reply")
    c.open("base text")
    real = c._client.infer

    def infer_then_drop(*args, **kwargs):
        real(*args, **kwargs)
        raise ConnectionError("reply lost")

    c._client.infer = infer_then_drop
    with pytest.raises(ConnectionError):
        c.append(" applied but unconfirmed")
    c._client.infer = real
    assert c.append(" next").tolist() == hf_ids("bundled", "base text next")
    assert c.last.reopened and c.append("!").tolist() == hf_ids("bundled", "base text next!")
    c.close()


def test_idle_timeout_then_new_start(native):
    """The sequence batcher drops a sequence idle past max_sequence_idle_microseconds (IDLE_S here) and
    the store forgets it too; a raw client must START again; SessionClient re-opens by itself."""
    mod = _mod("grpc")
    raw = mod.InferenceServerClient(native.grpc_url)
    raw.infer("toktier_session", _inputs(mod, "idle one"), sequence_id="idle-raw", sequence_start=True)
    c = SessionClient(native.grpc_url, session_id=777001)
    c.open("idle two")
    time.sleep(IDLE_S + 2.0)
    with pytest.raises(Exception, match="START flag"):
        raw.infer("toktier_session", _inputs(mod, " more", mode="delta"), sequence_id="idle-raw")
    r = raw.infer("toktier_session", _inputs(mod, "idle one more", reply="patch"), sequence_id="idle-raw",
                  sequence_start=True, sequence_end=True)
    assert _get(r, "KEEP").tolist() == [0] and _get(r, "INPUT_ID").tolist() == hf_ids("bundled", "idle one more")
    assert c.append(" more").tolist() == hf_ids("bundled", "idle two more")
    assert c.reopens == 1
    c.close()
    raw.close()


def test_metrics_endpoint(native):
    body = urllib.request.urlopen(native.metrics_url, timeout=5).read().decode()
    assert 'nv_inference_request_success{model="toktier_session"' in body
    assert 'nv_inference_request_success{model="toktier_encode"' in body


# ---------------------------------------------------------------- another tokenizer family


def test_family_replay_delta_patch(native_family):
    name = native_family.family
    turns = load_turns(trajectory_files(None)[1])[:10]
    for protocol in PROTOCOLS:
        with SessionClient(_url(native_family, protocol), protocol=protocol) as c:
            c.open(turns[0])
            assert c.ids.tolist() == hf_ids(name, turns[0])
            for prev, cur in zip(turns, turns[1:]):
                assert c.append(cur[len(prev):]).tolist() == hf_ids(name, cur)
            # traps: a split special token "<|im_" + "end|>", Llama-3 digit groups "1234" + "5"
            for delta in ["<|im_", "end|>\n", "x = 1234", "5", "678\n"]:
                assert c.append(delta).tolist() == hf_ids(name, c.text), (name, delta)
    mod = _mod("grpc")
    client = mod.InferenceServerClient(native_family.grpc_url)
    for flag in (True, False):  # llama3_1 adds <|begin_of_text|> with add_special_tokens=True
        r = client.infer("toktier_encode", _inputs(mod, turns[-1], add_special=flag))
        assert _get(r, "INPUT_ID").tolist() == hf_ids(name, turns[-1], flag)
        r = client.infer("toktier_session", _inputs(mod, "12345 tokens", add_special=flag),
                         sequence_id=f"flag-{flag}", sequence_start=True)
        r = client.infer("toktier_session", _inputs(mod, "678", mode="delta", reply="full"),
                         sequence_id=f"flag-{flag}", sequence_end=True)
        assert _get(r, "INPUT_ID").tolist() == hf_ids(name, "12345 tokens678", flag)
    client.close()


# ---------------------------------------------------------------- the PyTriton face


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("sid", [31337, "py-face"], ids=["int-id", "str-id"])
def test_pytriton_session(pytriton_face, protocol, sid):
    mod = _mod(protocol)
    client = mod.InferenceServerClient(_url(pytriton_face, protocol))
    sid = sid + len(protocol) if isinstance(sid, int) else f"{sid}-{protocol}"

    def call(text, mode=None, reply=None, start=False, end=False):
        return client.infer("toktier_session", _inputs(mod, text, mode=mode, reply=reply),
                            parameters={"session_id": sid, "session_start": start, "session_end": end})

    text = "pytriton pipe"
    held = _get(call(text, start=True), "INPUT_ID").tolist()
    assert held == hf_ids("gpt2", text)
    for delta in ["line", " and more text\n"]:
        text += delta
        r = call(delta, mode="delta", reply="patch")
        held = held[: int(_get(r, "KEEP")[0])] + _get(r, "INPUT_ID").tolist()
        assert held == hf_ids("gpt2", text)
    with pytest.raises(Exception, match="not valid UTF-8"):
        call(b"\xff", mode="delta")
    r = call("", mode="delta", end=True)
    assert _get(r, "INPUT_ID").tolist() == hf_ids("gpt2", text)
    with pytest.raises(Exception, match="UnknownSession"):
        call("x", mode="delta")
    r = client.infer("toktier_encode", _inputs(mod, "hello world"))
    assert _get(r, "INPUT_ID").tolist() == [31373, 995]
    # PyTriton 0.7 cannot send a zero-size tensor: "no ids" is [-1] with REQUEST_INPUT_LEN 0
    r = client.infer("toktier_encode", _inputs(mod, ""))
    assert _get(r, "INPUT_ID").tolist() == [-1] and _get(r, "REQUEST_INPUT_LEN").tolist() == [0] == [len(hf_ids("gpt2", ""))]
    client.close()


def test_pytriton_session_client(pytriton_face):
    turns = _turns()[:6]
    with SessionClient(pytriton_face.grpc_url, face="pytriton") as c:
        c.open(turns[0])
        for prev, cur in zip(turns, turns[1:]):
            assert c.append(cur[len(prev):]).tolist() == hf_ids("gpt2", cur)
    # the server lost the session: the client resends the whole text
    c = SessionClient(pytriton_face.http_url, protocol="http", face="pytriton", session_id="py-lost")
    c.open("abc")
    pytriton_face.handler.store.pop("py-lost")
    assert c.append(" def").tolist() == hf_ids("gpt2", "abc def") and c.reopens == 1
    c.close()
