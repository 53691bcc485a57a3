"""minijinja admission (toktier_backend/chat/fast.py) and the JSON helper (toktier_backend/jsonio.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.chat.conftest import hf_tokenizer
from tests.chat.corpus import TEMPLATES, template_source
from toktier_backend import jsonio
from toktier_backend.chat.fast import PROBES, MiniJinjaRenderer, admit
from toktier_backend.chat.template import ChatRenderer, special_tokens
from toktier_backend.errors import InvalidRequest


@pytest.mark.parametrize("name", TEMPLATES)
def test_admitted_and_equal_to_transformers(name, folder):
    """Each shared template is admitted, and the admitted renderer equals transformers on every probe."""
    src, cfg = template_source(name)
    adm = admit(src, special_tokens(cfg))
    assert adm.reason is None and adm.renderer is not None
    hf = hf_tokenizer(str(folder(name)))
    for messages, options in PROBES:
        if not messages:  # transformers refuses an empty conversation before the template runs
            continue
        try:
            want = hf.apply_chat_template(messages, tokenize=False, **options)
        except Exception:  # noqa: BLE001 - refused by the reference: must be refused here too
            with pytest.raises(InvalidRequest):
                adm.renderer.render(messages, **options)
            continue
        assert adm.renderer.render(messages, **options) == want



def _call(arguments):
    return [{"type": "function", "function": {"name": "f", "arguments": arguments}}]


# requests where minijinja alone would answer otherwise than the reference: a float the template reads
# reaches Python as an int when integral, 10**40 as a float, an undefined value as None (where jinja2's
# tojson raises); the same values inside a container minijinja passes back whole
_ODD_VALUES = [
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": _call(30.0)}], {}),
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": _call(10**40)}], {}),
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": _call({"t": 30.0})}],
     {}),
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": _call([1e16, -0.0])}],
     {"add_generation_prompt": False}),
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": _call({"n": 10**40})}],
     {}),
    ([{"role": "user", "content": "go"}], {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "minimum": 0.0, "maximum": 1e16}}}]}),
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": "ab"},
      {"role": "user", "content": "go"}], {}),  # tool_call.function is undefined for a char of a string
    ([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": _call(None)}], {}),
    # Python's strip removes U+001C-U+001F, minijinja's trim does not; a lone surrogate (U+FFFD in minijinja)
    ([{"role": "user", "content": "hi\x1f"}, {"role": "assistant", "content": " \x1cok\x1d "}], {}),
    ([{"role": "user", "content": "a\ud800b"}], {}),
    # a tuple stays a tuple (transformers 5's plain copy); minijinja prints it as a list
    ([{"role": "user", "content": ("a", 1)}], {}),
    # kwargs: a numpy scalar and a float subclass reach the template as floats; bytes and bytearray are
    # placeholders naming their types
    ([{"role": "user", "content": "go"}], {"bos_token": np.float64(1e16)}),
    ([{"role": "user", "content": "go"}], {"bos_token": bytearray(b"x")}),
]


def _like_transformers(name, folder, messages, **options):
    """Every renderer of template ``name`` (jinja2, the session, minijinja) gives transformers' text of
    ``apply_chat_template(messages, tokenize=False, **options)``, or refuses what transformers refuses."""
    from toktier_backend.chat.session import ChatSession
    from toktier_backend.chat.template import ChatRenderer

    src, cfg = template_source(name)
    sp = special_tokens(cfg)
    renderers = [ChatRenderer(src, sp), ChatSession(src, sp), admit(src, sp).renderer]
    hf = hf_tokenizer(str(folder(name)))
    try:
        want = hf.apply_chat_template(messages, tokenize=False, **options)
    except Exception:  # noqa: BLE001 - refused by the reference: must be refused here too
        for r in renderers:
            with pytest.raises(InvalidRequest):
                r.render(messages, **options)
        return
    for r in renderers:
        got = r.render(messages, **options)
        assert (got if isinstance(got, str) else got.text) == want, type(r).__name__


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("case", range(len(_ODD_VALUES)))
def test_odd_values_equal_to_transformers(name, case, folder):
    """Floats, big ints, undefined values inside ``tojson``, odd whitespace, lone surrogates, tuples, numpy
    and bytes kwargs (found by a differential fuzz and a review): every renderer gives transformers' text,
    or refuses what transformers refuses."""
    messages, options = _ODD_VALUES[case]
    _like_transformers(name, folder, messages, **{"add_generation_prompt": True, **options})

_FINALS = [
    [{"type": "text", "text": "Once upon"}],
    [{"type": "text", "text": "first"}, {"type": "image"}, {"type": "text", "text": "second"}, {"type": "image"}],
    [{"type": "image"}],  # no text block: refused
    ["plain string block", {"type": "text", "text": "x"}],
    [{"type": "text", "text": 5}],  # a text that is not a string: refused
    ["a block holding text"],  # "text" in a string block, which transformers then indexes: refused
    5,
    "",
]


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("case", range(len(_FINALS)))
def test_continue_final_message_like_transformers(name, case, folder):
    """continue_final_message on content blocks and other content (transformers 5 continues the last text
    block): each renderer gives transformers' text or refuses what it refuses."""
    messages = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": _FINALS[case]}]
    _like_transformers(name, folder, messages, continue_final_message=True)


