"""`edgeserve up | node | gateway` as processes: the internal token's floor, the connection
flags of a real gateway, and the API keys a restarted `up --redis-url` leaves in Redis."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.conftest import INTERNAL_TOKEN, REDIS_URL, free_port
from tests.edgeserve.test_connections import (
    LINGER_S,
    read_response,
    refusal,
    seconds_until_gone,
)

EDGESERVE = [sys.executable, "-c", "from edgeserve.cli import main; main()"]


def _stderr(result) -> str:
    return " ".join(result.stderr.replace("│", " ").split())  # rich boxes and wraps it


@pytest.mark.parametrize("command", [["node", "--device", "cpu"], ["gateway"]])
def test_an_internal_token_shorter_than_16_characters_is_refused(command: list[str]) -> None:
    result = CliRunner().invoke(build_app(), [*command, "--internal-token", "a"])
    assert result.exit_code == 2
    assert "Invalid value for --internal-token: the internal token must be at least 16 " \
        "characters, got 1 (`openssl rand -hex 24` makes one)" in _stderr(result)  # fmt: skip


def test_up_refuses_a_short_internal_token_from_its_environment(monkeypatch) -> None:
    monkeypatch.setenv("EDGESERVE_INTERNAL_TOKEN", "fifteen-chars-x")
    result = CliRunner().invoke(build_app(), ["up", "--device", "cpu"])
    assert result.exit_code == 2
    assert "Invalid value for EDGESERVE_INTERNAL_TOKEN: the internal token must be at least " \
        "16 characters, got 15" in _stderr(result)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--header-timeout-s", "0"], "header_timeout_s must be a positive number of seconds, got 0.0"),
        (["--max-header-bytes", "100"], "max_header_bytes must be at least 1024, got 100"),
        (["--keep-alive-timeout-s", "20"], "keep_alive_timeout_s must be at most header_timeout_s (10.0), got 20.0"),
        (["--max-connections", "0"], "max_connections must be at least 1, got 0"),
        (["--body-deadline-s", "5"], "body_deadline_s must be at least body_timeout_s (10.0), got 5.0"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", [["gateway"], ["node", "--device", "cpu"]])
def test_connection_limits_are_refused_before_anything_starts(command, args, message) -> None:
    result = CliRunner().invoke(build_app(), [*command, "--internal-token", INTERNAL_TOKEN, *args])
    assert result.exit_code == 2
    assert message in _stderr(result)


def _vm_hwm_kib(pid: int) -> int:
    """The process's peak resident memory."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _get(port: int, path: str = "/openapi.json") -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" % path.encode())
        return read_response(sock)[0]


def _fill(port: int, cap: int) -> list[socket.socket]:
    """`cap` idle connections, all accepted: the server is at its cap. (A refused client's
    close reaches the server a moment after its answer: until then it still counts.)"""
    deadline = time.monotonic() + 10
    while True:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(cap)]
        if not select.select(idle, [], [], 0.3)[0]:  # nothing to read: none refused
            return idle
        for sock in idle:
            sock.close()
        assert time.monotonic() < deadline, "the server kept refusing below its cap"


