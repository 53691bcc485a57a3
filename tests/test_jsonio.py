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


# integers at and past the edges of orjson's 64-bit range, and a float orjson and json agree on
EDGES = b'[100000000000000000000, 18446744073709551615, 18446744073709551616, -9223372036854775808, ' \
        b'-9223372036854775809, 123456789012345678901234567890, 1e+20, {"a": [99999999999999999999]}]'


@pytest.mark.parametrize("data", [EDGES, EDGES.decode(), bytearray(EDGES), memoryview(EDGES)])
def test_loads_keeps_integers_past_64_bits(data):
    orjson = pytest.importorskip("orjson")
    want = json.loads(EDGES)
    assert orjson.loads(EDGES) != want  # orjson alone makes floats of them: the case is live
    got = jsonio.loads(data)
    assert got == want
    assert [type(v) for v in got] == [type(v) for v in want]  # 1e+20 == 10**20: the types tell them apart
    assert json.dumps(got) == json.dumps(want)


def test_may_hold_big_int_needs_a_run_of_19_digits():
    # every integer orjson turns into a float has 19 or more digits in one run (2**63 has 19)
    assert len(str(2**63)) == 19 and len(str(2**64)) == 20
    assert jsonio.may_hold_big_int(str(-(2**63) - 1).encode())
    assert jsonio.may_hold_big_int(b'{"id": 9223372036854775807}')  # 19 digits (in range: a cautious yes)
    assert not jsonio.may_hold_big_int(b'[922337203685477580, "x", 1.5e300, "1234567890 12345678901"]')
    assert not jsonio.may_hold_big_int('[922337203685477580, "é"]')
    assert jsonio.may_hold_big_int('["é", 10000000000000000000]')
