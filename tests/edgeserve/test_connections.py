"""Connection limits: the servers `edgeserve` builds (`_server`), on loopback, against raw
sockets; and a real `edgeserve gateway` process with its connection flags."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgeserve.connections import (
    LINGER_S,
    MAX_LINGERING_REFUSALS,
    ConnectionLimits,
    default_max_connections,
)
from tests.conftest import INTERNAL_TOKEN, REDIS_URL, free_port

pytestmark = pytest.mark.timeout(60)


async def read_body(receive: Any) -> bytes | None:
    """The whole request body, or None when the client went away."""
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message["body"]
        more = message["more_body"]
    return body


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/echo answers its body; /stream reads its body, then streams 12 SSE events over 3 s;
    /early answers 401 without reading its body; /ack begins its answer, then reads its body
    and ends with the body's length; /block holds the event loop for 0.5 s; else 'hello'."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/stream":
        if await read_body(receive) is None:
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for i in range(12):
            await asyncio.sleep(0.25)
            await send(
                {"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    if scope["path"] == "/ack":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"reading\n", "more_body": True})
        if (body := await read_body(receive)) is not None:
            await send({"type": "http.response.body", "body": b"%d\n" % len(body)})
        return
    if scope["path"] == "/block":
        time.sleep(0.5)  # a busy server: nothing is accepted meanwhile
    status, body = 200, b"hello"
    if scope["path"] == "/early":
        status, body = 401, b"no key"
    elif scope["path"] == "/echo":
        echoed = await read_body(receive)
        if echoed is None:
            return
        body = echoed
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", b"%d" % len(body))]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


class Served:
    """`app` behind edgeserve's own server (serve._server) in a thread of its own."""

    def __init__(self, limits: ConnectionLimits) -> None:
        from edgeserve.servers import listen, uvicorn_server

        sockets = listen("127.0.0.1", 0)
        self.port = int(sockets[0].getsockname()[1])
        self.server = uvicorn_server(app, sockets, limits)
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


@contextlib.contextmanager
def served(**limits: Any) -> Iterator[Served]:
    server = Served(ConnectionLimits(**limits))
    try:
        yield server
    finally:
        server.stop()


def read_response(sock: socket.socket) -> tuple[str, dict[str, str], bytes]:
    """One response of known length: (status line, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "closed before the whole body"
        body += chunk
    return status, headers, body


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (EOF or reset), with nothing more to read."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def are_gone(socks: list[socket.socket]) -> list[bool]:
    """Whether the server's end of each of `socks` is gone: a byte sent comes back as a reset.
    (Reading cannot tell: a lingering server has sent its FIN already.)"""
    for sock in socks:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.send(b"a")
    time.sleep(0.1)  # the resets' way back
    gone = []
    for sock in socks:
        try:
            sock.send(b"a")
            gone.append(False)
        except (BrokenPipeError, ConnectionResetError):
            gone.append(True)
    return gone


def seconds_until_gone(sock: socket.socket, limit_s: float, every_s: float = 0.3) -> float:
    """Send a byte of body every `every_s` until the server's end of `sock` is gone."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if are_gone([sock])[0]:
            return time.monotonic() - started
        time.sleep(every_s)
    raise AssertionError(f"still open after {limit_s} s of a byte every {every_s} s")


def refusal(sock: socket.socket) -> tuple[str, str, bytes]:
    """A refusal as the client reads it: (status line, Connection header, body), then EOF."""
    status, headers, body = read_response(sock)
    assert headers["content-type"] == "text/plain; charset=utf-8"
    assert is_closed(sock)
    return status, headers["connection"], body


GET = b"GET /hello HTTP/1.1\r\nHost: t\r\n\r\n"


