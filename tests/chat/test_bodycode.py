"""Compiled loop bodies (toktier_backend/chat/bodycode.py) against the jinja2 bodies and the full render.

Two sessions render the same requests: one through the compiled bodies, one through the jinja2 bodies only
(``compiled_bodies=False``). After every request the texts must equal the reference full render
(:class:`ChatRenderer`, the stock sandbox) and every kept record (output, ``loop`` reads, namespace reads,
comparison outcomes, writes, highest message read, length dependence) must be the same in both sessions.
Inputs: the six shared templates on real trajectories with random edits and on the fuzz's odd values, and
small templates written to reach each construct the compiler models (C1-C8 of the module), including ones
where the compiled code must give up mid-iteration (a bail after a namespace write) and ones it must refuse.
"""

from __future__ import annotations

import random

import pytest
from jinja2 import Undefined
from jinja2.utils import Namespace

from tests.chat.corpus import TEMPLATES, TOOL_TEMPLATES, conversation, template_source, trajectories
from tests.chat.test_fuzz import Gen
from tests.chat.test_session import TOOLS, _edit
from toktier_backend.chat import bodycode
from toktier_backend.chat.session import ChatSession
from toktier_backend.chat.template import ChatRenderer, segment_environment, special_tokens
from toktier_backend.errors import InvalidRequest


def _records(chat: ChatSession) -> list:
    out = []
    for memo in chat._memos or ():
        if hasattr(memo, "recs"):
            out.append([None if r is None else (r.out, r.loop_reads, r.ns_reads, r.cmps, r.writes, r.maxread, r.nsens)
                        for r in memo.recs[:memo.n]])
        elif isinstance(memo, str):  # a plain segment's output
            out.append(memo)
        else:  # a reusable plain segment's memo (a namespace read is compared by its attributes)
            inputs = {k: repr(v) if isinstance(v, (Namespace, Undefined)) else v for k, v in memo.inputs.items()}
            out.append((memo.out, inputs, memo.maxread, memo.nsens, memo.n))
    return out


class Twin:
    """The compiled session, the jinja2-bodies session and the reference renderer, stepped together."""

    def __init__(self, source: str, specials: dict):
        self.fast = ChatSession(source, specials, fast_full=False)
        self.slow = ChatSession(source, specials, fast_full=False, compiled_bodies=False)
        self.ref = ChatRenderer(source, specials)
        self.rendered = 0

    def step(self, messages, *, incremental: bool = True, **options) -> str:
        try:
            want = self.ref.render(messages, **options)
        except InvalidRequest:
            for chat in (self.fast, self.slow):
                with pytest.raises(InvalidRequest):
                    chat.render(messages, **options)
            return "refused"
        got = self.fast.render(messages, **options)
        assert got.text == want, (messages, options)
        assert self.slow.render(messages, **options).text == want
        assert (got.route == "incremental") == incremental, got.route
        assert _records(self.fast) == _records(self.slow)
        self.rendered += 1
        return want

    def compiled(self) -> int:
        """Iterations the compiled bodies rendered (rendered less those that went to jinja2)."""
        s = self.fast.stats
        assert not any(k.startswith(("body_not_compiled", "plain_not_compiled")) for k in s), dict(s)
        return s["iterations_rendered"] - s["iterations_compiled_bailed"]


def _files():
    files = trajectories()
    return [f for f in files if "function_calling" in f.name][0], files[-1]


@pytest.mark.parametrize("name", TEMPLATES)
def test_shared_templates_on_trajectories_with_edits(name):
    """Real turns and random edits of history (truncations, rewrites, deletions, insertions, the system
    message toggled), tools and flags switched."""
    src, cfg = template_source(name)
    twin = Twin(src, special_tokens(cfg))
    rng = random.Random(4242 + TEMPLATES.index(name))
    for path in _files():
        conv = conversation(name, path)[:24]
        for i in range(2, len(conv) + 1, 2):
            options = {"add_generation_prompt": conv[i - 1]["role"] != "assistant"}
            if name in TOOL_TEMPLATES:
                options["tools"] = TOOLS
            twin.step(conv[:i], **options)
        for _ in range(25):
            conv = _edit(rng, conv, name)
            options = {"add_generation_prompt": rng.random() < 0.7}
            if name == "qwen3" and rng.random() < 0.3:
                options["enable_thinking"] = rng.random() < 0.5
            twin.step(conv, **options)
    assert twin.compiled() > 100
    assert twin.fast.stats["iterations_compiled_bailed"] < twin.compiled() // 4


