"""The gateway's watch over quiet nodes (`NodeWatch`): a node that answers its health probe
(200, or 503 while it loads) is alive; one that does not answer in time, or refuses the
connection, is marked down. The nodes: a stand-in on loopback, a socket that accepts and
never answers (a frozen node), and a port nobody listens on."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.liveness import NodeWatch
from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
from scheduler.placement import LocalReservations, Placement, Placer
from tests.conftest import ServerThread, free_port

pytestmark = pytest.mark.timeout(60)

SILENCE_S = 0.3
PROBE_TIMEOUT_S = 0.5


@dataclass
class Fleet:
    watch: NodeWatch
    placer: Placer
    num_probes: list[int]  # the health probes the alive node has answered

    async def live(self) -> list[str]:
        return [r.node_id for r in (await self.placer.served())["smollm2"]]


def _loading_node(num_probes: list[int]) -> Starlette:
    async def health(request: Request) -> PlainTextResponse:
        num_probes.append(1)
        await asyncio.sleep(0.2)
        return PlainTextResponse("loading", 503)

    return Starlette(routes=[Route("/internal/v1/health", health)])


@pytest.fixture
def addresses() -> Iterator[tuple[str, str, str, list[int]]]:
    """(alive, frozen, gone) addresses, and the alive node's probe count."""
    num_probes: list[int] = []
    alive = ServerThread(_loading_node(num_probes)).start()
    frozen = socket.create_server(("127.0.0.1", free_port()), backlog=16)  # never accepts
    frozen_url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
    yield alive.url, frozen_url, f"http://127.0.0.1:{free_port()}", num_probes
    frozen.close()
    alive.stop()


@pytest.fixture
async def fleet(addresses: tuple[str, str, str, list[int]]) -> AsyncIterator[Fleet]:
    *urls, num_probes = addresses
    registry = LocalCapacityRegistry()
    for node_id, url in zip(("alive", "frozen", "gone"), urls, strict=True):
        await registry.publish(CapacityRecord(
            node_id, url, "mixed", ("smollm2",), 1000, 1000, 16, "fp32", 0, 0, 0.0, time.time(),
            300.0, "fp32",
        ))  # fmt: skip
    placer = Placer(CapacityView(registry, max_age_s=0.0), LocalReservations())
    async with httpx.AsyncClient() as client:
        auth = {"authorization": "Bearer internal"}
        yield Fleet(NodeWatch(client, auth, placer, SILENCE_S, PROBE_TIMEOUT_S), placer,
                    num_probes)  # fmt: skip


def _placement(fleet: Fleet, node_id: str, address: str) -> Placement:
    return Placement(f"req-{node_id}", node_id, address, 0)


async def test_a_node_that_answers_is_alive_and_others_are_marked_down(
    fleet: Fleet, addresses: tuple[str, str, str, list[int]]
) -> None:
    alive, frozen, gone, _ = addresses
    assert await fleet.live() == ["alive", "frozen", "gone"]
    assert await fleet.watch.answers(_placement(fleet, "alive", alive)) is True
    started = time.monotonic()
    assert await fleet.watch.answers(_placement(fleet, "frozen", frozen)) is False
    assert time.monotonic() - started < PROBE_TIMEOUT_S + 1.5  # not a read timeout's wait
    assert await fleet.watch.answers(_placement(fleet, "gone", gone)) is False
    assert await fleet.live() == ["alive"]


async def test_the_quiet_streams_of_one_node_share_one_probe(
    fleet: Fleet, addresses: tuple[str, str, str, list[int]]
) -> None:
    alive = _placement(fleet, "alive", addresses[0])
    assert await asyncio.gather(*(fleet.watch.answers(alive) for _ in range(5))) == [True] * 5
    assert fleet.num_probes == [1]
    assert await fleet.watch.answers(alive) is True  # the next silence: a probe of its own
    assert fleet.num_probes == [1, 1]


async def test_a_frozen_node_is_found_after_its_silence_and_one_probe(
    fleet: Fleet, addresses: tuple[str, str, str, list[int]]
) -> None:
    frozen = _placement(fleet, "frozen", addresses[1])
    heard = time.monotonic()
    await fleet.watch.until_unresponsive(frozen, lambda: heard)
    assert SILENCE_S <= time.monotonic() - heard < SILENCE_S + PROBE_TIMEOUT_S + 1.5
    assert await fleet.live() == ["alive", "gone"]
    assert fleet.watch.silence == "stopped answering: nothing for 0.3s, no answer to a probe"


async def test_a_node_that_answers_its_probes_is_waited_on(
    fleet: Fleet, addresses: tuple[str, str, str, list[int]]
) -> None:
    alive = _placement(fleet, "alive", addresses[0])
    long_ago = time.monotonic() - 60
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fleet.watch.until_unresponsive(alive, lambda: long_ago), 1.5)
    assert len(fleet.num_probes) >= 2  # a probe, another silence, another probe
    assert "alive" in await fleet.live()


async def test_a_node_that_refused_a_connection_is_distrusted_until_it_publishes(
    fleet: Fleet, addresses: tuple[str, str, str, list[int]]
) -> None:
    await fleet.watch.mark_down(_placement(fleet, "gone", addresses[2]))
    assert await fleet.live() == ["alive", "frozen"]
