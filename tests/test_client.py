"""Unit tests of ``SessionClient`` (toktier_backend/client.py) without a Triton server.

A fake inference client stands in for ``tritonclient``'s: it decodes the request tensors the real
``tritonclient.grpc.InferInput`` serialized, keeps each sequence's text, and answers as ``toktier_session``
does: ``KEEP`` at most the common prefix of the previous and the new HF ids (``back`` ids before it, so the
patch re-sends ids the client already holds), the patch from there. Every id the tests assert is HF
``Tokenizer.from_file(path).encode(text, add_special_tokens=True).ids`` computed in the test. The L0 tests
against a real tritonserver are in tests/serving/test_served.py.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

from tritonclient.utils import deserialize_bytes_tensor  # noqa: E402

from toktier_backend.client import SessionClient  # noqa: E402
from toktier_backend.errors import ToktierError  # noqa: E402

from .conftest import reference  # noqa: E402


def hf(name: str, text: str) -> list[int]:
    return reference(name).encode(text, add_special_tokens=True).ids


class _Result:
    def __init__(self, arrays: dict[str, np.ndarray]):
        self._arrays = arrays

    def as_numpy(self, name: str) -> np.ndarray:
        return self._arrays[name]


class FakeServer:
    """``infer`` as ``toktier_session`` answers it (see the module docstring).

    ``back``: ids before the common prefix that ``KEEP`` stops at (cycled per request). ``forget``: the next
    request's sequence is unknown to the model instance (``UnknownSession``). ``script``: precomputed
    ``(keep, patch, n)`` replies, answered in order without encoding (for the allocation test).
    """

    def __init__(self, name: str = "gpt2", back: tuple[int, ...] = (0, 1, 3)):
        self.name = name
        self.back = back
        self.sessions: dict[object, tuple[str, list[int]]] = {}
        self.requests: list[dict] = []
        self.forget = False
        self.bad_keep = False
        self.script: list[tuple[int, np.ndarray, int]] | None = None

    def infer(self, model, inputs, *, outputs, headers, sequence_id=0, sequence_start=False, sequence_end=False,
              **kw):
        x = {t.name(): deserialize_bytes_tensor(t._get_content())[0] if t.datatype() == "BYTES" else None
             for t in inputs}
        req = {"text": x["TEXT"].decode(), "mode": x["MODE"].decode(), "reply": x["REPLY"].decode(),
               "start": sequence_start, "end": sequence_end, "id": sequence_id}
        self.requests.append(req)
        if self.script is not None:
            keep, patch, n = self.script.pop(0)
            return self._reply(keep, patch, n)
        if self.forget:
            self.forget = False
            self.sessions.pop(sequence_id, None)
        held = self.sessions.get(sequence_id)
        if req["mode"] == "delta":
            if held is None:
                raise RuntimeError("[StatusCode.NOT_FOUND] UnknownSession: resend MODE=full")
            text = held[0] + req["text"]
        else:
            text = req["text"]
        ids = hf(self.name, text)
        old = held[1] if held is not None and not sequence_start else []
        lcp = 0
        while lcp < min(len(old), len(ids)) and old[lcp] == ids[lcp]:
            lcp += 1
        keep = max(0, lcp - self.back[len(self.requests) % len(self.back)])
        if self.bad_keep:
            self.bad_keep = False
            keep = len(old) + 5
        if sequence_end:
            self.sessions.pop(sequence_id, None)
        else:
            self.sessions[sequence_id] = (text, ids)
        if req["reply"] == "full":
            keep_out, patch = keep, ids
        else:
            keep_out, patch = keep, ids[keep:]
        return self._reply(keep_out, np.asarray(patch, dtype=np.int32), len(ids))

    @staticmethod
    def _reply(keep: int, patch: np.ndarray, n: int) -> _Result:
        return _Result({"INPUT_ID": patch.reshape(1, -1), "REQUEST_INPUT_LEN": np.array([[n]], dtype=np.int32),
                        "KEEP": np.array([[keep]], dtype=np.int32), "ROUTE": np.array([[b"append"]], dtype=object)})

    def close(self):
        pass


def _client(server: FakeServer, **kw) -> SessionClient:
    return SessionClient("127.0.0.1:1", client=server, session_id="s1", **kw)


# the traps of STYLE.md's differential tests: the last token of the held text merges with the delta
TRAPS = ["def pipe", "line(x):", "\n", "    return x", "  ", "\n\n", " 1234", "5", "<|endo", "ftext|>", " e", "\u0301!"]


@pytest.mark.parametrize("reply", ["patch", "full"])
def test_appends_rebuild_hf_ids_and_held_arrays_never_change(reply):
    """Each reply equals HF ids of the text so far; every array returned earlier still equals the HF ids of
    its own text after all later appends, an edit (update) and a truncation; replies are read-only."""
    srv = FakeServer()
    c = _client(srv, reply=reply)
    held: list[tuple[np.ndarray, list[int]]] = []
    ids = c.open("hello")
    text = "hello"
    assert ids.tolist() == hf("gpt2", text) == [31373]
    held.append((ids, [31373]))
    for delta in TRAPS:
        ids = c.append(delta)
        text += delta
        assert c.text == text
        assert ids.tolist() == hf("gpt2", text), delta
        assert c.ids.tolist() == ids.tolist()
        held.append((ids, hf("gpt2", text)))
    for new in (text.replace("pipe", "pipes"), text[: len(text) // 2], text[: len(text) // 2] + " tail"):
        ids = c.update(new)
        assert ids.tolist() == hf("gpt2", new) and c.text == new
        held.append((ids, hf("gpt2", new)))
    for ids, want in held:
        assert ids.tolist() == want
        assert not ids.flags.writeable
        with pytest.raises(ValueError):
            ids[0] = 0
    assert all(r["mode"] == ("delta" if r["text"] in TRAPS else "full") for r in srv.requests)


def test_patch_rewrites_held_tail_copy_on_write():
    """"pipe" + "line": the patch from KEEP changes an id the held reply shows; that reply keeps its ids."""
    srv = FakeServer(back=(0,))
    c = _client(srv)
    first = c.open("def pipe")
    second = c.append("line")
    assert first.tolist() == hf("gpt2", "def pipe") and second.tolist() == hf("gpt2", "def pipeline")
    assert hf("gpt2", "def pipe")[-1] != hf("gpt2", "def pipeline")[len(first) - 1]  # the trap is real
    assert srv.requests[-1]["text"] == "line"


def test_dropped_replies_are_rewritten_in_place():
    """A caller that keeps no reply gets views of one buffer (no copy per append) with the right ids."""
    srv = FakeServer(back=(2,))
    c = _client(srv)
    c.open("one two three")
    base = c.ids.base
    assert base is not None
    text = "one two three"
    for delta in [" four", " five", " six", "\n"]:
        text += delta
        assert c.append(delta).base is base  # the reply is dropped at once: written in place
        assert c.ids.tolist() == hf("gpt2", text)


def test_reopen_resends_whole_text():
    """The model instance forgot the session: the client resends text + delta with MODE=full."""
    srv = FakeServer()
    c = _client(srv)
    c.open("first part")
    srv.forget = True
    assert c.append(", second part").tolist() == hf("gpt2", "first part, second part")
    assert c.reopens == 1 and c.last.reopened
    assert [r["mode"] for r in srv.requests[-2:]] == ["delta", "full"]
    assert srv.requests[-1]["text"] == "first part, second part"
    assert c.append("!").tolist() == hf("gpt2", "first part, second part!") and c.text == "first part, second part!"


def test_reply_that_does_not_add_up_keeps_state_and_resends_full():
    """KEEP beyond the ids held: ToktierError, the held ids and text unchanged; the next request sends
    the whole text with a full reply."""
    srv = FakeServer()
    c = _client(srv)
    before = c.open("abc def")
    srv.bad_keep = True
    with pytest.raises(ToktierError, match="does not add up"):
        c.append(" ghi")
    assert c.text == "abc def" and c.ids.tolist() == before.tolist() == hf("gpt2", "abc def")
    assert c.append(" jkl").tolist() == hf("gpt2", "abc def jkl")
    assert srv.requests[-1]["mode"] == "full" and srv.requests[-1]["reply"] == "full"


def test_append_allocates_delta_not_context():
    """An append on a ~400K-char session allocates O(delta + patch), not a copy of the text or the ids
    (tracemalloc peak; a text or ids copy alone would be ~400 KB / ~400 KB)."""
    base = ("The quick brown fox jumps over the lazy dog. " * 9000)[:400_000]
    deltas = [" And then the dog woke up.", " It was not amused.\n"]
    texts = [base, base + deltas[0], base + deltas[0] + deltas[1]]
    ids = [np.asarray(hf("gpt2", t), dtype=np.int32) for t in texts]
    srv = FakeServer()
    keeps = [0] + [len(ids[i]) - 2 for i in range(2)]
    srv.script = [(k, x[k:].copy(), len(x)) for k, x in zip(keeps, ids)]
    c = _client(srv)
    c.open(base)
    tracemalloc.start()
    try:
        for i, d in enumerate(deltas):
            tracemalloc.reset_peak()
            got = c.append(d)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 64 * 1024, peak
            del got
    finally:
        tracemalloc.stop()
    assert c.ids.tolist() == ids[-1].tolist() and c.text == texts[-1]
