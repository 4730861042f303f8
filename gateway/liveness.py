"""Whether a node gone quiet is alive: the gateway's watch over the nodes it waits on.

A frozen (stopped, hung) node's kernel still accepts connections and keeps them open,
so its requests would wait out the read timeout. A node silent on a request's stream for
`silence_s` is asked its health instead: one that answers (200, or 503 while it loads or
drains) is waited for another `silence_s`; one that does not answer within
`probe_timeout_s` is marked down, and the request waiting on it fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from scheduler.placement import Placement, Placer

# A node that refuses a connection, or resets one, is dead or dying whatever its record
# says: it is distrusted until it publishes again. (Its keep-alive outlives the gateway's
# pooled connections, so a live node never closes one the gateway is sending on.)
NODE_GONE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


class NodeWatch:
    def __init__(
        self,
        client: httpx.AsyncClient,
        auth: dict[str, str],
        placer: Placer,
        silence_s: float,
        probe_timeout_s: float,
    ) -> None:
        self._client = client
        self._auth = auth
        self._placer = placer
        self.silence_s = silence_s
        self._probe_timeout_s = probe_timeout_s
        self._probes: dict[str, asyncio.Future[bool]] = {}  # node id -> the probe in flight

    async def answers(self, placement: Placement) -> bool:
        """Whether the node answers its health endpoint within probe_timeout_s (one that does
        not is marked down). The quiet streams of one node share one probe in flight."""
        probe = self._probes.get(placement.node_id)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(placement))
            self._probes[placement.node_id] = probe
            probe.add_done_callback(lambda _: self._probes.pop(placement.node_id, None))
        return await asyncio.shield(probe)

    async def _probe(self, placement: Placement) -> bool:
        try:
            await self._client.get(
                f"{placement.address}/internal/v1/health",
                headers=self._auth,
                timeout=self._probe_timeout_s,
            )
        except httpx.PoolTimeout:
            return True  # our own connections are all in use: nothing learnt of the node
        except httpx.HTTPError:
            await self._placer.mark_down(placement.node_id)
            return False
        return True

    async def mark_down(self, placement: Placement) -> None:
        """Distrusts `placement`'s node until it publishes again (it refused or reset us)."""
        await self._placer.mark_down(placement.node_id)

    @property
    def silence(self) -> str:
        """How a node that the probe gave up on failed, for the log."""
        return f"stopped answering: nothing for {self.silence_s:g}s, no answer to a probe"

    async def until_unresponsive(
        self, placement: Placement, last_heard: Callable[[], float]
    ) -> None:
        """Returns once the node has sent nothing for silence_s since `last_heard()` (a
        monotonic time) and then does not answer a probe; one that answers is given another
        silence_s."""
        answered_at = float("-inf")
        while True:
            quiet_until = max(last_heard(), answered_at) + self.silence_s
            if (wait := quiet_until - time.monotonic()) > 0:
                await asyncio.sleep(wait)
                continue
            if not await self.answers(placement):
                return
            answered_at = time.monotonic()
