"""Incremental chat rendering (toktier_backend/chat/session.py) against transformers' ``apply_chat_template``.

Every step is compared as text (``tokenize=False``) and as ids (``tokenize=True`` against our tokenizer
session fed ``append(delta)`` when the render extends the previous text, else ``update(text)``), on the six
shared templates with real SWE-agent trajectories replayed turn by turn, random edits of history, and
templates that defeat the analysis. Each test also asserts that the incremental path ran (records reused).
"""

from __future__ import annotations

import json
import random

import pytest

from tests.chat.conftest import hf_tokenizer, our_tokenizer
from tests.chat.corpus import TEMPLATES, TOOL_TEMPLATES, alternating, conversation, template_source, trajectories
from toktier_backend.chat.session import ChatSession
from toktier_backend.chat.template import ChatRenderer, special_tokens
from toktier_backend.errors import InvalidRequest

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command <cmd> & 'quote'",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]
ODD = ["Ünïcødé 😀 日本語", "<|im_end|> <|eot_id|> <｜User｜> <start_of_turn>", "{{ not jinja }} {% raw %}",
       "  padded\n\n", "\t'm \"quoted\"\r\n", "</think>tail", "<tool_response>x</tool_response>"]


class Checker:
    """Renders through one :class:`ChatSession` and one tokenizer session, asserting each step against
    transformers, and tracks the previous text to check the departure."""

    def __init__(self, name: str, folder, template: str | None = None):
        self.name = name
        self.path = str(folder(name))
        self.hf = hf_tokenizer(self.path)
        source, cfg = template_source(name)
        self.template = template or source
        self.chat = ChatSession(self.template, special_tokens(cfg))
        self.tok = our_tokenizer(self.path).session(add_special_tokens=False)
        self.prev = ""
        self.tok_text = ""  # the text the tokenizer session holds
        self.steps = 0

    def reference(self, messages, *, tokenize, **options):
        extra = {} if self.template is None else {"chat_template": self.template}
        return self.hf.apply_chat_template(messages, tokenize=tokenize, return_dict=False, **extra, **options)

    def step(self, messages, *, ids: bool = True, **options) -> str | None:
        try:
            want = self.reference(messages, tokenize=False, **options)
        except Exception as e:  # noqa: BLE001 - the template refused: ours must refuse too
            with pytest.raises(InvalidRequest):
                self.chat.render(messages, **options)
            return type(e).__name__
        r = self.chat.render(messages, **options)
        assert r.text == want, (self.name, len(messages), options)
        d = r.departure
        assert want[:d] == self.prev[:d]
        assert d == len(self.prev) or d == len(want) or want[d] != self.prev[d]
        assert r.delta == want[d:]
        assert r.previous_length == len(self.prev)
        if ids:
            synced = self.tok_text is self.prev
            got = self.tok.append(r.delta) if r.extends_previous and synced else self.tok.update(r.text)
            self.tok_text = want
            assert got.tolist() == self.reference(messages, tokenize=True, **options), (self.name, len(messages))
        self.prev = want
        self.steps += 1
        return None


def _files():
    files = trajectories()
    fc = [f for f in files if "function_calling" in f.name]
    plain = [f for f in files if "function_calling" not in f.name and "demonstrations_replay" in f.name]
    return fc[0], plain[0]


@pytest.mark.parametrize("name", TEMPLATES)
def test_replay_trajectories(name, folder):
    """Turn by turn: a request ends at a user/tool message (generation prompt on), then the assistant's
    reply is appended (prompt off): the generation prompt is replaced by the message. After the first
    request each step renders O(new messages) iterations per loop: at most 3 (the new message, the old last
    one when it read ``loop.last``, a reverse scan's match), also for qwen3 when observations come as user
    turns: each new user query moves ``last_query_index``, but earlier turns recorded the outcome of
    ``loop.index0 > ns.last_query_index``, not its value (analysis O6)."""
    check = Checker(name, folder)
    loops = sum(1 for seg in check.chat.plan.segments if hasattr(seg, "body"))
    for path in _files():
        conv = conversation(name, path)[:18]
        options = {"tools": TOOLS} if name in TOOL_TEMPLATES and "function_calling" in path.name else {}
        check.chat.reset()
        check.tok = our_tokenizer(check.path).session(add_special_tokens=False)
        check.prev = check.tok_text = ""
        per_step = []
        for i in range(2, len(conv) + 1):
            agp = conv[i - 1]["role"] != "assistant"
            before = check.chat.stats["iterations_rendered"]
            check.step(conv[:i], ids=i % 3 == 0 or i == len(conv), add_generation_prompt=agp, **options)
            per_step.append(check.chat.stats["iterations_rendered"] - before)
        assert max(per_step[1:]) <= 3 * loops, per_step
    assert check.chat.stats["incremental"] == check.steps
    assert check.chat.stats["iterations_reused"] > 100


