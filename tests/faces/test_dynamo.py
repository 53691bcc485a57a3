"""The toktier chat processor inside Dynamo's real frontend (ai-dynamo 1.6.1), on loopback, no mocks.

Processes: ``python -m toktier_backend.faces.dynamo`` (Dynamo's frontend + our processor), and as engines
Dynamo's own ``python -m dynamo.mocker`` (KV events, prefix cache) or ``dynamo_echo_worker.py`` (a
``ModelInput.Tokens`` worker registered with Dynamo's runtime that records the ids it receives). Discovery is
``file`` in a temporary folder, request plane tcp, event plane zmq, every host 127.0.0.1. Every process is
stopped by its pid.

The reference for every id: ``transformers.AutoTokenizer`` renders the conversation
(``apply_chat_template(tokenize=False, add_generation_prompt=True)``), HF ``tokenizers`` encodes it
(``Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids``), both computed here.

Needs ai-dynamo (``deploy/install_dynamo.sh``); without it the tests *fail* with that command.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tokenizers

from tests.faces.conftest import REPO, SHARED, require, tokenizer_file

MODEL = "qwen3"
ECHO_REPLY = "Hello from the echo worker."
BLOCK = 16


def _dynamo_installed() -> None:
    try:
        import dynamo.frontend  # noqa: F401
        import dynamo.llm  # noqa: F401
    except ImportError as e:
        pytest.fail(f"ai-dynamo is not installed ({e}): run deploy/install_dynamo.sh in this environment")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process in its own session, stopped by its pid (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.log = log
        self._f = open(log, "ab")
        self.p = subprocess.Popen(args, env=env, cwd=REPO, stdout=self._f, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self._f.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _post(port: int, body, *, raw: bytes | None = None, timeout: float = 60.0):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_model(port: int, name: str, procs: list[Proc], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.p.poll() is not None:
                pytest.fail(f"{p.log.name} exited with {p.p.returncode}:\n{p.text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if any(m.get("id") == name for m in json.load(r).get("data", [])):
                    # the chat engine is built by the factory right after discovery; one probe proves it
                    status, _ = _post(port, {"model": name, "messages": [{"role": "user", "content": "ping"}],
                                             "max_tokens": 1})
                    if status == 200:
                        return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    pytest.fail(f"model {name} not served on :{port} within {timeout}s:\n" + "\n".join(p.text()[-2000:] for p in procs))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """qwen3's tokenizer.json + its published tokenizer_config.json (real chat template) + a small config."""
    d = tmp_path_factory.mktemp("dyn_model")
    (d / "tokenizer.json").symlink_to(tokenizer_file(MODEL))
    cfg = SHARED / "chat_templates" / MODEL / "tokenizer_config.json"
    if not cfg.is_file():
        pytest.fail(f"{cfg} missing")
    (d / "tokenizer_config.json").symlink_to(cfg)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "max_position_embeddings": 1 << 21, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 1, "num_key_value_heads": 1, "eos_token_id": 151645}))
    return d


@pytest.fixture(scope="module")
def reference(model_dir):
    """``ref(messages) -> ids``: transformers renders, HF tokenizers encodes."""
    require("transformers")
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def ref(messages, **kw) -> list[int]:
        text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        return hf.encode(text, add_special_tokens=False).ids

    ref.hf = hf
    return ref


