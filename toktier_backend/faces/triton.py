"""The Triton face: the Handler behind the Triton Python backend models ``toktier_session`` /
``toktier_encode`` and their PyTriton twins.

Pure Python and numpy: no Triton import. ``model_repository/*/1/model.py`` and
:mod:`toktier_backend.faces.pytriton` turn tensors into one :class:`Handler` call and the returned dict
back into tensors; the Handler turns that into one :class:`~toktier_backend.serving.core.ServingCore` call
(sessions, verifier, metrics, pool: all there).

Sessions are keyed by the Triton **correlation ID** (an ``int`` or a ``str``, as
``request.correlation_id()`` returns it; ``17`` and ``"17"`` are different sessions, as they are for the
sequence batcher). START replaces whatever the key held, END frees it after the reply, and a session idle
for longer than the store's TTL is dropped; the TTL is set from the sequence batcher's
``max_sequence_idle_microseconds`` so that the store forgets a session when Triton does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping

import numpy as np

from toktier_backend.errors import ToktierError
from toktier_backend.faces import triton_io
from toktier_backend.runtime.pool import CpuPool
from toktier_backend.serving.core import (  # noqa: F401  (re-exported)
    DEFAULT_MAX_TEXT_BYTES,
    DEFAULT_SESSION_BUDGET_BYTES,
    MODES,
    REPLIES,
    CoreConfig,
    Reply,
    ServingCore,
)
from toktier_backend.serving.metrics import Metrics, Origin
from toktier_backend.serving.session_store import (  # noqa: F401  (re-exported)
    DEFAULT_SESSION_TTL_S,
    SessionEntry,
    SessionStore,
)
from toktier_backend.serving.verifier import Verifier
from toktier_backend.tokenizer import Tokenizer, default_tokenizer_path

if TYPE_CHECKING:
    from toktier_backend.gpu.routing import GpuRouter

SESSION_MODEL = "toktier_session"
ENCODE_MODEL = "toktier_encode"

CorrelationId = Hashable  # int or str, as request.correlation_id() returns it


# ---------------------------------------------------------------- handler


class Handler:
    """Serves ``toktier_session`` and ``toktier_encode`` requests for one tokenizer, through a serving core.

    Args:
        tokenizer: a core ``Tokenizer`` (a new :class:`ServingCore` is built for it from the keywords below),
            or a ``ServingCore`` to serve from (the keywords must then be left out).
        face: the ``face`` label of its metrics (``triton``, ``pytriton``).
        models: the models it serves, registered with the core (zero-valued counters exported).
        name, max_text_bytes, session_ttl_s, session_budget_bytes, clock, verifier, metrics, pool, router:
            :class:`ServingCore`'s. Session steps run on ``pool`` at ``REPAIR`` priority (at once, on the
            calling thread, counted by the pool); the tokenizer's chunked full encodes run on its workers at
            ``CHUNK`` priority.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | ServingCore,
        *,
        face: str = "triton",
        models: tuple[str, ...] = (SESSION_MODEL, ENCODE_MODEL),
        name: str = "tokenizer",
        max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        session_budget_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        verifier: Verifier | None = None,
        metrics: Metrics | None = None,
        pool: CpuPool | None = None,
        router: "GpuRouter | None" = None,
    ):
        if isinstance(tokenizer, ServingCore):
            self.core = tokenizer
        else:
            self.core = ServingCore(tokenizer, name=name, max_text_bytes=max_text_bytes, session_ttl_s=session_ttl_s,
                                    session_budget_bytes=session_budget_bytes, clock=clock, verifier=verifier,
                                    metrics=metrics, pool=pool, router=router)
        self.session_origin = Origin(face, SESSION_MODEL)
        self.encode_origin = Origin(face, ENCODE_MODEL)
        for model in models:
            self.core.register(Origin(face, model), sessions=model == SESSION_MODEL)

    # the core's parts, as the Handler exposed them
    tokenizer = property(lambda self: self.core.tokenizer)
    store = property(lambda self: self.core.store)
    verifier = property(lambda self: self.core.verifier)
    metrics = property(lambda self: self.core.metrics)
    pool = property(lambda self: self.core.pool)
    router = property(lambda self: self.core.router)
    name = property(lambda self: self.core.name)
    max_text_bytes = property(lambda self: self.core.max_text_bytes)

    @classmethod
    def from_spec(cls, spec: str, *, sha256: str | None = None, engine: str = "auto", **kwargs: Any) -> "Handler":
        """Load the tokenizer named by ``spec`` (a ``tokenizer.json`` path, a folder holding one, a Hub id,
        or ``"default"`` for the bundled GPT-2 file) and build a handler for it.

        Raises:
            tt.UnsupportedTokenizer: the file cannot be served (malformed, unsupported, or not the pinned one).
        """
        from toktier_backend.tokenizer import load_tokenizer

        if spec in ("", "default"):
            spec = str(default_tokenizer_path())
        return cls(load_tokenizer(spec, sha256=sha256 or None, engine=engine), name=str(spec), **kwargs)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], *, session_ttl_s: float = DEFAULT_SESSION_TTL_S,
                        model: str = SESSION_MODEL, instance_kind: str = "CPU", device_id: int = 0,
                        face: str = "triton", models: tuple[str, ...] | None = None) -> "Handler":
        """A handler from a model's ``config.pbtxt`` parameters (``CoreConfig.from_parameters``; see
        ``model_repository/README.md``); the TTL follows the sequence batcher's idle timeout.

        Args:
            model: the model this instance serves (``toktier_session`` or ``toktier_encode``).
            instance_kind: Triton's ``model_instance_kind`` (``"CPU"``, ``"GPU"``, ``"MODEL"``): a
                ``toktier_encode`` instance of kind ``GPU`` gets the GPU router on ``device_id``.
            models: the models to register (default: ``(model,)``; PyTriton binds both).

        Raises:
            tt.UnsupportedTokenizer: the file cannot be served, or ``tokenizer`` is empty or an unfilled
                ``${...}`` (the bundled GPT-2 file only as ``default``); the model then fails to load.
            ValueError: a parameter is malformed (names it). A GPU engine that cannot load never raises:
                it is logged and counted, and the instance serves from the CPU.
        """
        from toktier_backend.faces.parameters import tokenizer_spec

        tokenizer_spec(params, ("tokenizer",), model=model)  # unfilled/empty: refuse before any work
        models = models or (model,)
        config = CoreConfig.from_parameters(params, session_ttl_s=session_ttl_s)
        gpu = model == ENCODE_MODEL and str(instance_kind).upper() == "GPU"
        core = ServingCore.from_config(config, gpu_device=int(device_id) if gpu else None,
                                       sweeper=SESSION_MODEL in models)
        return cls(core, face=face, models=models)

    def close(self) -> None:
        """Stop the verifier and sweeper threads (``finalize``)."""
        self.core.close()

    # ------------------------------------------------------------ sessions

    def handle_session(
        self,
        corr_id: CorrelationId,
        text: bytes | str,
        mode: str | bytes | None = None,
        reply: str | bytes | None = None,
        add_special: bool | None = None,
        *,
        start: bool = False,
        end: bool = False,
    ) -> dict[str, np.ndarray]:
        """One request of a sequence (:meth:`ServingCore.step`).

        Returns:
            ``INPUT_ID`` int32[n - KEEP] (patch) or int32[n] (full); ``REQUEST_INPUT_LEN`` int32[1] = n, the
            total ids of the session text; ``KEEP`` int32[1], ids of the previous reply still valid (0 for a
            new session); ``ROUTE`` object[1] (bytes), the repair route. The ids equal HF
            ``Tokenizer.encode(session_text, add_special_tokens=flag).ids``.

        Raises:
            InvalidRequest: bad mode/reply, not UTF-8 or lone surrogates, over ``max_text_bytes``, START with
                ``delta``, or a ``delta`` that changes ``add_special_tokens``. The session is unchanged.
            UnknownSession: ``delta`` for a correlation ID this server does not hold: resend ``full``.
        """
        r = self.core.step(self.session_origin, corr_id, text, mode=mode, reply=reply, add_special_tokens=add_special,
                           start=start, end=end)
        return {
            "INPUT_ID": r.ids,
            "REQUEST_INPUT_LEN": np.array([r.n], dtype=np.int32),
            "KEEP": np.array([r.keep], dtype=np.int32),
            "ROUTE": np.array([r.route.encode()], dtype=np.object_),
        }

    def handle_session_tensors(
        self, corr_id: CorrelationId, inputs: Mapping[str, np.ndarray | None], *, start: bool, end: bool
    ) -> dict[str, np.ndarray]:
        """:meth:`handle_session` from input tensors (``TEXT``, optional ``MODE``, ``REPLY``,
        ``ADD_SPECIAL_TOKENS``; shape [1] or [1, 1]), or :meth:`handle_chat` when they carry ``MESSAGES``
        (``triton_io.chat_args``). START/END are honoured even when the tensors are bad."""
        chat = triton_io.is_chat(inputs)
        try:
            args = triton_io.chat_args(inputs) if chat else triton_io.session_args(inputs)
        except ToktierError as e:
            self.core.refuse(self.session_origin, e, key=corr_id, start=start, end=end)
            raise
        if chat:
            return self.handle_chat(corr_id, **args, start=start, end=end)
        return self.handle_session(corr_id, **args, start=start, end=end)

    def handle_chat(
        self,
        corr_id: CorrelationId,
        messages: list | bytes,
        *,
        mode: str | bytes | None = None,
        reply: str | bytes | None = None,
        add_special: bool | None = None,
        add_generation_prompt: bool = False,
        tools: list | None = None,
        documents: list | None = None,
        continue_final_message: bool | str = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        start: bool = False,
        end: bool = False,
    ) -> dict[str, np.ndarray]:
        """One chat request of a sequence (:meth:`ServingCore.chat`, keyed by the correlation ID, waiting for
        the sequence's previous request): the conversation rendered with the model's chat template
        (incrementally, from the sequence's previous request), then encoded. ``mode="delta"``: ``messages``
        are the messages after the sequence's previous request's (``ServingCore.chat``).

        Returns:
            as :meth:`handle_session`; the ids equal HF ``Tokenizer.encode(text, add_special_tokens=flag).ids``
            of ``text`` = transformers ``apply_chat_template(messages, tokenize=False, ...)`` (``flag``
            default ``False``, as ``apply_chat_template(tokenize=True)``).

        Raises:
            InvalidRequest: no chat template, malformed messages, the template refused them, the prompt is
                over ``max_text_bytes``, a delta with no previous chat request held. The session is unchanged.
        """
        r = self.core.chat(self.session_origin, messages, key=corr_id, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           chat_template_kwargs=chat_template_kwargs, add_special_tokens=bool(add_special),
                           reply=reply, start=start, end=end, wait=True, mode=mode)
        return {
            "INPUT_ID": r.ids,
            "REQUEST_INPUT_LEN": np.array([r.n], dtype=np.int32),
            "KEEP": np.array([r.keep], dtype=np.int32),
            "ROUTE": np.array([r.route.encode()], dtype=np.object_),
        }

    # ------------------------------------------------------------ stateless encode

    def handle_encode(self, text: bytes | str, add_special: bool | None = None) -> dict[str, np.ndarray]:
        """Encode one text (:meth:`ServingCore.encode_stateless`).

        Returns:
            ``INPUT_ID`` int32[n], equal to HF ``encode(text, add_special_tokens=flag).ids``
            (gpt2: ``b"hello world"`` -> ``[31373, 995]``); ``REQUEST_INPUT_LEN`` int32[1] = n.

        Raises:
            InvalidRequest: not UTF-8, lone surrogates, or over ``max_text_bytes``.
        """
        r = self.core.encode_stateless(self.encode_origin, text,
                                       add_special_tokens=True if add_special is None else bool(add_special))
        return {"INPUT_ID": r.ids, "REQUEST_INPUT_LEN": np.array([r.n], dtype=np.int32)}

    def handle_encode_tensors(self, inputs: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """:meth:`handle_encode` from input tensors (``TEXT``, optional ``ADD_SPECIAL_TOKENS``)."""
        try:
            args = triton_io.encode_args(inputs)
        except ToktierError as e:
            self.core.refuse(self.encode_origin, e)
            raise
        return self.handle_encode(**args)


    def handle_encode_batch(
        self, batch: list[Mapping[str, np.ndarray | None]]
    ) -> list[dict[str, np.ndarray] | Exception]:
        """:meth:`handle_encode_tensors` for every request of one ``execute()`` (:meth:`ServingCore.encode_batch`:
        on a GPU instance the GPU share of the batch is one device pass).

        Returns:
            per request, in order: the outputs of :meth:`handle_encode`, or the exception that request
            raised (``InvalidRequest`` for bad tensors, bad UTF-8, lone surrogates, over ``max_text_bytes``);
            one bad request never fails the others.
        """
        items: list[tuple[bytes | str, bool] | Exception] = []
        for inputs in batch:
            try:
                args = triton_io.encode_args(inputs)
                items.append((args["text"], True if args["add_special"] is None else bool(args["add_special"])))
            except ToktierError as e:
                self.core.refuse(self.encode_origin, e)
                items.append(e)
        return [r if isinstance(r, Exception) else {"INPUT_ID": r.ids, "REQUEST_INPUT_LEN": np.array([r.n], dtype=np.int32)}
                for r in self.core.encode_batch(self.encode_origin, items)]


def reply_is_full(out: Mapping[str, np.ndarray]) -> bool:
    """Does ``INPUT_ID`` hold all ids (a full reply), not just those from ``KEEP`` on?"""
    return len(out["INPUT_ID"]) == int(out["REQUEST_INPUT_LEN"].reshape(-1)[0])
