"""The proxy's chat route through the core's chat step, on a real SWE-agent trajectory with Qwen3's real chat
template. Each forwarded prompt is compared with ids computed here: transformers renders
(``apply_chat_template(tokenize=False)``), HF ``tokenizers`` encodes (``add_special_tokens=False``)."""

from __future__ import annotations

import json
import threading

import pytest
from prometheus_client import CollectorRegistry

import toktier_backend as tt
from tests.chat.corpus import conversation, trajectories
from toktier_backend.chat.template import load_chat_template, special_tokens
from toktier_backend.faces.proxy import TokenProxy, make_server
from toktier_backend.serving.core import ServingCore
from toktier_backend.serving.metrics import Metrics
from toktier_backend.serving.verifier import Verifier

from .conftest import auto_tokenizer, hf_ids
from .test_proxy import FakeUpstream, post

NAME = "qwen3"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]


@pytest.fixture(scope="module")
def served(chat_folder, tmp_path_factory):
    """(proxy base URL, upstream, core, metric reader): the proxy on a core with every reply verified."""
    folder = chat_folder(NAME)
    path = folder / "tokenizer.json"
    tok = tt.load_tokenizer(str(path))
    reg = CollectorRegistry()
    verifier = Verifier(tok, rate=1.0, first_n=0,
                        quarantine_file=tmp_path_factory.mktemp("q") / "quarantine.json")
    core = ServingCore(tok, verifier=verifier, metrics=Metrics(reg), chat_template=load_chat_template(path),
                       special_tokens=special_tokens(path), min_prefix_chars=2048)
    upstream = FakeUpstream()
    proxy = TokenProxy(core, upstream.url + "/v1")
    server = make_server(proxy, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def value(name, **labels):
        want = set(labels.items())
        return sum(s.value for fam in reg.collect() for s in fam.samples
                   if s.name == name and want <= set(s.labels.items()))

    yield f"http://127.0.0.1:{server.server_address[1]}", upstream, core, value, folder
    server.shutdown()
    server.server_close()
    upstream.close()
    core.close()


def _conv(n: int) -> list[dict]:
    path = next(f for f in trajectories() if "function_calling" in f.name)
    return conversation(NAME, path)[:n]


@pytest.mark.parametrize("keyed", [True, False])
def test_chat_route_turn_by_turn(served, keyed):
    base, upstream, core, value, folder = served
    hf = auto_tokenizer(str(folder))
    conv = _conv(12)
    renders = []
    before = value("toktier_chat_renders_total", face="proxy", model="chat", route="incremental")
    for i in range(2, len(conv) + 1):
        headers = {"X-Session-ID": "traj"} if keyed else {}
        body = {"model": "m", "messages": conv[:i], "tools": TOOLS, "max_tokens": 4}
        if conv[i - 1]["role"] == "assistant":
            body["add_generation_prompt"] = False
        status, h, reply = post(base, "/v1/chat/completions", body, headers)
        assert status == 200, reply
        text = hf.apply_chat_template(conv[:i], tools=TOOLS, tokenize=False,
                                      add_generation_prompt=body.get("add_generation_prompt", True))
        want = hf_ids(NAME, text, add_special_tokens=False)
        assert upstream.last["body"]["prompt"] == want, i
        assert int(h["X-Toktier-Prompt-Tokens"]) == len(want)
        renders.append((h["X-Toktier-Session"], h["X-Toktier-Render"]))
    if keyed:
        assert all(r == ("key", "incremental") for r in renders), renders
    else:  # no key: found again by its first two messages (its system prompt alone passes min_prefix_chars)
        assert all(r == ("prefix", "incremental") for r in renders), renders
    assert value("toktier_chat_renders_total", face="proxy", model="chat", route="incremental") > before
    assert core.verifier.drain(60)
    assert value("toktier_verifier_samples_total", face="proxy", model="chat", result="mismatch") == 0
    assert value("toktier_verifier_samples_total", face="proxy", model="chat", result="match") >= len(renders)


def test_chat_route_keeps_integers_past_64_bits(served):
    """A tool call's arguments holding integers orjson alone would make floats (10**20 -> 1e+20): the
    forwarded ids are transformers' render of the standard library's parse (a fresh body, then a turn on
    the same session)."""
    base, upstream, core, value, folder = served
    hf = auto_tokenizer(str(folder))
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "bash",
                                                             "arguments": {"n": 10**20, "m": -(10**19)}}}]}
    conv = _conv(3) + [call, {"role": "tool", "content": "ok"}]
    for n in (len(conv) - 1, len(conv)):
        body = {"model": "m", "messages": conv[:n], "tools": TOOLS, "max_tokens": 4}
        status, _, reply = post(base, "/v1/chat/completions", body, {"X-Session-ID": "big-ints"})
        assert status == 200, reply
        text = hf.apply_chat_template(json.loads(json.dumps(conv[:n])), tools=TOOLS, tokenize=False,
                                      add_generation_prompt=True)
        assert str(10**20) in text
        assert upstream.last["body"]["prompt"] == hf_ids(NAME, text, add_special_tokens=False), n


def test_chat_errors_are_400_and_counted(served):
    base, upstream, core, value, _ = served
    before = value("toktier_request_errors_total", face="proxy", model="chat", code="INVALID_ARG")
    status, _, body = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "chat_template_kwargs": {"tools": []}})
    assert status == 400 and "chat_template_kwargs may not set" in json.loads(body)["error"]["message"]
    status, _, body = post(base, "/v1/chat/completions", None, raw=b'{"messages": [')
    assert status == 400 and "not JSON" in json.loads(body)["error"]["message"]
    assert value("toktier_request_errors_total", face="proxy", model="chat", code="INVALID_ARG") == before + 2
