"""Node reservations: the tokens placed requests hold on each node, so gateways don't pile on.

    Reservations (protocol)
    ├── RedisReservations   fleets: one hash per node in Redis, renewed while requests run
    └── LocalReservations   `edgeserve up`: a dict in the process

A reservation in Redis is a hash field `request_id -> "tokens:expires_ms"` with a short
TTL (`ttl_s`, 6 s) that the gateway holding it renews every `ttl_s / 3` while its request
runs, for all its requests in one script call. So a reservation whose release never
reaches Redis (the gateway was SIGKILLed, or Redis was away) stops counting at most `ttl_s`
after the last renewal, whatever the request's length; releases that failed are sent again
with the next renewal that reaches Redis.

While Redis is away (`scheduler.store_watch`) the gateway picks and reserves against the
requests it holds itself, with the same scoring, and writes them into Redis with the first
renewal that reaches it: other gateways' reservations are not seen meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from scheduler.store_watch import StoreAway, StoreWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One live node as the reservation step sees it."""

    node_id: str
    num_free_tokens: int
    limit_tokens: int  # most tokens the gateways may hold reserved on it at once
    queue_cost_tokens: int  # penalty for the requests already waiting there


class Reservations(Protocol):
    async def reserve_best(
        self, request_id: str, num_tokens: int, candidates: Sequence[Candidate]
    ) -> int | None:
        """Atomically pick the best candidate that can hold `num_tokens` and reserve them; its index, or None."""
        ...

    async def release(self, node_id: str, request_id: str) -> None: ...

    async def reserved_tokens(self, node_id: str) -> int: ...


def pick_best(
    candidates: Sequence[Candidate], num_tokens: int, reserved: Mapping[str, int]
) -> int | None:
    """The index of the best candidate that can hold `num_tokens` more than `reserved` on it
    (free tokens less reserved less queue cost; ties to the first), or None: the Lua
    script's rule, for a table in this process."""
    best, best_score = None, 0
    for i, c in enumerate(candidates):
        held = reserved.get(c.node_id, 0)
        if held + num_tokens > c.limit_tokens:
            continue
        score = c.num_free_tokens - held - c.queue_cost_tokens
        if best is None or score > best_score:
            best, best_score = i, score
    return best


# The hash's own expiry is only ever extended (PTTL guard): a gateway with a longer TTL
# shares the hash during a rolling upgrade.
_RESERVE_BEST = """
-- KEYS[i]: the reservation hash of candidate i (field request_id -> "tokens:expires_ms")
-- ARGV: request_id, num_tokens, ttl_ms, then per candidate: free_tokens, limit_tokens, queue_cost
local need = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local best, best_score = -1, 0
for i, key in ipairs(KEYS) do
  local reserved = 0
  local entries = redis.call('HGETALL', key)
  for j = 1, #entries, 2 do
    local tokens, until_ms = string.match(entries[j + 1], '(%d+):(%d+)')
    if tonumber(until_ms) <= now then
      redis.call('HDEL', key, entries[j])
    else
      reserved = reserved + tonumber(tokens)
    end
  end
  local base = 3 + (i - 1) * 3
  local free = tonumber(ARGV[base + 1])
  local limit = tonumber(ARGV[base + 2])
  local queue_cost = tonumber(ARGV[base + 3])
  if reserved + need <= limit then
    local score = free - reserved - queue_cost
    if best < 0 or score > best_score then
      best, best_score = i, score
    end
  end
end
if best < 0 then
  return -1
end
redis.call('HSET', KEYS[best], ARGV[1], need .. ':' .. (now + ttl))
if redis.call('PTTL', KEYS[best]) < ttl then redis.call('PEXPIRE', KEYS[best], ttl) end
return best - 1
"""

_RENEW = """
-- KEYS: reservation hashes
-- ARGV: ttl_ms, num_renewals, then per renewal: key index, request_id, tokens;
--       then per release: key index, request_id
local ttl = tonumber(ARGV[1])
local num_renewals = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 0, num_renewals - 1 do
  local key = KEYS[tonumber(ARGV[3 + 3 * i])]
  redis.call('HSET', key, ARGV[4 + 3 * i], ARGV[5 + 3 * i] .. ':' .. (now + ttl))
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
for j = 3 + 3 * num_renewals, #ARGV, 2 do
  redis.call('HDEL', KEYS[tonumber(ARGV[j])], ARGV[j + 1])
end
return 0
"""

_RESERVED_TOKENS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reserved = 0
local entries = redis.call('HGETALL', KEYS[1])
for j = 1, #entries, 2 do
  local tokens, until_ms = string.match(entries[j + 1], '(%d+):(%d+)')
  if tonumber(until_ms) > now then reserved = reserved + tonumber(tokens) end