def _edit(rng: random.Random, conv: list[dict], name: str) -> list[dict]:
    conv = [dict(m) for m in conv]
    op = rng.choice(["truncate", "rewrite", "delete", "insert", "system", "append", "append"])
    body = [i for i, m in enumerate(conv) if m["role"] != "system"]
    if op == "truncate" and len(conv) > 3:
        conv = conv[: rng.randrange(2, len(conv))]
    elif op == "rewrite" and body:
        i = rng.choice(body)
        conv[i]["content"] = rng.choice(ODD) + conv[i]["content"][: rng.randrange(0, 200)]
    elif op == "delete" and len(body) > 2:
        del conv[rng.choice(body[:-1])]
    elif op == "insert" and body:
        conv.insert(rng.choice(body), {"role": "user", "content": rng.choice(ODD)})
    elif op == "system":
        if conv and conv[0]["role"] == "system":
            conv = conv[1:]
        else:
            conv = [{"role": "system", "content": "You are terse. " + rng.choice(ODD)}] + conv
    else:
        role = "user" if not conv or conv[-1]["role"] != "user" else "assistant"
        m = {"role": role, "content": rng.choice(ODD) + " reply"}
        if role == "assistant" and rng.random() < 0.5:
            m["reasoning_content"] = "thinking about " + rng.choice(ODD)
        conv.append(m)
    return alternating(conv) if name == "gemma3" and rng.random() < 0.8 else conv


@pytest.mark.parametrize("name", TEMPLATES)
def test_random_edits(name, folder):
    """Truncations, rewrites, deletions and insertions of history, the system message toggled, tools, the
    generation prompt and continue_final_message switched, enable_thinking: every step exact (or refused by
    both, e.g. gemma3's alternation rule)."""
    rng = random.Random(1717 + TEMPLATES.index(name))
    check = Checker(name, folder)
    conv = conversation(name, _files()[1])[:10]
    refused = 0
    for step in range(30):
        conv = _edit(rng, conv, name)
        options = {}
        if name in TOOL_TEMPLATES and rng.random() < 0.3:
            options["tools"] = TOOLS
        if name == "qwen3" and rng.random() < 0.3:
            options["enable_thinking"] = rng.random() < 0.5
        if conv and conv[-1]["role"] == "assistant" and rng.random() < 0.3:
            options["continue_final_message"] = True
        else:
            options["add_generation_prompt"] = rng.random() < 0.7
        refused += check.step(conv, ids=step % 4 == 0, **options) is not None
    assert check.chat.stats["incremental"] == check.steps  # no fallback: every accepted step was incremental
    assert refused < 22


def test_scalar_types_and_key_order(folder):
    """``1``, ``1.0`` and ``True`` are equal in Python but not in the text (qwen3 writes dict arguments with
    tojson); nor are two key orders. Each variant must re-render its message."""
    check = Checker("qwen3", folder)
    base = [{"role": "user", "content": "go"}]
    for args in ({"a": 1, "b": "x"}, {"a": 1.0, "b": "x"}, {"a": True, "b": "x"}, {"b": "x", "a": True},
                 {"b": "x", "a": True}):
        call = [{"type": "function", "function": {"name": "f", "arguments": args}}]
        conv = base + [{"role": "assistant", "content": "", "tool_calls": call}, {"role": "tool", "content": "ok"}]
        check.step(conv, add_generation_prompt=True, tools=TOOLS)
    assert check.chat.stats["incremental"] == 5


