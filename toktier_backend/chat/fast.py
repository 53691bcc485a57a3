"""A faster full render: minijinja, admitted per template by a load-time canary against the jinja2 reference.

The reference is :class:`.template.ChatRenderer` (jinja2 sandbox, transformers-compatible). minijinja (a
Rust implementation of jinja) renders the same templates several times faster, but it is a different
implementation: its ``tojson`` escapes HTML characters, its Python-method compatibility is partial, it has
no ``{% generation %}`` tag. So, as for tokenizer engines (:mod:`toktier_backend.engines.admission`), a
template is rendered by minijinja only if, at load, every probe conversation of :data:`PROBES` (system or
not, tools, tool calls and results, reasoning, unicode and special-token text, add_generation_prompt on and
off, continue_final_message of the content, of a named field and of content blocks, a request the template
refuses with ``raise_exception``) gives text identical to the reference, or both refuse it, and no call in
it passes keywords jinja2 treats otherwise (:func:`_odd_calls`). Otherwise (or when minijinja is not
installed) :func:`admit` returns no renderer and the reason.

The canary admits a template, not every value: per request, values that minijinja does not carry through
unchanged (floats, ints past 64 bits, tuples, U+001C-U+001F, lone surrogates, an undefined value reaching
``tojson``) send that request to the jinja2 reference (:class:`MiniJinjaRenderer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

from toktier_backend.chat import template as _t
from toktier_backend.errors import InvalidRequest

_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run <cmd> & report 'ok'",
                                            "parameters": {"type": "object", "properties": {
                                                "cmd": {"type": "string"}}, "required": ["cmd"]}}}]
_CALL = [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls -la"}'}}]

# (messages, options) pairs; each is rendered by both implementations.
PROBES: list[tuple[list[dict], dict]] = [
    ([{"role": "user", "content": "Hello"}], {"add_generation_prompt": True}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  2+2?  "}],
     {"add_generation_prompt": False}),
    ([{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Fix it"},
      {"role": "assistant", "content": None, "tool_calls": _CALL},
      {"role": "tool", "content": "a.py\nb.py", "tool_call_id": "call_1"},
      {"role": "tool", "content": "<tool_response>x</tool_response>", "tool_call_id": "call_1"},
      {"role": "assistant", "content": "Done."}], {"tools": _TOOLS, "add_generation_prompt": True}),
    ([{"role": "user", "content": "Think"},
      {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nYes", "reasoning_content": "hmm"},
      {"role": "user", "content": "Again"}, {"role": "assistant", "content": "<think>a</think>b"}],
     {"add_generation_prompt": False, "enable_thinking": False}),
    ([{"role": "user", "content": "Ünïcødé 😀 <|im_end|> <|eot_id|> <｜User｜> {{ x }} {% raw %}"},
      {"role": "assistant", "content": "日本語\t\r\n ok"}], {"add_generation_prompt": True, "enable_thinking": False}),
    ([{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once upon"}],
     {"continue_final_message": True}),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "reasoning_content": "Let me"}],
     {"continue_final_message": "reasoning_content"}),
    ([{"role": "user", "content": "Write"}, {"role": "assistant", "content": [{"type": "text", "text": "Once"}]}],
     {"continue_final_message": True}),
    ([{"role": "assistant", "content": "first"}, {"role": "assistant", "content": "second"}],
     {"add_generation_prompt": True}),
    ([], {"add_generation_prompt": True}),
]


class _Unproven(Exception):
    """minijinja gave ``tojson`` a ``None``, which may stand for an undefined value (below)."""


_I64 = 1 << 63
# Python's str.strip/split/trim whitespace that minijinja's (Unicode White_Space) is not
_ODD_SPACES = ("\x1c", "\x1d", "\x1e", "\x1f")
_STR = frozenset({str})


def _odd_text(text: str) -> bool:
    """Does ``text`` hold U+001C-U+001F or a lone surrogate (which minijinja writes as U+FFFD)? Substring
    searches and one UTF-8 encode, in C."""
    if any(c in text for c in _ODD_SPACES):
        return True
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _holds(values: list, want_none: bool, strs: list | None = None) -> bool:
    """Does any of ``values`` (plain copies: exact JSON types and tuples) hold, anywhere, dict keys included,
    a value minijinja does not carry through unchanged (:class:`MiniJinjaRenderer`): a float, an int outside
    the signed 64-bit range, a tuple (minijinja prints a list), a string :func:`_odd_text` flags, or
    (``want_none``) ``None``? A walk with an explicit stack (no recursion limit); the strings are gathered
    (a dict's keys or values at once when all are strings; ``strs``: strings gathered already) and searched
    joined, in one pass."""
    stack = list(values)
    strs = [] if strs is None else strs
    pop, push, gather = stack.pop, stack.extend, strs.extend
    while stack:
        x = pop()
        t = type(x)
        if t is str:
            strs.append(x)
        elif t is dict:
            (gather if _STR.issuperset(map(type, x)) else push)(x)
            vals = x.values()
            (gather if _STR.issuperset(map(type, vals)) else push)(vals)
        elif t is list:
            push(x)
        elif t is int:
            if not -_I64 <= x < _I64:
                return True
        elif t is not bool and (x is not None or want_none):
            return True  # a float, a tuple, None where asked, or another type (none after plain)
    return _odd_text("".join(strs))


def _unproven_request(chat: list, *values: Any) -> bool:
    """:func:`_holds` of prepared messages and other plain values: the messages' string keys and values are
    gathered by comprehensions over the list, the rest walked (cost: ``docs/design/chat.md``)."""
    strs = [x for m in chat for x in m.values() if type(x) is str]
    strs += [k for m in chat for k in m if type(k) is str]
    rest = [x for m in chat for x in m.values() if type(x) is not str]
    rest += [k for m in chat for k in m if type(k) is not str]
    return _holds(rest + list(values), False, strs)


class MiniJinjaRenderer:
    """Full renders with minijinja, same arguments and preprocessing as :class:`.template.ChatRenderer`.

    Requests the canary cannot vouch for are rendered by the jinja2 reference instead (rare in chat
    traffic; each found by a differential fuzz against transformers or a review):

    - a float, an int outside the signed 64-bit range, a tuple, or a string holding U+001C-U+001F or a lone
      surrogate, anywhere in the messages, tools, documents, kwargs or special tokens (their plain copies):
      minijinja passes an integral float to Python as an ``int`` (``30.0`` reaches ``tojson`` as ``30``),
      prints floats its own way, holds ``10**40`` as a float, prints a tuple as a list, does not strip
      U+001C-U+001F (Python's ``str.strip`` does) and writes a lone surrogate as U+FFFD;
    - a ``tojson`` argument that holds ``None``: minijinja passes an undefined value to a Python filter as
      ``None``, and where jinja2's ``tojson`` raises on an undefined value (``TypeError``: not JSON
      serializable) ``json.dumps(None)`` writes ``null``. The other callbacks (``raise_exception``,
      ``strftime_now``) refuse the request either way.

    Raises:
        InvalidRequest: as ``ChatRenderer.render``.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        import minijinja

        def raise_exception(message):
            raise ValueError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            if _holds([x], True):
                raise _Unproven
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        self._env = minijinja.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                                          filters={"tojson": tojson},
                                          globals={"raise_exception": raise_exception, "strftime_now": strftime_now})
        self._env.add_template("chat", source)
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._reference: _t.ChatRenderer | None = None  # built on the first unproven request

    def render(self, messages, *, tools=None, documents=None, add_generation_prompt=False,
               continue_final_message=False, **kwargs: Any) -> str:
        _t.check_request(messages, add_generation_prompt, continue_final_message)
        chat = [_t.prepare_message(m) for m in messages]
        final = None
        if continue_final_message:
            final, chat[-1] = _t.continue_message(chat, self.source, continue_final_message)
        tools, documents, extra = _t.plain(tools), _t.plain(documents), _t.plain(kwargs)
        if _unproven_request(chat, tools, documents, extra, self.special_tokens):
            return self._reference_render(messages, tools, documents, add_generation_prompt,
                                          continue_final_message, kwargs)
        variables = {**self.special_tokens, **extra}
        try:
            text = self._env.render_template("chat", messages=chat, tools=tools, documents=documents,
                                             add_generation_prompt=bool(add_generation_prompt), **variables)
        except _Unproven:
            return self._reference_render(messages, tools, documents, add_generation_prompt,
                                          continue_final_message, kwargs)
        except Exception as e:  # minijinja.TemplateError and errors raised from our callbacks
            raise InvalidRequest(f"the chat template refused the request: {e}") from e
        return _t.finish_continue(text, final)

    def _reference_render(self, messages, tools, documents, add_generation_prompt, continue_final_message,
                          kwargs) -> str:
        if self._reference is None:
            self._reference = _t.ChatRenderer(self.source, self.special_tokens)
        return self._reference.render(messages, tools=tools, documents=documents,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, **kwargs)


