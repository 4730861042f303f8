"""How `edgeserve run` finds the `edgeserve up` running on this machine: `up` writes its
address, account and API key to `$EDGESERVE_HOME/up.json` once it is ready, readable by
its user alone (0600, as an SSH key), and removes it when it stops."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgeserve.settings import state_dir


def up_file_path() -> Path:
    return state_dir() / "up.json"


@dataclass(frozen=True)
class UpFile:
    url: str  # the gateway, as this machine reaches it
    account_id: str
    api_key: str
    model: str  # as `up --model` named it
    pid: int = field(default_factory=os.getpid)

    def write(self) -> None:
        """Written whole or not at all: a `run` never reads half a file."""
        path = up_file_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{self.pid}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self), out)
        os.replace(partial, path)

    def remove(self) -> None:
        """Removes the file if it is still this process's (a later `up` may have replaced it)."""
        if read_up_file() == self:
            with contextlib.suppress(FileNotFoundError):
                up_file_path().unlink()

    @property
    def is_alive(self) -> bool:
        """Whether the process that wrote it still runs (a killed `up` leaves its file)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            return True
        return True


def read_up_file() -> UpFile | None:
    """The `up` recorded in this home, or None (no file, or one that cannot be read)."""
    try:
        fields = json.loads(up_file_path().read_text())
        return UpFile(**fields)
    except (OSError, ValueError, TypeError):
        return None
