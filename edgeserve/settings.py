"""Settings shared by the `edgeserve` commands: where local state lives."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def state_dir() -> Path:
    """$EDGESERVE_HOME, else the user's cache dir (the same place models are pulled to)."""
    configured = os.environ.get("EDGESERVE_HOME")
    if configured:
        return Path(configured).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgeserve"))


def journal_path(port: int) -> Path:
    """The usage journal of the process (gateway or node) on this host and port: a restarted
    one replays its own."""
    path = state_dir() / "journal" / f"usage-{socket.gethostname()}-{port}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # every command's, where REDIS_URL is unset

# A Redis that stops answering is an error after this long, never a hang (the billing
# worker's blocking read waits 0.5 s; the admission limiter has its own, shorter bound).
REDIS_TIMEOUT_S = 5.0


def redis_client(url: str) -> Any:
    """An asyncio Redis client for `url` whose connects and calls give up after REDIS_TIMEOUT_S."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )
