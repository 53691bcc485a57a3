"""Chat templates in the sandbox: the text equals ``transformers``' ``apply_chat_template(tokenize=False)``
for the same template, and the sandbox holds."""

from __future__ import annotations

import json

import pytest

from toktier_backend.errors import InvalidRequest, UnsupportedTokenizer
from toktier_backend.chat.template import ChatRenderer, load_chat_template, special_tokens

from .conftest import CHATML_TEMPLATE, CONFIGS, LLAMA3_TEMPLATE, auto_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "naïve question: what's <b>1 & 2</b>?"},
    {"role": "assistant", "content": "3", "reasoning_content": "1+2", "tool_calls": None},
    {"role": "user", "content": "  and the next one?  "},
]
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "list <files>",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
@pytest.mark.parametrize("kw", [
    {"add_generation_prompt": True},
    {"add_generation_prompt": False},
    {"add_generation_prompt": True, "tools": TOOLS},
    {"add_generation_prompt": True, "enable_thinking": False},
])
def test_render_equals_transformers(hf_folder, name, kw):
    folder = hf_folder(name)
    hf = auto_tokenizer(str(folder))
    renderer = ChatRenderer(load_chat_template(folder / "tokenizer.json"), special_tokens(folder / "tokenizer.json"))
    assert renderer.render(MESSAGES, **kw) == hf.apply_chat_template(MESSAGES, tokenize=False, **kw)


def test_continue_final_message_equals_transformers(hf_folder):
    folder = hf_folder("qwen3")
    hf = auto_tokenizer(str(folder))
    msgs = MESSAGES[:2] + [{"role": "assistant", "content": "The answer is"}]
    renderer = ChatRenderer(CHATML_TEMPLATE)
    assert renderer.render(msgs, continue_final_message=True) == hf.apply_chat_template(
        msgs, tokenize=False, continue_final_message=True)


def test_load_chat_template_sources(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load_chat_template(tmp_path / "tokenizer.json") is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
         "eos_token": {"content": "</s>"}, "bos_token": "<s>"}))
    assert load_chat_template(tmp_path) == "D"
    assert special_tokens(tmp_path / "tokenizer.json") == {"eos_token": "</s>", "bos_token": "<s>"}
    (tmp_path / "chat_template.jinja").write_text("J{{ 1 }}")
    assert load_chat_template(tmp_path / "tokenizer.json") == "J{{ 1 }}"  # the .jinja file wins
    assert load_chat_template(tmp_path, "{{ x }}") == "{{ x }}"
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": "F"}))
    assert load_chat_template(None, tmp_path / "t.json") == "F"
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(UnsupportedTokenizer, match="tokenizer_config.json"):
        load_chat_template(tmp_path)


def test_sandbox_and_errors():
    with pytest.raises(InvalidRequest, match="unsafe"):  # no way out through dunder attributes
        ChatRenderer("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    assert ChatRenderer("{% generation %}G{% endgeneration %}").render([]) == "G"
    with pytest.raises(InvalidRequest, match="refused"):  # immutable: no list mutation
        ChatRenderer("{% set _ = messages.append(1) %}").render([])
    with pytest.raises(InvalidRequest, match="refused"):
        ChatRenderer("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(InvalidRequest, match="no system role"):
        ChatRenderer("{{ raise_exception('no system role') }}").render([])
    with pytest.raises(InvalidRequest, match="list of objects"):
        ChatRenderer("x").render("not a list")
    with pytest.raises(UnsupportedTokenizer, match="does not compile"):
        ChatRenderer("{% for %}")
    assert ChatRenderer("{{ x | tojson }}").render([], x={"a": "<é>"}) == '{"a": "<é>"}'  # no HTML escaping
    assert ChatRenderer(LLAMA3_TEMPLATE, {"bos_token": "<B>"}).render([]) == "<B>"
    assert CONFIGS  # the fixtures' templates are the ones rendered above
