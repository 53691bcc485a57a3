"""L0: chat requests (``MESSAGES``) to ``toktier_session`` in the real tritonserver (nvidia-pytriton), on
loopback. A real SWE-agent trajectory (``../shared/corpus/swe-agent``) is sent turn by turn under one
sequence, with Qwen3's real chat template (``../shared/chat_templates/qwen3``). Every reply is compared with
ids computed here: transformers renders (``apply_chat_template(tokenize=False)``), HF ``tokenizers`` encodes
(``add_special_tokens=False``), and once with ``apply_chat_template(tokenize=True)`` itself.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.chat.conftest import hf_tokenizer
from tests.chat.corpus import conversation, trajectories

from .conftest import _need_serving_deps, _start, hf_ids, metric, scrape

pytestmark = pytest.mark.serving

NAME = "qwen3"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, chat_folder):
    """tritonserver with our repository on the qwen3 folder (tokenizer.json + its real tokenizer_config.json),
    every reply verified, its own quarantine file, the toktier_* exporter on a free port."""
    _need_serving_deps()
    from toktier_backend.deploy.server import TritonServer

    folder = chat_folder(NAME)
    tmp = tmp_path_factory.mktemp("chat_served")
    server = TritonServer(str(folder), http_port=0, grpc_port=0, metrics_port=0, session_idle_s=60,
                          log_path=tmp / "tritonserver.log", exit_timeout_s=3, toktier_metrics_port=0,
                          parameters={"quarantine_file": str(tmp / "quarantine.json"), "verifier_rate": "1.0"})
    server.folder = folder
    _start(server, tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pytriton_chat(tmp_path_factory, chat_folder):
    """The same handler through PyTriton on the qwen3 folder, every reply verified."""
    _need_serving_deps()
    from toktier_backend.deploy.server import PyTritonServer

    folder = chat_folder(NAME)
    tmp = tmp_path_factory.mktemp("chat_pytriton")
    server = PyTritonServer(str(folder), http_port=0, grpc_port=0, metrics_port=0, session_idle_s=60,
                            log_path=tmp / "tritonserver.log",
                            parameters={"quarantine_file": str(tmp / "quarantine.json"), "verifier_rate": "1.0"})
    server.folder = folder
    _start(server, tmp_path_factory)
    yield server
    server.stop()


def _chat_inputs(mod, messages=None, *, agp=None, kwargs=None, text=None, mode=None, reply=None, raw=None):
    def t(name, value, dtype):
        x = mod.InferInput(name, [1, 1], dtype)
        x.set_data_from_numpy(np.array([[value]], dtype=np.object_ if dtype == "BYTES" else np.bool_))
        return x

    out = []
    if messages is not None or raw is not None:
        out.append(t("MESSAGES", raw if raw is not None else json.dumps(messages).encode(), "BYTES"))
    if agp is not None:
        out.append(t("ADD_GENERATION_PROMPT", agp, "BOOL"))
    if kwargs is not None:
        out.append(t("CHAT_TEMPLATE_KWARGS", json.dumps(kwargs).encode(), "BYTES"))
    if text is not None:
        out.append(t("TEXT", text.encode(), "BYTES"))
    if mode is not None:
        out.append(t("MODE", mode.encode(), "BYTES"))
    if reply is not None:
        out.append(t("REPLY", reply.encode(), "BYTES"))
    return out


def _conv(n: int = 14) -> list[dict]:
    path = next(f for f in trajectories() if "function_calling" in f.name)
    return conversation(NAME, path)[:n]


def _want(folder, messages, **options) -> list[int]:
    text = hf_tokenizer(str(folder)).apply_chat_template(messages, tokenize=False, **options)
    return hf_ids(NAME, text, add_special_tokens=False)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_messages_turn_by_turn_equal_transformers(chat_server, protocol):
    if protocol == "grpc":
        import tritonclient.grpc as mod
        url = chat_server.grpc_url
    else:
        import tritonclient.http as mod
        url = chat_server.http_url
    client = mod.InferenceServerClient(url)
    conv = _conv()
    seq = f"chat-{protocol}"
    kw = {"tools": TOOLS}
    full: list[int] = []
    for i in range(2, len(conv) + 1):
        agp = conv[i - 1]["role"] != "assistant"
        reply = "patch" if i % 2 else None
        r = client.infer("toktier_session", _chat_inputs(mod, conv[:i], agp=agp, kwargs=kw, reply=reply),
                         sequence_id=seq, sequence_start=i == 2, sequence_end=i == len(conv))
        want = _want(chat_server.folder, conv[:i], add_generation_prompt=agp, tools=TOOLS)
        ids = r.as_numpy("INPUT_ID").reshape(-1).tolist()
        keep = int(r.as_numpy("KEEP").reshape(-1)[0])
        n = int(r.as_numpy("REQUEST_INPUT_LEN").reshape(-1)[0])
        got = full[:keep] + ids if reply == "patch" else ids
        assert got == want and n == len(want), (protocol, i)
        if i > 2:
            assert keep > 0 and r.as_numpy("ROUTE").reshape(-1)[0].decode() in ("append", "edit", "noop"), i
        full = got
    # transformers' own tokenize=True agrees on the last turn
    hf = hf_tokenizer(str(chat_server.folder))
    assert full == hf.apply_chat_template(conv, tokenize=True, return_dict=False, add_generation_prompt=agp,
                                          tools=TOOLS)


def test_delta_of_messages_turn_by_turn(chat_server):
    """``MODE=delta``: START carries the first messages, each later request only the messages after the
    previous request's, ``REPLY=patch``. The client's ids (kept + patch) equal transformers + HF tokenizers
    on the whole conversation each turn."""
    import tritonclient.grpc as mod

    client = mod.InferenceServerClient(chat_server.grpc_url)
    conv = _conv()
    kw = {"tools": TOOLS}
    r = client.infer("toktier_session", _chat_inputs(mod, conv[:3], agp=True, kwargs=kw),
                     sequence_id="delta-1", sequence_start=True)
    full = r.as_numpy("INPUT_ID").reshape(-1).tolist()
    assert full == _want(chat_server.folder, conv[:3], add_generation_prompt=True, tools=TOOLS)
    for i in range(3, len(conv) - 1, 2):
        r = client.infer("toktier_session", _chat_inputs(mod, conv[i:i + 2], agp=True, kwargs=kw, mode="delta",
                                                         reply="patch"),
                         sequence_id="delta-1", sequence_end=i + 3 >= len(conv))
        keep = int(r.as_numpy("KEEP").reshape(-1)[0])
        full = full[:keep] + r.as_numpy("INPUT_ID").reshape(-1).tolist()
        assert full == _want(chat_server.folder, conv[:i + 2], add_generation_prompt=True, tools=TOOLS), i
        assert keep > 0


def test_pytriton_messages_full_then_delta(pytriton_chat):
    """The PyTriton face takes the same chat inputs (keyed by the ``session_id`` parameter): whole
    conversations, then deltas of messages; every reply equals transformers + HF tokenizers."""
    import tritonclient.grpc as mod

    client = mod.InferenceServerClient(pytriton_chat.grpc_url)
    conv = _conv()
    kw = {"tools": TOOLS}
    for i in range(2, len(conv) + 1, 2):
        delta = i > 6
        msgs = conv[i - 2:i] if delta else conv[:i]
        r = client.infer("toktier_session", _chat_inputs(mod, msgs, agp=True, kwargs=kw,
                                                         mode="delta" if delta else None),
                         parameters={"session_id": "py-chat", "session_start": i == 2})
        ids = r.as_numpy("INPUT_ID").reshape(-1).tolist()
        assert ids == _want(pytriton_chat.folder, conv[:i], add_generation_prompt=True, tools=TOOLS), i
    handler = pytriton_chat.handler
    assert handler.core.verifier.drain() and handler.core.verifier.mismatches == 0
    assert handler.core.verifier.samples >= 1
    client.close()


def test_enable_thinking_and_continue_final_message(chat_server):
    import tritonclient.grpc as mod

    client = mod.InferenceServerClient(chat_server.grpc_url)
    conv = _conv(4)
    r = client.infer("toktier_session", _chat_inputs(mod, conv, agp=True, kwargs={"enable_thinking": False}),
                     sequence_id="think", sequence_start=True)
    assert r.as_numpy("INPUT_ID").reshape(-1).tolist() == _want(chat_server.folder, conv, add_generation_prompt=True,
                                                                 enable_thinking=False)
    partial = conv + [{"role": "assistant", "content": "Let me look at"}]
    r = client.infer("toktier_session", _chat_inputs(mod, partial, kwargs={"continue_final_message": True}),
                     sequence_id="think", sequence_end=True)
    assert r.as_numpy("INPUT_ID").reshape(-1).tolist() == _want(chat_server.folder, partial,
                                                                 continue_final_message=True)


@pytest.mark.parametrize("case, why", [
    ("both", "both 'TEXT' and 'MESSAGES'"),
    ("neither", "exactly one of the inputs"),
    ("not_json", "not JSON"),
    ("not_array", "JSON array of message objects"),
    ("element", "element 1 is a int"),
    ("refused", "the chat template (refused|failed on) the request"),
])
def test_bad_chat_requests_are_invalid_arg(chat_server, case, why):
    import tritonclient.grpc as mod
    from tritonclient.utils import InferenceServerException

    conv = _conv(3)
    inputs = {
        "both": lambda: _chat_inputs(mod, conv, text="hello"),
        "neither": lambda: _chat_inputs(mod, agp=True),
        "not_json": lambda: _chat_inputs(mod, raw=b"[{not json"),
        "not_array": lambda: _chat_inputs(mod, raw=b'{"role": "user"}'),
        "element": lambda: _chat_inputs(mod, raw=b'[{"role": "user", "content": "x"}, 3]'),
        "refused": lambda: _chat_inputs(mod, raw=b'[{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]'),
    }[case]()
    client = mod.InferenceServerClient(chat_server.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        client.infer("toktier_session", inputs, sequence_id=f"bad-{case}", sequence_start=True, sequence_end=True)
    assert "INVALID_ARG" in str(e.value.status())
    import re
    assert re.search(why, str(e.value)), str(e.value)


def test_delta_without_a_previous_chat_request_is_refused(chat_server):
    """``MODE=delta`` with ``MESSAGES`` on START: INVALID_ARG (as a text delta on START); after a ``TEXT``
    request of the sequence: NOT_FOUND, as a text delta for an unknown session. Both ask for the whole
    conversation."""
    import tritonclient.grpc as mod
    from tritonclient.utils import InferenceServerException

    client = mod.InferenceServerClient(chat_server.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        client.infer("toktier_session", _chat_inputs(mod, _conv(3), mode="delta"), sequence_id="bad-delta",
                     sequence_start=True, sequence_end=True)
    assert "INVALID_ARG" in str(e.value.status()) and "MODE=full" in str(e.value), str(e.value)
    client.infer("toktier_session", _chat_inputs(mod, text="plain text"), sequence_id="bad-delta-2",
                 sequence_start=True)
    with pytest.raises(InferenceServerException) as e:
        client.infer("toktier_session", _chat_inputs(mod, _conv(3), mode="delta"), sequence_id="bad-delta-2",
                     sequence_end=True)
    assert "NOT_FOUND" in str(e.value.status()) and "MODE=full" in str(e.value), str(e.value)


def test_chat_renders_counted_and_verified(chat_server):
    """Metrics carry the face label; every chat reply was re-rendered and re-encoded by the verifier and
    matched (no quarantine)."""
    import time

    import tritonclient.grpc as mod

    client = mod.InferenceServerClient(chat_server.grpc_url)
    conv = _conv(6)
    for i in range(2, len(conv) + 1):
        client.infer("toktier_session", _chat_inputs(mod, conv[:i], agp=True), sequence_id="counted",
                     sequence_start=i == 2, sequence_end=i == len(conv))
    deadline = time.time() + 30
    while True:
        s = scrape(chat_server.toktier_metrics_url)
        inc = metric(s, "toktier_chat_renders_total", face="triton", model="toktier_session", route="incremental")
        match = metric(s, "toktier_verifier_samples_total", face="triton", model="toktier_session", result="match")
        if (inc >= len(conv) - 1 and match >= len(conv) - 1) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert inc >= len(conv) - 1
    assert metric(s, "toktier_requests_total", face="triton", model="toktier_session", mode="chat") >= len(conv) - 1
    assert match >= len(conv) - 1
    assert metric(s, "toktier_verifier_samples_total", face="triton", result="mismatch") == 0
    assert metric(s, "toktier_chat_template_quarantined", face="triton") == 0
