"""The servers' ports in tests: never one a client connection could take first."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.conftest import free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(5)]
    assert len(set(ports)) == 5
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(10000 <= p < ephemeral_low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
