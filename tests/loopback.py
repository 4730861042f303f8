"""A real SmolLM2 node on loopback, and gateways built around it with the parts a test chooses.

The admission and usage end-to-end tests share one node per module and start one
gateway per test, each wired with its own limiter, queue settings, sink or ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.conftest import (
    ACCOUNT_ID,
    INTERNAL_TOKEN,
    OTHER_ACCOUNT_ID,
    ServerThread,
    start_node_server,
    wait_for_nodes,
)

API_KEY = "es-e2e-key-a"
OTHER_KEY = "es-e2e-key-b"
ADMIN_TOKEN = "admin-e2e-token-0123456789"


@dataclass
class Node:
    server: ServerThread
    registry: Any  # LocalCapacityRegistry shared with the gateways of the test

    def total_tokens(self) -> int:
        records = asyncio.run(self.registry.list_live())
        return int(records[0].num_total_tokens)


def start_node(engine: Any) -> Node:
    from scheduler.capacity import LocalCapacityRegistry

    registry = LocalCapacityRegistry()
    server, _ = start_node_server(engine, registry, "node-1")
    wait_for_nodes(registry)
    return Node(server, registry)


def running_node(engine: Any) -> Iterator[Node]:
    """Body of a module-scoped `node` fixture: one node for the whole module."""
    started = start_node(engine)
    yield started
    started.server.stop()


def start_gateway(
    node: Node,
    *,
    overcommit: float = 2.0,
    settings: dict[str, Any] | None = None,
    keys: Any = None,
    reservations: Any = None,
    **parts: Any,
) -> ServerThread:
    """A gateway on loopback in front of `node`; `parts` go to create_app (limiter, ledger...).

    `keys` defaults to an in-memory store holding API_KEY and OTHER_KEY (a store passed in
    holds what the caller put there); `reservations` defaults to in-process ones."""
    from gateway.app import create_app
    from gateway.keys import MemoryKeyStore
    from gateway.settings import GatewaySettings
    from scheduler.capacity import CapacityView
    from scheduler.placement import LocalReservations, Placer

    if keys is None:
        keys = MemoryKeyStore()
        asyncio.run(keys.add(API_KEY, ACCOUNT_ID))
        asyncio.run(keys.add(OTHER_KEY, OTHER_ACCOUNT_ID))
    app = create_app(
        GatewaySettings(
            internal_token=INTERNAL_TOKEN,
            capacity_max_age_s=0.2,
            admin_token=ADMIN_TOKEN,
            **(settings or {}),
        ),
        keys=keys,
        placer=Placer(
            CapacityView(node.registry, max_age_s=0.2),
            reservations or LocalReservations(),
            overcommit=overcommit,
        ),
        **parts,
    )
    return ServerThread(app).start()
