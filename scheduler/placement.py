"""Placement: which node gets a request, with its tokens reserved so gateways don't pile on.

Each gateway sees the same capacity records, refreshed once per heartbeat; if
every gateway picked "the node with the most free KV" from them, a burst would
land on one node. So the pick and a reservation of the request's estimated
tokens happen in one atomic step against a shared reservation table (a Lua
script in Redis for fleets, a dict for one process; `scheduler/reservations.py`),
and the reservation is released when the request ends.

Score of a candidate node (higher wins, ties go to the lower node id):

    free KV tokens - tokens reserved on it - num_waiting * queue_cost_tokens
    (+ affinity_tokens on the node that last ran the same account's prompts for the
       model: its prefix cache may hold them; remembered in Redis for fleets, so every
       gateway sends an account's next prompt where the last one went)

A request in a session (the client's `x-session-affinity` header) is placed by its
session instead, more firmly than by a bonus: on the node that ran the session's last
prompt while that node is live, serves the model and can take the request; otherwise on
the best node, which the session follows from then on. A new session's score has a small
draw of its own per node (at most `session_spread_tokens`), so sessions spread over
nodes of about equal scores, alike on every gateway. A session is named by a digest of
the account and the client's id: one account's ids can never name, or steer, another's
session, and the key is as long whatever the id, which is kept nowhere.

A node is a candidate only while `reserved + this request <= total KV tokens *
overcommit`: the node may queue some work, but past that the fleet is out of
capacity and the caller answers 429 / 3040. Reservations carry a short expiry that
the gateway renews while the request runs, so one that dies holding them cannot leak them.

A node the gateway could not connect to is marked down (`mark_down`): this gateway
places nothing more there until the node publishes a new capacity record, rather than
sending request after request at a dead address until its record's TTL lapses.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from scheduler.capacity import CapacityRecord, CapacityView
from scheduler.reservations import (
    Candidate,
    LocalReservations,
    RedisReservations,
    Reservations,
)
from scheduler.store_watch import StoreAway, StoreWatch

__all__ = [
    "Affinities",
    "Candidate",
    "LocalAffinities",
    "LocalReservations",
    "Placement",
    "Placer",
    "RedisAffinities",
    "RedisReservations",
    "Reservations",
    "affinity_key",
    "session_key",
]


@dataclass(frozen=True)
class Placement:
    """Where a request goes, and the reservation to release when it ends."""

    request_id: str
    node_id: str
    address: str
    num_reserved_tokens: int
    # Disaggregated: the prefill node whose KV the decode node `address` takes (the
    # decode node holds the reservation; a prefill holds its pages only briefly).
    prefill_address: str | None = None
    prefill_node_id: str | None = None

    @property
    def node_ids(self) -> frozenset[str]:
        """Every node the request runs on: a retry goes to none of them."""
        return frozenset(n for n in (self.node_id, self.prefill_node_id) if n is not None)


def affinity_key(account_id: str, model: str) -> str:
    """The key of the node that last ran `account_id`'s prompts for `model`."""
    return f"affinity:{model}:{account_id}"


def session_key(account_id: str, model: str, session_id: str) -> str:
    """The key of the node holding a session's prefix: a digest of the account and the
    client's session id (salted by the account, fixed in length, the id not readable)."""
    account = account_id.encode()
    digest = hashlib.blake2b(digest_size=16, person=b"edgeserve-sess")
    digest.update(len(account).to_bytes(4, "big") + account)
    digest.update(session_id.encode("utf-8", "surrogatepass"))
    return f"session:{model}:{digest.hexdigest()}"


class Affinities(Protocol):
    """Which node last ran the prompts filed under a key (`affinity_key`, `session_key`)."""

    async def get(self, keys: Sequence[str]) -> list[str | None]:
        """The node of each key, None where there is none."""
        ...

    async def remember(self, keys: Sequence[str], node_id: str) -> None: ...


