"""Fixtures of the CLI's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from billing.ledger import SqliteLedger
from tests.billing.samples import DAY2, make_event


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    """A SQLite ledger of three rows: acct-a's a-1 (day 1) and a-2 (day 2), acct-b's b-1."""
    path = tmp_path / "ledger.sqlite3"
    ledger = SqliteLedger(path)
    ledger.insert_many(
        [
            make_event("a-1", input_tokens=1_000_000, cached_tokens=500_000, output_tokens=0),
            make_event("a-2", started_at=DAY2, ended_at=DAY2, output_tokens=1_000_000),
            make_event("b-1", account_id="acct-b"),
        ]
    )
    ledger.close()
    return path
