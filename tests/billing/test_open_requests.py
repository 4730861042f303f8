"""What the ledger keeps of a request between its start and its end: the parameters a start
or a node record opens it with, and the end billed from the two when its gateway died."""

from __future__ import annotations

import json

from billing.open_requests import completed, merge_params
from tests.billing.samples import DAY1, make_event


def test_a_start_and_a_node_record_fill_their_own_columns() -> None:
    start = make_event("r1", kind="start", status="cancelled", output_tokens=0)
    node = make_event("r1", kind="node", output_tokens=9, ended_at=DAY1 + 4)
    start_json = json.dumps(start.to_fields(), sort_keys=True)
    node_json = json.dumps(node.to_fields(), sort_keys=True)
    assert merge_params(start, 123.0) == ("r1", start_json, None, DAY1, None, 123.0, "r1")
    assert merge_params(node, 124.0) == ("r1", None, node_json, None, DAY1 + 4, 124.0, "r1")


def test_the_end_of_a_request_whose_gateway_died_takes_from_both() -> None:
    start = make_event("r1", kind="start", status="cancelled", input_tokens=50, cached_tokens=16,
                       output_tokens=0, node_id="node-a")  # fmt: skip
    node = make_event("r1", kind="node", account_id="ignored", input_tokens=49, output_tokens=9,
                      ended_at=DAY1 + 4, status="ok", node_id="node-a")  # fmt: skip
    end = completed(json.dumps(start.to_fields()), json.dumps(node.to_fields()))
    assert end == make_event(
        "r1", input_tokens=50, cached_tokens=16, output_tokens=9, ended_at=DAY1 + 4, status="ok",
        node_id="node-a",
    )  # fmt: skip
    # A node's clock behind the gateway's never ends a request before it started.
    early = make_event("r1", kind="node", output_tokens=3, started_at=DAY1 - 3, ended_at=DAY1 - 2,
                       status="error")  # fmt: skip
    end = completed(json.dumps(start.to_fields()), json.dumps(early.to_fields()))
    assert (end.started_at, end.ended_at, end.output_tokens, end.status, end.kind) == (
        DAY1, DAY1, 3, "error", "end",
    )  # fmt: skip
