"""Errors the engine raises for bad input or missing models, and the node API code of each
(`common.node_api.NodeErrorCode`; gpu_node/server.py maps codes to statuses in one table).

    EngineError
    ├── ModelNotFoundError        unknown model name, missing or unreadable GGUF
    ├── InvalidRequestError       empty prompt, bad sampling params      invalid_request
    │   ├── RequestTooLargeError  prompt + max_tokens past the window    request_too_large
    │   │                         (common.window: the context, or the KV pool where smaller)
    │   └── InvalidGrammarError   a grammar that does not compile        invalid_grammar
    ├── EngineStoppedError        submit after shutdown                  over_capacity
    └── RequestCancelledError     submit of a request already cancelled  cancelled
                                  (its cancel came first)

Anything else escaping the engine is a bug.
"""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelNotFoundError(EngineError):
    pass


class InvalidRequestError(EngineError):
    pass


class RequestTooLargeError(InvalidRequestError):
    pass


class InvalidGrammarError(InvalidRequestError):
    pass


class EngineStoppedError(EngineError):
    pass


class RequestCancelledError(EngineError):
    pass