@pytest.mark.parametrize("name", TEMPLATES)
def test_shared_templates_on_odd_values(name):
    """The fuzz's values: signed zeros, 1/1.0/True, big ints, None, content blocks, special-token text."""
    src, cfg = template_source(name)
    twin = Twin(src, special_tokens(cfg))
    gen = Gen(99 + TEMPLATES.index(name), alternate=name == "gemma3")
    conv = gen.edit([])
    for _ in range(60):
        options = {"add_generation_prompt": gen.r.random() < 0.7}
        if gen.r.random() < 0.5:
            options["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"a": -0.0}}}]
        twin.step(conv, **options)
        conv = gen.edit(conv)
    assert twin.compiled() > 20


# small templates, each reaching constructs the compiler models (module docstring, C1-C8)
SCOPING = """
{%- set greeting = 'hi' -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set who = 'U' -%}{%- elif message.role == 'assistant' -%}{%- set who = 'A' -%}
{%- endif -%}
{{- (who if who is defined else '?') ~ ':' ~ greeting ~ ':' ~ (extra if extra is defined else 'none') ~ ':' -}}
{%- set late = 'L' -%}{{ late }}
{%- if message.content is string and message.content -%}{{ message.content | trim | upper }}{%- endif -%}
{%- for part in message.parts -%}
{{- loop.index ~ '/' ~ loop.length ~ ('L' if loop.last else '') ~ ('F' if loop.first else '') ~ loop.revindex0 -}}
{{- part -}}{%- set message = 'shadow' -%}{{- message -}}{%- if part == 'stop' -%}{% break %}{%- endif -%}
{%- endfor -%}
{{- message.role -}}
{{- '|' ~ loop.index0 ~ loop.revindex ~ loop.first ~ loop.last ~ loop.length ~ '\\n' -}}
{%- endfor -%}
"""
NAMESPACE = """
{%- set ns = namespace(count=0, last_user=-1, seen=false, text='') -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- set ns.count = ns.count + 1 -%}
{%- if loop.index0 > ns.last_user -%}after{%- else -%}before{%- endif -%}
{%- if ns.last_user == loop.index0 -%}=here{%- endif -%}
{{- ns.count -}}{%- if not ns.seen and message.role == 'assistant' -%}{%- set ns.seen = true -%}FIRST{%- endif -%}
{%- set ns.text = ns.text + message.role[0] -%}{{ ns.text }}{{ ns.never is defined }}
{%- endfor -%}
{{- ns.count ~ ns.text -}}
"""
LOOKAHEAD = """
{%- for m in messages -%}
{%- if loop.last or messages[loop.index0 + 1].role != m.role -%}<{{ m.role }}>{%- endif -%}
{%- if not loop.first and messages[loop.index0 - 1].role == 'tool' -%}after-tool{%- endif -%}
{{- messages|length -}}{{- m['content'][:3] ~ m['content'][-1:] ~ m.content[::2] -}}
{%- endfor -%}
{%- for m in messages|reverse -%}{{ loop.revindex0 }}{{ m.role[0] }}{{ loop.index }}{%- endfor -%}
{%- for m in messages[::-1] -%}{%- if m.role == 'user' -%}{{ (messages|length - 1) - loop.index0 }}{%- endif -%}
{%- endfor -%}
"""
ALIAS = """
{%- if messages[0].role == 'system' -%}{%- set rest = messages[1:] -%}{%- else -%}{%- set rest = messages -%}{%- endif -%}
{%- for m in rest -%}{{ loop.index }}:{{ m.content[:3] }}/{{ loop.revindex0 }}{{ 'F' if loop.first }}{%- endfor -%}
"""
VALUES = """
{%- for m in messages -%}
{%- if m.role == 'bad' -%}{{ raise_exception('bad role ' ~ m.role) }}{%- endif -%}
{{- m.tool_calls | tojson if m.tool_calls is defined else '' -}}
{{- (m.content | tojson(indent=2)) if m.content is not string else m.content.split('\\n')[0].strip().replace('a', 'b') -}}
{{- m.content is iterable -}}{{- m.content is mapping -}}{{- m.content | length -}}{{- m.content is string -}}
{{- (loop.index0 % 3) * 2 - 1 + (10 // 3) + 2 ** 3 -}}{{- 7 / 2 -}}{{- -loop.index -}}{{ 1.5 }}
{{- m.content.startswith('x') and m.content.endswith('y') or m.content.count('a') > 1 -}}
{{- m.get_me is none -}}{{- m.score if m.score is defined and m.score is not none else 'no score' -}}
{{- 'yes' if 'a' in m.content else 'no' -}}{{- m.role ~ 1 ~ none ~ true -}}
{{- m.role in ['user', 'tool'] -}}{{- m.role not in ('x', none, 1) -}}
{%- endfor -%}
"""
BAIL_AFTER_WRITE = """
{%- set ns = namespace(x=0) -%}
{%- for m in messages -%}{%- set ns.x = ns.x + 1 -%}{{ m.missing }}{{ ns.x }}{{ m.content }}{%- endfor -%}{{ ns.x }}
"""
PLAIN = """
{%- set _private = 'p' -%}
{%- if tools -%}{%- set head = 'T' ~ (tools | length) -%}{%- else -%}{%- set head = 'none' -%}{%- endif -%}
{%- set ns = namespace(first=messages[0].role, n=messages | length, empty=none) -%}
{{- head ~ '|' ~ ns.first ~ ns.n ~ (ns.missing is defined) ~ (ns.empty is none) ~ '|' -}}
{%- if tools -%}{%- for tool in tools -%}{{ loop.index }}:{{ tool.function.name }}{{ ',' if not loop.last else '' }}
{%- set scratch = tool -%}{%- endfor -%}{%- endif -%}
{%- for m in messages -%}<{{ m.role }}:{{ head }}:{{ ns.first }}>{%- endfor -%}
{%- if add_generation_prompt -%}{{ 'GO' ~ (extra if extra is defined else '') ~ (scratch is defined) }}{%- endif -%}
{%- if messages | length > 99 -%}{{ raise_exception('too long') }}{%- endif -%}
{{- ns.first ~ (_private is defined) -}}
"""
PLAIN_UNDEFINED = """
{%- set maybe = messages[0].missing -%}{%- set sure = messages[0].role -%}
{%- for m in messages -%}{{ m.role }}{%- endfor -%}
{{- (maybe is defined) ~ sure -}}
"""
SYNTHETIC = {"plain": PLAIN, "plain_undefined": PLAIN_UNDEFINED, "scoping": SCOPING, "namespace": NAMESPACE, "lookahead": LOOKAHEAD, "alias": ALIAS, "values": VALUES,
             "bail_after_write": BAIL_AFTER_WRITE}


def _messages(rng: random.Random, n: int, parts: bool) -> list[dict]:
    out = []
    if rng.random() < 0.5:
        out.append({"role": "system", "content": "be brief a"})
    for i in range(n):
        role = rng.choice(["user", "assistant", "tool", "user", "assistant"])
        m = {"role": role, "content": rng.choice(["hello there", "  padded\n", "a\nb", "xay", "", "é😀 ab"])}
        if parts:
            m["parts"] = rng.choice([["p"], ["p", "q", "stop", "r"], [], ["x", "y"]])
        if role == "assistant" and rng.random() < 0.4:
            m["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": rng.choice(['{"a":1}', {"b": 2}])}}]
        if rng.random() < 0.2:
            m["score"] = rng.choice([1, 2.5, None, -0.0])
        if rng.random() < 0.05:
            m["content"] = rng.choice([[{"type": "text", "text": "blk"}], {"k": "v"}, 5])
        out.append(m)
    return out


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_constructs(name):
    """Each synthetic template over growing, edited and truncated conversations, with and without an outer
    variable (``extra``) and the generation prompt."""
    twin = Twin(SYNTHETIC[name], {"bos_token": "<s>"})
    rng = random.Random(sum(map(ord, name)))
    for trial in range(6):
        conv = _messages(rng, 3, parts=name == "scoping")
        twin.fast.reset()
        twin.slow.reset()
        for _ in range(8):
            options = {"add_generation_prompt": rng.random() < 0.5}
            if rng.random() < 0.5:
                options["extra"] = rng.choice(["E", 0, -0.0])
            if rng.random() < 0.5:
                options["tools"] = TOOLS * rng.randint(1, 2)
            twin.step(conv, **options)
            r = rng.random()
            if r < 0.6:
                conv = conv + _messages(rng, rng.randint(1, 2), parts=name == "scoping")[-2:]
            elif r < 0.8 and len(conv) > 2:
                conv = conv[:rng.randrange(1, len(conv))]
            else:
                i = rng.randrange(len(conv))
                conv = conv[:i] + [dict(conv[i], content=rng.choice(["edited a", "y"]))] + conv[i + 1:]
    assert twin.rendered >= 30
    stats = twin.fast.stats
    if name == "bail_after_write":  # every iteration prints an undefined attribute after its write: jinja2's
        assert stats["iterations_compiled_bailed"] == stats["iterations_rendered"] > 20
    else:
        assert twin.compiled() > 20
    if name == "plain_undefined":  # exporting an undefined value: the jinja2 render, every time
        assert stats["plain_compiled_bailed"] >= twin.rendered
    else:
        assert stats["plain_compiled_bailed"] == 0


