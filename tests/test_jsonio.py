"""``jsonio.dumps``: the proxy's forwarded bodies (token-ID prompts as numpy arrays) against the standard
library's ``json`` on the same values with the arrays as lists."""

from __future__ import annotations

import json

import numpy as np
import pytest

from toktier_backend import jsonio


def test_dumps_writes_arrays_as_the_standard_library_writes_lists():
    ids = np.arange(0, 300_000, 7, dtype=np.int32)
    value = {"model": "m", "prompt": ids, "rows": [ids[:3], ids[3:5]], "temperature": 0.7, "n": np.int64(2),
             "text": "é\u2028\"x\"", "stop": None, "stream": False}
    plain = {**value, "prompt": ids.tolist(), "rows": [[0, 7, 14], [21, 28]], "n": 2}
    assert json.loads(jsonio.dumps(value)) == plain == json.loads(json.dumps(plain))


def test_dumps_falls_back_where_orjson_refuses():
    strided = np.arange(10, dtype=np.int32)[::2]  # not contiguous
    big = 2**70  # beyond 64 bits
    got = json.loads(jsonio.dumps({"a": strided, "b": big}))
    assert got == {"a": [0, 2, 4, 6, 8], "b": big}
    with pytest.raises(TypeError):
        jsonio.dumps({"a": object()})