class RedisAffinities:
    """Affinities shared by the fleet's gateways: `{prefix}{key}` -> node id, kept `ttl_s`
    after the last prompt (a prefix cache forgets old prompts too)."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "edgeserve:",
        ttl_s: float = 600.0,
        *,
        watch: StoreWatch | None = None,
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_ms = int(ttl_s * 1000)
        self._watch = watch or StoreWatch()

    async def get(self, keys: Sequence[str]) -> list[str | None]:
        """The nodes, or Nones: also while Redis is away (a hint, not worth a failed request)."""
        names = [self._prefix + key for key in keys]
        try:
            values = await self._watch.call(lambda: self._redis.mget(names))
        except StoreAway:
            return [None] * len(keys)
        return [v.decode() if isinstance(v, bytes) else v for v in values]

    async def remember(self, keys: Sequence[str], node_id: str) -> None:
        async def set_all() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.set(self._prefix + key, node_id, px=self._ttl_ms)
            await pipe.execute()

        with contextlib.suppress(StoreAway):
            await self._watch.call(set_all)


class LocalAffinities:
    """The same in one process: the `max_entries` most recently placed keys."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._max_entries = max_entries
        self._table: OrderedDict[str, str] = OrderedDict()

    async def get(self, keys: Sequence[str]) -> list[str | None]:
        return [self._table.get(key) for key in keys]

    async def remember(self, keys: Sequence[str], node_id: str) -> None:
        for key in keys:
            self._table[key] = node_id
            self._table.move_to_end(key)
        while len(self._table) > self._max_entries:
            self._table.popitem(last=False)


def _can_serve(records: list[CapacityRecord]) -> list[CapacityRecord]:
    """Those of `records` that can take a request: the ones that serve whole requests, and
    decode nodes beside a prefill node of their own KV and activations dtypes (the only KV
    a decode node takes), without which a decode node serves nothing."""
    kinds = {r.kv_kind for r in records if r.role == "prefill"}
    return [r for r in records if r.role != "decode" or r.kv_kind in kinds]


