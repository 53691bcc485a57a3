"""The template analysis (toktier_backend/chat/analysis.py): which templates split, and which do not (why)."""

from __future__ import annotations

import pytest

from tests.chat.corpus import TEMPLATES, template_source
from toktier_backend.chat.analysis import LoopSegment, PlainSegment, analyze


@pytest.mark.parametrize("name", TEMPLATES)
def test_shared_templates_are_incremental(name):
    plan = analyze(template_source(name)[0])
    assert plan.reason is None
    assert any(isinstance(s, LoopSegment) for s in plan.segments)


def test_qwen3_structure():
    """Qwen3: the tools/system prologue (reusable, O7), the namespace ``set`` (binds a name: rendered every
    time), the reverse scan for the last user query (``index`` inlined, O5), the main loop, the generation
    prompt (reusable)."""
    plan = analyze(template_source("qwen3")[0])
    kinds = [type(s) for s in plan.segments]
    assert kinds == [PlainSegment, PlainSegment, LoopSegment, LoopSegment, PlainSegment]
    assert [getattr(s, "reusable", None) for s in plan.segments] == [True, False, None, None, True]
    assert plan.segments[0].free == {"tools", "messages"} and plan.segments[0].uses_messages
    assert plan.segments[2].forms[0].reverse and not plan.segments[3].forms[0].reverse
    assert plan.inlined == ("index",)


@pytest.mark.parametrize("source, reusable", [
    ("{{ bos_token }}{% if tools %}{{ tools|tojson }}{% endif %}", [True]),
    ("{% set x = messages|length %}{{ x }}", [False, True]),
    ("{% if true %}{% set x = 1 %}{% endif %}{{ messages[0].content }}", [False, True]),
    (("{% set ns = namespace(a=1) %}{% set ns.a = 2 %}{{ strftime_now('%d') }}"
      "{% if x %}{{ messages|length }}{% endif %}"),
     [False, True]),
    ("{{ strftime_now('%d') }}{{ [1, 2]|random }}{{ messages.pop() }}", [False]),
])
def test_reusable_plain_statements(source, reusable):
    """O7: statements that bind a name, write a namespace, call a nondeterministic global or use messages
    other than by index/length are not reusable; neighbours of one kind share a segment."""
    plan = analyze(source + "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert [s.reusable for s in plan.segments if isinstance(s, PlainSegment)] == reusable


def test_gemma3_alias_forms():
    plan = analyze(template_source("gemma3")[0])
    loop = next(s for s in plan.segments if isinstance(s, LoopSegment))
    assert loop.alias == "loop_messages"
    assert {(f.start, f.reverse) for f in loop.forms} == {(0, False), (1, False)}


@pytest.mark.parametrize("source, why", [
    ("{% for m in messages %}{{ m.content }}{% if loop.changed(m.role) %}!{% endif %}{% endfor %}", None),
    ("{% if x %}{% for m in messages %}{{ m.content }}{% endfor %}{% endif %}", "not at root"),
    ("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}", "break/continue"),
    ("{% for m in messages %}{{ strftime_now('%H:%M:%S') }}{{ m.content }}{% endfor %}", "strftime_now"),
    ("{% for m in messages if m.role != 'system' %}{{ m.content }}{% endfor %}", "else/if/recursive"),
    ("{% macro f(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ f(m) }}{% endfor %}", "Macro"),
    ("{% for m in messages %}{{ messages.index(m) }}{% endfor %}", "not modelled"),
    ("{{ messages|map(attribute='content')|join }}", "no root-level loop"),
    ("{% for m in messages %}{{ m.content }}{{ toktier_compare__ }}{% endfor %}", "comparison recorder"),
])
def test_templates_that_defeat_the_analysis(source, why):
    plan = analyze(source)
    if why is None:  # analysable; loop.changed is refused at render time instead (session tests)
        assert plan.reason is None
    else:
        assert plan.reason is not None and why in plan.reason


def test_message_order_observed():
    assert not analyze(template_source("qwen3")[0]).observes_message_order
    assert analyze("{% for m in messages %}{{ m|tojson }}{% endfor %}").observes_message_order
    assert analyze("{% for m in messages %}{% for k in m %}{{ k }}{% endfor %}{% endfor %}").observes_message_order
