"""JSON bodies: ``loads(bytes)`` and ``dumps(value)`` with orjson where installed, else the standard library.

orjson parses large chat bodies faster than ``json.loads`` (numbers: docs/design/chat.md), and writes a
numpy id array without a Python int per id (the proxy's forwarded prompt: docs/integrations.md).

``loads`` gives the standard library's values (``dict``/``list``/``str``/``int``/``float``/``bool``/
``None``), which is what a Python server (vLLM's, transformers' users) parses the same body to, so a
template renders the same text from them. orjson differs in two ways. It parses an integer outside
``[-2**63, 2**64)`` to a ``float``, silently (``100000000000000000000`` -> ``1e+20``, which ``tojson`` then
writes differently): a body that may hold one (:func:`may_hold_big_int`) is parsed by the standard
library. It rejects ``NaN``/``Infinity`` and lone surrogates, which ``json`` accepts: the first raise
:class:`InvalidRequest` on both paths here; a lone surrogate that the standard library lets through is
refused later, by the tokenizer's text check.
"""

from __future__ import annotations

import json
import re
from typing import Any

from toktier_backend.errors import InvalidRequest

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a core dependency; the fallback keeps imports working
    _orjson = None



def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


#: ASCII digits -> ``0``, every other byte -> a space: a run of 19 digits becomes a run of 19 ``0`` bytes.
_DIGIT_RUNS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_RUN = b"0" * 19
_RUN_STR = re.compile(r"[0-9]{19}")


def may_hold_big_int(data: bytes | bytearray | str) -> bool:
    """Could the JSON text ``data`` hold an integer that orjson parses to a ``float`` (one below ``-2**63``
    or at least ``2**64``)? Such a literal has at least 19 digits in one run (JSON writes no leading zeros;
    ``2**63 == 9223372036854775808`` has 19), so without a run of 19 ASCII digits it holds none. A run
    inside a string or a float also answers ``True``: the caller then parses with the standard library
    (exact, slower). Two C passes over bytes (``bytes.translate``, ``bytes.find``), a regex over a str."""
    if isinstance(data, str):
        return _RUN_STR.search(data) is not None
    return data.translate(_DIGIT_RUNS).find(_RUN) >= 0


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse a JSON document.

    Args:
        data: UTF-8 bytes (or str) of one JSON value.

    Returns:
        The value ``json.loads`` gives (module docstring), built from ``dict``, ``list``, ``str``, ``int``,
        ``float``, ``bool``, ``None``.

    Raises:
        InvalidRequest: not valid JSON (the parser's message, with its position), or ``NaN``/``Infinity``.
    """
    if isinstance(data, memoryview):
        data = bytes(data)
    if _orjson is not None and not may_hold_big_int(data):
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError as e:
            raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except ValueError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError as e:  # (orjson refuses past 1024 levels with a JSONDecodeError)
        raise InvalidRequest("request body is not valid JSON: nested too deeply") from e


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
