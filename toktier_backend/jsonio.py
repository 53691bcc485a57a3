"""JSON bodies: ``loads(bytes)`` and ``dumps(value)`` with orjson where installed, else the standard library.

orjson parses large chat bodies faster than ``json.loads`` (numbers: docs/design/chat.md), and writes a
numpy id array without a Python int per id (the proxy's forwarded prompt: docs/integrations.md).
Both give the same Python values for valid JSON (``dict``/``list``/``str``/``int``/``float``/``bool``/
``None``); orjson rejects ``NaN``/``Infinity`` and lone surrogates, which ``json`` accepts: those bodies
raise :class:`InvalidRequest` either way here.
"""

from __future__ import annotations

import json
from typing import Any

from toktier_backend.errors import InvalidRequest

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a core dependency; the fallback keeps imports working
    _orjson = None



def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse a JSON document.

    Args:
        data: UTF-8 bytes (or str) of one JSON value.

    Returns:
        The value, built from ``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``, ``None``.

    Raises:
        InvalidRequest: not valid JSON (the parser's message, with its position).
    """
    if _orjson is not None:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError as e:
            raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except ValueError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e


def _plain_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(value: Any) -> bytes:
    """UTF-8 JSON of ``value``: JSON types, and numpy arrays (written as lists of numbers) and scalars.

    Compact (no spaces). The same value as ``json.dumps(value_with_arrays_as_lists)`` once parsed.

    Raises:
        TypeError: a value that is neither (from the standard library's encoder).
    """
    if _orjson is not None:
        try:
            return _orjson.dumps(value, option=_orjson.OPT_SERIALIZE_NUMPY)
        except _orjson.JSONEncodeError:
            pass  # (e.g. an int beyond 64 bits, a non-contiguous array): the standard library writes it
    return json.dumps(value, separators=(",", ":"), default=_plain_default).encode()
