"""The segments' sandbox (``template.PlainFastSandbox``) returns what jinja2's stock
``ImmutableSandboxedEnvironment`` returns, for every object kind and attribute name its fast paths take and
for the ones they must leave to the stock code; and the incremental render that uses it equals
transformers' ``apply_chat_template``, sandbox errors included."""

from __future__ import annotations

import pytest
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.chat.corpus import conversation
from tests.chat.test_session import Checker, _files
from toktier_backend.chat.template import DICT_ATTRIBUTES, SandboxPlain, plain_fast_sandbox, segment_environment

NAMES = ["content", "role", "items", "keys", "get", "pop", "update", "clear", "setdefault", "copy", "fromkeys",
         "format", "format_map", "strip", "split", "upper", "startswith", "__class__", "__dict__", "__init__",
         "_x", "mro", "__len__", "missing", "value", "cycle", "first", ""]


class _Plain(SandboxPlain):
    """A SandboxPlain as the session's ``loop`` is one: public ints, a method, a property."""

    __slots__ = ("_v",)

    def __init__(self):
        self._v = 3

    first = property(lambda self: True)
    value = property(lambda self: self._v)

    def cycle(self, *args):
        return args[0]


def _objects():
    from jinja2.utils import Namespace

    return [
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
            return getattr(b, "__name__", None) == a.__name__ and a({"a": 1}) == b({"a": 1})
        return a == b
    return type(a) is type(b) and a == b


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


def test_segments_use_the_fast_class_under_the_jinja2_it_was_proven_for():
    import jinja2

    assert jinja2.__version__.startswith("3.1.")  # the version the tests run on (pyproject.toml: >= 3.1.6)
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