REFUSED = {
    "tuple literal": "{%- for m in messages -%}{{ '%s/%s' % (m.role, m.content) }}{%- endfor -%}",
    "dict method": "{%- for m in messages -%}{% for k, v in m.items() %}{{ k }}{% endfor %}{%- endfor -%}",
    "loop.cycle": "{%- for m in messages -%}{{ loop.cycle('a', 'b') }}{%- endfor -%}",
    "bare loop": "{%- for m in messages -%}{{ loop }}{%- endfor -%}",
    "namespace printed": "{%- set ns = namespace(a=1) -%}{%- for m in messages -%}{{ ns }}{%- endfor -%}",
    "filter outside the list": "{%- for m in messages -%}{{ m.content | replace('a', 'b') }}{%- endfor -%}",
    "global other than raise_exception": "{%- for m in messages -%}{{ range(2) | list }}{%- endfor -%}",
    "messages printed": "{%- for m in messages -%}{{ messages[1:] | length }}{%- endfor -%}",
}


@pytest.mark.parametrize("why", sorted(REFUSED))
def test_refused_constructs_render_through_jinja2(why):
    """A body outside the modelled subset is not compiled (counted with the reason); its text is exact."""
    twin = Twin(REFUSED[why], {})
    conv = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    whole = why in ("bare loop", "namespace printed")  # printed whole: the jinja2 body refuses too (full render)
    twin.step(conv, incremental=not whole)
    twin.step(conv + [{"role": "user", "content": "ef"}], incremental=not whole)
    assert any(k.startswith("body_not_compiled") for k in twin.fast.stats), (why, dict(twin.fast.stats))
    assert twin.fast.stats["iterations_compiled_bailed"] == 0


