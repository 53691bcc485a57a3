"""``toktier proxy``: OpenAI completion/chat requests in, exact token IDs out to ``/v1/completions``.

For engines whose frontend tokenizer cannot be swapped (Dynamo's ``DYN_TOKENIZER`` takes only its built-in
backends), the proxy sits in front of any OpenAI-compatible server whose ``/v1/completions`` accepts token
IDs as ``prompt`` (vLLM, SGLang, Dynamo's frontend, ``trtllm-serve``):

- ``POST /v1/completions`` with a string ``prompt``: tokenized (``add_special_tokens`` from the body,
  default true), forwarded with ``prompt`` = the ids. Token-ID prompts are forwarded unchanged; a list of
  strings is tokenized row by row.
- ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template and tokenized
  with ``add_special_tokens=False`` by the serving core's chat step (``ServingCore.chat``: the
  conversation's ``ChatSession`` renders only what changed since its previous request, in the same
  session as its ids; ``tools``, ``documents``, ``chat_template_kwargs``, ``add_generation_prompt``
  (default true), ``continue_final_message`` honoured), forwarded to ``/v1/completions``; the reply (JSON
  or SSE stream) is turned back into ``chat.completion`` / ``chat.completion.chunk`` objects with
  ``message``/``delta`` content. Tool-call and reasoning parsing are not done here.
- Anything else (``GET /v1/models``, …) is forwarded as is. ``GET /health`` answers locally.

Sessions: the ``--session-header`` (default ``X-Session-ID``) or a body field ``conversation_id`` /
``session_id`` keys a session; without one, a long prompt finds its session by prefix (the serving core,
:mod:`toktier_backend.serving.core`, which also samples replies to the shadow verifier and counts them in
``toktier_*`` with ``face="proxy"``, ``model`` ``completions`` or ``chat``; ``--metrics-port`` serves them).
Each reply carries ``X-Toktier-Route``, ``X-Toktier-Reused`` (ids
kept from the session's previous prompt), ``X-Toktier-Prompt-Tokens`` and ``X-Toktier-Session``; a chat reply
also ``X-Toktier-Render`` (``incremental`` or ``full:<reason>``). The ids
always equal HF ``Tokenizer.from_file(path).encode(text, add_special_tokens=flag).ids``.

Pure standard library (``http.server`` + ``urllib``); binds to loopback by default.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

import numpy as np

from toktier_backend import jsonio
from toktier_backend.chat.template import load_chat_template
from toktier_backend.config import special_tokens, stop_on_signals
from toktier_backend.errors import InvalidRequest, ToktierError
from toktier_backend.serving.core import CoreConfig, ServingCore
from toktier_backend.serving.metrics import Origin
from toktier_backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_SESSION_HEADER = "X-Session-ID"
SESSION_BODY_FIELDS = ("conversation_id", "session_id")
# Chat-only fields that /v1/completions does not take (consumed here or dropped).
_CHAT_ONLY = (
    "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "documents", "max_completion_tokens", "logprobs",
    "top_logprobs", "reasoning_effort", "add_special_tokens",
)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
                "content-length", "proxy-authorization", "proxy-authenticate"}


class ProxyError(Exception):
    """An error to answer with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class TokenProxy:
    """The proxy's logic, independent of the HTTP server (tests drive it directly too).

    Args:
        core: the serving core (sessions, verifier, metrics, pool), or a bare ``Tokenizer`` (then a core with
            ``CoreConfig``'s defaults is built for it).
        upstream: base URL of the OpenAI-compatible server (``http://host:port``; a trailing ``/v1`` is fine).
        chat_template: jinja source, set as the core's chat template (``ServingCore.use_chat_template``), or
            ``None``: the core's own (``ServingCore.from_config`` loads the one beside the tokenizer); without
            one chat requests fail with 400.
        special_tokens: template variables ``bos_token``, ``eos_token``, … (``tokenizer_config.json``), with
            ``chat_template``.
        session_header: request header that keys a session (case-insensitive).
        timeout_s: upstream timeout in seconds (connect and each read).
        face: the ``face`` label of its metrics.
    """

    def __init__(
        self,
        core: ServingCore | Tokenizer,
        upstream: str,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        session_header: str = DEFAULT_SESSION_HEADER,
        timeout_s: float = 600.0,
        face: str = "proxy",
    ):
        if not isinstance(core, ServingCore):
            core = ServingCore.from_config(CoreConfig(tokenizer=str(core.path)), tokenizer=core)
        self.core = core
        self.tokenizer = core.tokenizer
        base = upstream.rstrip("/")
        self.upstream = base[: -len("/v1")] if base.endswith("/v1") else base
        if chat_template:
            core.use_chat_template(chat_template, special_tokens)
        self.session_header = session_header
        self.timeout_s = timeout_s
        self.completions_origin = Origin(face, "completions")
        self.chat_origin = Origin(face, "chat")
        for origin in (self.completions_origin, self.chat_origin):
            core.register(origin, sessions=True)

    @classmethod
    def from_spec(cls, tokenizer_spec: str | None, upstream: str, *, chat_template: str | None = None,
                  config: CoreConfig | None = None, **kwargs):
        """Load the tokenizer (``tokenizer.json``, a folder, a Hub id, ``None``/``default`` = bundled GPT-2)
        into a serving core built from ``config`` (default ``CoreConfig()``; its ``tokenizer`` is replaced by
        ``tokenizer_spec``), and its chat template (``chat_template`` file or source, else the one beside the
        tokenizer).

        Raises:
            UnsupportedTokenizer: the tokenizer, its chat template or its ``tokenizer_config.json`` cannot
                be read.
        """
        import dataclasses

        spec = "default" if tokenizer_spec in (None, "") else tokenizer_spec
        core = ServingCore.from_config(dataclasses.replace(config or CoreConfig(), tokenizer=spec))
        path = core.tokenizer.path
        template = load_chat_template(path, chat_template)
        return cls(core, upstream, chat_template=template, special_tokens=special_tokens(path), **kwargs)

    # ------------------------------------------------------------ request -> forwarded body

    def session_key(self, headers: dict[str, str], body: dict[str, Any]) -> str | None:
        """The session key: the header, else ``conversation_id`` / ``session_id`` in the body, else ``None``."""
        value = headers.get(self.session_header.lower())
        if value:
            return "h:" + value
        for field in SESSION_BODY_FIELDS:
            v = body.get(field)
            if isinstance(v, (str, int)) and not isinstance(v, bool) and v not in ("", 0):
                return f"b:{v}"
        return None

    def _encode(self, origin: Origin, text: str, key: str | None, flag: bool) -> tuple[np.ndarray, dict[str, str]]:
        r = self.core.encode(origin, text, key=key, add_special_tokens=flag, what="prompt")
        info = {"X-Toktier-Route": r.shown_route, "X-Toktier-Reused": str(r.keep),
                "X-Toktier-Prompt-Tokens": str(r.n), "X-Toktier-Session": r.session or "none"}
        return r.ids, info  # (never changed by a later call; written out by jsonio.dumps)

    def completion_body(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
        """``/v1/completions`` body -> (forwarded body with token-ID ``prompt``, ``X-Toktier-*`` headers).
        A prompt the proxy encoded is an ``int32`` array (or a list of them): :func:`jsonio.dumps` writes it."""
        out = {k: v for k, v in body.items() if k not in SESSION_BODY_FIELDS and k != "add_special_tokens"}
        flag = body.get("add_special_tokens", True)
        if not isinstance(flag, bool):
            raise ProxyError(400, f"add_special_tokens must be a boolean, got {flag!r}")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            out["prompt"], info = self._encode(self.completions_origin, prompt, self.session_key(headers, body), flag)
            return out, info
        if _is_ids(prompt) or (isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt)):
            return out, {"X-Toktier-Route": "passthrough", "X-Toktier-Session": "none"}
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            rows = [self.core.encode(self.completions_origin, p, add_special_tokens=flag, what="prompt").ids
                    for p in prompt]
            out["prompt"] = rows
            return out, {"X-Toktier-Route": "batch", "X-Toktier-Prompt-Tokens": ",".join(str(len(r)) for r in rows),
                         "X-Toktier-Session": "none"}
        raise ProxyError(400, "prompt must be a string, a list of strings, token IDs, or a list of token-ID lists")

    def chat_body(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
        """``/v1/chat/completions`` body -> (``/v1/completions`` body with token-ID ``prompt``, an ``int32``
        array written by :func:`jsonio.dumps`; headers)."""
        if self.core.chat_template is None:
            raise ProxyError(400, "this proxy has no chat template: start it with --chat-template FILE, or serve a "
                                  "tokenizer folder with tokenizer_config.json / chat_template.jinja")
        messages = body.get("messages")  # the body's messages, parsed once in _Handler.do_POST (jsonio)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ProxyError(400, "chat_template_kwargs must be an object")
        cont = body.get("continue_final_message", False)  # a bool, or a field name (ServingCore.chat checks)
        flag = body.get("add_special_tokens", False)
        if not isinstance(flag, bool):
            raise ProxyError(400, f"add_special_tokens must be a boolean, got {flag!r}")
        r = self.core.chat(
            self.chat_origin,
            messages,
            key=self.session_key(headers, body),
            tools=body.get("tools"),
            documents=body.get("documents"),
            add_generation_prompt=bool(body.get("add_generation_prompt", not cont)),
            continue_final_message=cont,
            chat_template_kwargs=kwargs,
            add_special_tokens=flag,
        )
        ids = r.ids  # int32 array, never changed by a later call; written out by jsonio.dumps
        info = {"X-Toktier-Route": r.shown_route, "X-Toktier-Reused": str(r.keep),
                "X-Toktier-Prompt-Tokens": str(r.n), "X-Toktier-Session": r.session or "none",
                "X-Toktier-Render": r.render or ""}
        out = {k: v for k, v in body.items() if k not in _CHAT_ONLY and k not in SESSION_BODY_FIELDS}
        if "max_completion_tokens" in body and "max_tokens" not in body:
            out["max_tokens"] = body["max_completion_tokens"]
        if body.get("logprobs"):
            out["logprobs"] = int(body.get("top_logprobs") or 1)
        out["prompt"] = ids
        return out, info

    # ------------------------------------------------------------ upstream

    def url(self, path: str) -> str:
        return self.upstream + path

    def open_upstream(self, method: str, path: str, body: bytes | None, headers: dict[str, str]):
        """Send the request upstream; returns the open response (any status)."""
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        if body is not None:
            fwd["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url(path), data=body, method=method, headers=fwd)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            return e
        except (urllib.error.URLError, OSError) as e:
            raise ProxyError(502, f"upstream {self.upstream} unreachable: {e}", "upstream_error") from e


# ---------------------------------------------------------------- chat reply translation


def chat_from_completion(reply: dict[str, Any]) -> dict[str, Any]:
    """A ``text_completion`` reply as a ``chat.completion`` (``text`` -> ``message.content``)."""
    out = {k: v for k, v in reply.items() if k != "choices"}
    out["object"] = "chat.completion"
    out["choices"] = [
        {**{k: v for k, v in c.items() if k not in ("text", "logprobs")},
         "message": {"role": "assistant", "content": c.get("text", "")},
         "logprobs": c.get("logprobs")}
        for c in reply.get("choices", [])
    ]
    return out


def chat_chunk_from_completion(chunk: dict[str, Any], started: set[int]) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk as a ``chat.completion.chunk`` (``text`` -> ``delta.content``;
    the first chunk of each choice also carries ``role``)."""
    out = {k: v for k, v in chunk.items() if k != "choices"}
    out["object"] = "chat.completion.chunk"
    choices = []
    for c in chunk.get("choices", []):
        idx = c.get("index", 0)
        delta: dict[str, Any] = {}
        if idx not in started:
            started.add(idx)
            delta["role"] = "assistant"
        if c.get("text"):
            delta["content"] = c["text"]
        choices.append({**{k: v for k, v in c.items() if k not in ("text", "logprobs")},
                        "delta": delta, "logprobs": c.get("logprobs")})
    out["choices"] = choices
    return out


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


# ---------------------------------------------------------------- HTTP server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "toktier-proxy"
    proxy: TokenProxy  # set on the subclass made by make_server

    def log_message(self, fmt, *args):  # route through logging, not stderr
        log.info("%s - %s", self.address_string(), fmt % args)

    # -------------------------------------------------------- plumbing

    def _headers(self) -> dict[str, str]:
        return {k.lower(): v for k, v in self.headers.items()}

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send_json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: ProxyError) -> None:
        self._send_json(e.status, {"error": {"message": e.message, "type": e.kind, "code": e.status}})

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    # -------------------------------------------------------- verbs

    def do_GET(self):  # noqa: N802
        if self.path.rstrip("/") == "/health":
            return self._send_json(200, {"status": "ok", "upstream": self.proxy.upstream,
                                         "sessions": len(self.proxy.core.store)})
        self._passthrough("GET", None)

    def do_POST(self):  # noqa: N802
        raw = self._read_body()
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self._passthrough("POST", raw)
        try:
            chat = path == "/v1/chat/completions"
            origin = self.proxy.chat_origin if chat else self.proxy.completions_origin
            try:
                body = jsonio.loads(raw or b"{}")  # the one parse of a request body (orjson)
            except InvalidRequest as e:
                self.proxy.core.refuse(origin, e)  # (counted: refused before the core saw it)
                raise ProxyError(400, f"InvalidRequest: request body is not JSON ({e})") from e
            if not isinstance(body, dict):
                self.proxy.core.refuse(origin, InvalidRequest("request body must be a JSON object"))
                raise ProxyError(400, "request body must be a JSON object")
            try:
                fwd, info = (self.proxy.chat_body if chat else self.proxy.completion_body)(body, self._headers())
            except ToktierError as e:
                raise ProxyError(400, f"{type(e).__name__}: {e}") from e
            resp = self.proxy.open_upstream("POST", "/v1/completions", jsonio.dumps(fwd), self._fwd_headers())
            self._relay(resp, info, chat=chat, stream=bool(body.get("stream")))
        except ProxyError as e:
            self._send_error(e)

    # -------------------------------------------------------- relays

    def _fwd_headers(self) -> dict[str, str]:
        skip = {self.proxy.session_header.lower()}
        return {k: v for k, v in self.headers.items() if k.lower() not in skip}

    def _passthrough(self, method: str, raw: bytes | None) -> None:
        try:
            resp = self.proxy.open_upstream(method, self.path, raw, self._fwd_headers())
        except ProxyError as e:
            return self._send_error(e)
        with resp:
            data = resp.read()
            self.send_response(resp.status)
            ctype = resp.headers.get("Content-Type")
            if ctype:
                self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def _relay(self, resp, info: dict[str, str], *, chat: bool, stream: bool) -> None:
        with resp:
            status = resp.status
            ctype = resp.headers.get("Content-Type", "")
            if status >= 400 or not (stream and "text/event-stream" in ctype):
                data = resp.read()
                if chat and status < 400:
                    try:
                        data = json.dumps(chat_from_completion(json.loads(data))).encode()
                    except (ValueError, AttributeError, TypeError):
                        pass  # not a completion reply: relay as is
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in info.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in info.items():
                self.send_header(k, v)
            self.end_headers()
            started: set[int] = set()
            for line in _lines(resp):
                if chat and line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                    try:
                        chunk = chat_chunk_from_completion(json.loads(line[5:]), started)
                        line = b"data: " + json.dumps(chunk).encode() + b"\n"
                    except (ValueError, AttributeError, TypeError):
                        pass
                self._chunk(line)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()


def _lines(resp) -> Iterable[bytes]:
    while True:
        line = resp.readline()
        if not line:
            return
        yield line


def make_server(proxy: TokenProxy, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A threading HTTP server for ``proxy`` (not started); ``port=0`` picks a free one
    (``server.server_address[1]``)."""
    handler = type("ProxyHandler", (_Handler,), {"proxy": proxy})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_proxy(
    tokenizer: str | None,
    upstream: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    chat_template: str | None = None,
    session_header: str = DEFAULT_SESSION_HEADER,
    config: CoreConfig | None = None,
    timeout_s: float = 600.0,
    metrics_port: int | None = None,
) -> int:
    """Run the proxy until SIGTERM/SIGINT. Returns the exit code (0 on a clean stop).

    Args:
        config: the serving core's settings (``max_sessions``, ``min_prefix_chars``, ``session_ttl_s``,
            ``verifier_rate``, ``quarantine_file``, ...; default ``CoreConfig()``).
        metrics_port: serve the ``toktier_*`` metrics on ``host:metrics_port/metrics`` (``None``: not served).
    """
    proxy = TokenProxy.from_spec(tokenizer, upstream, chat_template=chat_template, session_header=session_header,
                                 timeout_s=timeout_s, config=config)
    server = make_server(proxy, host, port)
    exporter = None
    if metrics_port is not None:
        from toktier_backend.serving.metrics import start_exporter

        exporter, _ = start_exporter(metrics_port, host)
    with stop_on_signals() as stop:
        thread = threading.Thread(target=server.serve_forever, name="toktier-proxy", daemon=True)
        thread.start()
        print(f"toktier proxy: http://{server.server_address[0]}:{server.server_address[1]} -> {proxy.upstream}/v1/completions "
              f"(tokenizer {proxy.tokenizer.path}, chat template {'yes' if proxy.core.chat_template else 'none'}, "
              f"session header {session_header}"
              + (f", toktier metrics http://{host}:{metrics_port}/metrics" if metrics_port is not None else "") + ")",
              flush=True)
        try:
            while not stop.wait(0.5):
                pass
            print("toktier proxy: stopping", flush=True)
            return 0
        finally:
            server.shutdown()
            server.server_close()
            if exporter is not None:
                exporter.shutdown()
            proxy.core.close()
