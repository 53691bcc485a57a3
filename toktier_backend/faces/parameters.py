"""Model parameters every Triton model reads the same way: which tokenizer to load.

A ``config.pbtxt`` is a template until something fills it: TensorRT-LLM's ``tools/fill_template.py``
(``string.Template.safe_substitute``: a key it is not given stays ``${key}``) or ``toktier serve``
(:func:`toktier_backend.deploy.server.prepare_repository`). An unfilled or empty tokenizer parameter must
not load anything: serving the bundled GPT-2 file in place of the user's model gives ids that look fine and
are wrong for the model ("hello world" -> ``[31373, 995]`` whatever the model). The bundled file is served
only when a parameter names it: ``default``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from toktier_backend.errors import UnsupportedTokenizer

DEFAULT_TOKENIZER = "default"
"""The parameter value that asks for the bundled GPT-2 ``tokenizer.json``."""


def is_unfilled(value: str | None) -> bool:
    """True for a missing or blank value, or one still holding a ``${...}`` template placeholder."""
    v = (value or "").strip()
    return not v or "${" in v


def tokenizer_spec(params: Mapping[str, str], keys: Sequence[str] = ("tokenizer",), *, model: str = "model") -> str:
    """The tokenizer spec named by the first of ``keys`` that is filled in.

    Args:
        params: the model's ``parameters`` (``{key: string_value}``).
        keys: parameters that may name the tokenizer, in order of precedence (``preprocessing``: ours,
            ``tokenizer``, then TensorRT-LLM's ``tokenizer_dir``). Two filled ones must agree.
        model: how the error names the model.

    Returns:
        a ``tokenizer.json`` path, a folder holding one, a Hub id, or ``"default"`` (the bundled GPT-2 file;
        :func:`toktier_backend.default_tokenizer_path`), stripped.

    Raises:
        UnsupportedTokenizer: no key is filled in (empty, absent, or ``${...}``), naming each key and its
            value; or two filled keys name different tokenizers.
    """
    filled = [(k, params[k].strip()) for k in keys if not is_unfilled(params.get(k))]
    if not filled:
        seen = ", ".join(f"{k}={params.get(k)!r}" for k in keys)
        raise UnsupportedTokenizer(
            f"{model}: no tokenizer configured ({seen}). Set the parameter {keys[-1]!r} in config.pbtxt to a "
            f"tokenizer.json path, a folder holding one, or a Hub id (TensorRT-LLM: fill_template.py "
            f"{keys[-1]}:DIR; toktier serve --tokenizer SPEC fills it), or to {DEFAULT_TOKENIZER!r} for the "
            f"bundled GPT-2 file."
        )
    key, spec = filled[0]
    for other, value in filled[1:]:
        if value != spec:
            raise UnsupportedTokenizer(
                f"{model}: parameters {key}={spec!r} and {other}={value!r} name different tokenizers; fill one "
                f"of them, or make them agree."
            )
    return spec