def test_headers_sent_at_one_byte_a_second_are_cut_off_at_the_deadline() -> None:
    with served(header_timeout_s=1.0, keep_alive_timeout_s=1.0) as server, server.connect() as sock:
        started = time.monotonic()
        for byte in GET:  # 1 byte a second, until the server answers
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.send(bytes([byte]))
            if select.select([sock], [], [], 1.0)[0]:
                break
        answered_s = time.monotonic() - started
        assert refusal(sock) == (
            "HTTP/1.1 408 Request Timeout", "close", b"request headers not received within 1 s"
        )  # fmt: skip
    assert 0.9 <= answered_s < 3.0


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline_without_an_answer() -> None:
    with served(header_timeout_s=1.0, keep_alive_timeout_s=1.0) as server, server.connect() as sock:
        started = time.monotonic()
        assert is_closed(sock)
        assert 0.9 <= time.monotonic() - started < 3.0


def test_a_head_of_exactly_the_cap_is_served_and_one_byte_more_is_431() -> None:
    cap = 4096
    head = b"GET /hello HTTP/1.1\r\nHost: t\r\nX-Pad: \r\n\r\n"
    exact = head.replace(b"X-Pad: ", b"X-Pad: " + b"a" * (cap - len(head)))
    assert len(exact) == cap
    with served(max_header_bytes=cap) as server:
        with server.connect() as sock:
            sock.sendall(exact)
            assert read_response(sock)[::2] == ("HTTP/1.1 200 OK", b"hello")
        with server.connect() as sock:
            sock.sendall(exact.replace(b"X-Pad: ", b"X-Pad: a"))
            assert refusal(sock) == (
                "HTTP/1.1 431 Request Header Fields Too Large", "close",
                b"request line and headers exceed 4096 bytes",
            )  # fmt: skip


