"""Integrations with serving stacks: the TensorRT-LLM ensemble, vLLM, Dynamo (via vLLM or the proxy).

Each module imports its optional dependencies lazily, so ``import toktier_backend.integrations`` costs nothing:

- :mod:`.sessions` — :class:`~.sessions.SessionCache`: sessions keyed by an ID (correlation ID, header,
  conversation ID) or by the prompt's prefix, with an LRU cap and an idle TTL. Used by all routes below.
- :mod:`.trtllm` — the TensorRT-LLM ``preprocessing`` contract (``model_repository/preprocessing``).
- :mod:`.chat` — chat templates rendered in a sandboxed jinja2 environment (``ImmutableSandboxedEnvironment``).
- :mod:`.vllm_tokenizer` / :mod:`.vllm_plugin` — vLLM ``tokenizer_mode="toktier"`` (needs ``transformers``).
- :mod:`.proxy` — ``toktier proxy --upstream URL``: OpenAI completion/chat in, token IDs out to ``/v1/completions``.

See ``docs/integrations.md`` for the commands.
"""
