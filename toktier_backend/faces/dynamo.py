"""``toktier dynamo``: Dynamo's own OpenAI frontend, with our chat processor in front of its KV router.

ai-dynamo 1.6.1's ``--tokenizer`` / ``DYN_TOKENIZER`` is a closed list (``default``, ``fastokens``,
``basetenkenizer``; ``dynamo/frontend/frontend_args.py``), so a tokenizer cannot be plugged in by name. What
Dynamo does expose is the hook its own ``--dyn-chat-processor vllm|sglang`` uses (``dynamo/frontend/main.py``):
``EntrypointArgs(EngineType.Dynamic, ..., chat_engine_factory=factory)``. Dynamo calls the factory once per
discovered model with ``(instance_id, model_deployment_card, routed_engine)``; the factory returns a
``PythonAsyncEngine(generator, loop)`` that serves ``/v1/chat/completions`` for that model. Our generator:

1. renders ``messages`` with the model's chat template (the card's ``tokenizer_config.json`` /
   ``chat_template.jinja``, or ``--toktier-chat-template``) and encodes the text with
   ``add_special_tokens=False`` as ``apply_chat_template(tokenize=True)`` does, in one call of the serving
   core's chat step (:class:`FaceSessions`, the one adapter to the core: ``ServingCore.chat``), which renders
   only what changed since the conversation's previous request, in the session of its key. The ids equal HF
   ``Tokenizer.from_file(card_dir/tokenizer.json).encode(text, add_special_tokens=False).ids`` of the jinja2
   reference render (:class:`~toktier_backend.chat.template.ChatRenderer`);
3. sends Dynamo's preprocessed request (``token_ids`` + stop conditions + sampling options) to
   ``routed_engine.generate``: Dynamo's Rust KV router hashes these exact ids into blocks and picks the
   worker with the most overlap, and the worker (``ModelInput.Tokens``) receives them unchanged;
4. detokenizes the worker's ``token_ids`` with HF ``tokenizers.decoders.DecodeStream`` (the reference's own
   incremental decoder) into ``chat.completion.chunk`` objects; Dynamo's HTTP layer streams them or, for
   ``stream: false``, folds them into one ``chat.completion``.

Session key (first present wins; a key is namespaced by its field):

1. ``metadata.session_id`` (chat and completions bodies carry ``metadata``);
2. ``prompt_cache_key`` (chat only in 1.6.1);
3. ``user``;
4. none: a prompt of at least ``--toktier-min-prefix-chars`` finds its session by prefix.

1.6.1 drops the ``X-Dynamo-Session-ID`` header before a Python processor, and rejects ``nvext.agent_context``
and ``conversation_id`` with 400, so these three body fields are what reaches us. A wrong or shared key costs
time, never an id: ``Session.update`` finds the real departure point by comparing texts.

Not done here (Dynamo 1.6.1 exposes no Python API for them outside the vLLM / SGLang processors): tool-call
and reasoning parsing (``message.content`` carries the raw text), logprobs, ``n > 1``. ``stop`` strings are
applied to the detokenized text here (with hold-back while streaming); stop token ids go to the worker.

``/v1/completions`` never reaches a chat processor: Dynamo's Rust preprocessor tokenizes a text ``prompt``
itself. Send token-ID prompts (``"prompt": [ids]``, passed straight to the router) or go through
``toktier proxy``.

Every flag of ``python -m dynamo.frontend`` is accepted as is (its own ``FrontendArgGroup``); ours are
``--toktier-*``. Run as ``toktier dynamo [flags]`` or ``python -m toktier_backend.faces.dynamo [flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Hashable

from toktier_backend.errors import InvalidRequest, ToktierError

log = logging.getLogger(__name__)

#: ``model`` label of the ``toktier_*`` metrics this face records.
METRICS_MODEL = "toktier_dynamo"
#: Body fields that key a session, in the order they are tried (``metadata`` is an object: its ``session_id``).
SESSION_FIELDS = ("metadata.session_id", "prompt_cache_key", "user")
DEFAULT_METRICS_PORT = 8003


# ---------------------------------------------------------------- the one adapter to the serving core


@dataclasses.dataclass
class FaceEncoded:
    """One prompt encode.

    Attributes:
        ids: ``list[int]`` (Dynamo's request wants a JSON list); equals HF
            ``encode(text, add_special_tokens=flag).ids``.
        route: ``new`` / ``append`` / ``edit`` / ``full`` / ``noop`` / ``reference`` / ``encode`` / ``busy``
            (``serving.core.Reply.shown_route``).
        reused: ids kept from the session's previous prompt.
        session: ``"key"``, ``"prefix"`` or ``None``.
    """

    ids: list[int]
    route: str
    reused: int
    session: str | None
    render: str | None = None  # a chat request's render route (``incremental`` or ``full:<reason>``)


class FaceSessions:
    """The serving core of one tokenizer, as this face uses it: every encode goes through :meth:`encode`,
    one :meth:`ServingCore.encode` call (sessions by key or by prompt prefix, one byte budget, the shadow
    verifier, the ``toktier_*`` metrics under ``face="dynamo"``, the CPU pool).

    Args:
        tokenizer: a core ``toktier_backend.Tokenizer``.
        name: how logs and the verifier name this model.
        max_sessions, min_prefix_chars, ttl_s: the core's session limits (sessions; chars; seconds).
        verifier_rate: probability that a reply beyond the first ``verifier_first_n`` is re-encoded with
            the HF reference on the verifier thread (``0`` and ``first_n=0``: no verifier).
        quarantine_file: shared quarantine file (``None``: the default, ``config.default_quarantine_file``).
        metrics: a ``serving.metrics.Metrics`` (default: the process-wide one; ``None`` if prometheus_client
            is missing).
    """

    def __init__(self, tokenizer: Any, *, name: str, max_sessions: int = 256, min_prefix_chars: int = 2048,
                 ttl_s: float = 600.0, verifier_rate: float = 0.01, verifier_first_n: int = 32,
                 quarantine_file: str | None = None, metrics: Any = "default", chat_template: str | None = None):
        from toktier_backend.serving.core import CoreConfig, ServingCore
        from toktier_backend.serving.metrics import Origin

        config = CoreConfig(tokenizer=str(tokenizer.path), max_sessions=max_sessions,
                            min_prefix_chars=min_prefix_chars, session_ttl_s=ttl_s, verifier_rate=verifier_rate,
                            verifier_first_n=verifier_first_n, quarantine_file=quarantine_file or "",
                            chat_template=chat_template or "")
        kw = {} if metrics == "default" else {"metrics": metrics}
        self.core = ServingCore.from_config(config, tokenizer=tokenizer, **kw)
        self.core.name = name
        self.origin = Origin("dynamo", METRICS_MODEL)
        self.core.register(self.origin, sessions=True)
        self.tokenizer = tokenizer
        self.name = name

    @property
    def verifier(self):
        return self.core.verifier

    @property
    def metrics(self):
        return self.core.metrics

    def encode(self, key: Hashable | None, text: str, *, add_special_tokens: bool = False) -> FaceEncoded:
        """Ids of ``text`` (the whole rendered prompt), repairing the session of ``key`` (or the one found
        by prefix when ``key`` is ``None``). Thread-safe; runs off the event loop.

        Raises:
            InvalidRequest: not a ``str`` of Unicode scalar values, or over the size limit.
        """
        r = self.core.encode(self.origin, text, key=key, add_special_tokens=add_special_tokens, what="prompt")
        return FaceEncoded(r.ids.tolist(), r.shown_route, int(r.keep), r.session)

    def chat(self, key: Hashable | None, messages: Any, **options: Any) -> FaceEncoded:
        """Ids of a chat request (``ServingCore.chat``: rendered with the core's chat template, incrementally
        in the session of ``key``, then encoded with ``add_special_tokens=False``). ``options``: the core's
        (``tools``, ``documents``, ``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``). Thread-safe; runs off the event loop.

        Raises:
            InvalidRequest: malformed messages or options, the template refused them, over the size limit.
        """
        r = self.core.chat(self.origin, messages, key=key, **options)
        return FaceEncoded(r.ids.tolist(), r.shown_route, int(r.keep), r.session, r.render)

    def close(self) -> None:
        self.core.close()


# ---------------------------------------------------------------- request -> session key, prompt


def session_key(request: dict[str, Any]) -> str | None:
    """The session key of a chat body: ``metadata.session_id``, else ``prompt_cache_key``, else ``user``
    (strings or integers; empty means absent), as ``"<field>:<value>"``; ``None`` when none is present."""
    meta = request.get("metadata")
    candidates = (
        ("metadata.session_id", meta.get("session_id") if isinstance(meta, dict) else None),
        ("prompt_cache_key", request.get("prompt_cache_key")),
        ("user", request.get("user")),
    )
    for field, value in candidates:
        if isinstance(value, (str, int)) and not isinstance(value, bool) and value not in ("", 0):
            return f"{field}:{value}"
    return None


class _StopText:
    """Applies ``stop`` strings to streamed text: text that could still begin a stop string is held back.

    ``push(delta)`` returns ``(text to emit, stopped)``; ``flush()`` returns what is held at the end."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""

    def push(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        self.buf += delta
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf = self.buf[:cut], ""
            return out, True
        keep = min(self.hold, len(self.buf))
        out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def _stops(request: dict[str, Any]) -> tuple[list[str], list[int]]:
    stop = request.get("stop")
    if stop is None:
        return [], list(request.get("stop_token_ids") or [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise InvalidRequest(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    texts = [s for s in stop if isinstance(s, str)]
    ids = [s for s in stop if isinstance(s, int) and not isinstance(s, bool)]
    return texts, ids + list(request.get("stop_token_ids") or [])


# ---------------------------------------------------------------- the chat processor of one model


class ChatProcessor:
    """Serves ``/v1/chat/completions`` of one model for Dynamo (``PythonAsyncEngine(self.generator, loop)``).

    Args:
        sessions: the model's :class:`FaceSessions` (its core holds the model's chat template).
        routed_engine: Dynamo's routed engine (KV router -> workers), from the factory call.
        eos_token_ids: ids that end generation (from the card's ``config.json`` / ``tokenizer_config.json``).
    """

    def __init__(self, sessions: FaceSessions, routed_engine: Any, eos_token_ids: list[int]):
        self.sessions = sessions
        self.routed_engine = routed_engine
        self.eos_token_ids = list(eos_token_ids)
        self.hf = sessions.tokenizer.reference  # tokenizers.Tokenizer: detokenization

    def encode_request(self, request: dict[str, Any]) -> FaceEncoded:
        """The prompt ids of a chat body (Dynamo hands it over parsed: ``request["messages"]`` is the one
        place this face reads the conversation), through the core's chat step.

        Raises:
            InvalidRequest: no ``messages`` list, ``n != 1``, bad options, or the template refuses the
                conversation.
        """
        if request.get("n", 1) != 1:
            raise InvalidRequest(f"n={request.get('n')!r}: only n=1 is served by the toktier chat processor")
        kwargs = request.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise InvalidRequest("chat_template_kwargs must be an object")
        cont = request.get("continue_final_message", False)  # a bool, or a field name (ServingCore.chat checks)
        return self.sessions.chat(
            session_key(request),
            request.get("messages"),
            tools=request.get("tools"),
            documents=request.get("documents"),
            add_generation_prompt=bool(request.get("add_generation_prompt", not cont)),
            continue_final_message=cont,
            chat_template_kwargs=kwargs,
        )

    def preprocessed(self, request: dict[str, Any], ids: list[int], stop_ids: list[int]) -> dict[str, Any]:
        """Dynamo's preprocessed request (the Rust ``PreprocessedRequest`` fields) for ``ids``."""
        top_k = request.get("top_k")
        return {
            "model": request.get("model"),
            "token_ids": ids,
            "stop_conditions": {
                "max_tokens": request.get("max_completion_tokens") or request.get("max_tokens"),
                "stop": None,
                "stop_token_ids": stop_ids or None,
                "min_tokens": request.get("min_tokens"),
                "ignore_eos": request.get("ignore_eos"),
            },
            "sampling_options": {
                "n": 1,
                "presence_penalty": request.get("presence_penalty"),
                "frequency_penalty": request.get("frequency_penalty"),
                "repetition_penalty": request.get("repetition_penalty"),
                "temperature": request.get("temperature"),
                "top_p": request.get("top_p"),
                "top_k": top_k if isinstance(top_k, int) and top_k > 0 else None,
                "min_p": request.get("min_p"),
                "seed": request.get("seed"),
            },
            "output_options": {"logprobs": None, "prompt_logprobs": None,
                               "skip_special_tokens": request.get("skip_special_tokens", True)},
            "eos_token_ids": self.eos_token_ids,
            "annotations": [],
        }

    async def generator(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """One chat request: render, encode (session), route, detokenize. Yields ``chat.completion.chunk``
        envelopes.

        Raises:
            dynamo.llm.exceptions.InvalidArgument: bad request (Dynamo answers 400 with the message).
        """
        from dynamo.llm.exceptions import InvalidArgument

        try:
            stop_texts, stop_ids = _stops(request)
            enc = await asyncio.to_thread(self.encode_request, request)
        except ToktierError as e:  # InvalidRequest included: Dynamo answers 400 with this message
            raise InvalidArgument(f"{type(e).__name__}: {e}") from e
        preproc = self.preprocessed(request, enc.ids, stop_ids)
        async for item in self._stream(request, preproc, len(enc.ids), stop_texts, context):
            yield item

    async def _stream(self, request, preproc, n_prompt: int, stop_texts: list[str], context) -> AsyncIterator[dict]:
        from tokenizers.decoders import DecodeStream

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = request.get("model")
        decoder = DecodeStream(skip_special_tokens=bool(request.get("skip_special_tokens", True)))
        stopper = _StopText(stop_texts)
        opts = request.get("stream_options") or {}
        want_usage = not request.get("stream") or bool(opts.get("include_usage"))
        n_out, first = 0, True
        cached: int | None = None  # prompt ids the worker found in its KV cache (its completion_usage)

        def chunk(content: str | None, finish: str | None) -> dict[str, Any]:
            nonlocal first
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
                first = False
            if content:
                delta["content"] = content
            out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            if finish is not None and want_usage:
                out["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                "total_tokens": n_prompt + n_out}
                if cached is not None:
                    out["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
            out["llm_metrics"] = {"input_tokens": n_prompt, "output_tokens": n_out, "chunk_tokens": 0}
            if cached is not None:
                out["llm_metrics"]["cached_tokens"] = cached
            return {"_dynamo_annotated": True, "data": out}

        stream = await self.routed_engine.generate(preproc, context=context)
        async for resp in stream:
            if resp.is_error():
                msg = "; ".join(resp.comments() or []) or "worker error"
                yield {"_dynamo_annotated": True, "event": "error", "comment": [msg]}
                return
            data = resp.data()
            if not isinstance(data, dict):
                continue
            if "token_ids" not in data:
                msg = data.get("message") if data.get("status") == "error" else f"no token_ids in {data!r}"
                yield {"_dynamo_annotated": True, "event": "error", "comment": [str(msg)]}
                return
            usage = data.get("completion_usage")
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens_details"), dict):
                c = usage["prompt_tokens_details"].get("cached_tokens")
                cached = c if isinstance(c, int) else cached
            ids = data.get("token_ids") or []
            n_out += len(ids)
            text = "".join(piece for t in ids if (piece := decoder.step(self.hf, int(t))) is not None)
            emit, stopped = stopper.push(text)
            finish = _finish_reason(data.get("finish_reason"))
            if stopped:
                yield chunk(emit, "stop")
                return
            if finish is not None:
                yield chunk(emit + stopper.flush(), finish)
                return
            if emit or first:
                yield chunk(emit, None)
        yield chunk(stopper.flush(), "stop")


def _finish_reason(raw: Any) -> str | None:
    if raw is None:
        return None
    raw = str(raw).lower()
    if raw in ("eos", "stop"):
        return "stop"
    if raw == "length":
        return "length"
    if raw in ("cancelled", "canceled"):
        return "cancelled"
    return "error" if raw.startswith("error") else raw


# ---------------------------------------------------------------- the factory Dynamo calls per model


def _eos_ids(hf: Any, folder: Path) -> list[int]:
    """End-of-sequence ids: ``config.json`` / ``generation_config.json`` ``eos_token_id`` plus
    ``tokenizer_config.json``'s ``eos_token`` (its id in the vocabulary)."""
    import json

    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            v = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    from toktier_backend.chat.template import special_tokens

    eos = special_tokens(folder / "tokenizer.json").get("eos_token")
    if eos:
        i = hf.token_to_id(eos)
        if i is not None and i not in ids:
            ids.append(i)
    return ids


class EngineFactory:
    """``chat_engine_factory`` for ``EntrypointArgs``: one :class:`ChatProcessor` per discovered model.

    Args:
        args: the parsed ``--toktier-*`` flags (``engine``, ``chat_template``, ``max_prompt_chars``, session
            and verifier limits).
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.sessions: dict[str, FaceSessions] = {}

    async def chat_engine_factory(self, instance_id: Any, mdc: Any, routed_engine: Any) -> Any:
        from dynamo.llm import PythonAsyncEngine

        import toktier_backend as tt

        if not mdc.model_type().supports_chat():
            raise RuntimeError(f"model {mdc.name()!r}: type {mdc.model_type()} has no chat surface")
        folder = Path(mdc.local_dir())
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise RuntimeError(f"model {mdc.name()!r}: no tokenizer.json in the card's folder {folder}; the "
                               "toktier chat processor needs the HF tokenizer file")
        a = self.args
        tok = await asyncio.to_thread(tt.load_tokenizer, str(path), engine=a.toktier_engine,
                                      max_chars=a.toktier_max_prompt_chars)
        sessions = FaceSessions(tok, name=mdc.name(), max_sessions=a.toktier_max_sessions,
                                min_prefix_chars=a.toktier_min_prefix_chars, ttl_s=a.toktier_session_idle_seconds,
                                verifier_rate=a.toktier_verifier_rate, verifier_first_n=a.toktier_verifier_first_n,
                                quarantine_file=a.toktier_quarantine_file, chat_template=a.toktier_chat_template)
        if sessions.core.chat_template is None:
            sessions.close()
            raise RuntimeError(f"model {mdc.name()!r}: no chat template beside {path} (tokenizer_config.json / "
                               "chat_template.jinja); pass --toktier-chat-template FILE")
        self.sessions[mdc.name()] = sessions
        proc = ChatProcessor(sessions, routed_engine, _eos_ids(tok.reference, folder))
        log.info("toktier chat processor for %s: %s (engine %s, eos %s)", mdc.name(), path, tok.engine.name,
                 proc.eos_token_ids)
        return PythonAsyncEngine(proc.generator, asyncio.get_running_loop())


# ---------------------------------------------------------------- command line


def add_toktier_arguments(parser: argparse.ArgumentParser) -> None:
    """Our flags, all ``--toktier-*`` so they never collide with ``dynamo.frontend``'s."""
    g = parser.add_argument_group("toktier chat processor")
    g.add_argument("--toktier-engine", default="auto", help="tokenizer engine: auto, gigatoken, fastokens, hf")
    g.add_argument("--toktier-chat-template", default=None,
                   help="chat template file for every model (default: the one in each model card's folder)")
    g.add_argument("--toktier-max-prompt-chars", type=int, default=64 * 1024 * 1024,
                   help="rendered prompt size limit in chars; larger requests get 400 (default 64M)")
    g.add_argument("--toktier-max-sessions", type=int, default=256, help="sessions held per model (LRU beyond)")
    g.add_argument("--toktier-min-prefix-chars", type=int, default=2048,
                   help="prompts with no session key at least this long (chars) find their session by prefix")
    g.add_argument("--toktier-session-idle-seconds", type=float, default=600.0)
    g.add_argument("--toktier-verifier-rate", type=float, default=0.01,
                   help="share of replies re-encoded by the HF reference off the request path (default 0.01)")
    g.add_argument("--toktier-verifier-first-n", type=int, default=32, help="replies always verified first")
    g.add_argument("--toktier-quarantine-file", default=None, help="shared quarantine file (default: in memory)")
    g.add_argument("--toktier-metrics-host", default="127.0.0.1")
    g.add_argument("--toktier-metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="port of the toktier_* Prometheus metrics (Dynamo's own stay on --http-port /metrics)")


def parse_args(argv: list[str] | None):
    """``(FrontendConfig, toktier namespace)`` from ``dynamo.frontend``'s own argument group plus ours."""
    from dynamo.frontend.frontend_args import FrontendArgGroup, FrontendConfig

    parser = argparse.ArgumentParser(prog="toktier dynamo", formatter_class=argparse.RawTextHelpFormatter,
                                     description="Dynamo's frontend (all its flags) with the toktier chat processor.")
    FrontendArgGroup().add_arguments(parser)
    add_toktier_arguments(parser)
    args = parser.parse_args(argv)
    config = FrontendConfig.from_cli_args(args)
    config.validate()
    if config.chat_processor not in ("dynamo", None):
        parser.error(f"--dyn-chat-processor {config.chat_processor}: this command runs its own chat processor")
    return config, args


async def _amain(argv: list[str] | None) -> int:
    from dynamo.common.configuration.groups.router_args import build_router_config
    from dynamo.frontend.main import _export_transport_tls_env, load_frontend_route_extensions
    from dynamo.llm import EngineType, EntrypointArgs, make_engine, run_input
    from dynamo.runtime import DistributedRuntime

    from toktier_backend.serving.metrics import start_exporter

    os.environ.pop("DYN_SYSTEM_PORT", None)  # a worker's port, as dynamo.frontend does
    config, args = parse_args(argv)
    if args.toktier_metrics_port > 0:
        start_exporter(args.toktier_metrics_port, args.toktier_metrics_host)
    loop = asyncio.get_running_loop()
    _export_transport_tls_env(config)
    runtime = DistributedRuntime(loop, config.discovery_backend, config.request_plane,
                                 event_plane=config.event_plane, response_plane=config.response_plane)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    os.environ["DYN_ROUTER_MIN_INITIAL_WORKERS"] = str(config.min_initial_workers)
    factory = EngineFactory(args)
    kwargs: dict[str, Any] = {
        "http_host": config.http_host, "http_port": config.http_port,
        "kv_cache_block_size": config.kv_cache_block_size, "router_config": build_router_config(config),
        "migration_limit": config.migration_limit,
        "metrics_prefix": config.metrics_prefix if (config.metrics_prefix or "").strip() else None,
        "enable_anthropic_api": config.enable_anthropic_api,
        "strip_anthropic_preamble": config.strip_anthropic_preamble,
        "enable_streaming_tool_dispatch": config.enable_streaming_tool_dispatch,
        "enable_streaming_reasoning_dispatch": config.enable_streaming_reasoning_dispatch,
        "reasoning_field_name": config.reasoning_field_name,
        "tokenizer_backend": config.tokenizer_backend, "tokenizer_fallback": config.tokenizer_fallback,
        "chat_engine_factory": factory.chat_engine_factory,
    }
    for name in ("migration_max_seq_len", "model_name", "model_path", "tls_cert_path", "tls_key_path",
                 "tls_client_ca_cert_path", "namespace", "namespace_prefix"):
        if getattr(config, name, None) is not None and getattr(config, name) != "":
            kwargs[name] = getattr(config, name)
    if config.kserve_grpc_server and config.grpc_metrics_port:
        kwargs["http_metrics_port"] = config.grpc_metrics_port
    engine = await make_engine(runtime, EntrypointArgs(EngineType.Dynamic, **kwargs))
    routes = load_frontend_route_extensions(config.frontend_route_extensions)
    print(f"toktier dynamo: http://{config.http_host}:{config.http_port} (chat: toktier processor; "
          f"toktier metrics :{args.toktier_metrics_port})", flush=True)
    try:  # the three inputs of dynamo.frontend: text (--interactive), KServe gRPC, HTTP
        if config.interactive:
            await run_input(runtime, "text", engine)
        elif config.kserve_grpc_server:
            await run_input(runtime, "grpc", engine)
        else:
            await run_input(runtime, "http", engine, routes)
    except asyncio.CancelledError:
        pass
    finally:
        for s in factory.sessions.values():
            s.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run Dynamo's frontend with the toktier chat processor until SIGTERM / SIGINT."""
    try:
        import dynamo.frontend.frontend_args  # noqa: F401
        import uvloop
    except ImportError as e:
        raise SystemExit("toktier dynamo needs ai-dynamo 1.6.1 in this environment: deploy/install_dynamo.sh "
                         "(or `pip install ai-dynamo==1.6.1` where its whole dependency set is reachable)") from e
    return uvloop.run(_amain(argv))


if __name__ == "__main__":
    sys.exit(main())
