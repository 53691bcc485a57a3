"""The segments' sandbox (``template.PlainFastSandbox``) returns what jinja2's stock
``ImmutableSandboxedEnvironment`` returns, for every object kind and attribute name its fast paths take and
for the ones they must leave to the stock code; and the incremental render that uses it equals
transformers' ``apply_chat_template``, sandbox errors included."""

from __future__ import annotations

import pytest
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from tests.chat.corpus import conversation
from tests.chat.test_session import Checker, _files
from toktier_backend.chat.template import (DICT_ATTRIBUTES, STOCK_CALL_PARAMETERS, SandboxPlain, fast_sandbox_proven,
                                           plain_fast_sandbox, segment_environment)

NAMES = ["content", "role", "items", "keys", "get", "pop", "update", "clear", "setdefault", "copy", "fromkeys",
         "format", "format_map", "strip", "split", "upper", "startswith", "__class__", "__dict__", "__init__",
         "_x", "mro", "__len__", "missing", "value", "cycle", "first", "", "maketrans", "join", "translate",
         "__self__", "__globals__", "gi_frame", "depth", "depth0", "previtem", "nextitem", "changed", "last",
         "index0", "fmt", 1, None]


class _Plain(SandboxPlain):
    """A SandboxPlain as the session's ``loop`` is one: public ints, a method, a property."""

    __slots__ = ("_v",)

    def __init__(self):
        self._v = 3

    first = property(lambda self: True)
    value = property(lambda self: self._v)
    fmt = "{0}".format  # a raw str.format: the stock path wraps it (wrap_str_format), so must the fast one

    def cycle(self, *args):
        return args[0]


class _Dict(dict):
    def __missing__(self, key):
        return "missing " + str(key)


class _Str(str):
    def format(self, *args, **kwargs):  # noqa: A003 - a str subclass's own format
        return "own format"


class _Liar:
    """An object that claims to be a SandboxPlain through ``__class__`` (not through its type)."""

    fmt = "{0}".format

    @property
    def __class__(self):  # noqa: PLE0307 - the spoof under test
        return _Plain


def _objects():
    from collections import defaultdict

    from jinja2.utils import Namespace
    from markupsafe import Markup

    from toktier_backend.chat.analysis import IterForm
    from toktier_backend.chat.session import _Rec, _RecLoop, _recording_namespace_class

    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    loops = [_RecLoop(_Rec(chat[p], p), p, 2, IterForm(0, False), chat, ImmutableSandboxedEnvironment().undefined)
             for p in (0, 1)]
    state = {("ns", "content"): "ns value", ("ns", "fmt"): "{0}".format, ("ns", "items"): [1], ("ns", "last"): 3,
             ("ns", "_x"): 1, ("other", "role"): "not this namespace's"}
    namespaces = [_recording_namespace_class()("ns", state, _Rec(None, 0)), _recording_namespace_class()("ns", {}, _Rec(None, 0))]
    return [*loops, *namespaces, _Dict(items="key"), defaultdict(int, content="d"), _Str("{0}"), Markup("<b>{0}</b>"), _Liar(),
            
        {"content": "hi", "role": "user", "items": "key named items", "get": 1, "format": "f", "_x": 2, "": 0},
        {}, {1: "int key"}, "some text", "", ["a", "b"], 7, 1.5, True, None, _Plain(), Namespace(content="ns"),
        Undefined(name="u"),
    ]


def _same(a, b) -> bool:
    if isinstance(a, Undefined) or isinstance(b, Undefined):
        return (type(a) is type(b) and a._undefined_name == b._undefined_name
                and a._undefined_hint == b._undefined_hint and a._undefined_obj is b._undefined_obj
                and a._undefined_exception is b._undefined_exception)
    if callable(a) and callable(b) and not isinstance(a, type):
        # bound methods are new objects at each access: the same function of the same object; the
        # sandbox's str.format wrapper is a new closure: compare what it returns
        if getattr(a, "__name__", None) in ("format", "format_map") and getattr(a, "__self__", None) is None:
            return getattr(b, "__name__", None) == a.__name__ and _called(a) == _called(b)
        return a == b
    return type(a) is type(b) and a == b