def test_a_64_mib_header_is_refused_after_the_cap_without_being_read() -> None:
    with served() as server, server.connect() as sock:
        sent = 0

        def send_huge_header() -> None:
            nonlocal sent
            sock.sendall(b"GET /hello HTTP/1.1\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            with contextlib.suppress(OSError):  # the server closes in the middle of it
                for _ in range(64):
                    sock.sendall(chunk)
                    sent += len(chunk)

        sender = threading.Thread(target=send_huge_header)
        sender.start()
        try:
            assert refusal(sock) == (
                "HTTP/1.1 431 Request Header Fields Too Large", "close",
                b"request line and headers exceed 65536 bytes",
            )  # fmt: skip
        finally:
            sock.shutdown(socket.SHUT_RDWR)
            sender.join(timeout=10)
        assert sent < 64 << 20  # cut off, not read to its end


def test_connections_past_the_cap_are_refused_at_once_and_the_others_served() -> None:
    with served(max_connections=8, header_timeout_s=3.0, keep_alive_timeout_s=3.0) as server:
        before = server.connect()  # opened before the flood
        flood = [server.connect() for _ in range(7)]  # the cap is reached, all idle
        time.sleep(0.2)  # every one accepted
        refused = [server.connect() for _ in range(20)]
        started = time.monotonic()
        for sock in refused:
            assert refusal(sock) == (
                "HTTP/1.1 503 Service Unavailable", "close", b"too many connections"
            )  # fmt: skip
            sock.close()
        assert time.monotonic() - started < 1.0
        before.sendall(GET)
        assert read_response(before)[::2] == ("HTTP/1.1 200 OK", b"hello")
        before.close()
        for sock in flood:  # the header deadline cuts the idle ones
            assert is_closed(sock)
            sock.close()
        with server.connect() as after:
            after.sendall(GET)
            assert read_response(after)[::2] == ("HTTP/1.1 200 OK", b"hello")


def test_a_stalled_body_is_408_and_a_slow_one_is_served() -> None:
    with served(body_timeout_s=1.5, keep_alive_timeout_s=1.0, header_timeout_s=5.0) as server:
        with server.connect() as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
            assert refusal(sock) == (
                "HTTP/1.1 408 Request Timeout", "close", b"no byte of the request body for 1.5 s"
            )  # fmt: skip
        with server.connect() as sock:  # 6 bytes over 1.8 s: never idle for 1.5 s
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\n\r\n")
            for byte in b"abcdef":
                time.sleep(0.3)
                sock.sendall(bytes([byte]))
            assert read_response(sock)[::2] == ("HTTP/1.1 200 OK", b"abcdef")


def test_a_body_trickled_past_its_deadline_is_408_or_cut_and_a_large_one_is_served() -> None:
    limits = {"body_timeout_s": 1.0, "body_deadline_s": 2.0, "keep_alive_timeout_s": 1.0,
              "header_timeout_s": 5.0}  # fmt: skip
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
    with served(**limits) as server:
        with server.connect() as sock:  # a byte every 0.3 s: never idle for 1 s
            sock.sendall(head % b"/echo")
            started = time.monotonic()
            while not select.select([sock], [], [], 0.3)[0]:
                sock.send(b"a")
            assert refusal(sock) == (
                "HTTP/1.1 408 Request Timeout", "close", b"request body not received within 2 s"
            )  # fmt: skip
            assert 1.9 <= time.monotonic() - started < 3.5
        with server.connect() as sock:  # an answer begun is cut, unfinished
            sock.sendall(head % b"/ack")
            started = time.monotonic()
            data = b""
            while b"reading\n" not in data:
                data += sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 200 OK\r\n")
            seconds_until_gone(sock, limit_s=4.0)
            assert 1.9 <= time.monotonic() - started < 3.5
        with server.connect() as sock:  # 4 MiB in 64 KiB pieces over about a second
            body = bytes(range(256)) * (1 << 14)
            sock.sendall(
                b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            for i in range(0, len(body), 1 << 16):
                sock.sendall(body[i : i + (1 << 16)])
                time.sleep(0.015)
            assert read_response(sock)[::2] == ("HTTP/1.1 200 OK", body)


@pytest.mark.parametrize(
    ("framing", "first_bytes"),
    [(b"Content-Length: 100000", b"a"), (b"Transfer-Encoding: chunked", b"186a0\r\na")],
)
def test_an_answer_given_before_the_body_is_read_closes_the_connection_after_the_linger(
    framing: bytes, first_bytes: bytes
) -> None:
    limits = {"body_timeout_s": 1.0, "keep_alive_timeout_s": 1.0, "header_timeout_s": 5.0}
    with served(**limits) as server:
        with server.connect() as sock:  # a byte every 0.3 s, for ever: never idle, never done
            sock.sendall(
                b"POST /early HTTP/1.1\r\nHost: t\r\n%s\r\n\r\n%s" % (framing, first_bytes)
            )
            assert read_response(sock)[::2] == ("HTTP/1.1 401 Unauthorized", b"no key")
            assert seconds_until_gone(sock, limit_s=LINGER_S + 2.0) >= LINGER_S - 0.5
            assert sock.recv(1) == b""  # its FIN came first: the answer was whole
        with server.connect() as sock:  # a client that sends its whole body first reads the answer
            sock.sendall(b"POST /early HTTP/1.1\r\nHost: t\r\nContent-Length: 300000\r\n\r\n")
            sock.sendall(b"a" * 300_000)
            assert read_response(sock)[::2] == ("HTTP/1.1 401 Unauthorized", b"no key")
            assert is_closed(sock)


def test_a_client_past_the_cap_that_sent_a_300_kb_body_reads_the_503() -> None:
    with served(max_connections=1) as server, server.connect() as held:  # the only slot
        # A busy server: the request arrives before its connection is accepted, as at a full node.
        held.sendall(b"GET /block HTTP/1.1\r\nHost: t\r\n\r\n")
        time.sleep(0.1)
        with server.connect() as sock:

            def send() -> None:  # whole before reading, as HTTP clients do
                with contextlib.suppress(OSError):
                    sock.sendall(
                        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 300000\r\n\r\n"
                    )
                    sock.sendall(b"a" * 300_000)

            sender = threading.Thread(target=send)
            sender.start()
            try:
                status, _, body = read_response(sock)
                assert (status, body) == (
                    "HTTP/1.1 503 Service Unavailable",
                    b"too many connections",
                )
                assert (
                    sock.recv(1) == b""
                )  # an orderly close: a reset may destroy the answer unread
            finally:
                sender.join(timeout=10)
        assert read_response(held)[::2] == ("HTTP/1.1 200 OK", b"hello")


def test_at_most_MAX_LINGERING_REFUSALS_refused_connections_linger_at_once() -> None:
    with served(max_connections=1) as server, server.connect():  # it holds the only slot
        time.sleep(0.2)  # accepted
        refused = [server.connect() for _ in range(MAX_LINGERING_REFUSALS + 8)]
        try:
            for sock in refused:
                assert refusal(sock)[0] == "HTTP/1.1 503 Service Unavailable"
            assert are_gone(refused).count(False) == MAX_LINGERING_REFUSALS
        finally:
            for sock in refused:
                sock.close()


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout() -> None:
    with served(keep_alive_timeout_s=1.0, header_timeout_s=4.0) as server, server.connect() as sock:
        sock.sendall(GET)
        assert read_response(sock)[::2] == ("HTTP/1.1 200 OK", b"hello")
        sock.sendall(GET)  # kept alive within the timeout
        assert read_response(sock)[::2] == ("HTTP/1.1 200 OK", b"hello")
        idle_since = time.monotonic()
        assert is_closed(sock)  # silently: no 408 for a request never begun
        assert 0.9 <= time.monotonic() - idle_since < 3.0  # the keep-alive, not the head deadline


def test_the_last_request_a_connection_may_carry_is_answered_with_connection_close() -> None:
    with served(max_requests_per_connection=2) as server, server.connect() as sock:
        sock.sendall(GET)
        status, headers, _ = read_response(sock)
        assert (status, "connection" in headers) == ("HTTP/1.1 200 OK", False)
        sock.sendall(GET)
        status, headers, body = read_response(sock)
        assert (status, headers["connection"], body) == ("HTTP/1.1 200 OK", "close", b"hello")
        assert is_closed(sock)


def test_an_sse_stream_outlives_every_deadline() -> None:
    limits = {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "body_deadline_s": 1.0,
              "keep_alive_timeout_s": 1.0}  # fmt: skip
    with served(**limits) as server, server.connect() as sock:
        sock.sendall(b"POST /stream HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}")
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the chunked stream's end, 3 s on
            chunk = sock.recv(65536)
            assert chunk, f"the stream was cut: {data!r}"
            data += chunk
        events = re.findall(rb"data: [^\n]*", data)
        assert events == [b"data: %d" % i for i in range(12)] + [b"data: [DONE]"]
        sock.sendall(GET)  # and the connection serves on
        assert read_response(sock)[::2] == ("HTTP/1.1 200 OK", b"hello")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"header_timeout_s": 0}, "header_timeout_s must be a positive number of seconds, got 0"),
        ({"body_timeout_s": float("nan")}, "body_timeout_s must be a positive number of seconds, got nan"),
        ({"keep_alive_timeout_s": -1}, "keep_alive_timeout_s must be a positive number of seconds, got -1"),
        ({"max_header_bytes": 1023}, "max_header_bytes must be at least 1024, got 1023"),
        ({"max_connections": 0}, "max_connections must be at least 1, got 0"),
        ({"max_requests_per_connection": 0}, "max_requests_per_connection must be at least 1, got 0"),
        ({"keep_alive_timeout_s": 11.0}, "keep_alive_timeout_s must be at most header_timeout_s (10.0), got 11.0"),
        ({"body_deadline_s": float("inf")}, "body_deadline_s must be a positive number of seconds, got inf"),
        ({"body_deadline_s": 5.0}, "body_deadline_s must be at least body_timeout_s (10.0), got 5.0"),
    ],
)  # fmt: skip
def test_limits_are_validated_at_construction(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        ConnectionLimits(**fields)
    assert str(raised.value) == message


def test_the_default_cap_is_a_third_of_the_descriptors_left_at_most_10000() -> None:
    assert default_max_connections(1024) == 256
    assert default_max_connections(20_000) == 6581
    assert default_max_connections(1 << 20) == 10_000
    assert default_max_connections(100) == 1


# -- a real gateway process: huge heads, connections past its cap, a trickled body ---------

EDGESERVE = [sys.executable, "-c", "from edgeserve.cli import main; main()"]


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


@pytest.mark.timeout(600)  # a gateway process of its own
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


@pytest.mark.timeout(600)  # a gateway process of its own
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
