from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

import pytest

from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
from scheduler.placement import (
    Candidate,
    LocalAffinities,
    LocalReservations,
    Placement,
    Placer,
    RedisAffinities,
    RedisReservations,
    affinity_key,
    session_key,
)


def record(
    node_id: str,
    *,
    free_pages: int = 64,
    waiting: int = 0,
    models=("smollm2",),
    role="mixed",
    kv_dtype="fp8",
    activations="bf16",
    max_request_tokens=0,
) -> CapacityRecord:
    return CapacityRecord(
        node_id=node_id,
        address=f"http://{node_id}:8081",
        role=role,
        models=models,
        num_pages=64,
        num_free_pages=free_pages,
        page_size=16,  # 1024 tokens in all
        kv_dtype=kv_dtype,
        num_running=0,
        num_waiting=waiting,
        load=0.0,
        published_at=time.time(),
        ttl_s=30.0,
        activations=activations,
        max_request_tokens=max_request_tokens,
    )


@pytest.fixture(params=["local", "redis"])
def reservations(request, redis_client, redis_prefix):
    if request.param == "local":
        return LocalReservations()
    return RedisReservations(redis_client, prefix=redis_prefix)


@pytest.fixture(params=["local", "redis"])
def affinities(request, redis_client, redis_prefix):
    if request.param == "local":
        return LocalAffinities()
    return RedisAffinities(redis_client, prefix=redis_prefix)


async def test_reserve_best_picks_the_highest_score_and_counts_reservations(reservations) -> None:
    a = Candidate("node-a", num_free_tokens=1000, limit_tokens=2000, queue_cost_tokens=0)
    b = Candidate("node-b", num_free_tokens=900, limit_tokens=2000, queue_cost_tokens=0)
    assert await reservations.reserve_best("r1", 300, [a, b]) == 0  # a: 1000 > b: 900
    assert await reservations.reserve_best("r2", 300, [a, b]) == 1  # a: 700 < b: 900
    assert await reservations.reserve_best("r3", 300, [a, b]) == 0  # a: 700 > b: 600
    assert await reservations.reserved_tokens("node-a") == 600
    assert await reservations.reserved_tokens("node-b") == 300
    await reservations.release("node-a", "r1")
    assert await reservations.reserved_tokens("node-a") == 300


async def test_reserve_best_skips_nodes_past_their_limit_and_returns_none_when_full(
    reservations,
) -> None:
    a = Candidate("node-a", num_free_tokens=1000, limit_tokens=500, queue_cost_tokens=0)
    b = Candidate("node-b", num_free_tokens=0, limit_tokens=400, queue_cost_tokens=0)
    assert await reservations.reserve_best("r1", 400, [a, b]) == 0
    assert await reservations.reserve_best("r2", 400, [a, b]) == 1  # a would hold 800 > 500
    assert await reservations.reserve_best("r3", 1, [a, b]) == 0  # 401 <= 500
    assert await reservations.reserve_best("r4", 100, [a, b]) is None
    assert await reservations.reserve_best("r5", 1, []) is None


async def test_queue_depth_counts_against_a_node(reservations) -> None:
    busy = Candidate("node-a", num_free_tokens=1000, limit_tokens=2000, queue_cost_tokens=512)
    idle = Candidate("node-b", num_free_tokens=600, limit_tokens=2000, queue_cost_tokens=0)
    assert await reservations.reserve_best("r1", 10, [busy, idle]) == 1


async def test_concurrent_reservations_never_overbook(reservations) -> None:
    # 40 gateways' worth of requests at once against a 1000-token limit: exactly 10 fit.
    nodes = [Candidate("node-a", 1000, 1000, 0)]
    results = await asyncio.gather(
        *(reservations.reserve_best(f"r{i}", 100, nodes) for i in range(40))
    )
    assert sorted(results, key=lambda r: r is None) == [0] * 10 + [None] * 30
    assert await reservations.reserved_tokens("node-a") == 1000