class Stack:
    """Frontend-with-our-processor + one engine, with the env they share."""

    def __init__(self, tmp: Path, model_dir: Path, engine: str, face_args: list[str] = ()):
        _dynamo_installed()
        self.tmp, self.model_dir, self.engine = tmp, model_dir, engine
        self.port, self.metrics_port = _free_port(), _free_port()
        self.record = tmp / "received.jsonl"
        self.env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp / "kv"),
                    "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
                    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
                    "DYN_SYSTEM_HOST": "127.0.0.1", "HF_HUB_OFFLINE": "1",
                    "DYN_LOG": "info,dynamo_llm::kv_router=debug", "PYTHONPATH": str(REPO)}
        self.face_args = list(face_args)
        self.procs: list[Proc] = []
        self.face: Proc | None = None

    def start_engine(self) -> None:
        if self.engine == "echo":
            args = [sys.executable, str(REPO / "tests" / "faces" / "dynamo_echo_worker.py"),
                    "--model-path", str(self.model_dir), "--model-name", MODEL, "--record", str(self.record),
                    "--reply", ECHO_REPLY]
        else:
            args = [sys.executable, "-m", "dynamo.mocker", "--model-path", str(self.model_dir), "--model-name",
                    MODEL, "--speedup-ratio", "100", "--enable-prefix-caching", "--block-size", str(BLOCK)]
        self.procs.append(Proc(args, self.env, self.tmp / f"{self.engine}.log"))

    def start_face(self, *, cli: bool = False) -> Proc:
        """Our frontend: ``python -m toktier_backend.faces.dynamo``, or the ``toktier dynamo`` subcommand."""
        entry = ["-m", "toktier_backend.cli", "dynamo"] if cli else ["-m", "toktier_backend.faces.dynamo"]
        args = [sys.executable, *entry, "--http-host", "127.0.0.1", "--http-port",
                str(self.port), "--router-mode", "kv", "--kv-cache-block-size", str(BLOCK),
                "--toktier-metrics-port", str(self.metrics_port), "--toktier-verifier-first-n", "1000",
                *self.face_args]
        self.face = Proc(args, self.env, self.tmp / f"face-{len(self.procs)}.log")
        self.procs.append(self.face)
        _wait_model(self.port, MODEL, self.procs)
        return self.face

    def received(self) -> list[list[int]]:
        if not self.record.exists():
            return []
        return [json.loads(line)["token_ids"] for line in self.record.read_text().splitlines() if line.strip()]

    def chat(self, messages, **body):
        status, data = _post(self.port, {"model": MODEL, "messages": messages, "max_tokens": 8, **body})
        return status, (json.loads(data) if data and not body.get("stream") else data)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def echo(tmp_path_factory, model_dir):
    s = Stack(tmp_path_factory.mktemp("dyn_echo"), model_dir, "echo", ["--toktier-max-prompt-chars", "300000",
                                                                         "--toktier-min-prefix-chars", "2048"])
    try:
        s.start_engine()
        s.start_face()
        yield s
    finally:
        s.stop()


def _conversation(n_turns: int, path_index: int = 2) -> list[dict]:
    """Messages of a real SWE-agent trajectory (``../shared/corpus/swe-agent``), roles and text only."""
    files = sorted((SHARED / "corpus" / "swe-agent").glob("*.traj"))
    if not files:
        pytest.fail("../shared/corpus/swe-agent has no .traj files")
    hist = json.loads(files[path_index % len(files)].read_text())["history"]
    out = []
    for m in hist:
        c = m.get("content")
        role = m.get("role") if m.get("role") in ("system", "user", "assistant") else "user"  # tool -> user
        out.append({"role": role, "content": c if isinstance(c, str) else json.dumps(c)})
    return out[:n_turns]


def _last_received_after(stack: Stack, n_before: int) -> list[int]:
    got = stack.received()
    assert len(got) == n_before + 1, f"engine received {len(got) - n_before} requests, expected 1"
    return got[-1]


# ---------------------------------------------------------------- tests


def test_chat_ids_equal_hf_and_reply_detokenized(echo, reference):
    msgs = [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "naïve café 東京 🙂\tindent\n\n  spaces   and 1234567 digits"}]
    n = len(echo.received())
    status, reply = echo.chat(msgs)
    assert status == 200, reply
    assert _last_received_after(echo, n) == reference(msgs)
    assert reply["choices"][0]["message"]["content"] == ECHO_REPLY
    assert reply["usage"]["prompt_tokens"] == len(reference(msgs))
    assert reply["usage"]["completion_tokens"] == len(reference.hf.encode(ECHO_REPLY, add_special_tokens=False).ids)


