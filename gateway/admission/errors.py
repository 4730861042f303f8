"""Admission errors.

    AdmissionError
     ├── AdmissionUnavailable   the shared store is unreachable and the policy is fail-closed (503)
     ├── InvalidLimits          a limit value is not a positive integer (400)
     ├── InvalidRequest         an id cannot be used as a key, or a token count is negative (400)
     └── DuplicateRequestId     a request id was admitted twice (a caller bug)

A reservation larger than the account's tokens_per_minute is never admissible: the
client's error, raised as the gateway's own `TokenLimitError` (one name for it on the
gateway's wire). Running out of requests, tokens or slots is not an error: it is an
`Admission` with `admitted=False`.
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


class DuplicateRequestId(AdmissionError):
    """The request id already holds a reservation; request ids must be unique."""