async def test_expired_reservations_are_dropped(redis_client, redis_prefix) -> None:
    # r1 lasts 2 s (a loaded machine cannot lapse it before r2's first try); "kept", from a
    # table of 60 s reservations and taken after r1, keeps the node's hash alive past r1, so
    # only the script's own expiry of r1 can make room for r2.
    reservations = RedisReservations(redis_client, prefix=redis_prefix, ttl_s=2.0)
    long_lived = RedisReservations(redis_client, prefix=redis_prefix, ttl_s=60.0)
    node = [Candidate("node-a", 1000, 200, 0)]
    assert await reservations.reserve_best("r1", 100, node) == 0
    assert await long_lived.reserve_best("kept", 100, node) == 0
    assert await reservations.reserve_best("r2", 100, node) is None
    deadline = time.monotonic() + 10
    while await reservations.reserved_tokens("node-a") > 100:  # r1 lapses, by Redis's clock
        assert time.monotonic() < deadline, "r1 never expired"
        await asyncio.sleep(0.05)
    assert await reservations.reserve_best("r2", 100, node) == 0
    assert await reservations.reserved_tokens("node-a") == 200
    entries = await redis_client.hgetall(f"{redis_prefix}resv:node-a")
    assert sorted(entries) == [b"kept", b"r2"]


async def test_placer_spreads_a_burst_and_filters_model_role_and_exclusions() -> None:
    registry = LocalCapacityRegistry()
    for r in [
        record("node-a"),
        record("node-b"),
        record("node-c", models=("other",)),
        record("node-d", role="decode"),
    ]:
        await registry.publish(r)
    placer = Placer(CapacityView(registry, max_age_s=1.0), LocalReservations())
    chosen = [await placer.place("smollm2", f"r{i}", 100) for i in range(4)]
    assert [p.node_id for p in chosen if p] == ["node-a", "node-b", "node-a", "node-b"]
    assert chosen[0] == Placement("r0", "node-a", "http://node-a:8081", 100)

    retry = await placer.place("smollm2", "r9", 100, exclude=frozenset({"node-a"}))
    assert retry is not None and retry.node_id == "node-b"
    assert await placer.place("missing", "r10", 100) is None
    assert await placer.has_nodes("smollm2")
    assert not await placer.has_nodes("missing")


async def test_placer_answers_none_when_the_fleet_is_out_of_capacity() -> None:
    registry = LocalCapacityRegistry()
    await registry.publish(record("node-a"))  # 1024 tokens, overcommit 1.0
    reservations = LocalReservations()
    placer = Placer(CapacityView(registry, max_age_s=1.0), reservations, overcommit=1.0)
    first = await placer.place("smollm2", "r1", 1000)
    assert first is not None
    assert await placer.place("smollm2", "r2", 100) is None
    await placer.release(first)
    assert await placer.place("smollm2", "r2", 100) is not None


async def test_a_node_marked_down_gets_nothing_until_it_publishes_again() -> None:
    registry = LocalCapacityRegistry()
    await registry.publish(record("node-a"))
    await registry.publish(record("node-b", free_pages=32))
    view = CapacityView(registry, max_age_s=0.0)
    placer = Placer(view, LocalReservations())
    assert (await placer.place("smollm2", "r1", 100)).node_id == "node-a"
    await placer.mark_down("node-a")
    assert (await placer.place("smollm2", "r2", 100)).node_id == "node-b"
    assert await placer.largest_node_tokens("smollm2") == 1024  # node-b's pool, as node-a's
    await placer.mark_down("node-b")
    assert await placer.place("smollm2", "r3", 100) is None
    assert not await placer.has_nodes("smollm2")
    assert await placer.largest_node_tokens("smollm2") == 0
    await registry.publish(replace(record("node-a"), published_at=time.time() + 1))
    assert (await placer.place("smollm2", "r4", 100)).node_id == "node-a"  # alive again


async def test_decode_and_prefill_nodes_split_a_request_and_full_decoders_fall_back() -> None:
    registry = LocalCapacityRegistry()
    for r in [
        record("node-m"),  # mixed: whole requests
        record("dec-a", role="decode"),
        record("dec-b", role="decode", free_pages=32),
        record("pre-b", role="prefill", free_pages=16),
        record("pre-a", role="prefill", free_pages=16),  # ties with pre-b: the lower id
        record("pre-c", role="prefill", free_pages=16, waiting=1),
    ]:
        await registry.publish(r)
    placer = Placer(CapacityView(registry, max_age_s=1.0), LocalReservations(), overcommit=1.0)
    first = await placer.place("smollm2", "r1", 600)
    assert first == Placement("r1", "dec-a", "http://dec-a:8081", 600, "http://pre-a:8081", "pre-a")
    second = await placer.place("smollm2", "r2", 500)  # dec-a holds 600 of its 1024
    assert second == Placement(
        "r2", "dec-b", "http://dec-b:8081", 500, "http://pre-a:8081", "pre-a"
    )
    # both decode nodes are full: the request runs whole, on the best mixed or prefill node
    third = await placer.place("smollm2", "r3", 600)
    assert third == Placement("r3", "node-m", "http://node-m:8081", 600)
    assert first.node_ids == {"dec-a", "pre-a"} and third.node_ids == {"node-m"}
    # without a prefill node, decode nodes take nothing: the model is not served at all (a
    # decode-only fleet had counted as serving it, so requests waited out the capacity
    # queue's deadline for a 429, where no node could ever take them)
    alone = LocalCapacityRegistry()
    await alone.publish(record("dec-a", role="decode", max_request_tokens=1000))
    lonely = Placer(CapacityView(alone, max_age_s=0.0), LocalReservations())
    assert await lonely.place("smollm2", "r4", 10) is None
    assert not await lonely.has_nodes("smollm2")
    assert await lonely.largest_node_tokens("smollm2") == 0
    assert await lonely.max_request_tokens("smollm2") is None
    await alone.publish(record("pre-a", role="prefill", free_pages=16, max_request_tokens=500))
    assert await lonely.has_nodes("smollm2")
    assert await lonely.largest_node_tokens("smollm2") == 1024
    assert await lonely.max_request_tokens("smollm2") == 1000


