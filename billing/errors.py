"""The billing error hierarchy.

    BillingError
    ├── InvalidUsageEvent    an event (built, or read back from the stream or the journal) is malformed
    ├── PriceConfigError     the price file cannot be read or fails validation (names the entry and field)
    └── InvalidReportQuery   a report's account, dates or grouping are unusable (HTTP 400)

Exceptions are for bad input and bugs; a missing price is a normal value (`None`).
"""

from __future__ import annotations


class BillingError(Exception):
    """Base of every error billing raises on purpose."""


class InvalidUsageEvent(BillingError):
    pass


class PriceConfigError(BillingError):
    pass


class InvalidReportQuery(BillingError):
    pass
