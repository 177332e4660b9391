"""Typed errors for bad requests: each is a ``ValueError`` whose message names the culprit.

A ``RequestError`` concerns one request only: the engine refuses that request and keeps
serving the others. Start-up problems (a KV pool too small, bad config) are ``ConfigError``.
An engine that cannot serve any more is another kind of error: ``engine/failures.py``.
"""
from __future__ import annotations

from megainfer.config import ConfigError


class RequestError(ValueError):
    """One request is invalid; the message names the parameter and its value."""


class SamplingParamsError(RequestError):
    """A sampling parameter is out of range."""


class EmptyPromptError(RequestError):
    pass


class PromptTooLongError(RequestError):
    pass


class TokenIdError(RequestError):
    """A prompt token id is negative or >= vocab_size."""


class DuplicateRequestError(RequestError):
    pass


class CacheTooSmallError(ConfigError):
    """The KV block pool cannot hold one request of ``max_model_len`` tokens."""


__all__ = ["RequestError", "SamplingParamsError", "EmptyPromptError", "PromptTooLongError",
           "TokenIdError", "DuplicateRequestError", "CacheTooSmallError", "ConfigError"]
