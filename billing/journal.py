"""The local journal: usage events that could not reach Redis, one JSON line each, fsynced.

A gateway owns its journal file alone (one path per gateway process). A line is
appended with O_APPEND and fsynced before `append` returns, so an event the
journal accepted survives a crash; a line torn by a crash mid-write fails to
parse and is set aside in `<journal>.rejected` rather than replayed.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from billing.errors import InvalidUsageEvent
from billing.events import UsageEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JournalContents:
    events: list[UsageEvent]
    rejected_lines: list[str]


class Journal:
    """Blocking file operations; async callers run them in a thread and serialise them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.rejected_path = self.path.with_name(self.path.name + ".rejected")
        self.num_writes = 0  # write+fsync rounds of append_many

    def append(self, event: UsageEvent) -> None:
        self.append_many([event])

    def append_many(self, events: list[UsageEvent]) -> None:
        """One write and one fsync for all of them."""
        self.num_writes += 1
        self._append_lines(self.path, [_line(e) for e in events])

    def read(self) -> JournalContents:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return JournalContents([], [])
        events: list[UsageEvent] = []
        rejected: list[str] = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                events.append(UsageEvent.from_fields(json.loads(line)))
            except (ValueError, TypeError, AttributeError, InvalidUsageEvent):
                rejected.append(line)
        return JournalContents(events, rejected)

    def is_empty(self) -> bool:
        try:
            return self.path.stat().st_size == 0
        except FileNotFoundError:
            return True

    def clear(self, rejected_lines: list[str]) -> None:
        """Empty the journal after its events reached Redis, keeping unparsable lines aside."""
        self.keep([], rejected_lines)

    def keep(self, events: list[UsageEvent], rejected_lines: list[str]) -> None:
        """Leave only `events` in the journal (the others reached Redis), unparsable lines
        set aside. A crash leaves the old journal or the new one, never a part of either."""
        if rejected_lines:
            log.warning(
                "billing journal %s: %d unparsable lines set aside", self.path, len(rejected_lines)
            )
            self._append_lines(self.rejected_path, rejected_lines)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.unlink(missing_ok=True)
        self._append_lines(partial, [_line(e) for e in events])
        os.replace(partial, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)

    @staticmethod
    def _append_lines(path: Path, lines: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(line + "\n" for line in lines).encode()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # A crash mid-write leaves a last line without its newline: end it first, so the
            # torn line stays a line of its own (set aside on read) and takes no event with it.
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)


def _line(event: UsageEvent) -> str:
    """An event as its journal line (without the newline)."""
    return json.dumps(event.to_fields(), sort_keys=True)
