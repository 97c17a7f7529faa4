"""Errors a user can act on: each says what was wrong, with which value, and what to do."""


class StrataError(Exception):
    """Base of every error Strata raises on purpose."""


class ModelFormatError(StrataError):
    """The model file is not a usable GGUF: not GGUF, truncated, unknown architecture,
    unsupported tensor type, missing tensor or wrong shape."""


class ConfigError(StrataError):
    """An engine option has a value Strata cannot use."""


class RequestError(StrataError):
    """A generation request cannot be served as asked (bad sampling value, prompt too long)."""