def test_streaming_chunks_and_stop_string(echo, reference):
    msgs = [{"role": "user", "content": "stream please"}]
    n = len(echo.received())
    status, raw = echo.chat(msgs, stream=True, stream_options={"include_usage": True})
    assert status == 200
    events = [json.loads(line[5:]) for line in raw.decode().splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    text = "".join(c["delta"].get("content", "") for e in events for c in e.get("choices", []))
    assert text == ECHO_REPLY and len(events) > 2
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert _last_received_after(echo, n) == reference(msgs)
    status, reply = echo.chat(msgs, stop=[" echo"])  # text stop applied to the detokenized reply
    assert status == 200 and reply["choices"][0]["message"]["content"] == ECHO_REPLY.split(" echo")[0]
    assert reply["choices"][0]["finish_reason"] == "stop"
    # streamed, a stop string across two tokens (" the" + " echo"): the text that could begin it is held
    # back, never sent then taken back
    status, raw = echo.chat(msgs, stream=True, stop=["e ec", "worker"])
    deltas = [c["delta"].get("content", "") for line in raw.decode().splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"
              for c in json.loads(line[5:]).get("choices", [])]
    assert "".join(deltas) == ECHO_REPLY.split("e ec")[0] == "Hello from th"


def test_session_key_precedence():
    from toktier_backend.faces.dynamo import session_key

    full = {"metadata": {"session_id": "m"}, "prompt_cache_key": "p", "user": "u"}
    assert session_key(full) == "metadata.session_id:m"
    assert session_key({**full, "metadata": {"other": 1}}) == "prompt_cache_key:p"
    assert session_key({**full, "metadata": None, "prompt_cache_key": ""}) == "user:u"
    assert session_key({"user": 7}) == "user:7"
    assert session_key({"user": True, "metadata": {"session_id": 0}}) is None


@pytest.mark.parametrize("field", ["metadata", "prompt_cache_key", "user", "prefix"])
def test_multi_turn_sessions_by_each_key(echo, reference, field):
    """A real agent conversation resent turn by turn: every turn's ids equal HF, and from the second turn
    the session is repaired (the face's route counter for append/edit grows)."""
    convo = _conversation(9, path_index={"metadata": 0, "prompt_cache_key": 1, "user": 2, "prefix": 3}[field])
    extra = {"metadata": {"metadata": {"session_id": "m-1"}}, "prompt_cache_key": {"prompt_cache_key": "pck-1"},
             "user": {"user": "u-1"}, "prefix": {}}[field]
    before = _route_counts(echo.metrics())
    for k in range(2, len(convo) + 1):
        msgs = convo[:k]
        if msgs[-1]["role"] == "assistant":
            continue
        n = len(echo.received())
        status, reply = echo.chat(msgs, **extra)
        assert status == 200, reply
        assert _last_received_after(echo, n) == reference(msgs), f"turn {k}"
    after = _route_counts(echo.metrics())
    repaired = sum(after.get(r, 0) - before.get(r, 0) for r in ("append", "edit", "noop"))
    assert repaired >= 2, (before, after)


def _route_counts(metrics_text: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r'^toktier_requests_total\{[^}]*model="toktier_dynamo"[^}]*route="(\w+)"[^}]*\} (\S+)$',
                         metrics_text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    return out


def test_verifier_samples_and_metrics(echo):
    text = echo.metrics()
    m = re.search(r'^toktier_verifier_samples_total\{face="dynamo",model="toktier_dynamo",result="match"\} (\S+)$', text, re.M)
    assert m and float(m.group(1)) >= 1, text[-2000:]
    mm = re.search(r'^toktier_verifier_samples_total\{face="dynamo",model="toktier_dynamo",result="mismatch"\} (\S+)$', text, re.M)
    assert mm and float(mm.group(1)) == 0


def test_bad_input_gets_4xx_and_frontend_keeps_serving(echo, reference):
    # lone surrogate: Dynamo's JSON layer refuses it before any processor
    status, data = _post(echo.port, None, raw=b'{"model": "qwen3", "messages": [{"role": "user", "content": "a\\ud800b"}]}')
    assert status == 400 and b"hex escape" in data, data
    # oversize: over --toktier-max-prompt-chars (300000), our InvalidRequest -> 400 with the limit named
    status, data = _post(echo.port, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 310_000}]})
    assert status == 400 and b"over the limit of 300000" in data, data
    # malformed messages, n > 1
    status, data = _post(echo.port, {"model": MODEL, "messages": "nope"})
    assert status == 400, data
    status, data = _post(echo.port, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2})
    assert status == 400 and b"only n=1" in data, data
    # invalid UTF-8: Dynamo 1.6.1's HTTP layer replaces each bad byte by U+FFFD before any processor (it does
    # not answer 4xx); what reaches us is then encoded exactly
    n = len(echo.received())
    raw = b'{"model": "qwen3", "max_tokens": 4, "messages": [{"role": "user", "content": "a\xff\xfeb"}]}'
    status, data = _post(echo.port, None, raw=raw)
    assert status == 200, data
    assert _last_received_after(echo, n) == reference([{"role": "user", "content": "a\ufffd\ufffdb"}])
    # still serving, exactly
    msgs = [{"role": "user", "content": "after the bad ones"}]
    n = len(echo.received())
    assert echo.chat(msgs)[0] == 200
    assert _last_received_after(echo, n) == reference(msgs)


