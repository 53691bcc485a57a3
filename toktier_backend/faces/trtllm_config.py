"""``preprocessing/config.pbtxt`` as TensorRT-LLM's setup fills it, and the tensors beyond text.

Template. Our ``model_repository/preprocessing/config.pbtxt`` carries every ``${key}`` of NVIDIA/TensorRT-LLM
``triton_backend/all_models/inflight_batcher_llm/preprocessing/config.pbtxt``, so the documented setup
command (``tools/fill_template.py -i preprocessing/config.pbtxt tokenizer_dir:DIR,
triton_max_batch_size:64,preprocessing_instance_count:1``; it asserts each given key occurs in the file,
then ``string.Template.safe_substitute``\\ s, with ``max_queue_size`` and ``max_queue_delay_microseconds``
defaulting to 0) fills ours as it fills theirs. ``toktier serve`` fills what is left with
:data:`TEMPLATE_DEFAULTS` (:func:`fill_defaults`); the tokenizer keys have no default (see
:mod:`toktier_backend.faces.parameters`).

Tensors. ``PROMPT_TABLE_EXTRA_ID`` (``TYPE_UINT64 [1]``, optional) -> ``OUT_PROMPT_TABLE_EXTRA_IDS``
(``TYPE_UINT64 [-1]``), as the original's ``execute`` computes it: per row, the request's extra id at every
position whose id is a prompt-table (p-tuning) id, i.e. ``>=`` the tokenizer's ``vocab_size`` (HF: the
model's vocabulary without added tokens), 0 elsewhere; the output is absent when the input is. The
multimodal inputs (``IMAGE_BYTES``, ``IMAGE_URL``, ``IMAGES``, ``VIDEO_BYTES``) are declared so a
multimodal ensemble loads, and refused per request: this model encodes text only.
"""

from __future__ import annotations

import string
from typing import Mapping

import numpy as np

from toktier_backend.errors import InvalidRequest

TEMPLATE_DEFAULTS: dict[str, str] = {
    "triton_max_batch_size": "256",  # max_batch_size and the preferred batch size
    "max_queue_delay_microseconds": "0",  # the original's fill_template default
    "max_queue_size": "0",  # 0: unbounded (the original's fill_template default)
    "preprocessing_instance_count": "1",  # sessions live in one instance: see the config's comment
    "add_special_tokens": "true",  # the original's default when unset or not a boolean
    "multimodal_model_path": "",  # declared for fill_template; a multimodal model is refused at load
    "engine_dir": "",
    "max_num_images": "",
    "hf_model_path": "",
}
"""``${key}`` -> the value ``toktier serve`` substitutes when TensorRT-LLM's setup did not. ``tokenizer_dir``
and ``tokenizer`` have none: unfilled, the model refuses to load."""

TOKENIZER_KEYS = ("tokenizer", "tokenizer_dir")
"""The parameters that name the tokenizer, in order of precedence (two filled ones must agree)."""

MULTIMODAL_INPUTS = ("IMAGE_BYTES", "IMAGE_URL", "IMAGES", "VIDEO_BYTES")
EXTRA_INPUTS = ("PROMPT_TABLE_EXTRA_ID",) + MULTIMODAL_INPUTS
"""Inputs of the original's config beyond the text ones (read by the handler; multimodal ones refused)."""


def template_keys(text: str) -> set[str]:
    """The ``${key}`` / ``$key`` placeholders still in a config's text (``string.Template`` syntax)."""
    keys = set()
    for m in string.Template.pattern.finditer(text):
        name = m.group("named") or m.group("braced")
        if name:
            keys.add(name)
    return keys


def fill_defaults(text: str, values: Mapping[str, str] | None = None) -> str:
    """Substitute ``values`` then :data:`TEMPLATE_DEFAULTS` for the placeholders still in ``text``
    (``safe_substitute``: other placeholders, e.g. ``${tokenizer_dir}``, stay for the model to refuse)."""
    return string.Template(text).safe_substitute({**TEMPLATE_DEFAULTS, **(values or {})})


def refuse_multimodal(inputs: Mapping[str, np.ndarray | None]) -> None:
    """Raise for a request that sends any of :data:`MULTIMODAL_INPUTS`.

    Raises:
        InvalidRequest: naming the inputs sent.
    """
    sent = [n for n in MULTIMODAL_INPUTS if inputs.get(n) is not None]
    if sent:
        raise InvalidRequest(
            f"inputs {sent} were sent, but this preprocessing encodes text prompts only (QUERY, DECODER_QUERY). "
            f"Serve multimodal models with TensorRT-LLM's own preprocessing model, or send text only."
        )


def prompt_table_extra_ids(input_id: np.ndarray, extra_id: np.ndarray | None, vocab_size: int) -> np.ndarray | None:
    """``OUT_PROMPT_TABLE_EXTRA_IDS`` for one request.

    Args:
        input_id: ``int32[b, L]``, the padded ``INPUT_ID``.
        extra_id: ``PROMPT_TABLE_EXTRA_ID``, ``uint64[b, 1]`` (or ``[b]``), or ``None``.
        vocab_size: ids at or above it are prompt-table ids (HF ``tokenizer.vocab_size``: without added
            tokens).

    Returns:
        ``uint64[b, L]``: ``extra_id[i]`` where ``input_id[i, j] >= vocab_size``, else 0; ``None`` when
        ``extra_id`` is ``None`` (the output is then left out, as the original does).

    Raises:
        InvalidRequest: ``extra_id`` is not one value per row.
    """
    if extra_id is None:
        return None
    e = np.asarray(extra_id)
    b = input_id.shape[0]
    if e.shape not in ((b, 1), (b,)):
        raise InvalidRequest(
            f"PROMPT_TABLE_EXTRA_ID has shape {list(e.shape)}; send one TYPE_UINT64 value per QUERY row "
            f"(shape [{b}, 1])."
        )
    e = e.reshape(b, 1).astype(np.uint64)
    return np.where(input_id >= vocab_size, e, np.uint64(0)).astype(np.uint64)
