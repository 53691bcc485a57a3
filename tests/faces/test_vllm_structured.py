"""``TokTierTokenizer`` as vLLM's structured-output backends and renderer handle it (no vLLM needed):
isinstance checks the backends make, copies and unpickling without a second load, and the Qwen file kept
as the file to encode with when transformers only flips offset keys (its shipped guard tables then apply)."""

from __future__ import annotations

import copy
import json
import pickle

from .conftest import hf_ids, require, tokenizer_file


def _tok(hf_folder, name):
    require("transformers")
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer

    return TokTierTokenizer.from_pretrained(str(hf_folder(name)))


def test_backends_see_a_fast_hf_tokenizer(hf_folder):
    """xgrammar's from_huggingface and llguidance's from_tokenizer check isinstance(PreTrainedTokenizerFast);
    vLLM's guidance check asks for TokenizersBackend. The class stays ours and so do the ids."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer

    tok = _tok(hf_folder, "qwen3")
    assert isinstance(tok, PreTrainedTokenizerFast) and type(tok) is TokTierTokenizer
    backend = getattr(transformers, "TokenizersBackend", PreTrainedTokenizerFast)
    assert isinstance(tok, backend)
    assert tok.encode("hello world") == hf_ids("qwen3", "hello world")
    assert tok.backend_tokenizer.to_str() == tok.hf.backend_tokenizer.to_str()  # what the backends read
    tok.__class__ = type("Pool", (type(tok.hf),), {})  # vLLM's maybe_make_thread_pool: ignored
    assert type(tok) is TokTierTokenizer and type(tok.hf).__name__ != "Pool"


def test_copies_and_pickles_share_one_load(hf_folder, monkeypatch):
    """copy, deepcopy and unpickling reuse the loaded state (no AutoTokenizer call, same core tokenizer)."""
    import transformers

    tok = _tok(hf_folder, "gpt2")
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: calls.append(a) or real(*a, **k)))
    for other in (copy.copy(tok), copy.deepcopy(tok), pickle.loads(pickle.dumps(tok))):
        assert other.core is tok.core and other.hf is tok.hf
        assert other.encode("hello world") == [31373, 995] == hf_ids("gpt2", "hello world")
    assert calls == []


def test_offset_only_rebuild_keeps_the_model_file(tmp_path):
    """transformers 5 rebuilds Qwen's pipeline (``tokenizer_class: Qwen2Tokenizer``) with trim_offsets flipped
    (pre-tokenizer and decoder): the ids are the same, so the model's own tokenizer.json is encoded (its
    sha256 keys the shipped guard tables)."""
    require("transformers")
    from toktier_backend.faces.hf_compat import id_pipeline
    from toktier_backend.faces.vllm_tokenizer import TokTierTokenizer, _backend_file

    folder = tmp_path / "qwen3"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(tokenizer_file("qwen3"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    tok = TokTierTokenizer.from_pretrained(str(folder))
    serialized = tok.hf.backend_tokenizer.to_str()
    on_disk = tokenizer_file("qwen3").read_text()
    assert id_pipeline(serialized) == id_pipeline(on_disk)
    assert _backend_file(tok.hf, folder, None, None) == folder / "tokenizer.json"
    import tokenizers

    assert serialized != tokenizers.Tokenizer.from_file(str(tokenizer_file("qwen3"))).to_str()  # rebuilt: differs
    assert tok.core.tokenizer.path == folder / "tokenizer.json" and tok.encode("hello world") == hf_ids("qwen3", "hello world")


def test_id_pipeline_keeps_what_decides_ids():
    from toktier_backend.faces.hf_compat import id_pipeline

    base = json.loads(tokenizer_file("qwen3").read_text())
    changed = json.loads(json.dumps(base))
    changed["post_processor"] = {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}}
    assert id_pipeline(json.dumps(changed)) != id_pipeline(json.dumps(base))