async def test_a_decode_node_pairs_only_with_prefill_nodes_of_its_kv_and_activations() -> None:
    registry = LocalCapacityRegistry()
    for r in [
        record("node-m"),
        record("dec-16", role="decode", activations="fp16", kv_dtype="fp16"),  # the freest
        record("dec-b", role="decode", free_pages=40),
        record("dec-8", role="decode", free_pages=48, kv_dtype="fp8", activations="fp16"),
        record("pre-b", role="prefill", free_pages=60),  # the best prefill score
        record("pre-16", role="prefill", free_pages=10, activations="fp16", kv_dtype="fp16"),
    ]:
        await registry.publish(r)
    placer = Placer(CapacityView(registry, max_age_s=1.0), LocalReservations(), overcommit=1.0)
    # dec-16 takes KV from pre-16 alone, though pre-b scores higher
    first = await placer.place("smollm2", "r1", 600)
    assert first == Placement(
        "r1", "dec-16", "http://dec-16:8081", 600, "http://pre-16:8081", "pre-16"
    )
    # dec-8 (fp8 KV from fp16) has no prefill node of its kind: dec-b takes the next, with pre-b
    second = await placer.place("smollm2", "r2", 500)
    assert second == Placement(
        "r2", "dec-b", "http://dec-b:8081", 500, "http://pre-b:8081", "pre-b"
    )
    # dec-16 and dec-b full; dec-8 still takes nothing: the request runs whole on node-m
    third = await placer.place("smollm2", "r3", 600)
    assert third == Placement("r3", "node-m", "http://node-m:8081", 600)


async def test_an_accounts_next_request_prefers_the_node_holding_its_prefix(affinities) -> None:
    registry = LocalCapacityRegistry()
    await registry.publish(record("node-a"))  # 1024 free tokens
    await registry.publish(record("node-b", free_pages=60))  # 960
    placer = Placer(
        CapacityView(registry, max_age_s=1.0), LocalReservations(), affinity_tokens=512,
        affinities=affinities,
    )  # fmt: skip
    first = await placer.place("smollm2", "r1", 300, account_id="acct-x")
    assert first is not None and first.node_id == "node-a"  # 1024 > 960
    # node-a now scores 724 against node-b's 960, but holds acct-x's prompt: 724 + 512 wins
    second = await placer.place("smollm2", "r2", 300, account_id="acct-x")
    assert second is not None and second.node_id == "node-a"
    # another account has no affinity: the freer node
    other = await placer.place("smollm2", "r3", 100, account_id="acct-y")
    assert other is not None and other.node_id == "node-b"
    # node-a at 424 + 512 = 936 against node-b's 860: still acct-x's; one more and it is not
    third = await placer.place("smollm2", "r4", 300, account_id="acct-x")
    assert third is not None and third.node_id == "node-a"
    fourth = await placer.place("smollm2", "r5", 300, account_id="acct-x")
    assert fourth is not None and fourth.node_id == "node-b"  # 124 + 512 < 860
    # ... and the affinity follows the prompt to node-b
    fifth = await placer.place("smollm2", "r6", 10, account_id="acct-x")
    assert fifth is not None and fifth.node_id == "node-b"


