"""Reconciliation: does every usage event that reached the stream or a journal have a ledger row,
and is every recent ledger row backed by an event that says the same?

A stream entry is in one of three states for the billing group:

    unread     after the group's last-delivered id: no worker has seen it yet
    pending    delivered, not acknowledged: a worker holds it (or died holding it)
    acked      acknowledged: its ledger row was committed first, so it MUST be in the ledger

An acknowledged event absent from the ledger is a gap (something lost a row).
Unread and pending events without a row are in flight, and journaled events
without a row are waiting for Redis; both are reported, neither is a gap.

A stream's `start` without a ledger row is open: its end is on its way, or its gateway
died and the worker bills it from its node's record after the grace. One open for longer
than `open_limit_s` is a gap too (its node's record never came: the node died as well).
Nodes' records are read by the worker alone.

The other way round: a ledger row whose request ended after the oldest entry the
stream still holds (less `CLOCK_MARGIN_S`, for the gateways' clocks against
Redis's) must have its event in the stream or a journal, since the worker writes
rows only from the stream and trims only entries older than what it keeps. A row
with none is unbacked. A row that differs from its acknowledged event (other tokens,
status, account...) differs. Both make the ledger inconsistent, as a gap does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from billing.errors import InvalidUsageEvent
from billing.events import UsageEvent
from billing.journal import Journal
from billing.ledger import Ledger

_PAGE = 1000
CLOCK_MARGIN_S = 60.0
# A start still open past this lost its end and its node's record alike: the worker's
# grace (300 s) and a long stream's own length are well within it.
OPEN_LIMIT_S = 3600.0


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    num_stream_entries: int
    num_stream_requests: int  # distinct request ids (a replay adds an entry, not a request)
    num_pending_entries: int
    num_unread_entries: int
    num_journal_events: int
    num_malformed_entries: int
    missing_from_ledger: tuple[str, ...]  # acknowledged but no row: the gaps
    in_flight: tuple[str, ...]  # unread or pending, no row yet
    journal_unbilled: tuple[str, ...]  # journaled, no row yet
    # rows checked against the stream: those of requests that ended at or after this
    # (None: the stream holds nothing to check them against)
    rows_checked_since: float | None = None
    unbacked_rows: tuple[str, ...] = ()  # ledger rows no stream entry nor journal holds
    differing_rows: tuple[str, ...] = ()  # ledger rows that differ from their event
    open_starts: tuple[str, ...] = ()  # streams started, not yet billed
    unbilled_starts: tuple[str, ...] = ()  # open past the limit: the gaps among starts

    @property
    def is_consistent(self) -> bool:
        return not (
            self.missing_from_ledger
            or self.unbacked_rows
            or self.differing_rows
            or self.unbilled_starts
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "is_consistent": self.is_consistent,
            "num_stream_entries": self.num_stream_entries,
            "num_stream_requests": self.num_stream_requests,
            "num_pending_entries": self.num_pending_entries,
            "num_unread_entries": self.num_unread_entries,
            "num_journal_events": self.num_journal_events,
            "num_malformed_entries": self.num_malformed_entries,
            "missing_from_ledger": list(self.missing_from_ledger),
            "in_flight": list(self.in_flight),
            "journal_unbilled": list(self.journal_unbilled),
            "rows_checked_since": self.rows_checked_since,
            "unbacked_rows": list(self.unbacked_rows),
            "differing_rows": list(self.differing_rows),
            "open_starts": list(self.open_starts),
            "unbilled_starts": list(self.unbilled_starts),
        }


async def reconcile(
    redis_client: Any,
    ledger: Ledger,
    stream_key: str,
    group: str,
    journal_paths: Sequence[str | Path] = (),
    clock_margin_s: float = CLOCK_MARGIN_S,
    open_limit_s: float = OPEN_LIMIT_S,
    now: float | None = None,
) -> ReconcileReport:
    last_delivered = await _last_delivered_id(redis_client, stream_key, group)
    pending = await _pending_ids(redis_client, stream_key, group)
    acked: dict[str, UsageEvent] = {}
    waiting: dict[str, None] = {}
    starts: dict[str, float] = {}  # request id -> its stream's start
    num_entries = 0
    num_unread = 0
    num_malformed = 0
    oldest: str | None = None
    async for entry_id, fields in _entries(redis_client, stream_key):
        num_entries += 1
        oldest = oldest or entry_id
        is_delivered = _id_key(entry_id) <= _id_key(last_delivered)
        num_unread += not is_delivered
        try:
            event = UsageEvent.from_fields(fields)
        except InvalidUsageEvent:
            num_malformed += 1
            continue
        if event.kind != "end":
            if event.kind == "start":
                starts.setdefault(event.request_id, event.started_at)
            continue
        if is_delivered and entry_id not in pending:
            acked.setdefault(event.request_id, event)  # a replay: the first one was billed
        else:
            waiting[event.request_id] = None
    journal_ids: dict[str, None] = {}
    for path in journal_paths:
        contents = await asyncio.to_thread(Journal(path).read)
        journal_ids.update((e.request_id, None) for e in contents.events if e.kind == "end")
        starts.update((e.request_id, e.started_at) for e in contents.events if e.kind == "start")

    all_ids = list(acked) + list(waiting) + list(journal_ids) + list(starts)
    absent = await asyncio.to_thread(ledger.missing, all_ids)
    rows = await asyncio.to_thread(ledger.rows, [i for i in acked if i not in absent])
    since = None if oldest is None else _id_key(oldest)[0] / 1000 + clock_margin_s
    recent = [] if since is None else await asyncio.to_thread(ledger.ended_since, since)
    known = acked.keys() | waiting.keys() | journal_ids.keys() | starts.keys()
    unended = {i: at for i, at in starts.items() if i in absent and i not in journal_ids}
    # Starts the stream no longer holds (trimmed) stay open in the ledger until billed.
    for request_id, (started_at, _) in (await asyncio.to_thread(ledger.open_requests)).items():
        if started_at is not None and request_id not in journal_ids:
            unended.setdefault(request_id, started_at)
    limit = (time.time() if now is None else now) - open_limit_s
    return ReconcileReport(
        num_stream_entries=num_entries,
        num_stream_requests=len(acked.keys() | waiting.keys() | starts.keys()),
        num_pending_entries=len(pending),
        num_unread_entries=num_unread,
        num_journal_events=len(journal_ids),
        num_malformed_entries=num_malformed,
        missing_from_ledger=tuple(sorted(i for i in acked if i in absent)),
        in_flight=tuple(sorted(i for i in waiting if i in absent and i not in acked)),
        journal_unbilled=tuple(sorted(i for i in journal_ids if i in absent)),
        rows_checked_since=since,
        unbacked_rows=tuple(sorted(i for i in recent if i not in known)),
        differing_rows=tuple(sorted(i for i, row in rows.items() if row != acked[i])),
        open_starts=tuple(sorted(i for i, at in unended.items() if at >= limit)),
        unbilled_starts=tuple(sorted(i for i, at in unended.items() if at < limit)),
    )


async def _entries(redis_client: Any, stream_key: str) -> Any:
    start = "-"
    while True:
        page = await redis_client.xrange(stream_key, min=start, max="+", count=_PAGE)
        for entry_id, fields in page:
            yield _text(entry_id), fields
        if len(page) < _PAGE:
            return
        start = "(" + _text(page[-1][0])


async def _last_delivered_id(redis_client: Any, stream_key: str, group: str) -> str:
    try:
        groups = await redis_client.xinfo_groups(stream_key)
    except Exception as exc:
        if "no such key" in str(exc).lower():
            return "0-0"
        raise
    for info in groups:
        if _text(info["name"]) == group:
            return _text(info["last-delivered-id"])
    return "0-0"  # no group yet: nothing was ever delivered


async def _pending_ids(redis_client: Any, stream_key: str, group: str) -> set[str]:
    ids: set[str] = set()
    start = "-"
    while True:
        try:
            page = await redis_client.xpending_range(
                stream_key, group, min=start, max="+", count=_PAGE
            )
        except Exception as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc).lower():
                return ids
            raise
        ids.update(_text(p["message_id"]) for p in page)
        if len(page) < _PAGE:
            return ids
        start = "(" + _text(page[-1]["message_id"])


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