@pytest.mark.parametrize("later", ["render", "render_body"])
def test_scalar_types_and_key_order_after_a_json_delta(later):
    """Messages that came as JSON (``render_more_body``, kept uncopied, their strict entries computed only when
    a later request compares them) are still compared strictly: a whole conversation sent later with ``1.0``,
    ``True`` or another key order where they had ``1`` renders those messages again."""
    source, cfg = template_source("qwen3")
    ref = ChatRenderer(source, special_tokens(cfg))
    base = [{"role": "user", "content": "go"}]

    def turn(args, content="ok"):
        call = [{"type": "function", "function": {"name": "f", "arguments": args}}]
        return [{"role": "assistant", "content": "", "tool_calls": call}, {"role": "tool", "content": content}]

    for args in ({"a": 1.0, "b": "x"}, {"a": True, "b": "x"}, {"b": "x", "a": 1}):
        chat = ChatSession(source, special_tokens(cfg))
        chat.render(base, add_generation_prompt=True, tools=TOOLS)
        first = turn({"a": 1, "b": "x"}, "one")
        r = chat.render_more_body(json.dumps(first).encode(), add_generation_prompt=True, tools=TOOLS)
        assert r.text == ref.render(base + first, add_generation_prompt=True, tools=TOOLS)
        r = chat.render_more_body(json.dumps(turn({"c": 2}, "two")).encode(), add_generation_prompt=True, tools=TOOLS)
        conv = base + turn(args, "one") + turn({"c": 2}, "two")
        if later == "render":
            r = chat.render(conv, add_generation_prompt=True, tools=TOOLS)
        else:
            r, _ = chat.render_body(json.dumps(conv).encode(), top="array", add_generation_prompt=True, tools=TOOLS)
        want = ref.render(conv, add_generation_prompt=True, tools=TOOLS)
        assert want != ref.render(base + first + turn({"c": 2}, "two"), add_generation_prompt=True, tools=TOOLS)
        assert r.text == want, args


def test_mutated_in_place(folder):
    """The caller edits a message dict it already passed: the session compares against its own copies."""
    check = Checker("llama3_1", folder)
    conv = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    check.step(conv, add_generation_prompt=False)
    conv[0]["content"] = "uno"
    check.step(conv, add_generation_prompt=False)
    conv.append({"role": "user", "content": "three"})
    check.step(conv, add_generation_prompt=True)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_trust_identity(name, folder):
    """``trust_identity=True``: an in-process caller appends to its own list (same objects); exact every
    step, including after continue_final_message tagged the last message."""
    check = Checker(name, folder)
    check.chat = ChatSession(check.template, special_tokens(template_source(name)[1]), trust_identity=True)
    conv = conversation(name, _files()[1])[:12]
    msgs = conv[:2]
    for i in range(2, len(conv)):
        last = msgs[-1]["role"] == "assistant"
        if last and i % 3 == 0:
            check.step(msgs, ids=False, continue_final_message=True)
        check.step(msgs, ids=False, add_generation_prompt=not last)
        msgs.append(conv[i])
    assert check.chat.stats["iterations_reused"] > 0


