"""The servers a command runs: sockets bound before anything loads, uvicorn on them with
the connection limits (`edgeserve/connections.py`) and their flags, shared by `up`, `node`
and `gateway`, and one signal handler for every server of the process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    import uvicorn

    from edgeserve.connections import ConnectionLimits

# The connection limits' flags, the same on up, node and gateway.
HEADER_TIMEOUT = typer.Option(
    10.0,
    help="seconds from a connection's opening, or its previous response, to the end of a "
    "request's headers; past them 408 and close",
)
MAX_HEADER_BYTES = typer.Option(
    64 * 1024, help="bytes of a request's line and headers; past them 431 and close"
)
BODY_TIMEOUT = typer.Option(
    10.0, help="seconds without a byte of a request body being read; past them 408 and close"
)
BODY_DEADLINE = typer.Option(
    60.0,
    help="seconds from the end of a request's headers to the end of its body; past them 408 "
    "and close (at least --body-timeout-s)",
)
MAX_CONNECTIONS = typer.Option(
    None,
    help="open connections per server; past them 503 at once and close "
    "(default: a third of the open-file limit, at most 10000)",
)
MAX_REQUESTS_PER_CONNECTION = typer.Option(
    1000, help="requests per connection; the last one's answer says Connection: close"
)
KEEP_ALIVE_HELP = "seconds an idle keep-alive connection stays open (at most --header-timeout-s)"


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of `host` ("" for all) on `port` (0: one free port),
    before anything is printed or loaded: a port in use or a name that does not resolve is
    one line and exit 1, not a banner with a key that never works and then a traceback;
    and a port picked here cannot be taken before the server starts."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        cannot_listen(host, port, exc.strerror or str(exc))
    addresses = list(dict.fromkeys((family, address) for family, _, _, _, address in infos))
    sockets: list[socket.socket] = []
    try:
        for family, address in addresses[: 1 if port == 0 else None]:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # its own socket beside the IPv4 one
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        cannot_listen(host, port, os.strerror(exc.errno) if exc.errno else str(exc))
    return sockets


def cannot_listen(host: str, port: int, reason: str) -> NoReturn:
    typer.echo(f"error: cannot listen on {host}:{port}: {reason}", err=True)
    raise typer.Exit(1)


def bound_port(sockets: list[socket.socket]) -> int:
    return int(sockets[0].getsockname()[1])


def url_host(host: str) -> str:
    """`host` as a URL names it from this machine: a wildcard address is reached on loopback."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def connection_limits(max_connections: int | None, **fields: Any) -> ConnectionLimits:
    """ConnectionLimits from the flags, or the reason they are refused as a command-line
    error. The open-file limit is raised first: the default cap is a share of it."""
    from edgeserve.connections import (
        ConnectionLimits,
        default_max_connections,
        raise_open_file_limit,
    )

    if max_connections is None:
        max_connections = default_max_connections(raise_open_file_limit())
    else:
        raise_open_file_limit()
    try:
        return ConnectionLimits(max_connections=max_connections, **fields)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def uvicorn_server(
    app: Any, sockets: list[socket.socket], limits: ConnectionLimits
) -> uvicorn.Server:
    """A uvicorn server on the bound `sockets`, its connections bounded by `limits`."""
    import uvicorn

    from edgeserve.connections import protocol_class

    class Server(uvicorn.Server):
        # Signals are handled once for every server in the process (see run_servers).
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            await super().serve(sockets=bound)

    bound = sockets
    host, port = sockets[0].getsockname()[:2]
    config = uvicorn.Config(
        app, host=host, port=port, loop="uvloop", http=protocol_class(limits), ws="none",
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=30, access_log=False,
        log_level="warning",
        log_config=None,  # uvicorn's own lines go through the root logger: JSON, like ours
    )  # fmt: skip
    return Server(config)


async def run_servers(servers: list[uvicorn.Server], on_signal: Any = None) -> None:
    """Serve until SIGINT/SIGTERM; `on_signal` runs first (a node deregisters before it drains)."""
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()

    def stop() -> None:
        async def shutdown() -> None:
            if on_signal is not None:
                await on_signal()
            for server in servers:
                server.should_exit = True

        task = loop.create_task(shutdown())
        pending.add(task)
        task.add_done_callback(pending.discard)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(s.serve() for s in servers))