@dataclass
class Admission:
    """Result of :func:`admit`: ``renderer`` (``None`` if refused) and ``reason`` (``None`` if admitted)."""

    renderer: MiniJinjaRenderer | None
    reason: str | None


def admit(source: str, special_tokens: Mapping[str, str] | None = None) -> Admission:
    """Admit minijinja for ``source`` if every probe renders identically to the jinja2 reference (or both
    refuse it)."""
    try:
        fast = MiniJinjaRenderer(source, special_tokens)
    except ImportError as e:
        return Admission(None, f"minijinja not installed ({e})")
    except Exception as e:  # noqa: BLE001 - a template minijinja cannot compile is simply not admitted
        return Admission(None, f"minijinja does not compile the template: {type(e).__name__}: {e}")
    odd = _odd_calls(source)
    if odd:
        return Admission(None, odd)
    ref = _t.ChatRenderer(source, special_tokens)
    for i, (messages, options) in enumerate(PROBES):
        want = _outcome(ref, messages, options)
        got = _outcome(fast, messages, options)
        if want != got:
            return Admission(None, f"probe {i}: minijinja gives {got[1][:80]!r}, jinja2 {want[1][:80]!r}")
    return Admission(fast, None)


def _odd_calls(source: str) -> str | None:
    """Why minijinja may not render ``source`` though every probe agrees, else ``None``: a call that passes
    keywords from a mapping (``f(**x)``) or names a keyword that jinja2's own ``call`` signatures bind
    (:data:`.template.STOCK_CALL_PARAMETERS`: jinja2 raises ``TypeError``, minijinja passes it on)."""
    from jinja2 import nodes

    for call in _t.sandbox_environment().parse(source).find_all(nodes.Call):
        if call.dyn_kwargs is not None:
            return f"line {call.lineno}: a call with **keywords (jinja2 refuses some names minijinja passes)"
        for kw in call.kwargs:
            if kw.key in _t.STOCK_CALL_PARAMETERS:
                return f"line {call.lineno}: keyword {kw.key!r} (jinja2 refuses it, minijinja passes it)"
    return None


def _outcome(renderer, messages, options) -> tuple[bool, str]:
    try:
        return True, renderer.render(messages, **options)
    except InvalidRequest as e:
        return False, f"refused: {type(e).__name__}"