@pytest.mark.parametrize("body", [False, True], ids=["objects", "json"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_render_more_equals_the_whole_conversation(name, folder, body):
    """``render_more(new)`` (``body``: ``render_more_body`` of the new messages' JSON, which the session keeps
    uncopied): only the messages after the previous request's are passed; the text equals
    transformers' render of the whole conversation at every step (generation prompt on after a user/tool
    message, off after the assistant's), the departure and delta describe the change from the previous
    text, and the ids of the tokenizer session advanced by them equal ``tokenize=True``. A delta is refused
    on a fresh session and after ``continue_final_message``; a body that is not a JSON array of objects is
    refused and leaves the session as it was; a refusal by the template leaves a session that renders whole
    again."""
    check = Checker(name, folder)
    path = _files()[0]
    conv = conversation(name, path)[:16]
    options = {"tools": TOOLS} if name in TOOL_TEMPLATES else {}

    def more(new, **kw):
        if body:
            return check.chat.render_more_body(json.dumps(new).encode(), **kw)
        return check.chat.render_more([dict(m) for m in new], **kw)

    with pytest.raises(InvalidRequest, match="previous request"):
        more(conv[:2], add_generation_prompt=True, **options)
    check.step(conv[:2], add_generation_prompt=True, **options)
    for i in range(3, len(conv) + 1):
        agp = conv[i - 1]["role"] != "assistant"
        want = check.reference(conv[:i], tokenize=False, add_generation_prompt=agp, **options)
        if body and i == 5:
            for bad in (b'[{"role": "user"', b'{"role": "user", "content": "x"}', b'["x"]'):
                with pytest.raises(InvalidRequest):
                    check.chat.render_more_body(bad, add_generation_prompt=agp, **options)
        r = more([conv[i - 1]], add_generation_prompt=agp, **options)
        assert r.text == want, (name, i)
        assert want[:r.departure] == check.prev[:r.departure] and r.delta == want[r.departure:]
        got = check.tok.append(r.delta) if r.extends_previous else check.tok.splice(r.departure, r.delta)
        assert got.tolist() == check.reference(conv[:i], tokenize=True, add_generation_prompt=agp, **options), i
        check.prev = want
    assert check.chat.stats["incremental"] == len(conv) - 1
    j = max(i for i in range(1, len(conv) + 1) if conv[i - 1]["role"] == "assistant")
    r = check.chat.render(conv[:j], continue_final_message=True, **options)
    assert r.text == check.reference(conv[:j], tokenize=False, continue_final_message=True, **options)
    with pytest.raises(InvalidRequest, match="previous request"):
        more([{"role": "user", "content": "more"}], add_generation_prompt=True, **options)


_LOOP = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"  # no epilogue


@pytest.mark.parametrize("prologue, reused", [
    # tools and messages[0]: steps 2, 3, 5 (same tools, k > 0), 8, 9 (k >= 1, tools None again)
    (("{% if tools %}{{ tools|tojson }}{% endif %}{% if messages[0].role == 'system' %}{{ messages[0].content }}"
      "{% endif %}\n"), 5),
    # the length: steps 3, 6 and 8 keep it
    ("{{ messages|length }}\n", 3),
    # the last message by a negative index (the length, and k == n): steps 3 and 6
    ("{{ messages[-1].role }}\n", 2),
    # a name set before it (the length) and messages[1]: steps 3 and 6 (step 8 changed message 1)
    (("{% set n = messages|length %}{{ n }}{% if messages[1] is defined %}{{ messages[1].content[:3] }}"
      "{% endif %}\n"), 2),
])
def test_reusable_plain_segments(prologue, reused, folder):
    """Analysis O7: a plain statement's output is reused exactly when what it read is unchanged (tools,
    ``messages[0]``, the length, the last message by a negative index, a name set before it): the expected
    counts follow from the steps below by that rule. Every step equals transformers (text and ids)."""
    check = Checker("qwen2_5", folder, template=prologue + _LOOP)
    conv = [{"role": "system", "content": "be brief"}] + conversation("qwen2_5", _files()[1])[1:9]
    tools2 = [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": {}}}]
    check.step(conv[:3], add_generation_prompt=True, tools=TOOLS)  # 1
    check.step(conv[:4], tools=TOOLS)  # 2: one more message
    check.step(conv[:4], add_generation_prompt=True, tools=TOOLS)  # 3: only an option changed
    check.step(conv[:5], add_generation_prompt=True, tools=tools2)  # 4: other tools
    check.step(conv[:6], tools=tools2)  # 5
    check.step(conv[:6], tools=None)  # 6: no tools
    edited = [{"role": "system", "content": "be verbose"}] + conv[1:7]
    check.step(edited, add_generation_prompt=True)  # 7: the system message edited (k = 0)
    check.step(edited[:1] + [{"role": "user", "content": "new"}] + edited[2:7], add_generation_prompt=True)  # 8: k = 1
    check.step(edited[:3])  # 9: truncated
    check.step(conv[:8], add_generation_prompt=True)  # 10: the first system message again (k = 0)
    assert check.chat.stats["incremental"] == check.steps == 10
    assert check.chat.stats["plain_reused"] == reused, dict(check.chat.stats)



@pytest.mark.parametrize("template", [
    "{{ tools|tojson }}\n" + _LOOP,  # a reusable prologue's input (and the option's kept copy)
    "{{ zero }}\n" + _LOOP,  # a template kwarg
    _LOOP.replace("{{ m.content }}", "{{ m.content }} {{ zero }}"),  # a value the loop body reads (O3)
    ("{%- set ns = namespace(z=zero) %}"  # a namespace value a kept record read
     + _LOOP.replace("{{ m.content }}", "{{ m.content }} {{ ns.z }}")),
])
def test_signed_zero_is_a_change(template, folder):
    """``0.0 == -0.0`` in Python, but the text shows ``0.0`` and ``-0.0``: a request that changes only the
    sign of a zero must not reuse what the previous one rendered. Every step equals transformers."""
    check = Checker("qwen2_5", folder, template=template)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    for zero in (0.0, -0.0, -0.0, 0.0, 0):
        tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"z": zero}}}]
        check.step(conv, tools=tools, zero=zero)
    assert check.chat.stats["incremental"] == check.steps == 5



