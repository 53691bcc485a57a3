"""The ``tokenizer.json`` a given transformers version actually encodes with, derived from the files.

TensorRT-LLM's ``preprocessing`` loads ``AutoTokenizer.from_pretrained(tokenizer_dir)``, and TensorRT-LLM pins
transformers 4.57.x. There, ``LlamaTokenizerFast.__init__`` (``tokenization_llama_fast.py``) does two things
that ``tokenizer.json`` does not say:

1. it rebuilds the post-processor from ``tokenizer_config.json``'s ``add_bos_token`` (default true) and
   ``add_eos_token`` (default false): a bare ``TemplateProcessing`` with single ``[bos:0] $A:0 [eos:0]`` and
   pair ``[bos:0] $A:0 [eos:0] [bos:1] $B:1 [eos:1]`` (each part only when its flag is set), whatever the
   file's own post-processor was;
2. it adds every special token it names that the vocabulary lacks (``unk_token`` defaults to ``<unk>``) as a
   special added token (``normalized=False``), at the next free ids, in the order bos, eos, unk, sep, pad,
   cls, mask.

transformers 5.x keeps ``tokenizer.json`` as written (ids equal ``Tokenizer.from_file`` on it). So with a
config whose flags disagree with the file, 4.57.1 gives ``[15339, 1917, 128009]`` (llama3_1 "hello world",
``add_bos_token: false, add_eos_token: true``) where the file gives ``[128000, 15339, 1917]``: the reference
for a drop-in is what the pinned version returns. :func:`derived_file` writes the file 4.57 encodes with;
ids are then exact against HF ``tokenizers`` on that file. The rules above were read from transformers
4.57.1 and are checked against ids it computed (``tests/faces/data/hf_compat_4_57.json``).

Versions (the model parameter ``hf_compat``): ``"4.57"`` (rules above; other tokenizer classes are kept as
written), ``"5"`` or ``"none"`` (the file as written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from toktier_backend.config import cache_dir
from toktier_backend.errors import UnsupportedTokenizer

VERSIONS = ("4.57", "5", "none")
LLAMA_CLASSES = ("LlamaTokenizerFast", "LlamaTokenizer")
"""``tokenizer_class`` values whose 4.57 fast tokenizer rebuilds the post-processor (AutoTokenizer maps the slow
name to the fast class)."""
_LLAMA_DEFAULTS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
_SPECIAL_ORDER = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def derive_4_57(tokenizer_json: str, config: dict[str, Any]) -> str | None:
    """The serialized pipeline transformers 4.57 builds from ``tokenizer_json`` and ``config``
    (``tokenizer_config.json``), or ``None`` when it equals the file's (not a Llama fast tokenizer class).

    Raises:
        UnsupportedTokenizer: ``add_bos_token`` / ``add_eos_token`` is set but the token is not named
            (transformers raises the same at load).
    """
    if config.get("tokenizer_class") not in LLAMA_CLASSES:
        return None
    import tokenizers
    from tokenizers import AddedToken, processors

    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    names = {k: _content(config.get(k, _LLAMA_DEFAULTS.get(k))) for k in _SPECIAL_ORDER}
    missing = [names[k] for k in _SPECIAL_ORDER if names[k] and tok.token_to_id(names[k]) is None]
    if missing:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])
    add_bos = bool(config.get("add_bos_token", True))
    add_eos = bool(config.get("add_eos_token", False))
    bos, eos = names["bos_token"], names["eos_token"]
    for flag, token, what in ((add_bos, bos, "add_bos_token"), (add_eos, eos, "add_eos_token")):
        if flag and token is None:
            raise UnsupportedTokenizer(f"tokenizer_config.json sets {what} but names no token for it")
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                       special_tokens=specials)
    return tok.to_str()


def derived_file(tokenizer_path: str | Path, version: str) -> Path:
    """The ``tokenizer.json`` to encode with so ids equal transformers ``version``'s ``AutoTokenizer`` on the
    folder of ``tokenizer_path``.

    Args:
        tokenizer_path: the model's ``tokenizer.json``; ``tokenizer_config.json`` is read beside it.
        version: one of :data:`VERSIONS`.

    Returns:
        ``tokenizer_path`` itself when nothing changes; else ``$TOKTIER_CACHE_DIR/hf_compat/<sha256>/
        tokenizer.json`` (written once, atomically), with the model's ``tokenizer_config.json`` copied beside
        it (special tokens and chat template are read from there).

    Raises:
        ValueError: ``version`` is not one of :data:`VERSIONS`.
        UnsupportedTokenizer: see :func:`derive_4_57`.
    """
    if version not in VERSIONS:
        raise ValueError(f"hf_compat={version!r} is not one of {list(VERSIONS)}")
    path = Path(tokenizer_path)
    cfg_path = path.parent / "tokenizer_config.json"
    if version != "4.57" or not cfg_path.is_file():
        return path
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UnsupportedTokenizer(f"{cfg_path}: not valid JSON ({e})") from e
    serialized = derive_4_57(path.read_text(encoding="utf-8"), config)
    if serialized is None:
        return path
    folder = cache_dir() / "hf_compat" / hashlib.sha256(serialized.encode("utf-8")).hexdigest()
    out = folder / "tokenizer.json"
    if not out.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(serialized)
        shutil.copyfile(cfg_path, folder / "tokenizer_config.json")
        os.replace(tmp, out)
    return out


_OFFSET_ONLY_KEYS = ("trim_offsets",)
"""Keys read only when offsets are computed (``tokenizers``' ByteLevel reads ``trim_offsets`` in its
post-processing of offsets, never when splitting or assigning ids)."""


def id_pipeline(serialized: str) -> dict[str, Any]:
    """The parts of a serialized ``tokenizers`` pipeline that decide ids: everything but the ``decoder`` (used
    only by decode) and the offset-only keys (:data:`_OFFSET_ONLY_KEYS`), at any depth. Two pipelines with
    equal ``id_pipeline`` give the same ids for every text and flag: transformers 5 rebuilding Qwen's
    ``tokenizer.json`` with ``trim_offsets`` flipped in its ByteLevel pre-tokenizer and decoder is such a pair."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in _OFFSET_ONLY_KEYS}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    data = json.loads(serialized)
    data.pop("decoder", None)
    return strip(data)
