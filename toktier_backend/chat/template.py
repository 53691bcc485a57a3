"""Chat templates, rendered in a sandboxed jinja2 environment, for routes that receive ``messages``.

A chat template is untrusted code (it comes with the model), so it runs in jinja2's
``ImmutableSandboxedEnvironment``, set up as Hugging Face ``transformers`` does for
``apply_chat_template``: ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag, a ``tojson`` filter that does not HTML-escape, ``raise_exception``,
``strftime_now``, and ``namespace``/``dict`` that refuse underscore-prefixed names. Everything the template
sees is rebuilt from plain JSON types first. The variables are ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, …)
and any extra keyword (``enable_thinking``, …). Incremental rendering compiles a template's segments in a
twin of that environment (:func:`segment_environment`) whose attribute reads and calls return what the stock
sandbox returns, with its checks skipped only where they are proven to pass (:class:`SandboxPlain`, and the
``PlainFastSandbox`` class built by ``_plain_fast_sandbox_class``).

The rendered text is then tokenized with ``add_special_tokens=False`` (the template writes the special
tokens itself), as ``apply_chat_template(tokenize=True)`` does.

Where the template comes from (:func:`load_chat_template`): an explicit file, else beside the tokenizer:
``chat_template.jinja``, ``chat_template.json`` (``{"chat_template": ...}``), or ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of ``{"name", "template"}``: ``default`` is used).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as _np

from toktier_backend.config import special_tokens  # noqa: F401  (the template's variables; one copy, in config.py)
from toktier_backend.errors import InvalidRequest, UnsupportedTokenizer

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# ---------------------------------------------------------------- loading


def _folder_of(tokenizer_path: str | Path) -> Path:
    p = Path(tokenizer_path)
    return p if p.is_dir() else p.parent


def load_chat_template(tokenizer_path: str | Path | None, override: str | Path | None = None) -> str | None:
    """The chat template for a tokenizer, as jinja source; ``None`` if there is none.

    Args:
        tokenizer_path: the ``tokenizer.json`` (or its folder); its folder is searched.
        override: a template file (``.jinja``, or ``.json`` holding ``chat_template``), or the template
            itself when it contains ``{{`` or ``{%``.

    Raises:
        UnsupportedTokenizer: a template file exists but cannot be read or parsed (names the file).
    """
    if override is not None:
        text = str(override)
        if "{{" in text or "{%" in text:
            return text
        return _read_template_file(Path(text))
    if tokenizer_path is None:
        return None
    folder = _folder_of(tokenizer_path)
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).is_file():
            return _read_template_file(folder / name)
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        return _template_from_json(cfg, _read_json(cfg))
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnsupportedTokenizer(f"{path}: cannot read the chat template ({e})") from e
    if not isinstance(data, dict):
        raise UnsupportedTokenizer(f"{path}: expected a JSON object")
    return data


def _read_template_file(path: Path) -> str:
    if path.suffix == ".json":
        t = _template_from_json(path, _read_json(path))
        if t is None:  # named explicitly: a file without a template is a mistake, not "no template"
            raise UnsupportedTokenizer(f"{path}: no 'chat_template' in this file (give a .jinja file, or a .json "
                                       f"holding chat_template, such as a model's tokenizer_config.json)")
        return t
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise UnsupportedTokenizer(f"{path}: cannot read the chat template ({e})") from e


def _template_from_json(path: Path, data: dict) -> str | None:
    t = data.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise UnsupportedTokenizer(f"{path}: chat_template is a list without a 'default' entry ({sorted(map(str, named))})")
    raise UnsupportedTokenizer(f"{path}: chat_template must be a string or a list, got {type(t).__name__}")


# ---------------------------------------------------------------- the sandbox


@lru_cache(maxsize=1)
def sandbox_environment():
    """The jinja2 environment every chat template's full render runs in (see the module docstring): stock
    ``ImmutableSandboxedEnvironment``, the reference for every other path."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return _configured(ImmutableSandboxedEnvironment)


@lru_cache(maxsize=1)
def segment_environment():
    """The environment :mod:`.analysis` compiles a template's segments in (incremental rendering): the same
    configuration, filters, tests and globals (the same objects) as :func:`sandbox_environment`, as a
    ``PlainFastSandbox`` (``_plain_fast_sandbox_class``), whose ``getattr`` and ``call`` return what the stock
    sandbox's return. Its proofs read the code of jinja2 3.1.5 and 3.1.6 (the same ``sandbox.py`` and
    ``runtime.py``): under any other jinja2 version the segments use :func:`sandbox_environment` itself (before
    3.1.5 the stock sandbox caught ``str.format`` in ``call``, not in ``getattr``)."""
    import jinja2

    return plain_fast_sandbox() if fast_sandbox_proven(jinja2.__version__) else sandbox_environment()


def fast_sandbox_proven(version: str) -> bool:
    """Is ``version`` (``jinja2.__version__``) one whose sandbox code ``PlainFastSandbox``'s proofs read:
    3.1.5 or a later 3.1 release."""
    import re

    m = re.match(r"3\.1\.(\d+)", version)
    return m is not None and int(m.group(1)) >= 5


@lru_cache(maxsize=1)
def plain_fast_sandbox():
    """A ``PlainFastSandbox`` configured as :func:`sandbox_environment` (what :func:`segment_environment`
    returns under jinja2 3.1)."""
    return _configured(_plain_fast_sandbox_class())


class SandboxPlain:
    """Base class of objects whose public attributes the sandbox always allows (the session's recording
    ``loop`` and namespace). A subclass must hold: the class is no ``list``/``dict``/``set``/``deque`` (nor
    one of their ABCs), function, method, type, code, frame, traceback, generator, coroutine or async
    generator. Then, for a name without a leading ``_``, jinja2's ``SandboxedEnvironment.getattr`` returns
    ``wrap_str_format(value)`` if that is not ``None``, else ``value = getattr(obj, name)`` whenever that
    succeeds (``is_safe_attribute`` holds). An ``AttributeError`` sends the read to the stock path, which
    reads the attribute once more: reading twice must give what reading once gives."""

    __slots__ = ()


class SandboxCall:
    """Base class of callables the sandbox calls directly (the session's comparison recorder). A subclass
    must hold: neither the class nor its ``__call__`` has a ``jinja_pass_arg``, ``unsafe_callable`` or
    ``alters_data`` attribute. Then jinja2's ``SandboxedEnvironment.call`` finds the object safe
    (``is_safe_callable``) and ``Context.call`` passes it no context, environment or eval context
    (``_PassArg.from_obj`` of it and of its ``__call__`` is ``None``): it drops the ``_loop_vars`` and
    ``_block_vars`` keywords and calls the object, a ``StopIteration`` giving an undefined."""

    __slots__ = ()


#: Keyword names that jinja2 3.1's ``SandboxedEnvironment.call(__self, __context, __obj, ...)`` and
#: ``Context.call(__self, __obj, ...)`` bind to their own (name-mangled) parameters.
STOCK_CALL_PARAMETERS = frozenset({"_SandboxedEnvironment__self", "_SandboxedEnvironment__context",
                                   "_SandboxedEnvironment__obj", "_Context__self", "_Context__obj"})


# names ``getattr(d, name)`` finds on an exact ``dict`` instance: its type's MRO (a dict has no instance
# ``__dict__`` and its type no ``__getattr__``); for every other name it raises ``AttributeError``
DICT_ATTRIBUTES = frozenset(name for cls in dict.__mro__ for name in vars(cls))


@lru_cache(maxsize=1)
def _plain_fast_sandbox_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the globals every environment gets, by id, each with its object (an id is trusted only while it names
    # that object)
    direct = {id(o): o for o in _additions()[1].values()}

    class PlainFastSandbox(ImmutableSandboxedEnvironment):
        """``ImmutableSandboxedEnvironment`` whose ``getattr`` returns early, with the value the stock one
        returns, where jinja2 3.1's ``SandboxedEnvironment.getattr`` is known to take one path:

        - an exact ``dict`` and a ``str`` name not in :data:`DICT_ATTRIBUTES`: ``getattr`` raises
          ``AttributeError``, so the stock code returns ``obj[name]``, or ``undefined(obj=obj, name=name)`` if
          that raises ``TypeError`` or ``LookupError`` (as here);
        - an exact ``str`` and a name without a leading ``_``, other than ``format``/``format_map``: on
          success the stock code returns the value (``wrap_str_format`` matches only ``format`` and
          ``format_map``: a ``str`` method's ``__name__`` is its name, asserted in the tests;
          ``is_safe_attribute`` holds: a ``str`` is none of the internal or mutable types);
        - an object whose type is a :class:`SandboxPlain` subclass (``issubclass`` of its type: ``isinstance``
          would trust a ``__class__`` property) and a name without a leading ``_``: on success, the value
          through ``wrap_str_format`` as the stock code does, then by that class's contract.

        Anything else, and every ``AttributeError`` of the last two cases, takes the stock path.

        ``call`` of a ``str`` method other than ``format``/``format_map`` (a builtin method bound to an exact
        ``str``), of a global that :func:`_additions` made (``namespace``, ``raise_exception``,
        ``strftime_now``, ``dict``: those objects, by identity; a name a template binds to something else
        takes the stock path) or of a :class:`SandboxCall` calls it directly: the stock
        ``SandboxedEnvironment.call`` finds it safe (none of them has an ``unsafe_callable`` or
        ``alters_data`` attribute), then ``Context.call`` finds no ``jinja_pass_arg`` on it or its
        ``__call__``, drops the ``_loop_vars``/``_block_vars`` keywords and calls it, mapping a
        ``StopIteration`` (an argument's ``__iter__`` or ``__index__`` may raise one) to the same undefined as
        here (the globals' attributes are asserted in the tests). A keyword that the stock signatures take as
        one of their own parameters (:data:`STOCK_CALL_PARAMETERS`: the stock call raises ``TypeError``, two
        values for one argument) sends the call to the stock path.
        """

        def getattr(self, obj, attribute):
            t = type(obj)
            if type(attribute) is str:
                if t is dict:
                    if attribute not in DICT_ATTRIBUTES:
                        try:
                            return obj[attribute]
                        except (TypeError, LookupError):
                            return self.undefined(obj=obj, name=attribute)
                elif t is str and attribute[:1] != "_" and attribute != "format" and attribute != "format_map":
                    try:
                        return getattr(obj, attribute)
                    except AttributeError:
                        pass
                elif issubclass(t, SandboxPlain) and attribute[:1] != "_":
                    try:
                        value = getattr(obj, attribute)
                    except AttributeError:
                        pass
                    else:
                        fmt = self.wrap_str_format(value)
                        return value if fmt is None else fmt
            return super().getattr(obj, attribute)

        def call(self, context, obj, /, *args, **kwargs):  # positional-only: any keyword goes to obj
            t = type(obj)
            if (((t is _BUILTIN_METHOD and type(obj.__self__) is str and obj.__name__ != "format"
                    and obj.__name__ != "format_map") or direct.get(id(obj)) is obj or issubclass(t, SandboxCall))
                    and (not kwargs or STOCK_CALL_PARAMETERS.isdisjoint(kwargs))):
                kwargs.pop("_loop_vars", None)
                kwargs.pop("_block_vars", None)
                try:
                    return obj(*args, **kwargs)
                except StopIteration:
                    return context.environment.undefined(
                        "value was undefined because a callable raised a StopIteration exception")
            return super().call(context, obj, *args, **kwargs)

    return PlainFastSandbox


_BUILTIN_METHOD = type("".strip)


def _configured(cls):
    """An instance of ``cls`` (an ``ImmutableSandboxedEnvironment``) set up as transformers does."""
    import jinja2

    env = cls(trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    filters, globals_ = _additions()
    env.filters.update(filters)
    env.globals.update(globals_)
    return env


@lru_cache(maxsize=1)
def _generation_tag():
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}…{% endgeneration %}`` renders its body (assistant-mask tracking is not needed)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


@lru_cache(maxsize=1)
def _additions() -> tuple[dict, dict]:
    """(filters, globals) added to jinja2's defaults: one set of objects for every environment."""
    import jinja2.exceptions
    import jinja2.utils

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed names ({name!r})")

    class SafeNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 - same trick as jinja2.utils.Namespace
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class SafeDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    return ({"tojson": tojson},
            {"raise_exception": raise_exception, "strftime_now": strftime_now, "dict": SafeDict(),
             "namespace": SafeNamespace})


@lru_cache(maxsize=16)
def _compile(source: str):
    return sandbox_environment().from_string(source)


def plain(value: Any) -> Any:
    """Rebuild ``value`` from JSON types (and tuples) only, as transformers 5 ``_plain_template_data`` does
    (the template never sees other objects): exact scalars as they are; ``str``/``int``/``float``
    subclasses as their base type; mappings as dicts, lists as lists, tuples as tuples; a numpy scalar as
    its ``item()``; a dataclass instance as a dict of its fields; an object with ``model_dump`` (pydantic)
    as its dump; anything else as ``"<TypeName>"``."""
    t = type(value)
    if value is None or t is str or t is int or t is float or t is bool:
        return value
    if t is dict:  # exact types first (an exact str is its own copy): isinstance against Mapping is slow
        return {k if type(k) is str else plain(k): v if type(v) is str else plain(v) for k, v in value.items()}
    if t is list:
        return [v if type(v) is str else plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, _np.generic):
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


class ChatRenderer:
    """A compiled chat template plus the tokenizer's special tokens.

    Args:
        template: jinja source (see :func:`load_chat_template`).
        special_tokens: ``{"bos_token": ..., "eos_token": ...}`` exposed to the template.

    Raises:
        UnsupportedTokenizer: the template does not compile (jinja's message).
    """

    def __init__(self, template: str, special_tokens: Mapping[str, str] | None = None):
        import jinja2

        try:
            self._template = _compile(template)
        except jinja2.TemplateError as e:
            raise UnsupportedTokenizer(f"chat template does not compile: {e}") from e
        self.source = template
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: list[Mapping[str, Any]],
        *,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``messages``.

        Args:
            messages: OpenAI-style ``{"role", "content", ...}`` dicts (keys holding ``None`` are dropped,
                reasoning is copied to ``reasoning_content`` and ``thinking``, as transformers does).
            tools, documents: passed to the template as is (plain JSON).
            add_generation_prompt: open an assistant turn at the end.
            continue_final_message: end the text inside the last message's ``content`` (a string, or the last
                text block), or inside the field a string names, so the model continues it
                (:func:`continue_message`).
            **kwargs: more template variables (override the special tokens).

        Raises:
            InvalidRequest: malformed messages, or the template raised (``raise_exception``) or failed.
        """
        import jinja2

        check_request(messages, add_generation_prompt, continue_final_message)
        chat = [prepare_message(m) for m in messages]
        final = None
        if continue_final_message:
            final, chat[-1] = continue_message(chat, self.source, continue_final_message)
        variables = {**self.special_tokens, **plain(kwargs)}
        try:
            text = self._template.render(messages=chat, tools=plain(tools), documents=plain(documents),
                                         add_generation_prompt=bool(add_generation_prompt), **variables)
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the chat template refused the request: {e}") from e
        except Exception as e:
            raise InvalidRequest(f"the chat template failed on the request: {type(e).__name__}: {e}") from e
        return finish_continue(text, final)


def check_request(messages: Any, add_generation_prompt: bool, continue_final_message: Any) -> None:
    """Raise :class:`InvalidRequest` for a malformed ``messages`` list or contradictory flags."""
    if not isinstance(messages, list) or not all(map(_mapping_type, set(map(type, messages)))):
        raise InvalidRequest("messages must be a list of objects with 'role' and 'content'")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be set")


def prepare_message(message: Mapping[str, Any]) -> dict:
    """The dict the template sees for one message: plain JSON types, ``None`` values dropped, reasoning
    copied to ``reasoning_content`` and ``thinking`` (as transformers does). A new dict every call."""
    return prepare_plain(plain(message))


def prepare_plain(message: dict) -> dict:
    """:func:`prepare_message` of a message already rebuilt by :func:`plain` (not changed; a new dict)."""
    # (``None in values()``: identity first, and the plain types' ``==`` with ``None`` is False)
    if None in message.values():
        return _alias_reasoning({k: v for k, v in message.items() if v is not None})
    return _alias_reasoning(dict(message))


def continue_message(chat: list, source: str, flag: Any = True) -> tuple[str, dict]:
    """(the text to continue, a copy of the last message of ``chat`` with the continue tag appended to it),
    for ``continue_final_message=flag``, as transformers 5 ``render_jinja_template`` does it. ``flag`` a
    string names the field continued (e.g. ``"reasoning_content"``), any other true value is
    ``"content"``. A reasoning field (``reasoning_content``, ``thinking``, ``reasoning``) tags every one of
    them that equals it, and the template must name one of those; another field must be named itself. A
    string value is continued; of a list (or tuple) of content blocks, the last block with a ``"text"``
    key (a copy of the list, that block copied with the tag, under every key of the message that holds
    that same list: :func:`prepare_plain` shares the reasoning value among its names, and transformers
    tags the block in place).

    Raises:
        InvalidRequest: where transformers raises: no messages, the field absent or ``None``, a template
        ``source`` that names none of the fields tagged, a list with no text block (or a block ``"text" in
        block`` cannot test, or a string block holding ``"text"``: transformers then indexes a string), a
        value of another type, or a text that is not a string.
    """
    if not chat:
        raise InvalidRequest("continue_final_message needs a final message to continue; the conversation is empty")
    field = flag if isinstance(flag, str) else "content"
    message = chat[-1]
    value = message.get(field)
    if value is None:
        raise InvalidRequest(f"continue_final_message needs a final message with {field!r} to continue")
    fields = [f for f in _REASONING_FIELDS if message.get(f) == value] if field in _REASONING_FIELDS else [field]
    if not any(f in source for f in fields):
        raise InvalidRequest(f"continue_final_message: the chat template reads no {' or '.join(map(repr, fields))}")
    if type(value) is list or type(value) is tuple:  # (plain keeps a tuple a tuple, as transformers)
        for i in range(len(value) - 1, -1, -1):
            block = value[i]
            if type(block) is dict:
                if "text" not in block:
                    continue
                text = block["text"]
                if type(text) is not str:
                    break
                tagged = type(value)([*value[:i], {**block, "text": text + _CONTINUE_TAG}, *value[i + 1:]])
                return text, {k: tagged if v is value else v for k, v in message.items()}
            if type(block) in (str, list, tuple) and "text" not in block:
                continue
            break  # a block "text" in cannot test, or one that holds "text" but is not a dict
        raise InvalidRequest(f"continue_final_message needs a text block in the final message's {field!r}")
    if type(value) is not str:
        raise InvalidRequest(f"continue_final_message needs a string or text blocks in the final message's {field!r}")
    return value, {**message, **{f: value + _CONTINUE_TAG for f in fields}}


def finish_continue(text: str, final: str | None) -> str:
    """Cut ``text`` at the continue tag (``final`` is the final message's content; ``None``: no-op)."""
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise InvalidRequest("continue_final_message: the template dropped part of the final message")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _mapping_type(t: type) -> bool:
    return t is dict or issubclass(t, Mapping)


def _alias_reasoning(message: dict) -> dict:
    for k in _REASONING_FIELDS:
        reasoning = message.get(k)
        if reasoning is not None:
            break
    else:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}