def test_continue_after_a_whole_trusted_prefix_and_after_a_continue(folder):
    """continue_final_message with nothing new to parse (``render_more([])``: the trusted prefix is the whole
    list), and a one-loop template rendered again after a continue render (its kept text is whole, not
    pieces). Every step equals transformers."""
    check = Checker("qwen3", folder)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    check.step(conv)
    want = check.reference(conv, tokenize=False, continue_final_message=True)
    assert check.chat.render_more([], continue_final_message=True).text == want
    loop = Checker("qwen2_5", folder, template="{% for m in messages %}{{ m.content }}|{% endfor %}")
    loop.step(conv, ids=False, continue_final_message=True)
    loop.step(conv + [{"role": "user", "content": "more"}], ids=False)
    loop.step(conv + [{"role": "user", "content": "more"}, {"role": "user", "content": "again"}], ids=False)


def test_non_json_values_are_compared_by_their_copies(folder):
    """``b"x" == bytearray(b"x")`` but their plain copies (what the template sees) are ``"<bytes>"`` and
    ``"<bytearray>"``: as options and inside messages, each request renders what transformers renders."""
    check = Checker("qwen2_5", folder, template="{{ extra }}|{% for m in messages %}{{ m.content }}{{ m.x }}|{% endfor %}")
    for v in (b"x", bytearray(b"x"), memoryview(b"x"), b"x"):
        check.step([{"role": "user", "content": "hi", "x": v}], ids=False, extra=v)


_SCAN = ("{%- set ns = namespace(last=-1) %}"
         "{%- for m in ITER %}{%- if ns.last < 0 and m.role == 'user' %}SET{%- endif %}{%- endfor %}"
         "{%- for m in messages %}<|im_start|>{{ m.role }}{% if loop.index0 == ns.last %} (last query){% endif %}\n"
         "{{ m.content }}<|im_end|>\n{%- endfor %}")


@pytest.mark.parametrize("iterable, set_last, per_append", [
    ("messages[::-1]", "{%- set ns.last = (messages|length - 1) - loop.index0 %}", 2),
    ("messages|reverse", "{%- set ns.last = messages|length - loop.index0 - 1 %}", 2),
    # not the position: the match reads the length and is rendered again at every append
    ("messages[::-1]", "{%- set ns.last = (messages|length - 2) - loop.index0 %}", 3),
    # in a nested for, ``loop`` is the nested loop's: not rewritten; ns.last = length - 1 moves at every
    # append, so the main loop's old last message is rendered again as well
    ("messages[::-1]", "{%- for _ in [0] %}{%- set ns.last = (messages|length - 1) - loop.index0 %}{%- endfor %}", 4),
])
def test_reverse_scan_reads_the_position(iterable, set_last, per_append, folder):
    """Analysis O5b: in a reverse loop over every message, ``(messages|length - 1) - loop.index0`` is the
    position, so appending a message that is not a user query renders the new message once in each loop
    (2 iterations); an expression that is not the position keeps its length read, and the scan's match is
    rendered again. Every step equals transformers (text and ids)."""
    check = Checker("qwen2_5", folder, template=_SCAN.replace("ITER", iterable).replace("SET", set_last))
    conv = conversation("qwen2_5", _files()[1])[:12]
    check.step(conv[:3], add_generation_prompt=True)
    rendered = []
    for i in range(4, len(conv) + 1):
        before = check.chat.stats["iterations_rendered"]
        check.step(conv[:i], add_generation_prompt=conv[i - 1]["role"] != "assistant")
        if conv[i - 1]["role"] != "user":
            rendered.append(check.chat.stats["iterations_rendered"] - before)
    assert rendered and set(rendered) == {per_append}, rendered
    assert check.chat.stats["incremental"] == check.steps


