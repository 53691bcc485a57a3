"""Typed errors: one base class, one documented class per failure.

Every error raised across the public API derives from :class:`ToktierError`, so a serving adapter can map
each class to one Triton error code (INVALID_ARG, NOT_FOUND, UNAVAILABLE) and never fail a whole batch.
Messages follow tiktoken's ``raise_disallowed_special_token``: what was found, why, and the ways out.
"""

from __future__ import annotations


class ToktierError(Exception):
    """Base class of every toktier_backend error."""


class InvalidRequest(ToktierError, ValueError):
    """The request itself is bad: not UTF-8, lone surrogates, over the size limit, wrong type.

    Nothing was changed: a session that receives an invalid request keeps its previous state.
    """


class UnknownSession(ToktierError, KeyError):
    """A ``delta`` request named a session this server does not hold (never opened, evicted, restarted).

    The way out is to resend the request with the whole text (``MODE=full``), which rebuilds the session
    exactly.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown session"


class UnsupportedTokenizer(ToktierError):
    """The tokenizer file cannot be served: malformed JSON, an unknown model type, or a failed check."""


class EngineUnavailable(ToktierError):
    """A fast engine is not installed or was not admitted for this tokenizer file."""