@pytest.fixture
def gateway(redis_prefix: str, tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen(
        [*EDGESERVE, "gateway", "--port", str(port), "--redis-url", REDIS_URL,
         "--prefix", redis_prefix, "--internal-token", INTERNAL_TOKEN,
         "--header-timeout-s", "2", "--keep-alive-timeout-s", "2", "--max-connections", "4"],
        env=os.environ | {"EDGESERVE_HOME": str(tmp_path)},
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "gateway.log").open("wb"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
            try:
                assert _get(port) == "HTTP/1.1 200 OK"
                break
            except OSError:
                assert time.monotonic() < deadline, "the gateway never listened"
                time.sleep(0.1)
        yield port, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_gateway_refuses_huge_heads_without_growing_and_connections_past_its_cap(
    gateway,
) -> None:
    port, proc = gateway
    peak_before = _vm_hwm_kib(proc.pid)
    answers: list[tuple[str, str, bytes]] = []

    def unfinished_64_mib_head() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:

            def send() -> None:
                sock.sendall(b"GET /openapi.json HTTP/1.1\r\nX-Big: ")
                try:
                    for _ in range(64):
                        sock.sendall(b"a" * (1 << 20))
                except OSError:
                    pass  # cut off

            sender = threading.Thread(target=send)
            sender.start()
            answers.append(refusal(sock))
            sender.join(timeout=10)

    clients = [threading.Thread(target=unfinished_64_mib_head) for _ in range(3)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=30)
    assert answers == 3 * [(
        "HTTP/1.1 431 Request Header Fields Too Large", "close",
        b"request line and headers exceed 65536 bytes",
    )]  # fmt: skip
    assert _vm_hwm_kib(proc.pid) - peak_before < 16 * 1024  # not 3 x 64 MiB

    idle = _fill(port, 4)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as excess:
        started = time.monotonic()
        assert refusal(excess) == (
            "HTTP/1.1 503 Service Unavailable",
            "close",
            b"too many connections",
        )
        assert time.monotonic() - started < 1.0
    for sock in idle:
        sock.close()
    time.sleep(0.2)
    assert _get(port) == "HTTP/1.1 200 OK"


def test_a_keyless_body_sent_a_byte_at_a_time_reads_401_and_its_connection_closes(gateway) -> None:
    port, _ = gateway
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        assert read_response(sock)[0] == "HTTP/1.1 401 Unauthorized"
        # A byte every half second: never idle for --body-timeout-s, and never done.
        assert seconds_until_gone(sock, limit_s=LINGER_S + 3.0, every_s=0.5) < LINGER_S + 1.5


# -- the API key of `up --redis-url` -------------------------------------------------------


class Up:
    """`edgeserve up --redis-url` as a process, stopped once it has printed its API key."""

    def __init__(self, port: int, prefix: str, tmp_path: Path, **env: str) -> None:
        self.proc = subprocess.Popen(
            [*EDGESERVE, "up", "--port", str(port), "--device", "cpu", "--redis-url", REDIS_URL,
             "--prefix", prefix, "--ledger", str(tmp_path / "ledger.sqlite3")],
            env=os.environ | {"EDGESERVE_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"} | env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("  API key:"):
            line = self.proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        self.api_key = lines[-1].split()[-1]
        deadline = time.monotonic() + 60
        while True:  # serving (503 while the model loads): its signal handlers are set
            try:
                _get(port)
                break
            except OSError:
                assert time.monotonic() < deadline, "up never listened"
                time.sleep(0.05)

    def stop(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _account_keys(prefix: str, *keys: str) -> tuple[list[str], list[str | None]]:
    """The ids of account `local`'s keys, and the account each of `keys` resolves to."""
    from gateway.keys import RedisKeyStore

    async def read() -> tuple[list[str], list[str | None]]:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            store = RedisKeyStore(client, prefix)
            listed = [info.key_id for info in await store.list("local")]
            return listed, [await store.lookup(key) for key in keys]
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_a_restarted_up_leaves_one_generated_key_in_redis(
    smollm2_path, redis_prefix: str, tmp_path: Path
) -> None:
    from gateway.keys import key_id_of

    port = free_port()
    crashed = Up(port, redis_prefix, tmp_path)
    crashed.stop(signal.SIGKILL)  # no chance to revoke its key
    assert _account_keys(redis_prefix, crashed.api_key) == ([key_id_of(crashed.api_key)], ["local"])
    restarted = Up(port, redis_prefix, tmp_path)
    assert _account_keys(redis_prefix, crashed.api_key, restarted.api_key) == (
        [key_id_of(restarted.api_key)], [None, "local"],
    )  # fmt: skip
    restarted.stop(signal.SIGTERM)
    assert _account_keys(redis_prefix, restarted.api_key) == ([], [None])
    chosen = Up(port, redis_prefix, tmp_path, EDGESERVE_API_KEY="es-chosen-by-the-operator")
    chosen.stop(signal.SIGTERM)
    assert _account_keys(redis_prefix, "es-chosen-by-the-operator") == (
        [key_id_of("es-chosen-by-the-operator")], ["local"],
    )  # fmt: skip