def test_str_methods_are_methods_bound_to_the_string():
    """C6: every name in STR_METHODS is, on an exact str, a builtin method bound to that string, and the
    segments' sandbox returns it as is (so its call is the direct call ``PlainFastSandbox.call`` makes)."""
    env = segment_environment()
    s = "a b"
    for name in bodycode.STR_METHODS:
        m = env.getattr(s, name)
        assert type(m) is type("".strip) and m.__self__ is s and m.__name__ == name, name
    assert not bodycode.STR_METHODS & {"format", "format_map", "maketrans"}


def test_filters_and_tests_take_no_context():
    """C6: the environment's filters and tests the compiled code calls take no context or environment."""
    from jinja2.utils import _PassArg

    env = segment_environment()
    for name in bodycode.FILTERS:
        assert _PassArg.from_obj(env.filters[name]) is None, name
    for name in bodycode.TESTS:
        assert _PassArg.from_obj(env.tests[name]) is None, name


def test_undefined_is_false_and_nothing_else():
    """C3: UNDEFINED is false; printing, comparing, hashing, adding or iterating it raises."""
    U = bodycode.UNDEFINED
    assert not U and (U or 3) == 3 and U is not None
    for op in (str, repr, hash, len, iter, lambda u: u == "x", lambda u: "x" == u, lambda u: u != 1,
               lambda u: u + "a", lambda u: "a" + u, lambda u: 1 + u, lambda u: u < 1, lambda u: "a" in u,
               lambda u: u in {"a": 1}, lambda u: u in ["a"], lambda u: u[0], lambda u: "%s" % u):
        with pytest.raises(Exception):
            op(U)


