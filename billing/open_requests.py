"""Open requests: what the ledger keeps of a request between its start and its end.

A stream's `start` (the gateway's, once the status line is out) and its node's record (when it
ends there) open the request in `usage_open`; its `end` closes it. A request whose
gateway died never gets its end:

    start + node record ──(node record orphan_grace_s old)──> billed from the two,
                                                               kept as completed
    completed + a late end ─────────────────────────────────> the end's row replaces it
    completed, or a node record alone, retain_s old ─────────> forgotten
    a start alone (its node died too) ──────────────────────> kept; reconcile names it

The SQL here is the ledger's (both stores'); `billing.ledger` runs it in its transactions.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from billing.events import UsageEvent

# A request announced (its start, or its node's record, as the event's fields in JSON);
# completed_at is set once it is billed from the two.
SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_open (
    request_id    TEXT PRIMARY KEY,
    start_event   TEXT,
    node_event    TEXT,
    started_at    DOUBLE PRECISION,
    node_ended_at DOUBLE PRECISION,
    completed_at  DOUBLE PRECISION,
    recorded_at   DOUBLE PRECISION NOT NULL
)
"""


# The columns SCHEMA has beyond its first form, each with its type: a table of an earlier
# form gains them when a ledger opens it (CREATE TABLE IF NOT EXISTS leaves it as it is).
ADDED_COLUMNS = {"completed_at": "DOUBLE PRECISION"}


@dataclasses.dataclass(frozen=True)
class OpenSql:
    """The statements of one store, written with its parameter placeholder `p`."""

    # A start or a node's record opens its request, or fills in an open one, unless its end
    # is billed already (then it is late news, and dropped).
    merge: str
    # An end closes its request; before its row goes in, a row billed from a start and a
    # node record gives way to it (the gateway's own end says what reached the client).
    replace_completed: str
    close: str
    due: str
    complete: str
    forget: str
    listing: str

    @classmethod
    def for_placeholder(cls, p: str) -> OpenSql:
        real = "DOUBLE PRECISION"
        return cls(
            merge=(
                "INSERT INTO usage_open (request_id, start_event, node_event, started_at, "
                f"node_ended_at, recorded_at) SELECT {p}, {p}, {p}, CAST({p} AS {real}), "
                f"CAST({p} AS {real}), CAST({p} AS {real}) WHERE NOT EXISTS "
                f"(SELECT 1 FROM usage_ledger WHERE request_id = {p}) "
                "ON CONFLICT (request_id) DO UPDATE SET "
                "start_event = COALESCE(usage_open.start_event, excluded.start_event), "
                "node_event = COALESCE(usage_open.node_event, excluded.node_event), "
                "started_at = COALESCE(usage_open.started_at, excluded.started_at), "
                "node_ended_at = COALESCE(usage_open.node_ended_at, excluded.node_ended_at)"
            ),
            replace_completed=(
                f"DELETE FROM usage_ledger WHERE request_id = {p} AND EXISTS (SELECT 1 FROM "
                f"usage_open WHERE request_id = {p} AND completed_at IS NOT NULL)"
            ),
            close=f"DELETE FROM usage_open WHERE request_id = {p}",
            due=(
                "SELECT request_id, start_event, node_event FROM usage_open WHERE "
                "completed_at IS NULL AND start_event IS NOT NULL AND node_event IS NOT NULL "
                f"AND node_ended_at < {p} ORDER BY request_id"
            ),
            complete=f"UPDATE usage_open SET completed_at = {p} WHERE request_id = {p}",
            forget=(
                f"DELETE FROM usage_open WHERE completed_at < {p} "
                f"OR (start_event IS NULL AND node_ended_at < {p})"
            ),
            listing=(
                "SELECT request_id, started_at, node_ended_at FROM usage_open "
                "WHERE completed_at IS NULL"
            ),
        )


def merge_params(e: UsageEvent, recorded_at: float) -> tuple[Any, ...]:
    """A start or node record as the parameters of `OpenSql.merge`."""
    fields = json.dumps(e.to_fields(), sort_keys=True)
    is_start = e.kind == "start"
    return (
        e.request_id,
        fields if is_start else None,
        None if is_start else fields,
        e.started_at if is_start else None,
        None if is_start else e.ended_at,
        recorded_at,
        e.request_id,
    )


def completed(start_fields: str, node_fields: str) -> UsageEvent:
    """The end of a request whose gateway died: the client, account, model and prompt as
    its start has them; the output and how it ended as its node's record has them."""
    start = UsageEvent.from_fields(json.loads(start_fields))
    node = UsageEvent.from_fields(json.loads(node_fields))
    return dataclasses.replace(
        start,
        output_tokens=node.output_tokens,
        ended_at=max(node.ended_at, start.started_at),
        status=node.status,
        kind="end",
    )