async def test_the_prefill_node_of_a_split_request_gets_the_affinity(affinities) -> None:
    registry = LocalCapacityRegistry()
    for r in [
        record("dec-a", role="decode"),
        record("pre-a", role="prefill", free_pages=16),
        record("pre-b", role="prefill", free_pages=20),
    ]:
        await registry.publish(r)
    view = CapacityView(registry, max_age_s=0.0)  # every placement reads the records anew
    placer = Placer(view, LocalReservations(), affinity_tokens=512, affinities=affinities)
    first = await placer.place("smollm2", "r1", 10, account_id="acct-x")
    assert first is not None and first.prefill_address == "http://pre-b:8081"  # 320 > 256
    await registry.publish(record("pre-b", role="prefill", free_pages=8))  # 128 now
    again = await placer.place("smollm2", "r2", 10, account_id="acct-x")
    assert again is not None and again.prefill_address == "http://pre-b:8081"  # 128 + 512
    other = await placer.place("smollm2", "r3", 10, account_id="acct-y")
    assert other is not None and other.prefill_address == "http://pre-a:8081"


async def test_gateways_sharing_redis_send_an_account_where_its_last_prompt_went(
    redis_client, redis_prefix
) -> None:
    registry = LocalCapacityRegistry()  # both gateways read the same records
    await registry.publish(record("node-a"))  # 1024 free tokens
    await registry.publish(record("node-b", free_pages=60))  # 960

    def gateway() -> Placer:
        return Placer(
            CapacityView(registry, max_age_s=1.0),
            RedisReservations(redis_client, redis_prefix),
            affinity_tokens=512,
            affinities=RedisAffinities(redis_client, redis_prefix, ttl_s=60),
        )

    gateways = [gateway(), gateway()]
    first = await gateways[0].place("smollm2", "r1", 300, account_id="acct-x")
    assert first is not None and first.node_id == "node-a"  # 1024 > 960
    # the other gateway: node-a at 724 (the shared reservation) + 512 against node-b's 960
    second = await gateways[1].place("smollm2", "r2", 300, account_id="acct-x")
    assert second is not None and second.node_id == "node-a"
    other = await gateways[1].place("smollm2", "r3", 10, account_id="acct-y")
    assert other is not None and other.node_id == "node-b"
    key = f"{redis_prefix}affinity:smollm2:acct-x"
    assert await redis_client.get(key) in (b"node-a", "node-a")
    assert 0 < await redis_client.pttl(key) <= 60_000


async def test_local_affinities_keep_the_most_recent_keys() -> None:
    affinities = LocalAffinities(max_entries=2)
    for key, node in (("a", "n1"), ("b", "n2"), ("a", "n3"), ("c", "n1")):
        await affinities.remember([key], node)
    # "b" was the least recently placed when "c" came
    assert await affinities.get(["a", "b", "c", "d"]) == ["n3", None, "n1", None]


def test_session_keys_are_salted_by_account_and_as_long_whatever_the_id() -> None:
    key = session_key("acct-x", "smollm2", "chat-1")
    assert key.startswith("session:smollm2:") and "chat-1" not in key
    assert key == session_key("acct-x", "smollm2", "chat-1")
    assert key != session_key("acct-y", "smollm2", "chat-1")  # another account's session
    assert key != session_key("acct-x", "other", "chat-1")
    # the account and the id cannot be shifted into one another
    assert session_key("ab", "m", "c") != session_key("a", "m", "bc")
    assert len(session_key("acct-x", "smollm2", "s" * 100_000)) == len(key)
    assert affinity_key("acct-x", "smollm2") == "affinity:smollm2:acct-x"


async def test_a_session_comes_back_to_its_node_while_that_node_can_take_it(affinities) -> None:
    registry = LocalCapacityRegistry()
    await registry.publish(record("node-a"))  # 1024 free tokens
    await registry.publish(record("node-b", free_pages=60))  # 960
    view = CapacityView(registry, max_age_s=0.0)  # every placement reads the records anew
    placer = Placer(view, LocalReservations(), overcommit=1.0, affinities=affinities)
    first = await placer.place("smollm2", "r1", 300, account_id="acct-x", session_id="s1")
    assert first is not None and first.node_id == "node-a"  # 1024 + its draw > 960 + its
    # node-a fills up (its record says 128 free): no bonus would keep the session there,
    # the session does, while node-a can hold the request (724 + 300 <= 1024 reserved)
    await registry.publish(record("node-a", free_pages=8))
    again = await placer.place("smollm2", "r2", 300, account_id="acct-x", session_id="s1")
    assert again is not None and again.node_id == "node-a"
    # the same session id in another account names another session: placed by score
    other = await placer.place("smollm2", "r3", 10, account_id="acct-y", session_id="s1")
    assert other is not None and other.node_id == "node-b"
    # node-a cannot take 500 more (600 + 500 > 1024): node-b does, and the session follows
    third = await placer.place("smollm2", "r4", 500, account_id="acct-x", session_id="s1")
    assert third is not None and third.node_id == "node-b"
    await placer.release(first)
    fourth = await placer.place("smollm2", "r5", 10, account_id="acct-x", session_id="s1")
    assert fourth is not None and fourth.node_id == "node-b"
    # its node excluded (a retry) or marked down: the best other node, and the session moves
    retry = await placer.place(
        "smollm2", "r6", 10, exclude=frozenset({"node-b"}), account_id="acct-x", session_id="s1"
    )
    assert retry is not None and retry.node_id == "node-a"
    await placer.mark_down("node-a")
    moved = await placer.place("smollm2", "r7", 10, account_id="acct-x", session_id="s1")
    assert moved is not None and moved.node_id == "node-b"
    # a request without the session keeps the account's own affinity, apart from it
    assert await affinities.get([affinity_key("acct-x", "smollm2")]) == [None]


