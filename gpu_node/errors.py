"""Errors the engine raises for bad input or missing models.

    EngineError
    ├── ModelNotFoundError      unknown model name, missing or unreadable GGUF
    ├── InvalidRequestError     empty prompt, prompt past the context, bad sampling params
    ├── EngineStoppedError      submit after shutdown
    └── RequestCancelledError   submit of a request already cancelled (its cancel came first)

Anything else escaping the engine is a bug.
"""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelNotFoundError(EngineError):
    pass


class InvalidRequestError(EngineError):
    pass


class EngineStoppedError(EngineError):
    pass


class RequestCancelledError(EngineError):
    pass
