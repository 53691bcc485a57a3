"""Incremental body parsing (toktier_backend/chat/wire.py) against ``orjson.loads`` of the whole body, and
``ChatSession.render_body`` against transformers.

Values are compared through ``orjson.dumps`` (keeps dict key order; ``1``, ``1.0`` and ``true`` differ).
``same_prefix`` is checked against an independent oracle: ``json.JSONDecoder.raw_decode`` walks the old
body's messages array (char offsets of each message's end) and ``os.path.commonprefix`` gives the common
prefix of the old and new bodies; the expected count is the number of old messages ending inside it.
"""

from __future__ import annotations

import json
import os
import random

import orjson
import pytest

from tests.chat.corpus import TOOL_TEMPLATES, conversation, template_source, trajectories
from tests.chat.test_session import ODD, TOOLS, Checker, _edit, _files
from toktier_backend import jsonio
from toktier_backend.chat.session import ChatSession
from toktier_backend.chat.template import special_tokens
from toktier_backend.chat.wire import IncrementalBody
from toktier_backend.errors import InvalidRequest

_DEC = json.JSONDecoder()


def _message_ends(text: str, top: str) -> list[int] | None:
    """Char offsets after each message of the body ``text`` (``None``: not the expected shape)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if top == "object":
        if not isinstance(value, dict) or not isinstance(value.get("messages"), list):
            return None
        # the array of the (single) messages member: find its '[' by decoding members in order
        i = text.index("{") + 1
        while True:
            i = _skip_ws(text, i)
            key, i = _DEC.raw_decode(text, i)
            i = _skip_ws(text, i) + 1  # ':'
            i = _skip_ws(text, i)
            if key == "messages":
                break
            _, i = _DEC.raw_decode(text, i)
            i = _skip_ws(text, i) + 1  # ','
    else:
        if not isinstance(value, list):
            return None
        i = text.index("[")
    assert text[i] == "["
    ends, i = [], i + 1
    while True:
        i = _skip_ws(text, i)
        if text[i] == "]":
            return ends
        m, i = _DEC.raw_decode(text, i)
        if not isinstance(m, dict):
            return None
        ends.append(i)
        i = _skip_ws(text, i)
        if text[i] == ",":
            i += 1


def _skip_ws(text: str, i: int) -> int:
    while text[i] in " \t\r\n":
        i += 1
    return i


def _expected_prefix(old: bytes | None, new: bytes, top: str) -> int:
    if old is None:
        return 0
    try:
        a, b = old.decode(), new.decode()
    except UnicodeDecodeError:
        return 0
    ends = _message_ends(a, top)
    if ends is None or _message_ends(b, top) is None or _dup_messages(a, top) or _dup_messages(b, top):
        return 0
    d = len(os.path.commonprefix([a, b]))
    return sum(1 for e in ends if e <= d)


def _dup_messages(text: str, top: str) -> bool:
    if top != "object":
        return False
    pairs = json.loads(text, object_pairs_hook=lambda kv: kv)
    return sum(1 for k, _ in pairs if k == "messages") != 1


class Loader:
    """One :class:`IncrementalBody` checked after every load."""

    def __init__(self, top: str = "object"):
        self.top = top
        self.body = IncrementalBody(top=top)
        self.old: bytes | None = None
        self.old_objs: list = []
        self.reused = 0

    def load(self, raw: bytes):
        want = json.loads(raw)  # the standard library's values (jsonio's contract), not orjson's
        got = self.body.load(raw)
        assert json.dumps(got.value) == json.dumps(want)  # key order and scalar types too
        assert got.value == want
        expected = _expected_prefix(self.old, raw, self.top)
        assert got.same_prefix == expected, (got.same_prefix, expected)
        msgs = got.messages
        for i in range(got.same_prefix):
            assert msgs[i] is self.old_objs[i]
        self.reused += got.same_prefix
        self.old = raw
        self.old_objs = list(msgs) if msgs is not None else []
        return got


def _body(msgs, *, model="m", tools=None, style=0, order=0, top="object") -> bytes:
    """A request body in one of several byte styles (all the same JSON value but for key order)."""
    if top == "array":
        value = msgs
    elif order == 0:
        value = {"model": model, "messages": msgs, "stream": False, **({"tools": tools} if tools else {})}
    elif order == 1:
        value = {"messages": msgs, "model": model, "temperature": 0.5}
    else:
        value = {"model": model, "n": 1, "top_p": 1.0, "seed": True, "messages": msgs, "user": "x"}
    if style == 0:
        return orjson.dumps(value)
    if style == 1:
        return json.dumps(value).encode()  # ", " / ": " separators, \u escapes for non-ASCII
    if style == 2:
        return json.dumps(value, ensure_ascii=False, indent=1).encode()
    return (" \n" + json.dumps(value, ensure_ascii=False, separators=(" ,", " : ")) + "\t\n").encode()


def _conv():
    return conversation("qwen3", [f for f in trajectories() if "function_calling" in f.name][0])


@pytest.mark.parametrize("top", ["object", "array"])
@pytest.mark.parametrize("style", [0, 1, 2, 3])
def test_growing_conversation_reuses_every_old_message(top, style):
    conv = [dict(m) for m in _conv() * 4]
    last = 40
    assert last >= 10
    check = Loader(top)
    for end in range(2, last + 1):
        got = check.load(_body(conv[:end], style=style, order=style % 3, top=top, tools=TOOLS))
        if end > 2:
            assert got.same_prefix == end - 1  # the body changed only after the old array's last message
    assert check.reused == sum(range(2, last))


@pytest.mark.parametrize("top", ["object", "array"])
def test_random_edits_of_real_trajectories(top):
    """Appends, truncations, rewrites, deletions and inserts (``_edit``), edits inside message strings
    (quotes, backslashes, brackets, unicode), a message's keys reordered, a field before the array changed,
    byte styles switched, a duplicate ``messages`` key: equal to orjson every time, ``same_prefix`` as the
    oracle says."""
    rng = random.Random(2026 + (top == "array"))
    check = Loader(top)
    for path in _files():
        conv = conversation("qwen3", path)[:12]
        style, model = 0, "m"
        for _ in range(60):
            op = rng.random()
            if op < 0.45:
                conv = _edit(rng, conv, "qwen3")
            elif op < 0.6 and conv:
                i = rng.randrange(len(conv))
                m = dict(conv[i])
                c = m.get("content") or ""
                at = rng.randrange(len(c) + 1)
                m["content"] = c[:at] + rng.choice(['"', "\\", "{[", "]}", "é", "\u00e9", "\U0001f600",
                                                    "\\u00e9", "\n", ":", ","]) + c[at:]
                conv = conv[:i] + [m] + conv[i + 1:]
            elif op < 0.7 and conv:
                i = rng.randrange(len(conv))
                items = list(conv[i].items())
                rng.shuffle(items)
                conv = conv[:i] + [dict(items)] + conv[i + 1:]
            elif op < 0.78:
                model = rng.choice(["m", "other-model", "é"])
            elif op < 0.84:
                style = rng.randrange(4)
            raw = _body(conv, model=model, style=style, top=top, tools=TOOLS if rng.random() < 0.5 else None)
            if top == "object" and rng.random() < 0.08:  # a second messages member replaces the array
                raw = raw.rstrip()[:-1] + rng.choice([b', "messages": []}', b', "m\\u0065ssages": [{"a": 1}]}',
                                                      b', "x": {"messages": []}}', b', "x": ["messages"]}'])
            check.load(raw)
    assert check.reused > 300


def test_edits_give_exact_same_prefix():
    conv = [dict(m) for m in (_conv() * 3)[:20]]
    check = Loader()
    check.load(_body(conv))
    assert check.load(_body(conv[:20])).same_prefix == 20  # the same body
    assert check.load(_body(conv[:14])).same_prefix == 14  # truncation
    edited = [dict(m) for m in conv[:14]]
    edited[9]["content"] += "!"
    assert check.load(_body(edited)).same_prefix == 9  # an edit inside message 9's string
    assert check.load(_body(edited, model="n")).same_prefix == 0  # a byte before the array
    assert check.load(_body(edited, model="n")).same_prefix == 14
    swapped = [dict(m) for m in edited]
    swapped[3] = dict(reversed(list(swapped[3].items())))
    got = check.load(_body(swapped, model="n"))
    assert got.same_prefix == 3 and list(got.messages[3]) == list(swapped[3])
    # \u00e9 and a raw é: different bytes, equal value
    a = [{"role": "user", "content": "caf\u00e9"}, {"role": "assistant", "content": "x"}]
    check.load(b'{"messages":[{"role":"user","content":"caf\\u00e9"},{"role":"assistant","content":"x"}]}')
    got = check.load(b'{"messages":[{"role":"user","content":"caf\xc3\xa9"},{"role":"assistant","content":"x"}]}')
    assert got.same_prefix == 0 and got.value["messages"] == a


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "a"}], "messages": [{"role": "user", "content": "b"}]}',
    b'{"messages": [{"role": "user", "content": "a"}], "\\u006dessages": []}',
    b'{"messages": [{"role": "user", "content": "a"}, "not an object"]}',
    b'{"messages": {"role": "user"}}',
    b'[{"role": "user", "content": "a"}]',
    b'{"model": "m"}',
    b'"just a string"',
])
def test_odd_shapes_are_whole_parses(raw):
    body = IncrementalBody()
    first = body.load(raw)
    again = body.load(raw)
    assert orjson.dumps(first.value) == orjson.dumps(again.value) == orjson.dumps(orjson.loads(raw))
    assert again.same_prefix == 0


def test_invalid_json_raises_the_same_error_and_forgets():
    conv = _conv()[:6]
    good = _body(conv)
    body = IncrementalBody()
    body.load(good)
    for bad in (good[:-1], good[:-1] + b',}', good.replace(b'"role"', b'"role', 1)[:len(good)],
                good[:-2] + b'\xff"}', good[:-1] + b'}}'):
        with pytest.raises(InvalidRequest) as e:
            body.load(bad)
        with pytest.raises(InvalidRequest) as want:
            jsonio.loads(bad)
        assert str(e.value) == str(want.value)
        assert body.load(good).same_prefix == 0  # forgotten: a whole parse
        assert body.load(good).same_prefix == len(conv)


def test_bad_top_argument():
    with pytest.raises(ValueError, match="top"):
        IncrementalBody(top="dict")


# ---------------------------------------------------------------- ChatSession.render_body


class BodyChecker(Checker):
    """:class:`Checker` through ``render_body`` (bytes) and ``Session.splice`` for non-extending renders."""

    def step_body(self, messages, *, ids: bool = True, style: int = 0, **options):
        try:
            want = self.reference(messages, tokenize=False, **options)
        except Exception as e:  # noqa: BLE001 - the template refused: ours must refuse too
            with pytest.raises(InvalidRequest):
                self.chat.render_body(_body(messages, style=style), **options)
            return type(e).__name__
        r, value = self.chat.render_body(_body(messages, style=style), **options)
        assert value["messages"] == messages
        assert r.text == want, (self.name, len(messages), options)
        d = r.departure
        assert want[:d] == self.prev[:d] and r.delta == want[d:]
        if ids:
            synced = self.tok_text is self.prev
            if not synced:
                got = self.tok.update(want)
            elif r.extends_previous:
                got = self.tok.append(r.delta)
            else:
                got = self.tok.splice(d, r.delta)
            self.tok_text = want
            assert got.tolist() == self.reference(messages, tokenize=True, **options), (self.name, len(messages))
        self.prev = want
        self.steps += 1
        return None


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "deepseek_v3", "gemma3"])
def test_render_body_replay_and_edits(name, folder):
    """A trajectory replayed turn by turn from bytes (generation prompt on at observations, off after the
    reply: llama3_1's and qwen3's non-extending renders go through ``splice``), then random edits: text equals
    transformers, ids equal transformers' every step, and the loader's prefix was trusted."""
    check = BodyChecker(name, folder)
    conv = conversation(name, _files()[0])[:16]
    options = {"tools": TOOLS} if name in TOOL_TEMPLATES else {}
    for i in range(2, len(conv) + 1):
        check.step_body(conv[:i], add_generation_prompt=conv[i - 1]["role"] != "assistant", **options)
    assert check.chat.stats["messages_trusted"] >= sum(range(1, len(conv) - 1))
    assert check.chat.stats["incremental"] == check.steps
    rng = random.Random(99)
    for step in range(20):
        conv = _edit(rng, conv, name)
        check.step_body(conv, ids=True, style=rng.randrange(4), add_generation_prompt=rng.random() < 0.7,
                        **options)


def test_render_body_refusal_then_exact(folder):
    """gemma3 refuses non-alternating roles: InvalidRequest from render_body, and the next body is exact
    (the loader and the session both forgot their state)."""
    check = BodyChecker("gemma3", folder)
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    check.step_body(conv, add_generation_prompt=True)
    with pytest.raises(InvalidRequest):
        check.chat.render_body(_body(conv + [{"role": "assistant", "content": "c"}]), add_generation_prompt=True)
    check.step_body(conv + [{"role": "user", "content": "c"}], add_generation_prompt=True)
    check.step_body(conv + [{"role": "user", "content": "c"}, {"role": "assistant", "content": ODD[0]}])
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        check.chat.render_body(b'{"messages": [', add_generation_prompt=True)
    with pytest.raises(InvalidRequest, match="no list of messages"):
        check.chat.render_body(b'{"messages": 3}', add_generation_prompt=True)
    check.step_body(conv, add_generation_prompt=True)


def test_same_prefix_is_checked(folder):
    """A wrong ``same_prefix`` (objects the session never saw there) is not trusted: the messages are
    compared as usual and the text stays exact."""
    name = "llama3_1"
    src, cfg = template_source(name)
    chat = ChatSession(src, special_tokens(cfg))
    ref = ChatSession(src, special_tokens(cfg))
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat.render(conv)
    other = [{"role": "user", "content": "changed"}, {"role": "assistant", "content": "b"}]
    r = chat.render(other, same_prefix=2)
    assert r.text == ref.full_render(other) and chat.stats["messages_trusted"] == 0
    r = chat.render(other, same_prefix=2)
    assert r.text == ref.full_render(other) and chat.stats["messages_trusted"] == 2


def test_str_and_bytearray_bodies():
    raw = '{"messages": [{"role": "user", "content": "caf\u00e9"}]}'
    body = IncrementalBody()
    assert body.load(raw).value == orjson.loads(raw)
    got = body.load(bytearray(raw.encode()))
    assert got.value == orjson.loads(raw) and got.same_prefix == 1
    with pytest.raises(InvalidRequest):
        body.load('{"messages": [{"role": "user", "content": "\ud800"}]}')


def test_messages_as_a_value_after_the_array_keeps_the_reuse():
    """``"messages"`` as a string value or a nested key after the array is no second member: the old
    messages are still reused; as a member (literal or escaped) it is, and the body is parsed whole."""
    conv = [dict(m) for m in _conv()[:8]]
    tail = {"tools": [{"description": 'the "messages" list', "enum": ["messages"], "messages": {"x": 1}}]}
    check = Loader()
    for end in range(2, 9):
        got = check.load(orjson.dumps({"model": "m", "messages": conv[:end], **tail}))
        assert got.same_prefix == (end - 1 if end > 2 else 0)
    for extra in (b', "messages": 1}', b', "\\u006dessages": 1}'):
        raw = orjson.dumps({"model": "m", "messages": conv, **tail})[:-1] + extra
        assert check.load(raw).same_prefix == 0


@pytest.mark.parametrize("top", ["object", "array"])
@pytest.mark.parametrize("junk", [b".5", b"e5", b"E+1", b"0", b" 7", b"null", b"x", b"}", b",", b", ]"])
def test_bytes_that_would_continue_the_sentinel_are_invalid(top, junk):
    """Bytes right after a reused message's ``}`` that a number sentinel would absorb (``0.5``, ``0e5``)
    or that are otherwise invalid there: the body is invalid JSON and raises as ``jsonio.loads`` does,
    with the bytes after the array the old ones (the suffix-reuse path) or not."""
    conv = [dict(m) for m in _conv()[:4]]
    good = _body(conv, top=top)  # object mode: {"model", "messages", "stream"}: the last "]" is the array's
    body = IncrementalBody(top=top)
    body.load(_body(conv[:3], top=top))
    body.load(good)
    last_end = good.rindex(b"}", 0, good.rindex(b"]")) + 1  # the last message's closing brace
    assert good[last_end:].lstrip().startswith(b"]") and body.load(good).same_prefix == 4
    for bad in (good[:last_end] + junk + good[last_end:], good[:last_end] + junk + b"]}"):
        with pytest.raises(InvalidRequest) as e:
            body.load(bad)
        with pytest.raises(InvalidRequest) as want:
            jsonio.loads(bad)
        assert str(e.value) == str(want.value)
        body.load(good)
        body.load(good)


@pytest.mark.parametrize("top", ["object", "array"])
@pytest.mark.parametrize("tail_changes", [False, True])
def test_nesting_limit_as_orjson(top, tail_changes):
    """A new message nested around orjson's depth limit: accepted or refused exactly as a whole parse
    (the fragments keep the body's nesting depth)."""
    two = b'{"role":"user","content":"a"},{"role":"user","content":"b"}'
    wrap = (b'{"model":"m","messages":[', b'],"stream":false}') if top == "object" else (b"[", b"]")
    base = wrap[0] + two + wrap[1]
    outcomes = set()
    for n in range(1015, 1030):
        body = IncrementalBody(top=top)
        body.load(base)
        assert body.load(base).same_prefix == 2  # a tail parse: the members after the array are known
        end = wrap[1] if not tail_changes else wrap[1].replace(b"false", b"true ")
        raw = wrap[0] + two + b',{"role":"user","x":' + b"[" * n + b"]" * n + b"}" + end
        try:
            orjson.loads(raw)
            want = "ok"
        except orjson.JSONDecodeError:
            want = "refused"
        try:
            got = body.load(raw)
            assert got.same_prefix == 2 and len(got.messages) == 3
            outcome = "ok"
        except InvalidRequest:
            outcome = "refused"
        assert outcome == want, n
        outcomes.add(want)
    assert outcomes == {"ok", "refused"}


def test_callers_without_a_loader_are_not_held():
    """``render(messages)`` keeps no reference to the caller's message objects (only its own copies);
    ``same_prefix`` (an int) keeps them for the next request's check."""
    import gc
    import weakref

    class Message(dict):
        pass

    src, cfg = template_source("llama3_1")
    chat = ChatSession(src, special_tokens(cfg))
    for same_prefix, held in ((None, False), (0, True)):
        msgs = [Message(role="user", content="a"), Message(role="assistant", content="b")]
        refs = [weakref.ref(m) for m in msgs]
        chat.render(msgs, same_prefix=same_prefix)
        del msgs
        gc.collect()
        assert all((r() is not None) == held for r in refs), same_prefix


BIG = 100000000000000000000  # past 64 bits: orjson alone parses it to the float 1e+20


@pytest.mark.parametrize("top", ["object", "array"])
def test_integers_past_64_bits_in_new_messages(top):
    """New messages holding an integer orjson would make a float: the loader's value is ``json.loads``'s
    (the int), through its whole parse."""
    conv = _conv()[:6]
    big = {"role": "assistant", "content": "",
           "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"n": BIG, "m": -BIG}}}]}
    loader = Loader(top)  # (json.dumps bytes: orjson cannot write the integer)
    loader.load(_body(conv, top=top, style=1))
    raw = _body(conv + [big], top=top, style=1)
    assert json.dumps(orjson.loads(raw)) != json.dumps(json.loads(raw))  # the case is live (1e+20 == 10**20)
    got = loader.load(raw)  # (checks value and types against json.loads)
    assert got.messages[-1]["tool_calls"][0]["function"]["arguments"]["n"] == BIG
    loader.load(_body(conv + [big, {"role": "user", "content": "next"}], top=top, style=1))


def test_chat_text_keeps_integers_past_64_bits(folder):
    """qwen3 writes a tool call's arguments with ``tojson``: from bytes (``render_body``, then a delta
    through ``render_more_body``) the text is the jinja2 reference's on ``json.loads``'s messages, which
    writes the integer's digits."""
    from toktier_backend.chat.template import ChatRenderer

    src, cfg = template_source("qwen3")
    sp = special_tokens(cfg)
    ref = ChatRenderer(src, sp)
    conv = [{"role": "user", "content": "count"}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"n": BIG}}}]}
    more = [call, {"role": "tool", "content": "ok"}]
    for via_delta in (False, True):
        chat = ChatSession(src, sp)
        r, _ = chat.render_body(json.dumps(conv).encode(), top="array", add_generation_prompt=True)
        if via_delta:
            r = chat.render_more_body(json.dumps(more).encode(), add_generation_prompt=True)
        else:
            r, _ = chat.render_body(json.dumps(conv + more).encode(), top="array", add_generation_prompt=True)
        want = ref.render(json.loads(json.dumps(conv + more)), add_generation_prompt=True)
        assert str(BIG) in want
        assert r.text == want, via_delta