end
return reserved
"""

Slot = tuple[str, str]  # (node id, request id): a retry reserves the same request elsewhere


@dataclass(frozen=True)
class _Held:
    num_tokens: int
    is_shared: bool  # in Redis: reserved there, or renewed into it since


class RedisReservations:
    """Reservation table in Redis: one hash per node, `{prefix}resv:{node_id}`.

    Run `start()` (the gateway app does) so held reservations are renewed. For Redis
    Cluster put a hash tag in the prefix (e.g. "{edgeserve}:") so the scripts' keys share
    a slot.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "edgeserve:",
        ttl_s: float = 6.0,
        *,
        watch: StoreWatch | None = None,
        max_pending: int = 10_000,
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_ms = int(ttl_s * 1000)
        self._renew_s = ttl_s / 3  # two renewals may fail before a live request lapses
        self._watch = watch or StoreWatch()
        self._max_pending = max_pending
        self._reserve_best = client.register_script(_RESERVE_BEST)
        self._renew = client.register_script(_RENEW)
        self._reserved_tokens = client.register_script(_RESERVED_TOKENS)
        self._held: dict[Slot, _Held] = {}
        # Releases Redis has not taken; past max_pending the oldest is left to its TTL.
        self._pending: OrderedDict[Slot, None] = OrderedDict()
        self._task: asyncio.Task[None] | None = None

    def _key(self, node_id: str) -> str:
        return f"{self._prefix}resv:{node_id}"

    async def reserve_best(
        self, request_id: str, num_tokens: int, candidates: Sequence[Candidate]
    ) -> int | None:
        if not candidates:
            return None
        args: list[str | int] = [request_id, num_tokens, self._ttl_ms]
        for c in candidates:
            args += [c.num_free_tokens, c.limit_tokens, c.queue_cost_tokens]
        keys = [self._key(c.node_id) for c in candidates]
        try:
            reply = int(await self._watch.call(lambda: self._reserve_best(keys=keys, args=args)))
            index, is_shared = (None if reply < 0 else reply), True
        except StoreAway:
            index, is_shared = pick_best(candidates, num_tokens, self.held_tokens()), False
        if index is not None:
            self._held[candidates[index].node_id, request_id] = _Held(num_tokens, is_shared)
        return index

    async def release(self, node_id: str, request_id: str) -> None:
        held = self._held.pop((node_id, request_id), None)
        if held is not None and not held.is_shared:
            return  # reserved while Redis was away and never written there
        try:
            await self._watch.call(lambda: self._redis.hdel(self._key(node_id), request_id))
        except StoreAway:
            # A finishing request must not fail on this: sent again with the next renewal
            # that reaches Redis, and lapsing within ttl_s whatever happens.
            self._pend((node_id, request_id))

    async def reserved_tokens(self, node_id: str) -> int:
        """Tokens reserved on `node_id` by every gateway; by this one alone while Redis is away."""
        try:
            key = self._key(node_id)
            return int(await self._watch.call(lambda: self._reserved_tokens(keys=[key])))
        except StoreAway:
            return self.held_tokens().get(node_id, 0)

    def held_tokens(self) -> dict[str, int]:
        """Tokens this gateway holds reserved, by node."""
        by_node: dict[str, int] = {}
        for (node_id, _), held in self._held.items():
            by_node[node_id] = by_node.get(node_id, 0) + held.num_tokens
        return by_node

    @property
    def num_pending(self) -> int:
        """Releases that have not reached Redis yet."""
        return len(self._pending)

    def _pend(self, slot: Slot) -> None:
        self._pending[slot] = None
        self._pending.move_to_end(slot)
        if len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)

    async def renew(self) -> None:
        """Writes every reservation this gateway holds into Redis with a fresh expiry (those
        made while it was away too), and the releases it missed; one script call."""
        held, pending = dict(self._held), list(self._pending)
        if not held and not pending:
            return
        nodes = sorted({node_id for node_id, _ in [*held, *pending]})
        index = {node_id: i + 1 for i, node_id in enumerate(nodes)}
        args: list[str | int] = [self._ttl_ms, len(held)]
        for (node_id, request_id), h in held.items():
            args += [index[node_id], request_id, h.num_tokens]
        for node_id, request_id in pending:
            args += [index[node_id], request_id]
        keys = [self._key(n) for n in nodes]
        try:
            await self._watch.call(lambda: self._renew(keys=keys, args=args), force=True)
        except StoreAway:
            return
        for slot in pending:
            self._pending.pop(slot, None)
        for slot, h in held.items():
            if slot in self._held:
                self._held[slot] = _Held(h.num_tokens, is_shared=True)
            else:
                self._pend(slot)  # released while this renewal was on its way: written back

    async def start(self) -> None:
        """Renews every `ttl_s / 3` in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._renew_forever(), name="reservation-renewal")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _renew_forever(self) -> None:
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(self._renew_s)
            try:
                await self.renew()
            except Exception:  # a fault of ours must not end the renewals of live requests
                log.exception("renewing the node reservations failed")
            if task is not None and task.cancelling():  # a cancel a Redis call absorbed
                raise asyncio.CancelledError


class LocalReservations:
    """The same table in one process; no await between read and write keeps it atomic."""

    def __init__(self, ttl_s: float = 600.0) -> None:
        self._ttl_s = ttl_s
        self._table: dict[
            str, dict[str, tuple[int, float]]
        ] = {}  # node -> request -> (tokens, expires)

    def _live(self, node_id: str, now: float) -> dict[str, tuple[int, float]]:
        entries = self._table.setdefault(node_id, {})
        for request_id in [r for r, (_, until) in entries.items() if until <= now]:
            del entries[request_id]
        return entries

    async def reserve_best(
        self, request_id: str, num_tokens: int, candidates: Sequence[Candidate]
    ) -> int | None:
        now = time.monotonic()
        reserved = {
            c.node_id: sum(tokens for tokens, _ in self._live(c.node_id, now).values())
            for c in candidates
        }
        best = pick_best(candidates, num_tokens, reserved)
        if best is not None:
            self._table[candidates[best].node_id][request_id] = (num_tokens, now + self._ttl_s)
        return best

    async def release(self, node_id: str, request_id: str) -> None:
        self._table.get(node_id, {}).pop(request_id, None)

    async def reserved_tokens(self, node_id: str) -> int:
        return sum(tokens for tokens, _ in self._live(node_id, time.monotonic()).values())