def _called(f):
    try:
        return f({"a": 1})
    except Exception as e:  # noqa: BLE001 - the same error on both paths
        return (type(e), str(e))


def _outcome(env, obj, name):
    try:
        return env.getattr(obj, name)
    except Exception as e:  # noqa: BLE001 - an Undefined raises on attribute access: compare the errors
        return (type(e), str(e))


@pytest.mark.parametrize("name", NAMES)
def test_getattr_equals_the_stock_sandbox(name):
    fast, stock = plain_fast_sandbox(), ImmutableSandboxedEnvironment()
    for obj in _objects():
        got, want = _outcome(fast, obj, name), _outcome(stock, obj, name)
        assert _same(got, want), (obj, name, got, want)


def test_namespace_reads_are_recorded_as_by_the_stock_path():
    """A recording namespace read through the fast ``getattr`` records what the stock path records: the
    first value of each attribute read, ``MISSING`` for an attribute it does not have (read twice there)."""
    from toktier_backend.chat.session import MISSING, _Rec, _recording_namespace_class

    fast, stock = plain_fast_sandbox(), ImmutableSandboxedEnvironment()
    got = []
    for env in (fast, stock):
        rec = _Rec(None, 0)
        ns = _recording_namespace_class()("ns", {("ns", "a"): 1, ("ns", "b"): "x"}, rec)
        for name in ("a", "missing", "b", "a", "missing"):
            env.getattr(ns, name)
        got.append(rec.ns_reads)
    assert got[0] == got[1] == {("ns", "a"): 1, ("ns", "missing"): MISSING, ("ns", "b"): "x"}


@pytest.mark.parametrize("version, proven", [("3.1.4", False), ("3.1.5", True), ("3.1.6", True), ("3.1.10", True),
                                             ("3.2.0", False), ("4.0.0", False), ("3.0.3", False), ("13.1.6", False)])
def test_the_fast_class_is_used_only_where_its_proofs_hold(version, proven):
    """Before 3.1.5 the stock sandbox caught ``str.format`` in ``call``, not in ``getattr``: the fast ``call``
    would let a raw ``format`` through there."""
    assert fast_sandbox_proven(version) == proven


def test_segments_use_the_fast_class_under_the_jinja2_it_was_proven_for():
    import jinja2

    assert fast_sandbox_proven(jinja2.__version__)  # the version the tests run on (pyproject.toml: >= 3.1.6)
    assert segment_environment() is plain_fast_sandbox()
    assert type(plain_fast_sandbox()).__name__ == "PlainFastSandbox"
    assert type(plain_fast_sandbox()).__mro__[1] is ImmutableSandboxedEnvironment


def test_the_fast_paths_assumptions():
    # DICT_ATTRIBUTES is exactly what getattr finds on a dict: every other name raises AttributeError
    d = {}
    for name in DICT_ATTRIBUTES:
        getattr(d, name)
    assert not hasattr(d, "__dict__") and not hasattr(dict, "__getattr__")
    assert {"items", "keys", "get", "pop", "__class__", "__init__"} <= DICT_ATTRIBUTES
    # a str method's __name__ is its name, so wrap_str_format matches only format and format_map
    for name in dir(str):
        if not name.startswith("_"):
            assert getattr("x", name).__name__ == name, name