_FIELD_CASES = [
    ({"reasoning_content": "Let me think"}, "reasoning_content"),
    ({"reasoning": "Let me think"}, "reasoning"),  # copied to reasoning_content and thinking, all tagged
    ({"reasoning": "Let me think"}, "reasoning_content"),
    ({"thinking": "Let me think", "reasoning_content": "other"}, "thinking"),  # only the equal names tagged
    ({"reasoning": [{"type": "text", "text": "Let me"}]}, "reasoning"),  # one list under three names
    ({"reasoning_content": 7}, "reasoning_content"),  # not text: refused
    ({}, "reasoning_content"),  # absent: refused
    ({"reasoning_content": "Let me think"}, "content"),
    ({"name": "bot"}, "name"),  # a field most templates never name: refused by them
    ({"reasoning_content": "Let me think"}, ""),  # false: no continue
]


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("case", range(len(_FIELD_CASES)))
def test_continue_final_message_field_like_transformers(name, case, folder):
    """continue_final_message naming a field (transformers 5): the reasoning names tagged together, other
    fields alone; each renderer gives transformers' text or refuses what it refuses."""
    extra, field = _FIELD_CASES[case]
    messages = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once upon", **extra}]
    _like_transformers(name, folder, messages, continue_final_message=field)


def test_continue_final_message_on_no_messages():
    """A clear refusal (not an IndexError) from every renderer."""
    from toktier_backend.chat.session import ChatSession
    from toktier_backend.chat.template import ChatRenderer

    src = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for r in (MiniJinjaRenderer(src), ChatRenderer(src), ChatSession(src)):
        with pytest.raises(InvalidRequest, match="continue_final_message"):
            r.render([], continue_final_message=True)


def test_refused_when_output_differs():
    """minijinja's own tojson is bypassed, but a template using a Python method minijinja lacks (or a tag
    it does not know) is refused, with the reason."""
    src = "{% for m in messages %}{{ m.content.zfill(8) }}{% endfor %}"
    assert admit(src).renderer is None
    tag = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    adm = admit(tag)
    assert adm.renderer is None and "compile" in adm.reason


@pytest.mark.parametrize("call", ["dict(_Context__self=0)", "dict(_SandboxedEnvironment__obj=1)",
                                  "namespace(_Context__obj=2)", "dict(**m)"])
def test_refused_for_keywords_jinja2_binds(call):
    """jinja2's own ``call`` signatures take these keywords (a ``TypeError``), minijinja passes them on: such
    templates are not admitted, and the reference raises for them."""
    src = "{% for m in messages %}{{ m.content }}{{ " + call + " }}{% endfor %}"
    adm = admit(src)
    assert adm.renderer is None and "line 1" in adm.reason
    if "**" not in call:
        with pytest.raises(InvalidRequest, match="TypeError"):
            ChatRenderer(src).render([{"role": "user", "content": "hi"}])


def test_tojson_not_html_escaped():
    r = MiniJinjaRenderer("{{ tools|tojson }}")
    assert r.render([], tools=[{"a": "<b>&'"}]) == json.dumps([{"a": "<b>&'"}], ensure_ascii=False)


def test_jsonio():
    body = json.dumps({"messages": [{"role": "user", "content": "hé 😀", "n": 1.5}]}).encode()
    assert jsonio.loads(body) == json.loads(body)
    with pytest.raises(InvalidRequest):
        jsonio.loads(b'{"a": NaN}')
    with pytest.raises(InvalidRequest):
        jsonio.loads(b'{"a": ')
