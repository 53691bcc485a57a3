"""Faces: each parses its protocol, calls the serving core (``serving/``) and formats the reply.

- :mod:`.triton` / :mod:`.triton_io` — the Triton Python-backend models ``toktier_session`` / ``toktier_encode``.
- :mod:`.pytriton` — the same models through PyTriton.
- :mod:`.trtllm` — the TensorRT-LLM ``preprocessing`` model contract (``model_repository/preprocessing``).
- :mod:`.vllm_tokenizer` / :mod:`.vllm_plugin` — vLLM ``--tokenizer-mode toktier``.
- :mod:`.proxy` / :mod:`.proxy_cli` — ``toktier proxy``: OpenAI text in, token IDs out to an upstream server.

Each imports its optional dependencies lazily; see ``docs/integrations.md`` for the commands.
"""