def test_call_equals_the_stock_sandbox():
    from jinja2 import Template

    fast, stock = plain_fast_sandbox(), ImmutableSandboxedEnvironment()
    ctx = Template("x").new_context({})
    for f, args, kw in [(" a b ".strip, (), {}), ("a,b".split, (",",), {"_loop_vars": {}}),
                        ("abc".startswith, ("a",), {"_block_vars": {}}), ("{0}".format, (1,), {}),
                        ("x".replace, ("x", "y"), {"_loop_vars": {"v": 1}, "_block_vars": {}})]:
        assert fast.call(ctx, f, *args, **dict(kw)) == stock.call(ctx, f, *args, **dict(kw))
    with pytest.raises(TypeError):  # a wrong call raises as the stock path does
        fast.call(ctx, "a".strip, 1, 2)
    with pytest.raises(TypeError):
        stock.call(ctx, "a".strip, 1, 2)

    class Stop:  # an argument that raises StopIteration inside a str method: an undefined on both paths
        def __iter__(self):
            raise StopIteration

        def __index__(self):
            raise StopIteration

    for f, args in [("".join, (Stop(),)), ("ab".center, (Stop(),)), ("a b".split, (" ", Stop()))]:
        got, want = fast.call(ctx, f, *args), stock.call(ctx, f, *args)
        assert isinstance(got, Undefined) and _same(got, want), (f, got, want)


def _result(env, ctx, f, args, kw):
    try:
        out = env.call(ctx, f, *args, **dict(kw))
    except Exception as e:  # noqa: BLE001 - the same error on both paths
        return (type(e), str(e))
    if isinstance(out, Undefined):
        return ("undefined", out._undefined_hint)
    if isinstance(out, Namespace):
        return (type(out), object.__getattribute__(out, "_Namespace__attrs"))
    return out


def test_direct_calls_equal_the_stock_sandbox():
    """The globals the environments get (``namespace``, ``raise_exception``, ``strftime_now``, ``dict``) and
    a :class:`SandboxCall` (the session's comparison recorder) are called directly: what the stock path gives
    (values, errors, an undefined for a ``StopIteration``), and the attributes the proof relies on."""
    from jinja2 import Template
    from jinja2.utils import _PassArg

    from toktier_backend.chat.session import _Compare, _Rec, _recording_namespace_class
    from toktier_backend.chat.template import SandboxCall, sandbox_environment

    fast, stock = plain_fast_sandbox(), sandbox_environment()
    g = stock.globals
    ctx = Template("x").new_context({})
    ns_class = _recording_namespace_class()
    compare = _Compare(ns_class, fast.getattr)
    rec_ns = ns_class("ns", {("ns", "i"): 3}, _Rec(None, 0))

    class Stop:
        def __iter__(self):
            raise StopIteration

    cases = [(g["namespace"], (), {"a": 1, "_loop_vars": {}, "_block_vars": {}}), (g["namespace"], ({"b": 2},), {}),
             (g["namespace"], (), {"_x": 1}), (g["namespace"], (Stop(),), {}), (g["raise_exception"], ("no",), {}),
             (g["strftime_now"], ("%Y",), {"_loop_vars": {}}), (g["dict"], (), {"a": 1}),
             (g["dict"], ([("k", "v")],), {"_block_vars": {}}), (g["dict"], (Stop(),), {}),
             (compare, ({"i": 1}, "m", "i", "gt", "left", 0), {}), (compare, (rec_ns, "ns", "i", "lt", "right", 5), {}),
             (compare, ({"i": 1}, "m", "i", "gt", "left", "s"), {})]
    # keywords the stock signatures bind themselves: the same TypeError (message included) on both paths
    cases += [(f, (), {name: 0}) for f in (g["dict"], g["namespace"], g["raise_exception"], compare, "a".strip)
              for name in STOCK_CALL_PARAMETERS]
    for f, args, kw in cases:
        assert _result(fast, ctx, f, args, kw) == _result(stock, ctx, f, args, kw), (f, args, kw)
    for f in (*g.values(), compare):  # the proof's premises (template.SandboxCall, PlainFastSandbox.call)
        assert stock.is_safe_callable(f) and _PassArg.from_obj(f) is None and _PassArg.from_obj(f.__call__) is None
    assert isinstance(compare, SandboxCall)
    # STOCK_CALL_PARAMETERS are exactly the parameters of the two stock call methods (name-mangled)
    import inspect

    from jinja2.runtime import Context
    from jinja2.sandbox import SandboxedEnvironment

    own = {p.name for m in (SandboxedEnvironment.call, Context.call) for p in inspect.signature(m).parameters.values()
           if p.kind is p.POSITIONAL_OR_KEYWORD}
    assert own == STOCK_CALL_PARAMETERS
    # a template that binds the name to its own object reaches the stock path: no call of an unsafe one
    from jinja2.sandbox import SecurityError, unsafe

    with pytest.raises(SecurityError):
        fast.call(ctx, unsafe(lambda: 1))


