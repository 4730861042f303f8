"""A redis-server of the test's own on a free port, that the test can stop, freeze and thaw.

Shared by the tests of Redis outages in every room (admission, keys, capacity,
reservations, the gateway's store outage)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from tests.conftest import free_port


class RedisServer:
    """A throwaway redis-server without persistence."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGCONT)  # a frozen server cannot exit
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def freeze(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)
