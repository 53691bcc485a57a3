"""vLLM general plugin: registers ``tokenizer_mode="toktier"``.

Entry point (``pyproject.toml``)::

    [project.entry-points."vllm.general_plugins"]
    toktier = "toktier_backend.faces.vllm_plugin:register"

vLLM calls :func:`register` in every process it starts (and ``vllm serve``/Dynamo's ``--dyn-chat-processor
vllm`` call it while parsing engine arguments), so ``--tokenizer-mode toktier`` then resolves to
:class:`~toktier_backend.faces.vllm_tokenizer.TokTierTokenizer`. A tokenizer mode also selects the
chat renderer in current vLLM (``vllm/renderers/registry.py``); ours is vLLM's ``HfRenderer``, since the
class serves the HF tokenizer's chat template. Idempotent: registering twice changes nothing and logs
nothing.
"""

from __future__ import annotations

from toktier_backend.faces.vllm_tokenizer import MODE

TOKENIZER = ("toktier_backend.faces.vllm_tokenizer", "TokTierTokenizer")
RENDERER = ("vllm.renderers.hf", "HfRenderer")


def register() -> None:
    """Register ``MODE`` in vLLM's tokenizer registry (and renderer registry, where vLLM has one).

    Raises:
        ImportError: vLLM is not installed, or is older than the ``vllm.tokenizers`` registry (0.12).
    """
    try:
        from vllm.tokenizers.registry import TokenizerRegistry
    except ImportError as e:
        raise ImportError(
            f"tokenizer_mode={MODE!r} needs vLLM with vllm.tokenizers.registry (tested: 0.33.0): {e}"
        ) from e
    if TokenizerRegistry.tokenizers.get(MODE) != TOKENIZER:
        TokenizerRegistry.register(MODE, *TOKENIZER)
    try:
        from vllm.renderers.registry import RENDERER_REGISTRY
    except ImportError:  # vLLM before renderers: the tokenizer mode alone is enough
        return
    if RENDERER_REGISTRY.renderers.get(MODE) != RENDERER:
        RENDERER_REGISTRY.register(MODE, *RENDERER)
