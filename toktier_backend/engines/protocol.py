"""The engine protocol every tokenization backend implements, capabilities included.

An engine maps text to the *body* ids of the tokenizer: what HF ``tokenizers`` returns for
``encode(text, add_special_tokens=False).ids`` — added-token matching, normalizer, pre-tokenizer and model,
but no post-processor. The post-processor (BOS/EOS templates) is applied once, by the caller.

What the rest of the stack may do with an engine is declared here, not probed with ``getattr``:

- :attr:`Engine.releases_gil`: ``encode`` runs without the GIL and is safe from any number of threads at
  once, so ``pipeline/chunked.py`` encodes a long text's chunks on the CPU pool (else it never chunks:
  threads would only take turns);
- :attr:`Engine.accepts_utf8`: ``encode`` also takes the text's UTF-8 ``bytes`` (the chunked encoder then
  converts each chunk once and feeds the same bytes to the guard check and the engine);
- :meth:`Engine.reserve`: make ``n`` concurrent callers possible (engine objects loaded at startup; a no-op
  for engines that need none);
- :meth:`Engine.encode_batch`: several texts in one call.

:class:`DeviceEngine` adds :meth:`~DeviceEngine.accepts` for an engine that serves only some texts (the GPU
engine; ``gpu/routing.py`` sends the others to the CPU). Both are ``runtime_checkable``: ``isinstance``
checks that every member is present (not their types).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Engine(Protocol):
    """A tokenization backend.

    Attributes:
        name: registry name (``"hf"``, ``"gigatoken"``, ``"fastokens"``, ``"gpu"``).
        version: the backend package's version, part of the guard-set cache key.
        releases_gil: ``encode`` releases the GIL while it runs and may be called from any number of threads
            at once (fastokens, gigatoken: ``True``; HF ``tokenizers``, which holds the GIL in ``encode``,
            and the GPU engine, one request at a time: ``False``).
        accepts_utf8: ``encode`` also takes a text's UTF-8 ``bytes`` (gigatoken); else only ``str``.
    """

    name: str
    version: str
    releases_gil: bool
    accepts_utf8: bool

    def encode(self, text: str) -> np.ndarray:
        """Body ids of ``text`` (a ``str``, or its UTF-8 ``bytes`` where :attr:`accepts_utf8`).

        Returns:
            ``np.ndarray[int32] (n_tokens,)``; equals HF ``encode(text, add_special_tokens=False).ids``
            for every text the engine is admitted for (see ``engines/admission.py``). Example, gpt2:
            ``encode("hello world").tolist() == [31373, 995]``.

        Raises:
            UnicodeEncodeError: (engines that convert ``str`` to UTF-8 themselves) a lone surrogate.
        """
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` of each text, in order: ``[int32[n_i]]``."""
        ...

    def reserve(self, n: int) -> None:
        """Prepare for ``n`` threads calling :meth:`encode` at once (startup cost, never per request)."""
        ...


@runtime_checkable
class DeviceEngine(Engine, Protocol):
    """An engine that serves only the texts it :meth:`accepts` (the GPU engine: not NFC-changing texts, not
    over its largest size); a router sends the others to a CPU engine."""

    def accepts(self, text: str) -> bool:
        """Does :meth:`encode` run ``text`` on this engine's device (else on its CPU fallback)?"""
        ...


__all__ = ["DeviceEngine", "Engine"]
