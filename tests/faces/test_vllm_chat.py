"""vLLM's ``apply_chat_template(tokenize=True)`` through the core's chat step (``ServingCore.chat``), on a
real SWE-agent trajectory with Qwen3's and Llama 3.1's real templates. Every result is compared with
transformers' own ``apply_chat_template(tokenize=True, return_dict=False)`` on the same folder."""

from __future__ import annotations

import copy

import pytest
from prometheus_client import CollectorRegistry

import toktier_backend as tt
from tests.chat.corpus import TOOL_TEMPLATES, conversation, trajectories
from toktier_backend.serving.core import CoreConfig, ServingCore
from toktier_backend.serving.metrics import Metrics

from .conftest import auto_tokenizer

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]


def _pair(folder):
    """(ours, transformers, metric reader): ours built on a core with metrics on a private registry."""
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer, _backend_file

    hf = auto_tokenizer(str(folder))
    reg = CollectorRegistry()
    ours_hf = copy.deepcopy(hf)  # the face may set attributes on its HF tokenizer
    tok = tt.load_tokenizer(_backend_file(ours_hf, str(folder), None, None))
    core = ServingCore.from_config(CoreConfig(tokenizer=str(tok.path), verifier_rate=0, verifier_first_n=0),
                                   tokenizer=tok, metrics=Metrics(reg), sweeper=False)
    ours = TokTierTokenizer(ours_hf, core)

    def value(name, **labels):
        want = set(labels.items())
        return sum(s.value for fam in reg.collect() for s in fam.samples
                   if s.name == name and want <= set(s.labels.items()))

    return ours, hf, value


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
def test_apply_chat_template_turn_by_turn(chat_folder, name):
    ours, hf, value = _pair(chat_folder(name))
    path = next(f for f in trajectories() if "function_calling" in f.name)
    conv = conversation(name, path)[:14]
    kw = {"tools": TOOLS} if name in TOOL_TEMPLATES else {}
    n = 0
    for i in range(2, len(conv) + 1):
        agp = conv[i - 1]["role"] != "assistant"
        got = ours.apply_chat_template(conversation=conv[:i], add_generation_prompt=agp, tokenize=True,
                                       return_dict=False, **kw)
        assert got == hf.apply_chat_template(conv[:i], add_generation_prompt=agp, tokenize=True,
                                             return_dict=False, **kw), (name, i)
        n += 1
    # transformers 5's default return_dict=True: a BatchEncoding with the same ids
    enc = ours.apply_chat_template(conv, add_generation_prompt=False, **kw)
    assert enc["input_ids"] == hf.apply_chat_template(conv, tokenize=True, return_dict=False, **kw)
    counted = value("toktier_chat_renders_total", face="vllm", model="tokenizer")
    assert counted == n + 1
    assert value("toktier_chat_renders_total", face="vllm", model="tokenizer", route="incremental") >= n - 2
    assert value("toktier_requests_total", face="vllm", model="tokenizer", mode="chat") == n + 1


def test_keywords_we_do_not_render_go_to_transformers(chat_folder):
    """Another template, ``sanitize_control_tokens``, callables as tools: transformers renders (our encode
    still); template variables (``enable_thinking``) are ours. Every result equals transformers'."""
    ours, hf, value = _pair(chat_folder("qwen3"))
    msgs = [{"role": "user", "content": "hi <think>"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"}]
    other = "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
    cases = [
        ({"chat_template": other}, False),
        ({"add_generation_prompt": True, "enable_thinking": False}, True),
        ({"add_generation_prompt": True, "sanitize_control_tokens": True}, False),
    ]
    for kw, via_core in cases:
        before = value("toktier_chat_renders_total", face="vllm")
        got = ours.apply_chat_template(msgs, tokenize=True, return_dict=False, **kw)
        assert got == hf.apply_chat_template(msgs, tokenize=True, return_dict=False, **kw), kw
        assert (value("toktier_chat_renders_total", face="vllm") > before) == via_core, kw


def test_continue_final_message_naming_a_field(chat_folder):
    """transformers 5 takes ``continue_final_message="reasoning_content"``: rendered by the core, equal to
    transformers, as the ``True`` form is."""
    ours, hf, value = _pair(chat_folder("qwen3"))
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "reasoning_content": "Let me see"}]
    for cont in ("reasoning_content", True):
        before = value("toktier_chat_renders_total", face="vllm")
        got = ours.apply_chat_template(msgs, tokenize=True, return_dict=False, continue_final_message=cont)
        assert got == hf.apply_chat_template(msgs, tokenize=True, return_dict=False, continue_final_message=cont)
        assert value("toktier_chat_renders_total", face="vllm") == before + 1, cont
