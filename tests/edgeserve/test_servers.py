"""The sockets a command binds before it prints or loads anything (edgeserve/servers.py): a
port in use or a host that does not resolve is one line, and every address of a host is
bound."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.conftest import INTERNAL_TOKEN


@pytest.mark.parametrize(
    "command",
    [
        ["up", "--device", "cpu"],
        ["node", "--internal-token", INTERNAL_TOKEN, "--device", "cpu"],
        ["gateway", "--internal-token", INTERNAL_TOKEN],
    ],
)
def test_a_port_in_use_is_one_line_before_any_banner(command: list[str]) -> None:
    """`up` had printed its banner (a new API key that would never work), then ~10 KB of
    tracebacks; each command now binds its port before it prints or loads anything."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(build_app(), [*command, "--port", str(port)])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_host_that_does_not_resolve_is_one_readable_line() -> None:
    """getaddrinfo's errors carry negative codes: they had read "Unknown error -2"."""
    result = CliRunner().invoke(
        build_app(),
        ["gateway", "--internal-token", INTERNAL_TOKEN, "--host", "no-such-host.invalid"],
    )
    assert (result.exit_code, result.stdout) == (1, "")
    [line] = result.stderr.splitlines()
    assert line.startswith("error: cannot listen on no-such-host.invalid:8080: ")
    assert "Unknown error" not in line


def test_every_address_of_the_host_is_bound() -> None:
    """A host of several addresses ("" for all, a dual-stack name) had had only the first
    bound, where uvicorn had bound every one."""
    import socket

    from edgeserve.servers import listen
    from tests.conftest import free_port

    port = free_port()
    sockets = listen("", port)
    try:
        bound = sorted((s.family, s.getsockname()[:2]) for s in sockets)
    finally:
        for s in sockets:
            s.close()
    expected = [(socket.AF_INET, ("0.0.0.0", port))]
    if socket.has_ipv6:
        expected.append((socket.AF_INET6, ("::", port)))
    assert bound == expected