def test_format_through_the_segments_is_the_sandboxed_one(folder):
    """A template reaching for globals through ``str.format`` is refused on the incremental path too."""
    template = "{%- for m in messages %}{{ '{0.__globals__[os]}'.format(raise_exception) }}{% endfor %}"
    check = Checker("qwen2_5", folder, template=template)
    conv = conversation("qwen2_5", _files()[1])[:3]
    assert check.step(conv[:2]) is not None  # transformers raised (SecurityError), and so did we


_ATTRS = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n"
          "{%- if m.get is callable and m.items is callable %}[methods]{% endif %}"
          "{%- if m.nothing is not defined %}[undefined]{% endif %}"
          "{{ m.content.split(' ')|join('_') }}|{{ m.content.upper().strip() }}|{{ '{0}-{1}'.format(m.role, 1) }}"
          "{%- if loop.first %}[first]{% endif %}{{ loop.cycle('a', 'b') }}{{ loop.index }}"
          "{%- for c in m.content.split(' ')[:2] %}{{ loop.index0 }}{{ c.lower() }}{% endfor %}<|im_end|>\n"
          "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_attribute_heavy_template_equals_transformers(folder):
    """A body that reads dict keys, dict methods, undefined keys, str methods (``format`` through the
    sandbox's formatter), ``loop`` attributes and a nested loop: every step equals transformers (text and
    ids), with iterations reused."""
    check = Checker("qwen2_5", folder, template=_ATTRS)
    conv = conversation("qwen2_5", _files()[1])[:10]
    for i in range(2, len(conv) + 1):
        check.step(conv[:i], add_generation_prompt=True)
    assert check.chat.stats["incremental"] == check.steps
    assert check.chat.stats["iterations_reused"] > 0


@pytest.mark.parametrize("body, raises", [
    ("{{ m.__class__ }}", False),  # an unsafe attribute is an undefined: it prints as ""
    ("{{ m.content.__class__.__mro__ }}", True),  # reading an attribute of that undefined raises
    ("{{ m.pop('role') }}", True),  # immutable: no dict mutation
    ("{{ loop._rec }}{{ loop._rec.out }}", True),
    ("{{ m.content.format.__globals__ }}", False),
    ("{{ m.content.format.__globals__.x }}", True),
])
def test_sandbox_errors_are_the_full_renders(body, raises, folder):
    """What the stock sandbox refuses, the incremental render refuses the same way: transformers' text, or
    its error (``Checker.step``: then ours raises ``InvalidRequest``)."""
    check = Checker("qwen2_5", folder, template="{%- for m in messages %}<{{ m.role }}>" + body + "{% endfor %}")
    conv = conversation("qwen2_5", _files()[1])[:4]
    for i in (2, 3, 4):
        assert (check.step(conv[:i]) is not None) == raises


def test_a_keyword_the_stock_call_binds_is_refused_on_the_incremental_path_too():
    """``dict(_Context__self=0)`` raises ``TypeError`` in jinja2's sandbox; a loop body re-rendered on the
    incremental path must not render it (found in review: the direct call passed it to ``dict``)."""
    from toktier_backend.chat.session import ChatSession
    from toktier_backend.chat.template import ChatRenderer
    from toktier_backend.errors import InvalidRequest

    src = ("{%- for m in messages %}{% if m.role == 'assistant' %}{{ dict(_Context__self=0) }}{% endif %}"
           "{{ m.content }}{% endfor %}")
    first = [{"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"}]
    session = ChatSession(src, fast_full=False)
    assert session.render(first, add_generation_prompt=True).text == ChatRenderer(src).render(first)
    with pytest.raises(InvalidRequest, match="TypeError"):
        ChatRenderer(src).render(later)
    with pytest.raises(InvalidRequest, match="TypeError"):
        session.render(later, add_generation_prompt=True)