def test_loop_attributes_equal_jinja2s():
    """``loop_attr`` against jinja2's own ``loop`` for forward, offset and reversed loops."""
    import jinja2

    env = jinja2.Environment()
    tmpl = env.from_string("{% for x in xs %}{{ [loop.index0, loop.index, loop.revindex0, loop.revindex, "
                           "loop.first, loop.last, loop.length] }};{% endfor %}")
    for n in range(1, 6):
        for start in range(n):
            want = tmpl.render(xs=list(range(n))[start:]).split(";")[:-1]
            got = [str([bodycode.loop_attr(a, p, n, False, start) for a in
                        ("index0", "index", "revindex0", "revindex", "first", "last", "length")])
                   for p in range(start, n)]
            assert got == want
        want = tmpl.render(xs=list(range(n))[::-1]).split(";")[:-1]
        got = [str([bodycode.loop_attr(a, p, n, True, 0) for a in
                    ("index0", "index", "revindex0", "revindex", "first", "last", "length")])
               for p in range(n - 1, -1, -1)]
        assert got == want


HOSTILE_SOURCES = {
    "an import": "import os\ndef body():\n    return ''\n",
    "a dunder attribute": "def body():\n    return ().__class__\n",
    "a dunder name": "def body():\n    return __import__('os')\n",
    "a builtin it is not given": "def body():\n    return open('/etc/hostname')\n",
    "a call of a template value": "def body(l_0_m):\n    return l_0_m()\n",
    "a method of a template value": "def body(l_0_m):\n    _o = []\n    l_0_m.append(1)\n    return ''\n",
    "an attribute outside the list": "def body(rec):\n    return rec.cmps\n",
    "a lambda": "def body():\n    return (lambda: 1)()\n",
    "a generator": "def body():\n    yield 1\n",
    "two functions": "def body():\n    return ''\ndef other():\n    return ''\n",
    "a nested function": "def body():\n    def inner():\n        return ''\n    return inner()\n",
    "a decorator": "@_k0\ndef body():\n    return ''\n",
}


@pytest.mark.parametrize("why", sorted(HOSTILE_SOURCES))
def test_load_refuses_source_outside_the_generated_subset(why):
    """``_load`` is the one ``exec`` of the package (``tests/test_spec.py``): it runs only what the
    generator writes (C10)."""
    ran = []
    with pytest.raises(bodycode.Unsupported, match="generated source"):
        bodycode._load(HOSTILE_SOURCES[why], {"_k0": ran.append}, "<test>")
    assert ran == []


def test_load_gives_the_source_only_its_builtins():
    fn = bodycode._load("def body(x):\n    return str(len(x))\n", {}, "<test>")
    assert fn("abc") == "3"
    assert fn.__globals__["__builtins__"] == bodycode.SOURCE_BUILTINS


HOSTILE_TEMPLATE = """
{%- set q = '\"\"\"\\'); import os; (\\'' -%}
{%- for m in messages -%}
{{- q ~ \"'''\\n\\\\\" ~ (m.__import__ is defined) ~ (m.__builtins__ is defined) -}}
{%- set __import__ = m.content -%}{{- __import__ ~ '\\x00' -}}
{%- endfor -%}
"""


def test_template_text_reaches_the_source_as_data():
    """Quotes, backslashes, newlines and dunder names in a template are values and keys in the compiled
    body (C10); it renders what jinja2 renders, compiled."""
    twin = Twin(HOSTILE_TEMPLATE, {})
    conv = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c'd\"\n"}]
    assert "import os" in twin.step(conv)
    twin.step(conv + [{"role": "user", "content": "\\"}])
    assert twin.compiled() >= 2
    bodies = [fn for seg in twin.fast.plan.segments for fn in seg.fast.values()]
    assert bodies and all(fn is not None for fn in bodies)


