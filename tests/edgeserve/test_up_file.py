"""The file `edgeserve run` finds a running `up` by, and where a command's ledger lies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from edgeserve.stores import ledger_flag, ledger_location
from edgeserve.up_file import UpFile, read_up_file, up_file_path


def test_the_up_file_is_its_users_alone_and_removed_only_by_its_writer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    ours = UpFile("http://127.0.0.1:8080", "local", "es-key", "smollm2")
    ours.write()
    assert up_file_path() == tmp_path / "home" / "up.json"
    assert up_file_path().stat().st_mode & 0o777 == 0o600
    assert read_up_file() == ours and ours.is_alive
    later = UpFile("http://127.0.0.1:8081", "local", "es-other", "smollm2", pid=ours.pid + 1)
    later.write()
    ours.remove()  # replaced by a later up: not ours to remove
    assert read_up_file() == later
    later.remove()
    assert read_up_file() is None
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == []


def test_an_up_that_died_is_not_alive() -> None:
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert not UpFile("u", "a", "k", "m", pid=int(exited.stdout)).is_alive


def test_one_ledger_flag_its_aliases_and_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert ledger_flag("x.sqlite3", None, None) == "x.sqlite3"
    assert ledger_flag(None, "postgresql://db/l", None) == "postgresql://db/l"
    assert ledger_flag(None, None, tmp_path / "l.sqlite3") == tmp_path / "l.sqlite3"
    with pytest.raises(typer.BadParameter, match="give one of --ledger, --sqlite, not several"):
        ledger_flag("x.sqlite3", None, tmp_path / "l.sqlite3")
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    assert ledger_location(None) == str(tmp_path / "home" / "ledger.sqlite3")
    assert ledger_location(str(tmp_path / "own.sqlite3")) == str(tmp_path / "own.sqlite3")
    monkeypatch.setenv("DATABASE_URL", "postgresql://billing:pw@db/ledger")
    assert ledger_location(None) == "postgresql://billing@db/ledger"
    assert ledger_location("postgresql://u:pw@h/l") == "postgresql://u@h/l"