def test_kill_processor_mid_conversation_next_turn_exact(tmp_path, model_dir, reference):
    s = Stack(tmp_path, model_dir, "echo")
    try:
        s.start_engine()
        face = s.start_face()
        convo = [m for m in _conversation(12, 1)]
        users = [k for k in range(1, len(convo) + 1) if convo[k - 1]["role"] != "assistant"]
        for k in users[:3]:
            n = len(s.received())
            assert s.chat(convo[:k], user="agent-7")[0] == 200
            assert _last_received_after(s, n) == reference(convo[:k])
        face.stop(signal.SIGKILL)  # the processor dies holding the session
        s.procs.remove(face)
        s.start_face(cli=True)  # restarted through `toktier dynamo`
        for k in users[3:5]:
            n = len(s.received())
            status, reply = s.chat(convo[:k], user="agent-7")
            assert status == 200, reply
            assert _last_received_after(s, n) == reference(convo[:k])
    finally:
        s.stop()


def test_kv_router_overlap_on_shared_prefix(tmp_path, model_dir, reference):
    """With Dynamo's mocker (KV events, prefix cache, block 16): the router's overlap for a second
    conversation sharing a system prompt equals the shared full blocks of the HF ids, and the mocker
    reports those blocks as cached."""
    s = Stack(tmp_path, model_dir, "mocker")
    try:
        s.start_engine()
        s.start_face()
        system = {"role": "system", "content": _conversation(1, 0)[0]["content"]}
        convs = [[system, {"role": "user", "content": f"Question {q}: where is the bug?"}] for q in "abc"]
        ids = [reference(c) for c in convs]
        cached = []
        for c in convs:
            status, reply = s.chat(c, max_tokens=2)
            assert status == 200, reply
            cached.append(reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens"))
        lcp = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b)
        shared = lcp // BLOCK
        assert shared >= 10
        time.sleep(0.5)
        overlaps = [(int(a), int(b)) for a, b in re.findall(r"with (\d+)/(\d+) blocks overlap", s.face.text())]
        # the first probe request is the readiness ping; then the three conversations
        assert [o[0] for o in overlaps[-3:]] == [0, shared, shared], overlaps
        assert [o[1] for o in overlaps[-3:]] == [-(-len(i) // BLOCK) for i in ids], overlaps
        assert cached == [0, shared * BLOCK, shared * BLOCK]
    finally:
        s.stop()
