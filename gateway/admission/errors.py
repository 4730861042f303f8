"""Admission errors.

    AdmissionError
     ├── AdmissionUnavailable   the shared store is unreachable and the policy is fail-closed (503)
     ├── InvalidLimits          a limit value is not a positive integer (400)
     ├── InvalidRequest         an id cannot be used as a key, or a token count is negative (400)
     ├── RequestTooLarge        the token reservation alone exceeds tokens_per_minute (413)
     └── DuplicateRequestId     a request id was admitted twice (a caller bug)

Running out of requests, tokens or slots is not an error: it is an `Admission` with
`admitted=False`.
"""

from __future__ import annotations


class AdmissionError(Exception):
    """Base of every admission error."""


class AdmissionUnavailable(AdmissionError):
    """The limit store did not answer in time and the gateway is configured fail-closed."""


class InvalidLimits(AdmissionError, ValueError):
    """A limit is not a positive integer; the message names the field."""


class InvalidRequest(AdmissionError, ValueError):
    """An account id, model name or request id keys cannot carry, or a negative token count."""


class RequestTooLarge(AdmissionError, ValueError):
    """The request reserves more tokens than the account may use in a whole minute."""

    def __init__(self, estimated_tokens: int, tokens_per_minute: int) -> None:
        super().__init__(
            f"request reserves {estimated_tokens} tokens (its prompt, estimated from its "
            f"length, plus max_tokens), more than the account's limit of {tokens_per_minute} "
            f"tokens per minute; shorten the prompt or lower max_tokens"
        )
        self.estimated_tokens = estimated_tokens
        self.tokens_per_minute = tokens_per_minute


class DuplicateRequestId(AdmissionError):
    """The request id already holds a reservation; request ids must be unique."""