_U = {"role": "user", "content": "hi", "parts": [{"x": "E"}]}
_SYS_U_A = [{"role": "system", "content": "s"}, _U, {"role": "assistant", "content": "a"}]
#: Found by a review (session 17); each gave a text other than jinja2's. (template, [(messages, options)])
REVIEW = {
    # sibling nested loops share jinja2's local names: the second binds the namespace's name as its target
    "sibling frame rebinds a namespace name": (
        "{% set ns = namespace(x='NS') %}{% for m in messages %}{% for a in m.parts %}{{ ns.x }}{% endfor %}|"
        "{% for ns in m.parts %}{{ ns.x }}{% endfor %}{% endfor %}", [([_U], {})]),
    "sibling frame writes through a rebound name": (
        "{% set ns = namespace(x='NS') %}{% for m in messages %}{% for a in m.parts %}{{ ns.x }}{% endfor %}|"
        "{% for ns in m.parts %}{% set ns.x = 'W' %}{% endfor %}{% endfor %}{{ ns.x }}", [([_U], {})]),
    "sibling frame rebinds a global in a plain segment": (
        "{% if tools %}{% for t in tools %}{% set q = namespace(a=1) %}{% endfor %}{% for namespace in tools %}"
        "{{ namespace(a=2).a }}{% endfor %}{% endif %}{% for m in messages %}{{ m.role }}{% endfor %}",
        [([_U], {"tools": [{"n": 1}]})]),
    # Python NFKC-normalizes identifiers in jinja2's generated code; context keys stay as written
    "NFKC name next to loop": (
        "{% for m in messages %}{{ loop.index }}{{ \uff4c\uff4f\uff4f\uff50 is defined }}{% endfor %}", [([_U], {})]),
    "NFKC name next to an outer value": (
        "{% set x = 'X' %}{% for m in messages %}{{ \uff58 is defined }}{{ x }}{% endfor %}", [([_U], {})]),
    "NFKC root assignment": ("{% set \ufb01 = 'X' %}{% for m in messages %}{{ m.role }}{% endfor %}{{ fi }}", [([_U], {})]),
    "one namespace under two names": (
        "{% set ns = namespace(a=0) %}{% set al = ns %}{% for m in messages %}{% set ns.a = ns.a + 1 %}{{ al.a }}"
        "{% endfor %}", [([_U, _U], {})]),
    "namespace attribute order after reused records": (
        "{% set ns = namespace(flag=extra) %}{% for m in messages %}{% if loop.first and ns.flag %}{% set ns.a = 0 %}"
        "{% set ns.b = 0 %}{% endif %}{% if m.role == 'user' %}{% set ns.b = 1 %}{% endif %}"
        "{% if m.role == 'assistant' %}{% set ns.a = 2 %}{% endif %}{% endfor %}{{ ns }}",
        [(_SYS_U_A, {"extra": True}), (_SYS_U_A, {"extra": False})]),
    "reverse loop attribute order": (
        "{% set ns = namespace() %}{% for m in messages|reverse %}{% if m.role == 'assistant' %}{% set ns.a = 1 %}"
        "{% elif m.role == 'user' %}{% set ns.u = 1 %}{% else %}{% set ns.s = 1 %}{% endif %}{% endfor %}{{ ns }}",
        [(_SYS_U_A[:2], {}), (_SYS_U_A, {})]),
    # O5 would substitute the constant, and jinja2's optimizer folds 5[0:1] to an undefined
    "inlined constant folded": ("{% for m in messages %}{% set x = 5 %}{{ x[0:1] }}{% endfor %}", [([_U], {})]),
    "root variable shadows a global": ("{% set dict = 'D' %}{% for m in messages %}{{ dict }}{% endfor %}", [([_U], {})]),
    "keyword argument shadows a global": ("{% for m in messages %}{{ range is string }}{% endfor %}",
                                          [([_U], {"range": "K"}), ([_U, _U], {"range": 3})]),
    "empty branch": ("{% for m in messages %}{% if m.role == 'x' %}{% else %}{{ m.role }}{% endif %}{% endfor %}",
                     [([_U], {}), ([_U, _U], {})]),
}


@pytest.mark.parametrize("why", sorted(REVIEW))
def test_review_findings(why):
    """Compiled and jinja2-bodies sessions give jinja2's text, or refuse as it does, at every request."""
    source, requests = REVIEW[why]
    fast = ChatSession(source, {}, fast_full=False)
    slow = ChatSession(source, {}, fast_full=False, compiled_bodies=False)
    ref = ChatRenderer(source, {})
    for messages, options in requests:
        try:
            want = ref.render(messages, **options)
        except InvalidRequest:
            for chat in (fast, slow):
                with pytest.raises(InvalidRequest):
                    chat.render(messages, **options)
            continue
        assert fast.render(messages, **options).text == want
        assert slow.render(messages, **options).text == want
    if why == "empty branch":  # a Pass in the generated source is compiled, not refused
        assert not any(k.startswith("body_not_compiled") for k in fast.stats), dict(fast.stats)


def test_nesting_past_the_parser_limit_is_refused_not_raised():
    """Generated source too deep for Python's parser is :class:`bodycode.Unsupported` (the body renders
    through jinja2), not an error on every request."""
    source = "{% for m in messages %}{{ m.content" + "|trim('a')" * 120 + " }}{% endfor %}"
    fast, ref = ChatSession(source, {}, fast_full=False), ChatRenderer(source, {})
    for n in (1, 2):
        r = fast.render([_U] * n)
        assert r.text == ref.render([_U] * n) and r.route == "incremental"