class Placer:
    """Chooses a node for a request among the live ones serving its model."""

    def __init__(
        self,
        view: CapacityView,
        reservations: Reservations,
        overcommit: float = 2.0,
        queue_cost_tokens: int = 256,
        affinity_tokens: int = 512,
        affinities: Affinities | None = None,
        session_spread_tokens: int = 64,
    ) -> None:
        self._view = view
        self._reservations = reservations
        self._overcommit = overcommit
        self._queue_cost_tokens = queue_cost_tokens
        # Prefix affinity: the node that last ran an account's prompts for a model (its
        # prefix cache holds them) scores `affinity_tokens` more for that account's next
        # request; a node freer by more than that still wins. Shared through Redis in a
        # fleet (RedisAffinities); this process's memory by default.
        self._affinity_tokens = affinity_tokens
        self._affinities: Affinities = affinities if affinities is not None else LocalAffinities()
        # A new session's bonus on each node: at most this, its own draw per node.
        self._session_spread_tokens = session_spread_tokens
        # node id -> published_at of the record it had when a connection to it failed
        self._down: dict[str, float] = {}

    async def start(self) -> None:
        """Starts what the reservations run in the background (RedisReservations' renewals)."""
        start = getattr(self._reservations, "start", None)
        if start is not None:
            await start()

    async def aclose(self) -> None:
        close = getattr(self._reservations, "aclose", None)
        if close is not None:
            await close()

    async def mark_down(self, node_id: str) -> None:
        """Places nothing more on `node_id` until it publishes a newer record (it is alive
        again) or its record lapses."""
        for record in await self._view.live():
            if record.node_id == node_id:
                self._down[node_id] = record.published_at

    async def nodes(self) -> list[CapacityRecord]:
        """Every live node's record, in node id order: what the fleet looks like now."""
        return await self._view.live()

    async def _live(self, model: str | None) -> list[CapacityRecord]:
        """Live records serving `model` (all, for None), less the nodes marked down since
        they published."""
        live = []
        for record in await self._view.live(model):
            down_at = self._down.get(record.node_id)
            if down_at is None:
                live.append(record)
            elif record.published_at != down_at:
                del self._down[record.node_id]  # it published again: back
                live.append(record)
        return live

    async def _servable(self, model: str) -> list[CapacityRecord]:
        """The live records that can take a request for `model` (`_can_serve`): a fleet of
        decode nodes alone does not serve the model."""
        return _can_serve(await self._live(model))

    async def served(self) -> dict[str, list[CapacityRecord]]:
        """Every model some live node can take a request for, with those nodes' records."""
        by_model: dict[str, list[CapacityRecord]] = {}
        for record in await self._live(None):
            for model in record.models:
                by_model.setdefault(model, []).append(record)
        served = {model: _can_serve(records) for model, records in by_model.items()}
        return {model: records for model, records in served.items() if records}

    async def max_request_tokens(self, model: str) -> int | None:
        """The longest request (prompt + max_tokens) a live node serving `model` takes;
        None when none is live or none says."""
        records = await self._servable(model)
        sizes = [r.max_request_tokens for r in records if r.max_request_tokens]
        return max(sizes, default=None)

    def _candidate(
        self, record: CapacityRecord, affine: str | None = None, session: str | None = None
    ) -> Candidate:
        """`record` as the reservation step scores it: with the account's prefix affinity on
        the node `affine`, or for a new session (its key `session`) a small bonus of the
        session's own on each node, so that nodes of about equal scores share sessions
        alike on every gateway (the node with the highest draw, as rendezvous hashing)."""
        bonus = self._affinity_tokens if record.node_id == affine else 0
        if session is not None:
            draw = hashlib.blake2b(f"{session}|{record.node_id}".encode(), digest_size=4)
            bonus += int.from_bytes(draw.digest(), "big") % (self._session_spread_tokens + 1)
        return Candidate(
            node_id=record.node_id,
            num_free_tokens=record.num_free_tokens + bonus,
            limit_tokens=int(record.num_total_tokens * self._overcommit),
            queue_cost_tokens=record.num_waiting * self._queue_cost_tokens,
        )

    async def has_nodes(self, model: str) -> bool:
        return bool(await self._servable(model))

    async def largest_node_tokens(self, model: str) -> int:
        """KV tokens of the biggest live node serving `model` (0 when none): a request
        needing more can never be placed, however long it waits."""
        return max((r.num_total_tokens for r in await self._servable(model)), default=0)

    async def place(
        self,
        model: str,
        request_id: str,
        num_tokens: int,
        exclude: frozenset[str] = frozenset(),
        account_id: str = "",
        session_id: str | None = None,
    ) -> Placement | None:
        """Reserve `num_tokens` on the best live node serving `model`; None when none can take it.

        Where the model has both decode and prefill nodes, the request is disaggregated:
        the best decode node that can hold it, with the prefill node of the best score
        among those of the decode node's KV and activations dtypes (no reservation there);
        a decode node with no such prefill node takes nothing. Otherwise, or when every
        decode node is full, the best node that serves whole requests (mixed or prefill).
        The node that runs the prompt (the prefill node, or the whole-request one) gets the
        account's prefix affinity for its next request; with `session_id`, the session's
        instead: its node runs the session's next prompt whenever it can (see the module's
        docstring).
        """
        key = None
        if account_id:
            key = (
                session_key(account_id, model, session_id)
                if session_id
                else affinity_key(account_id, model)
            )
        (remembered,) = await self._affinities.get([key]) if key else [None]
        affine, pinned = (None, remembered) if session_id else (remembered, None)
        session = key if session_id else None  # the spread of a session not yet placed
        live = _can_serve([r for r in await self._live(model) if r.node_id not in exclude])
        prefillers = [r for r in live if r.role == "prefill"]
        decoders = [r for r in live if r.role == "decode"]
        if decoders:
            index = await self._reservations.reserve_best(
                request_id, num_tokens, [self._candidate(r) for r in decoders]
            )
            if index is not None:
                chosen = decoders[index]
                kin = [r for r in prefillers if r.kv_kind == chosen.kv_kind]
                # the session's node, else the best score; ties go to the lower node id, as
                # in the reservation step
                prefiller = next((r for r in kin if r.node_id == pinned), None) or min(
                    kin, key=lambda r: (-self._score(r, affine, session), r.node_id)
                )
                if key:
                    await self._affinities.remember([key], prefiller.node_id)
                return Placement(
                    request_id,
                    chosen.node_id,
                    chosen.address,
                    num_tokens,
                    prefiller.address,
                    prefiller.node_id,
                )
        records = [r for r in live if r.role in ("mixed", "prefill")]
        index = await self._reserve_on(request_id, num_tokens, records, pinned)
        if index is None:
            index = await self._reservations.reserve_best(
                request_id, num_tokens, [self._candidate(r, affine, session) for r in records]
            )
        if index is None:
            return None
        chosen = records[index]
        if key:
            await self._affinities.remember([key], chosen.node_id)
        return Placement(request_id, chosen.node_id, chosen.address, num_tokens)

    async def _reserve_on(
        self, request_id: str, num_tokens: int, records: list[CapacityRecord], node_id: str | None
    ) -> int | None:
        """The index in `records` of `node_id` (a session's node), with `num_tokens` reserved
        on it; None when it is not among them or cannot take the request."""
        at = next((i for i, r in enumerate(records) if r.node_id == node_id), None)
        if at is None:
            return None
        candidate = [self._candidate(records[at])]
        taken = await self._reservations.reserve_best(request_id, num_tokens, candidate)
        return None if taken is None else at

    def _score(
        self, record: CapacityRecord, affine: str | None = None, session: str | None = None
    ) -> int:
        """A node's score without reservations: free KV tokens (and the account's prefix
        affinity, or the session's spread) less its queue's cost."""
        candidate = self._candidate(record, affine, session)
        return candidate.num_free_tokens - candidate.queue_cost_tokens

    async def release(self, placement: Placement) -> None:
        await self._reservations.release(placement.node_id, placement.request_id)
