"""The gateway's local journal: events appended and fsynced one line each, read back, kept
or cleared, a line torn by a crash set aside rather than replayed."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from billing.journal import Journal, JournalContents
from tests.billing.samples import make_event


def test_events_appended_read_back_in_order(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "gw" / "usage.journal")
    assert journal.is_empty() and journal.read() == JournalContents([], [])
    a, b, c = make_event("a"), make_event("b", output_tokens=7), make_event("c", status="error")
    journal.append(a)
    journal.append_many([b, c])
    assert journal.num_writes == 2  # one write and fsync a call
    assert journal.read() == JournalContents([a, b, c], [])
    assert not journal.is_empty()
    assert stat.S_IMODE(journal.path.stat().st_mode) == 0o600
    first = journal.path.read_text().splitlines()[0]
    assert json.loads(first) == a.to_fields()
    assert list(json.loads(first)) == sorted(a.to_fields())  # keys sorted


def test_a_torn_line_is_set_aside_and_takes_no_event_with_it(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "usage.journal")
    a, b = make_event("a"), make_event("b")
    journal.append(a)
    torn = json.dumps(make_event("torn").to_fields())[:40]
    with journal.path.open("a") as f:
        f.write(torn)  # a crash mid-write: no newline
    journal.append(b)
    contents = journal.read()
    assert contents == JournalContents([a, b], [torn])

    journal.keep([b], contents.rejected_lines)  # a reached Redis; b did not
    assert journal.read() == JournalContents([b], [])
    assert journal.rejected_path == tmp_path / "usage.journal.rejected"
    assert journal.rejected_path.read_text() == torn + "\n"
    assert not (tmp_path / "usage.journal.partial").exists()

    journal.clear([])
    assert journal.is_empty() and journal.read() == JournalContents([], [])
    assert journal.rejected_path.read_text() == torn + "\n"  # set aside once


def test_lines_that_are_not_events_are_rejected_and_blank_ones_skipped(tmp_path: Path) -> None:
    path = tmp_path / "usage.journal"
    a = make_event("a")
    no_account = {k: v for k, v in a.to_fields().items() if k != "account_id"}
    bad_status = a.to_fields() | {"status": "maybe"}
    lines = [json.dumps(a.to_fields()), "", "[1, 2]", json.dumps(no_account),
             json.dumps(bad_status)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    assert Journal(path).read() == JournalContents([a], lines[2:])
