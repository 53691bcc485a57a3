"""The PyTriton face: ``toktier_session`` and ``toktier_encode`` bound to the same :class:`Handler`.

Same tensors as ``model_repository/`` (``TEXT`` etc., batch dimension first), with these differences, all
due to PyTriton 0.7:

- **Session key.** PyTriton 0.7 neither passes ``correlation_id()`` to the inference callable nor
  configures a sequence batcher (its ``ModelConfig`` knows only the dynamic batcher). Sessions are keyed by
  the request parameter ``session_id`` (int or str), and START/END come from the request parameters
  ``session_start`` / ``session_end`` (bool), e.g. ``client.infer(..., parameters={"session_id": "a1",
  "session_start": True})``. There is no Triton idle timeout: the session store's TTL alone drops idle
  sessions (``session_idle_s``).
- **Errors.** An exception in the callable reaches the client as Triton INTERNAL (HTTP 500) whose message
  holds the traceback, ending with ``toktier_backend.errors.<Class>: <message>``. No dynamic batcher is
  configured, so each call holds one request and one bad request fails only itself.
- **Empty ids.** PyTriton 0.7 cannot send a zero-size tensor ("memoryview: cannot cast view with zeros in
  shape or strides"), so an empty ``INPUT_ID`` comes back as ``[-1]`` (:data:`EMPTY_PAD`): take the first
  ``REQUEST_INPUT_LEN - KEEP`` ids of a patch (all ``REQUEST_INPUT_LEN`` of a full reply).
  :class:`~toktier_backend.client.SessionClient` does.
- **Access token.** PyTriton 0.7 restricts the model-repository, statistics, trace, logging and
  shared-memory endpoints behind an access token (``Triton.get_access_token()``); inference, health and
  metadata stay open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from toktier_backend.config import parse_bool, stub_environment
from toktier_backend.errors import InvalidRequest
from toktier_backend.faces import triton_io
from toktier_backend.faces.triton import DEFAULT_MAX_TEXT_BYTES, DEFAULT_SESSION_TTL_S, ENCODE_MODEL, SESSION_MODEL, Handler

MAX_BATCH_SIZE = 8
EMPTY_PAD = -1  # stands for "no ids": PyTriton 0.7 cannot send a zero-size INPUT_ID


def _padded(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if outputs["INPUT_ID"].size == 0:
        outputs = dict(outputs, INPUT_ID=np.array([EMPTY_PAD], dtype=np.int32))
    return triton_io.with_batch_dim(outputs, True)


def _parameter_flag(params: dict, name: str) -> bool:
    """A request parameter as a bool (``config.parse_bool``; absent: False).

    Raises:
        InvalidRequest: not a boolean (names the parameter).
    """
    try:
        return parse_bool(params.get(name), False, name=f"request parameter {name}")
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def session_infer(handler: Handler):
    """The ``toktier_session`` inference callable: ``list[Request] -> list[dict[str, ndarray]]``."""

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        responses = []
        for request in requests:
            params = request.parameters or {}
            session_id = params.get("session_id")
            if session_id is None:
                raise InvalidRequest(
                    "the PyTriton face keys sessions by the request parameter 'session_id' (int or str); "
                    "send parameters={'session_id': ..., 'session_start': True} on the first request."
                )
            inputs = {name: request.data.get(name) for name in triton_io.SESSION_INPUTS}
            try:
                start, end = _parameter_flag(params, "session_start"), _parameter_flag(params, "session_end")
            except InvalidRequest as e:
                handler.core.refuse(handler.session_origin, e)
                raise
            outputs = handler.handle_session_tensors(session_id, inputs, start=start, end=end)
            responses.append(_padded(outputs))
        return responses

    return infer


def encode_infer(handler: Handler):
    """The ``toktier_encode`` inference callable: the call's requests go to ``Handler.handle_encode_batch``
    together (with a GPU router, their GPU share is one device pass). PyTriton 0.7 has no per-request
    error, so a failed request raises and fails its call; without a dynamic batcher a call holds one."""

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        results = handler.handle_encode_batch([{n: r.data.get(n) for n in triton_io.ENCODE_INPUTS} for r in requests])
        for result in results:
            if isinstance(result, Exception):
                raise result
        return [_padded(result) for result in results]

    return infer


def create(
    tokenizer: str,
    *,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    max_text_bytes: int | None = None,
    session_idle_s: float | None = None,
    log_path: str | Path | None = None,
    parameters: dict[str, str] | None = None,
    gpu_device: int | None = None,
):
    """Build a ``pytriton.triton.Triton`` with both models bound (not started: call ``.run()``).

    ``parameters`` are the model parameters of ``model_repository`` (``tokenizer_sha256``,
    ``session_budget_bytes``, ``verifier_rate``, ...; see ``CoreConfig.from_parameters``).
    ``gpu_device``: serve ``toktier_encode`` as a Triton GPU instance would, through a
    ``gpu.routing.GpuRouter`` on that CUDA device (canary at load, CPU fallback, never a failed load), with
    the parameters ``gpu_engine``, ``gpu_crossover_chars`` and ``gpu_max_queue``; ``None``: CPU only.

    Returns:
        ``(triton, handler)``.
    """
    from pytriton.model_config import ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    # PyTriton passes this process's environment to tritonserver; its Python backend stub links
    # libpython3.X.so and must find this interpreter's (else a system Python without our packages)
    os.environ.update(stub_environment())
    handler = Handler.from_parameters(
        {**(parameters or {}), "tokenizer": tokenizer, "max_text_bytes": str(max_text_bytes or DEFAULT_MAX_TEXT_BYTES)},
        session_ttl_s=session_idle_s or DEFAULT_SESSION_TTL_S, face="pytriton", models=(SESSION_MODEL, ENCODE_MODEL),
        model=ENCODE_MODEL, instance_kind="CPU" if gpu_device is None else "GPU", device_id=gpu_device or 0,
    )
    config = TritonConfig(
        http_address=host,
        http_port=http_port,
        grpc_address=host,
        grpc_port=grpc_port,
        metrics_address=host,
        metrics_port=metrics_port,
        allow_gpu_metrics=False,
        exit_timeout_secs=10,
        log_file=Path(log_path) if log_path else None,
    )
    triton = Triton(config=config)
    # batcher=None: no dynamic batcher, so each call holds one request and an error fails only that one.
    model_config = ModelConfig(batching=True, max_batch_size=MAX_BATCH_SIZE, batcher=None)
    text = Tensor(name="TEXT", dtype=bytes, shape=(1,))
    add_special = Tensor(name="ADD_SPECIAL_TOKENS", dtype=np.bool_, shape=(1,), optional=True)
    triton.bind(
        model_name="toktier_session",
        infer_func=session_infer(handler),
        inputs=[  # as model_repository/toktier_session: exactly one of TEXT and MESSAGES (checked by the handler)
            Tensor(name="TEXT", dtype=bytes, shape=(1,), optional=True),
            Tensor(name="MODE", dtype=bytes, shape=(1,), optional=True),
            Tensor(name="REPLY", dtype=bytes, shape=(1,), optional=True),
            add_special,
            Tensor(name="MESSAGES", dtype=bytes, shape=(1,), optional=True),
            Tensor(name="ADD_GENERATION_PROMPT", dtype=np.bool_, shape=(1,), optional=True),
            Tensor(name="CHAT_TEMPLATE_KWARGS", dtype=bytes, shape=(1,), optional=True),
        ],
        outputs=[
            Tensor(name="INPUT_ID", dtype=np.int32, shape=(-1,)),
            Tensor(name="REQUEST_INPUT_LEN", dtype=np.int32, shape=(1,)),
            Tensor(name="KEEP", dtype=np.int32, shape=(1,)),
            Tensor(name="ROUTE", dtype=bytes, shape=(1,)),
        ],
        config=model_config,
        strict=True,
    )
    triton.bind(
        model_name="toktier_encode",
        infer_func=encode_infer(handler),
        inputs=[text, add_special],
        outputs=[
            Tensor(name="INPUT_ID", dtype=np.int32, shape=(-1,)),
            Tensor(name="REQUEST_INPUT_LEN", dtype=np.int32, shape=(1,)),
        ],
        config=model_config,
        strict=True,
    )
    return triton, handler
