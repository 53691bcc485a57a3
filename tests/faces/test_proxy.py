"""``toktier proxy`` against a fake OpenAI upstream on loopback that records what it receives.

Every forwarded ``prompt`` is compared with the HF reference: the completion prompt's
``encode(prompt, add_special_tokens=flag).ids``, and for chat, ``transformers``' own
``apply_chat_template(..., tokenize=True)`` of the same messages and template.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from toktier_backend.corpus import load_turns, trajectory_files
from toktier_backend.faces.proxy import TokenProxy, make_server

from .conftest import REPO, auto_tokenizer, hf_ids


class FakeUpstream:
    """An OpenAI-compatible ``/v1/completions`` on loopback: records each request (path, headers, JSON body)
    and answers a ``text_completion`` (or its SSE stream) whose text names the prompt's length."""

    def __init__(self):
        self.requests: list[dict] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):  # noqa: N802
                outer.requests.append({"path": self.path, "headers": dict(self.headers), "body": None})
                self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                       "body": body})
                if body.get("max_tokens") == -1:
                    return self._json(400, {"error": {"message": "max_tokens must be positive"}})
                n = len(body["prompt"]) if isinstance(body["prompt"], list) else -1
                if not body.get("stream"):
                    return self._json(200, {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "fake",
                                            "choices": [{"index": 0, "text": f"saw {n}", "logprobs": None,
                                                         "finish_reason": "stop"}],
                                            "usage": {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for piece in ("saw", f" {n}"):
                    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "fake",
                             "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

            def _json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def last(self) -> dict:
        return self.requests[-1]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def upstream():
    u = FakeUpstream()
    yield u
    u.close()


@pytest.fixture(scope="module")
def proxy(upstream, hf_folder):
    """The proxy in process (qwen3 file + ChatML template from tokenizer_config.json), on a free port."""
    p = TokenProxy.from_spec(str(hf_folder("qwen3")), upstream.url + "/v1")
    server = make_server(p, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    p.base = f"http://127.0.0.1:{server.server_address[1]}"
    yield p
    server.shutdown()
    server.server_close()


def post(base, path, body, headers=None, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_completion_forwards_exact_ids_with_sessions(proxy, upstream):
    turns = load_turns(trajectory_files()[0])[:6]
    for i, text in enumerate(turns):
        status, headers, body = post(proxy.base, "/v1/completions",
                                     {"model": "m", "prompt": text, "max_tokens": 5, "temperature": 0},
                                     {"X-Session-ID": "agent-1", "Authorization": "Bearer k"})
        assert status == 200
        sent = upstream.last
        assert sent["path"] == "/v1/completions"
        assert sent["body"]["prompt"] == hf_ids("qwen3", text, True)
        assert {k: v for k, v in sent["body"].items() if k != "prompt"} == {"model": "m", "max_tokens": 5, "temperature": 0}
        assert sent["headers"]["authorization"] == "Bearer k" and "x-session-id" not in sent["headers"]
        assert json.loads(body)["choices"][0]["text"] == f"saw {len(sent['body']['prompt'])}"
        assert headers["X-Toktier-Session"] == "key"
        assert headers["X-Toktier-Route"] == ("new" if i == 0 else "append"), headers
        assert (int(headers["X-Toktier-Reused"]) > 0) == (i > 0)
        assert int(headers["X-Toktier-Prompt-Tokens"]) == len(sent["body"]["prompt"])


def test_completion_flags_ids_and_batches(proxy, upstream):
    post(proxy.base, "/v1/completions", {"prompt": "<|im_start|>hi", "add_special_tokens": False, "max_tokens": 1})
    assert upstream.last["body"] == {"prompt": hf_ids("qwen3", "<|im_start|>hi", False), "max_tokens": 1}
    post(proxy.base, "/v1/completions", {"prompt": [1, 2, 3]})
    assert upstream.last["body"]["prompt"] == [1, 2, 3]
    _, headers, _ = post(proxy.base, "/v1/completions", {"prompt": ["a b", "c"]})
    assert upstream.last["body"]["prompt"] == [hf_ids("qwen3", "a b"), hf_ids("qwen3", "c")]
    assert headers["X-Toktier-Route"] == "batch"
    # a conversation ID in the body keys the session too (and is not forwarded)
    for text in ("first turn " * 300, "first turn " * 300 + "second"):
        _, headers, _ = post(proxy.base, "/v1/completions", {"prompt": text, "conversation_id": "c-9"})
        assert upstream.last["body"] == {"prompt": hf_ids("qwen3", text)}
    assert headers["X-Toktier-Route"] == "append" and headers["X-Toktier-Session"] == "key"


def test_chat_forwards_template_ids_and_translates(proxy, upstream, hf_folder):
    hf = auto_tokenizer(str(hf_folder("qwen3")))
    history = [{"role": "system", "content": "You are terse."}]
    for i, turn in enumerate(["fix the bug " * 200, "now add a test", "and run it"]):
        history.append({"role": "user", "content": turn})
        status, headers, body = post(proxy.base, "/v1/chat/completions",
                                     {"model": "m", "messages": history, "max_completion_tokens": 9,
                                      "chat_template_kwargs": {"enable_thinking": False}},
                                     {"X-Session-ID": "chat-1"})
        assert status == 200, body
        want = hf.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False,
                                      enable_thinking=False)
        sent = upstream.last["body"]
        assert sent == {"model": "m", "max_tokens": 9, "prompt": want}
        reply = json.loads(body)
        assert reply["object"] == "chat.completion"
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": f"saw {len(want)}"}
        assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["prompt_tokens"] == len(want)
        # the generation prompt of the previous request becomes the assistant turn: an edit near the end
        assert headers["X-Toktier-Route"] == "new" if i == 0 else headers["X-Toktier-Route"] in ("append", "edit")
        assert (int(headers["X-Toktier-Reused"]) > len(want) // 2) == (i > 0)
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})


def test_chat_stream_is_translated(proxy, upstream, hf_folder):
    hf = auto_tokenizer(str(hf_folder("qwen3")))
    msgs = [{"role": "user", "content": "stream please"}]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
    status, headers, body = post(proxy.base, "/v1/chat/completions", {"messages": msgs, "tools": tools, "stream": True})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    want = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert upstream.last["body"] == {"stream": True, "prompt": want}
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 2
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "saw"}
    assert chunks[1]["choices"][0]["delta"] == {"content": f" {len(want)}"}


def test_errors(proxy, upstream):
    status, _, body = post(proxy.base, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and "not JSON" in json.loads(body)["error"]["message"]
    status, _, body = post(proxy.base, "/v1/completions", {"prompt": "\ud800"})  # lone surrogate
    assert status == 400 and "InvalidRequest" in json.loads(body)["error"]["message"]
    status, _, body = post(proxy.base, "/v1/completions", {"prompt": {"x": 1}})
    assert status == 400
    status, _, body = post(proxy.base, "/v1/chat/completions", {"messages": "nope"})
    assert status == 400 and "list of objects" in json.loads(body)["error"]["message"]
    status, _, body = post(proxy.base, "/v1/completions", {"prompt": "x", "max_tokens": -1})  # upstream's 400
    assert status == 400 and json.loads(body)["error"]["message"] == "max_tokens must be positive"
    with urllib.request.urlopen(proxy.base + "/v1/models", timeout=30) as r:  # passthrough
        assert json.loads(r.read())["data"][0]["id"] == "fake-model"
    with urllib.request.urlopen(proxy.base + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"
    dead = TokenProxy(proxy.tokenizer, "http://127.0.0.1:9")  # nothing listens on the discard port
    server = make_server(dead)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, _, body = post(f"http://127.0.0.1:{server.server_address[1]}", "/v1/completions", {"prompt": "x"})
        assert status == 502 and json.loads(body)["error"]["type"] == "upstream_error"
    finally:
        server.shutdown()
        server.server_close()


def test_cli_proxy_command(upstream, tmp_path):
    """``toktier proxy --upstream URL`` (bundled GPT-2), one request, then SIGTERM: exit 0."""
    from toktier_backend.deploy.server import free_ports

    port = free_ports(1)[0]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "toktier_backend.cli", "proxy", "--upstream", upstream.url,
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"proxy did not start: {proc.stdout.read().decode()}")
                time.sleep(0.2)
        status, _, _ = post(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "hello world"})
        assert status == 200 and upstream.last["body"]["prompt"] == [31373, 995]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()
    assert b"toktier proxy: stopping" in out


# ---------------------------------------------------------------- the serving core behind the face


def test_faulty_engine_is_caught_and_quarantined_through_the_proxy(upstream, hf_folder, tmp_path):
    """A faulty engine build behind the proxy: a session's turn is forwarded with wrong ids once; the shadow
    verifier catches it and quarantines the fast routes; every later prompt forwarded is exact, and the
    requests show in ``toktier_*`` under ``face="proxy"``."""
    from ..faulty_engine import TRIGGER
    from .conftest import faulty_core

    core, value = faulty_core(hf_folder("qwen3") / "tokenizer.json", tmp_path)
    p = TokenProxy(core, upstream.url)
    server = make_server(p, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        turns = ["You are a coding agent.\nuser: fix a.py\n", f"assistant: {TRIGGER} found it\n", "user: thanks\n"]
        text, sent = "", []
        for turn in turns:
            text += turn
            status, headers, _ = post(base, "/v1/completions", {"prompt": text}, {"X-Session-ID": "faulty-1"})
            assert status == 200
            sent.append((text, upstream.last["body"]["prompt"], headers["X-Toktier-Route"]))
            if len(sent) == 2:
                assert sent[1][1] != hf_ids("qwen3", text) and sent[1][2] == "append"  # the fault went out
                assert core.verifier.drain(30) and core.verifier.mismatches == 1
                assert set(core.tokenizer.quarantined) == {"full", "append", "edit"}
        assert sent[0][1] == hf_ids("qwen3", sent[0][0]) and sent[2][1] == hf_ids("qwen3", sent[2][0])
        status, _, _ = post(base, "/v1/completions", {"prompt": f"stateless {TRIGGER}"})
        assert upstream.last["body"]["prompt"] == hf_ids("qwen3", f"stateless {TRIGGER}")
        assert core.verifier.drain(30) and core.verifier.mismatches == 1
        assert value("toktier_verifier_mismatches_total", face="proxy", model="completions", route="append") == 1
        assert value("toktier_quarantined_routes", face="proxy", model="completions") == 3
        assert value("toktier_requests_total", face="proxy", model="completions", mode="full") == 3
        assert value("toktier_requests_total", face="proxy", model="completions", route="encode") == 1
        assert value("toktier_verifier_samples_total", face="proxy", model="completions", result="match") == 3
        status, _, _ = post(base, "/v1/completions", {"prompt": "\ud800"})
        assert status == 400
        assert value("toktier_request_errors_total", face="proxy", model="completions", code="INVALID_ARG") == 1
    finally:
        server.shutdown()
        server.server_close()
        core.close()
