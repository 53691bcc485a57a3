"""Chat templates: loading a model's template and rendering OpenAI ``messages`` to the prompt text."""