def test_qwen3_prologue_is_reused_across_turns(folder):
    """The real Qwen3 template with tools: the tools/system prologue is rendered once, then reused while the
    tools and the first message are unchanged; a change of tools renders it again (text vs transformers)."""
    check = Checker("qwen3", folder)
    conv = conversation("qwen3", _files()[0])[:10]
    for i in range(2, len(conv) + 1):
        check.step(conv[:i], ids=False, add_generation_prompt=conv[i - 1]["role"] != "assistant", tools=TOOLS)
    assert check.chat.stats["plain_reused"] >= len(conv) - 2
    before = check.chat.stats["plain_reused"]
    check.step(conv, ids=False, add_generation_prompt=conv[-1]["role"] != "assistant", tools=TOOLS + TOOLS)
    assert check.chat.stats["plain_reused"] == before + 1  # the generation prompt only
    assert check.chat.stats["incremental"] == check.steps


def test_refusal_keeps_state(folder):
    """gemma3 refuses non-alternating roles (raise_exception): InvalidRequest, and the next request is
    still exact."""
    check = Checker("gemma3", folder)
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    check.step(conv, add_generation_prompt=True)
    with pytest.raises(InvalidRequest):
        check.chat.render(conv + [{"role": "assistant", "content": "c"}], add_generation_prompt=True)
    check.step(conv + [{"role": "user", "content": "c"}], add_generation_prompt=True)


@pytest.mark.parametrize("template, reason", [
    ("{% macro turn(m) %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endmacro %}"
     "{% for m in messages %}{{ turn(m) }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
     "full:template"),
    ("{% for m in messages %}{% if loop.changed(m.role) %}<|im_start|>{{ m.role }}\n{% endif %}{{ m.content }}"
     "<|im_end|>\n{% endfor %}", "full:loop.changed"),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}"
     "<|im_start|>{{ m.role }} {{ ns.n }}\n{{ m.content }}<|im_end|>\n{% endfor %}", "incremental"),
])
def test_templates_that_defeat_the_analysis(template, reason, folder):
    """Fallbacks are exact and counted with their reason; a namespace carried across turns is incremental."""
    check = Checker("qwen2_5", folder, template=template)
    conv = conversation("qwen2_5", _files()[1])[:8]
    for i in range(2, len(conv) + 1):
        check.step(conv[:i], add_generation_prompt=i % 2 == 0)
    routes = [k for k in check.chat.stats if k.startswith(reason)]
    assert routes and sum(check.chat.stats[k] for k in routes) == check.steps


def test_full_render_hook(folder):
    check = Checker("deepseek_v3", folder)
    conv = conversation("deepseek_v3", _files()[0])[:6]
    assert check.chat.full_render(conv, add_generation_prompt=True) == check.reference(
        conv, tokenize=False, add_generation_prompt=True)
    assert check.chat.stats["incremental"] == 0


