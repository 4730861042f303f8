"""Where the commands keep local state, and the Redis client every command opens."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from platformdirs import user_cache_dir

from edgeserve.settings import REDIS_TIMEOUT_S, journal_path, redis_client, state_dir


def test_state_lives_in_edgeserve_home_else_the_users_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    assert state_dir() == tmp_path / "home"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EDGESERVE_HOME", "~/es")
    assert state_dir() == tmp_path / "es"
    monkeypatch.delenv("EDGESERVE_HOME")
    assert state_dir() == Path(user_cache_dir("edgeserve"))


def test_a_process_journal_is_named_by_host_and_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    path = journal_path(8080)
    assert path == tmp_path / "journal" / f"usage-{socket.gethostname()}-8080.log"
    assert path.parent.is_dir() and not path.exists()


async def test_a_redis_client_gives_up_rather_than_hangs() -> None:
    client = redis_client("redis://127.0.0.1:6379/3")
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"], kwargs["db"]) == (
            REDIS_TIMEOUT_S, REDIS_TIMEOUT_S, 3,
        )  # fmt: skip
        assert REDIS_TIMEOUT_S == 5.0
    finally:
        await client.aclose()
