"""Tensor <-> Python conversion for the Triton models and the PyTriton face; numpy only, no Triton import.

Input tensors arrive as numpy arrays: ``TYPE_STRING`` as ``object`` arrays of ``bytes``, ``TYPE_BOOL`` as
``bool`` arrays, shaped ``[1]`` (``max_batch_size: 0``) or ``[1, 1]`` (batch dimension first). Each request
carries exactly one text; send several requests to batch (the dynamic batcher and the sequence batcher
gather them).

A ``toktier_session`` request carries either ``TEXT`` or ``MESSAGES`` (a chat request: a JSON array of
OpenAI-style messages, rendered with the model's chat template by the serving core), never both
(:func:`chat_args`, :func:`messages_bytes`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np

from toktier_backend.errors import InvalidRequest, ToktierError

SESSION_INPUTS = ("TEXT", "MODE", "REPLY", "ADD_SPECIAL_TOKENS", "MESSAGES", "ADD_GENERATION_PROMPT",
                  "CHAT_TEMPLATE_KWARGS")
CHAT_INPUTS = ("MESSAGES", "ADD_GENERATION_PROMPT", "CHAT_TEMPLATE_KWARGS")
CHAT_OPTION_KEYS = ("tools", "documents", "continue_final_message")
"""Keys of ``CHAT_TEMPLATE_KWARGS`` taken as the render's own options (``apply_chat_template``'s keywords);
every other key is a template variable."""
SESSION_OUTPUTS = ("INPUT_ID", "REQUEST_INPUT_LEN", "KEEP", "ROUTE")
ENCODE_INPUTS = ("TEXT", "ADD_SPECIAL_TOKENS")
ENCODE_OUTPUTS = ("INPUT_ID", "REQUEST_INPUT_LEN")

SEQUENCE_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
SEQUENCE_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


# ---------------------------------------------------------------- inputs


def read_inputs(get: Callable[[str], Any], names: Iterable[str]) -> dict[str, np.ndarray | None]:
    """``{name: get(name) as numpy or None}``; ``get`` returns a numpy array, an object with ``as_numpy()``
    (``pb_utils.Tensor``), or ``None`` for an absent optional input."""
    out: dict[str, np.ndarray | None] = {}
    for name in names:
        t = get(name)
        out[name] = None if t is None else (t.as_numpy() if hasattr(t, "as_numpy") else np.asarray(t))
    return out


def scalar(inputs: Mapping[str, np.ndarray | None], name: str, *, required: bool = False) -> Any:
    """The single element of input ``name`` (``bytes`` for strings, ``bool``), or ``None`` if absent.

    Raises:
        InvalidRequest: required and absent, or the tensor holds other than one element.
    """
    a = inputs.get(name)
    if a is None:
        if required:
            raise InvalidRequest(f"input {name!r} is required (TYPE_STRING, shape [1]).")
        return None
    a = np.asarray(a)
    if a.size != 1:
        raise InvalidRequest(
            f"input {name!r} has shape {list(a.shape)} ({a.size} elements); one request carries one element "
            f"(shape [1], or [1, 1] with the batch dimension). Send several requests to batch."
        )
    v = a.reshape(-1)[0]
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.bytes_):
        return bytes(v)
    if isinstance(v, np.generic):
        return v.item()
    return v


def _text(inputs: Mapping[str, np.ndarray | None]) -> bytes | str:
    v = scalar(inputs, "TEXT", required=True)
    if not isinstance(v, (bytes, str)):
        raise InvalidRequest(f"input 'TEXT' must be TYPE_STRING (UTF-8 bytes), got {type(v).__name__}.")
    return v


def _flag(inputs: Mapping[str, np.ndarray | None], name: str) -> bool | None:
    v = scalar(inputs, name)
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (bytes, str)):  # tolerate "true"/"false" sent as strings
        s = (v.decode("ascii", "replace") if isinstance(v, bytes) else v).strip().lower()
        if s in ("true", "1"):
            return True
        if s in ("false", "0"):
            return False
    if isinstance(v, (int, np.integer)) and int(v) in (0, 1):
        return bool(v)
    raise InvalidRequest(f"input {name!r} must be TYPE_BOOL, got {v!r}.")


def session_args(inputs: Mapping[str, np.ndarray | None]) -> dict[str, Any]:
    """Keyword arguments of ``Handler.handle_session`` (text, mode, reply, add_special) from input tensors.

    Raises:
        InvalidRequest: neither ``TEXT`` nor ``MESSAGES`` (see :func:`chat_args` for ``MESSAGES``).
    """
    if inputs.get("TEXT") is None:
        raise InvalidRequest(
            "toktier_session needs exactly one of the inputs 'TEXT' (TYPE_STRING [1]: the text) and 'MESSAGES' "
            "(TYPE_STRING [1]: a JSON array of chat messages); neither was sent."
        )
    return {
        "text": _text(inputs),
        "mode": scalar(inputs, "MODE"),
        "reply": scalar(inputs, "REPLY"),
        "add_special": _flag(inputs, "ADD_SPECIAL_TOKENS"),
    }


def is_chat(inputs: Mapping[str, np.ndarray | None]) -> bool:
    """Does the request carry ``MESSAGES`` (a chat request)?"""
    return inputs.get("MESSAGES") is not None


def messages_bytes(raw: Any) -> bytes:
    """The ``MESSAGES`` element as the UTF-8 JSON bytes of a message array, not parsed here: the core
    parses a keyed conversation's request from its first changed message on (``ServingCore.chat``).

    Raises:
        InvalidRequest: not ``TYPE_STRING``.
    """
    if isinstance(raw, str):
        return raw.encode("utf-8", "surrogatepass")  # a lone surrogate stays invalid UTF-8: the parse refuses it
    if not isinstance(raw, bytes):
        raise InvalidRequest(f"input 'MESSAGES' must be TYPE_STRING (UTF-8 JSON bytes), got {type(raw).__name__}.")
    return raw


def _json_object(inputs: Mapping[str, np.ndarray | None], name: str) -> dict:
    from toktier_backend import jsonio

    raw = scalar(inputs, name)
    if raw is None or raw in (b"", ""):
        return {}
    if not isinstance(raw, (bytes, str)):
        raise InvalidRequest(f"input {name!r} must be TYPE_STRING (UTF-8 JSON bytes), got {type(raw).__name__}.")
    try:
        value = jsonio.loads(raw)
    except ValueError as e:
        raise InvalidRequest(f"input {name!r} is not JSON ({e}); send a JSON object.") from e
    if not isinstance(value, dict):
        raise InvalidRequest(f"input {name!r} must be a JSON object, got {type(value).__name__}.")
    return value


def chat_args(inputs: Mapping[str, np.ndarray | None]) -> dict[str, Any]:
    """Keyword arguments of ``Handler.handle_chat`` from the input tensors of a chat request.

    ``MESSAGES``: JSON array of messages; ``ADD_GENERATION_PROMPT``: bool (default false, as
    ``apply_chat_template``); ``CHAT_TEMPLATE_KWARGS``: JSON object whose ``tools``, ``documents``,
    ``continue_final_message`` are the render's options and whose other keys are template variables
    (``enable_thinking``, ...); ``ADD_SPECIAL_TOKENS``: default false (the template writes the special
    tokens); ``REPLY``: as for a text; ``MODE``: absent or ``full`` (the messages are the whole conversation),
    or ``delta`` (the messages after the sequence's previous request's; checked by the core).

    Raises:
        InvalidRequest: ``TEXT`` sent too, bad JSON, or bad flags.
    """
    if inputs.get("TEXT") is not None:
        raise InvalidRequest(
            "the request carries both 'TEXT' and 'MESSAGES'; send exactly one: TEXT for a text, MESSAGES for a "
            "chat conversation (rendered with the model's chat template)."
        )
    kwargs = _json_object(inputs, "CHAT_TEMPLATE_KWARGS")
    options = {k: kwargs.pop(k) for k in CHAT_OPTION_KEYS if k in kwargs}
    cont = options.get("continue_final_message", False)
    if not isinstance(cont, (bool, str)):
        raise InvalidRequest("CHAT_TEMPLATE_KWARGS continue_final_message must be a boolean or the name of the "
                             f"field to continue, got {cont!r}.")
    return {
        "messages": messages_bytes(scalar(inputs, "MESSAGES")),
        "mode": scalar(inputs, "MODE"),
        "reply": scalar(inputs, "REPLY"),
        "add_special": _flag(inputs, "ADD_SPECIAL_TOKENS"),
        "add_generation_prompt": bool(_flag(inputs, "ADD_GENERATION_PROMPT")),
        "tools": options.get("tools"),
        "documents": options.get("documents"),
        "continue_final_message": cont,
        "chat_template_kwargs": kwargs,
    }


def encode_args(inputs: Mapping[str, np.ndarray | None]) -> dict[str, Any]:
    """Keyword arguments of ``Handler.handle_encode`` (text, add_special) from input tensors."""
    return {"text": _text(inputs), "add_special": _flag(inputs, "ADD_SPECIAL_TOKENS")}


# ---------------------------------------------------------------- outputs


def with_batch_dim(outputs: Mapping[str, np.ndarray], batched: bool) -> dict[str, np.ndarray]:
    """Add the leading batch dimension (``[n]`` -> ``[1, n]``) when the model has ``max_batch_size > 0``."""
    return {k: (v[np.newaxis, ...] if batched else v) for k, v in outputs.items()}


# ---------------------------------------------------------------- errors

def error_code(exc: BaseException) -> str:
    """The ``pb_utils.TritonError`` code name for ``exc``: INVALID_ARG, NOT_FOUND, UNAVAILABLE or INTERNAL
    (``serving.core.error_code``: the one mapping, also the metrics' ``code`` label)."""
    from toktier_backend.serving.core import error_code as _code

    return _code(exc)


def error_message(exc: BaseException) -> str:
    """``"<ErrorClass>: <message>"``; unexpected errors keep their type so logs show what broke."""
    name = type(exc).__name__
    text = str(exc)
    return f"{name}: {text}" if isinstance(exc, ToktierError) else f"internal error {name}: {text}"


# ---------------------------------------------------------------- model config


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters { key: ... value: { string_value: ... } }`` of a parsed model config, as a dict."""
    params = model_config.get("parameters") or {}
    return {k: (v.get("string_value", "") if isinstance(v, Mapping) else str(v)) for k, v in params.items()}


def sequence_idle_seconds(model_config: Mapping[str, Any], default: float) -> float:
    """The sequence batcher's ``max_sequence_idle_microseconds`` in seconds (``default`` if unset)."""
    sb = model_config.get("sequence_batching") or {}
    us = sb.get("max_sequence_idle_microseconds")
    try:
        us = int(us)
    except (TypeError, ValueError):
        return default
    return us / 1e6 if us > 0 else default


def is_batched(model_config: Mapping[str, Any]) -> bool:
    """True when the model has a batch dimension (``max_batch_size > 0``)."""
    return int(model_config.get("max_batch_size", 0) or 0) > 0