async def test_new_sessions_spread_over_nodes_of_equal_scores(affinities) -> None:
    registry = LocalCapacityRegistry()
    for node_id in ("node-a", "node-b", "node-c"):
        await registry.publish(record(node_id))
    placer = Placer(
        CapacityView(registry, max_age_s=1.0), LocalReservations(), affinities=affinities
    )

    async def place(request_id: str, session_id: str | None) -> str:
        placement = await placer.place(
            "smollm2", request_id, 100, account_id="acct-x", session_id=session_id
        )
        assert placement is not None
        await placer.release(placement)  # one at a time: the nodes' scores stay equal
        return placement.node_id

    firsts = {f"s{i}": await place(f"r{i}", f"s{i}") for i in range(30)}
    assert Counter(firsts.values()) == {"node-a": 9, "node-b": 8, "node-c": 13}
    # and each comes back to its node
    assert {s: await place(f"again-{s}", s) for s in firsts} == firsts
    # without a session, the account's requests stay together (its prefix affinity)
    assert {await place(f"plain-{i}", None) for i in range(5)} == {"node-a"}


async def test_a_split_requests_session_keeps_its_prefill_node(affinities) -> None:
    registry = LocalCapacityRegistry()
    for r in [
        record("dec-a", role="decode"),
        record("pre-a", role="prefill", free_pages=16),
        record("pre-b", role="prefill", free_pages=20),
    ]:
        await registry.publish(r)
    view = CapacityView(registry, max_age_s=0.0)
    placer = Placer(view, LocalReservations(), affinities=affinities)
    first = await placer.place("smollm2", "r1", 10, account_id="acct-x", session_id="s1")
    assert first is not None and first.prefill_node_id == "pre-b"  # 320 > 256
    await registry.publish(record("pre-b", role="prefill", free_pages=1))  # 16 now
    again = await placer.place("smollm2", "r2", 10, account_id="acct-x", session_id="s1")
    assert again is not None and again.prefill_node_id == "pre-b"
    new = await placer.place("smollm2", "r3", 10, account_id="acct-x", session_id="s2")
    assert new is not None and new.prefill_node_id == "pre-a"


async def test_gateways_sharing_redis_send_a_session_to_its_node(
    redis_client, redis_prefix
) -> None:
    registry = LocalCapacityRegistry()
    await registry.publish(record("node-a"))
    await registry.publish(record("node-b"))

    def gateway() -> Placer:
        return Placer(
            CapacityView(registry, max_age_s=1.0),
            RedisReservations(redis_client, redis_prefix),
            affinities=RedisAffinities(redis_client, redis_prefix, ttl_s=60),
        )

    gateways = [gateway(), gateway()]
    placed: dict[str, list[str]] = {}
    for i in range(8):
        for g, placer in enumerate(gateways):  # each session through both gateways in turn
            session = f"chat-{i}"
            placement = await placer.place(
                "smollm2", f"r{i}-{g}", 200, account_id="acct-x", session_id=session
            )
            assert placement is not None
            placed.setdefault(session, []).append(placement.node_id)
    # every session on one node through either gateway, while others' reservations pile up
    assert all(len(set(nodes)) == 1 for nodes in placed.values()), placed
    assert {nodes[0] for nodes in placed.values()} == {"node-a", "node-b"}
    key = f"{redis_prefix}{session_key('acct-x', 'smollm2', 'chat-0')}"
    assert await redis_client.get(key) in (placed["chat-0"][0].encode(), placed["chat-0"][0])
    assert 0 < await redis_client.pttl(key) <= 60_000