@pytest.mark.parametrize("body", ["{{ loop }}", "{{ ns }}", "{{ ns | string }}"])
def test_loop_or_namespace_printed_whole(body):
    """Printing ``loop`` or a namespace reads every attribute at once, which no record holds: such a request
    renders in full (the recording ``loop`` printed itself as a Python object, and a namespace printed
    without recording its reads was reused after an edit changed it)."""
    source = ("{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}" + body
              + "{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}")
    chat, ref = ChatSession(source, {}), ChatRenderer(source, {})
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    for messages in (conv, conv + [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
                     [{"role": "assistant", "content": "x"}] + conv[1:] + conv):
        r = chat.render(messages)
        assert r.text == ref.render(messages)
        assert r.route.startswith("full:")


def test_a_root_name_starting_with_underscore_reaches_later_statements():
    """A root ``set _name`` is a variable of every later root statement in the full render; jinja2's
    ``get_exported()`` leaves such names out, so segments must pass on the context's variables (O1)."""
    source = "{%- set _p = 'x' -%}{%- for m in messages -%}{{ m.role }}{{ _p }}{%- endfor -%}{{ _p is defined }}{{ _p }}"
    for compiled in (True, False):
        chat, ref = ChatSession(source, {}, compiled_bodies=compiled), ChatRenderer(source, {})
        conv = [{"role": "user", "content": "a"}]
        for messages in (conv, conv + [{"role": "assistant", "content": "b"}]):
            r = chat.render(messages)
            assert r.text == ref.render(messages)
            assert r.text.endswith("xTruex")


def test_plain_kept_reuses_only_a_copy_the_value_would_equal():
    """An option (tools, kwargs) keeps the previous request's plain copy only when ``plain(value)`` would
    equal it strictly: not across int/float/bool, signs of zero, key order, list/tuple, str subclasses,
    bytes-likes of equal bytes, or a numpy scalar and the bytes it holds."""
    import marshal

    import numpy as np

    from toktier_backend.chat.template import plain

    class S(str):
        pass

    chat = ChatSession("{% for m in messages %}{{ m.content }}{% endfor %}", {})
    values = [[{"a": 1, "b": [0.0]}], [{"a": 1, "b": [0.0]}], [{"a": 1.0, "b": [0.0]}], [{"a": True, "b": [0.0]}],
              [{"a": 1, "b": [-0.0]}], [{"b": [0.0], "a": 1}], [{"a": 1, "b": (0.0,)}], [{"a": S("1")}],
              [{"a": "1"}], [{"a": b"\x00" * 8}], [{"a": bytearray(8)}], [{"a": np.float64(0.0)}],
              [{"a": b"\x00" * 8}], [{"a": 10**30}], [{"a": 10**30}], None, None, {"x": float("nan")}]
    previous = None
    for i, v in enumerate(values):
        got = chat._plain_kept("tools", v)
        want = plain(v)
        assert type(got) is type(want) and marshal.dumps(got, 0) == marshal.dumps(want, 0), (i, v)
        # kept: a value equal to the previous one, or to the previous copy (the str subclass's); else new
        assert (got is previous) == (i in (1, 8, 14, 16)), (i, v)
        previous = got


@pytest.mark.parametrize("name", TEMPLATES)
def test_an_appended_turn_does_not_stream_the_old_text(name, monkeypatch):
    """On a turn that appends a message, what comes before the re-rendered records is skipped by length:
    the old text's stream (when there is one) holds the last records and the strings after them, never
    the loop's records from the start (deepseek_v3's system-prompt scan, a loop that prints nothing,
    made the old stream start before its main loop on every turn). Text against the full render at
    every step."""
    import toktier_backend.chat.session as session_module

    streamed = []  # pieces of each old stream
    real = session_module._common_prefix_streams

    def counting(a, b):
        old = list(a)
        streamed.append(len(old))
        return real(iter(old), b)

    monkeypatch.setattr(session_module, "_common_prefix_streams", counting)
    source, cfg = template_source(name)
    chat, ref = ChatSession(source, special_tokens(cfg)), ChatRenderer(source, special_tokens(cfg))
    conv = conversation(name, _files()[0])[:14]
    options = {"tools": TOOLS} if name in TOOL_TEMPLATES else {}
    chat.render(conv[:2], add_generation_prompt=True, **options)
    for i in range(3, len(conv) + 1):
        agp = conv[i - 1]["role"] != "assistant"
        r = chat.render_more([conv[i - 1]], add_generation_prompt=agp, **options)
        assert r.text == ref.render(conv[:i], add_generation_prompt=agp, **options), (name, i)
    assert chat.stats["incremental"] == len(conv) - 1
    assert max(streamed, default=0) <= 4, streamed
