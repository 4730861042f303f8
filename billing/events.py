"""The usage event: what crosses from the request path into billing.

Money is never in it: billing prices events; the request path only counts tokens.
Three kinds, all keyed by the request id:

    kind    says                                          written by
    end     the request's usage as its client got it      the gateway, when the request ends
    start   its client has the status line                the gateway, before a stream's first token
    node    what the node computed and sent toward it     the node, when the request ends there

An `end` is what the ledger bills. A `start` whose `end` never comes (its gateway died
mid-answer) is completed from the node's record: the prompt, and the tokens the node sent
(`billing.ledger`, `complete_orphans`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, cast

from billing.errors import InvalidUsageEvent

Status = Literal["ok", "cancelled", "error"]
STATUSES: frozenset[str] = frozenset({"ok", "cancelled", "error"})
Kind = Literal["end", "start", "node"]
KINDS: frozenset[str] = frozenset({"end", "start", "node"})

_TEXT_FIELDS = ("request_id", "account_id", "model", "node_id")
_TOKEN_FIELDS = ("input_tokens", "output_tokens", "cached_tokens")
# The most tokens a count may hold: the ledger's BIGINT. A count past it is refused here, so
# the worker dead-letters its event instead of failing the batch's insert again and again.
# The most tokens a count may hold. A request's count is bounded by a context window
# (millions), so 2^40 refuses only corrupt counts, and it leaves 2^23 events of the most
# tokens an account x model x day before a report's 64-bit SUM would overflow. A count past
# it is refused here, so the worker dead-letters its event instead of failing the batch's
# insert (or a later report) again and again.
MAX_TOKENS = 2**40
_TIME_FIELDS = ("started_at", "ended_at")
# The latest time a ledger row can hold: 9999-12-31 23:59:59 UTC, the last day a date has
# (a time in milliseconds, 1000x too large, falls past it).
MAX_EPOCH_S = 253402300799.0
# The longest text a field may hold: the fleet's identifiers are at most 256 characters
# (scheduler.capacity.IDENTIFIER), and Postgres indexes request_id in a btree (whose rows
# end at 2704 bytes).
MAX_TEXT = 256


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """What one request consumed.

    `request_id` is the idempotency key: the ledger keeps the first event for an
    id and ignores every replay. `cached_tokens` is the part of `input_tokens`
    served from the prefix cache (billed at the cached-input price), so it never
    exceeds `input_tokens`. `output_tokens` counts tokens actually delivered to
    the client, which is what a cancelled stream is billed for. Times are float
    epoch seconds; the UTC day of `ended_at` is the day the request is billed on.
    A `start` carries the prompt's counts and `status` "cancelled" (what a request cut
    off there is); a `node` carries the node's counts and how the request ended there.
    """

    request_id: str
    account_id: str
    model: str
    node_id: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    started_at: float
    ended_at: float
    status: Status
    kind: Kind = "end"

    def __post_init__(self) -> None:
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidUsageEvent(f"{name} must be a string, got {type(value).__name__}")
            if len(value) > MAX_TEXT:
                raise InvalidUsageEvent(f"{name} must be at most {MAX_TEXT} characters")
            # Postgres text holds no NUL and only what encodes as UTF-8.
            if "\x00" in value or _has_surrogate(value):
                raise InvalidUsageEvent(f"{name} must be UTF-8 text without NUL, got {value!r}")
        # node_id may be empty: a request that failed before placement ran on no node.
        for name in ("request_id", "account_id", "model"):
            if not getattr(self, name):
                raise InvalidUsageEvent(f"{name} must not be empty")
        for name in _TOKEN_FIELDS:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_TOKENS
            ):
                raise InvalidUsageEvent(
                    f"{name} must be an integer in [0, {MAX_TOKENS}], got {value!r}"
                )
        if self.cached_tokens > self.input_tokens:
            raise InvalidUsageEvent(
                f"cached_tokens ({self.cached_tokens}) exceeds input_tokens ({self.input_tokens})"
            )
        for name in _TIME_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidUsageEvent(f"{name} must be epoch seconds, got {value!r}")
            if not math.isfinite(value) or not 0 <= value <= MAX_EPOCH_S:
                raise InvalidUsageEvent(
                    f"{name} must be epoch seconds in [0, {MAX_EPOCH_S:.0f}], got {value!r}"
                )
        if self.ended_at < self.started_at:
            raise InvalidUsageEvent(
                f"ended_at ({self.ended_at}) is before started_at ({self.started_at})"
            )
        if self.status not in STATUSES:
            raise InvalidUsageEvent(
                f"status must be one of {sorted(STATUSES)}, got {self.status!r}"
            )
        if self.kind not in KINDS:
            raise InvalidUsageEvent(f"kind must be one of {sorted(KINDS)}, got {self.kind!r}")

    def to_fields(self) -> dict[str, str]:
        """Flat string fields for XADD (and for one journal line)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "kind" and value == "end":
                continue  # an entry without a kind is an end, as every reader takes it
            # repr of a float round-trips exactly; str of an int is the int.
            out[_field_name(f.name, self.kind)] = (
                repr(float(value)) if f.name in _TIME_FIELDS else str(value)
            )
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[str, str] | Mapping[bytes, bytes]) -> UsageEvent:
        """Parse what `to_fields` wrote (as XRANGE/XREADGROUP return it, bytes or str)."""
        data: dict[str, str] = {}
        try:
            for key, value in raw.items():
                k = key.decode() if isinstance(key, bytes) else key
                data[k] = value.decode() if isinstance(value, bytes) else value
        except UnicodeDecodeError as exc:
            raise InvalidUsageEvent(f"usage event has a field that is not UTF-8: {exc}") from None
        kind = data.get("kind", "end")  # an entry without a kind is an end
        missing = [
            name
            for f in fields(cls)
            if f.name != "kind" and (name := _field_name(f.name, kind)) not in data
        ]
        if missing:
            raise InvalidUsageEvent(f"usage event lacks fields: {', '.join(missing)}")
        try:
            return cls(
                request_id=data["request_id"],
                account_id=data["account_id"],
                model=data["model"],
                node_id=data["node_id"],
                input_tokens=int(data["input_tokens"]),
                output_tokens=int(data["output_tokens"]),
                cached_tokens=int(data["cached_tokens"]),
                started_at=float(data["started_at"]),
                ended_at=float(data["ended_at"]),
                status=cast(Status, data[_field_name("status", kind)]),
                kind=cast(Kind, kind),
            )
        except ValueError as exc:
            raise InvalidUsageEvent(f"usage event has a non-numeric field: {exc}") from None


def _field_name(name: str, kind: str) -> str:
    """The stream field that holds `name` in an event of `kind`. A start or node record
    holds its status as `outcome`: a reader that knows ends alone finds no `status` in
    it and dead-letters it, rather than billing it as the request's end (and the real end
    after it as a replay)."""
    return "outcome" if name == "status" and kind != "end" else name


def _has_surrogate(text: str) -> bool:
    """Whether `text` holds a lone surrogate (no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
