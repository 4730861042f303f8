from __future__ import annotations

import pytest

from gateway.keys import (
    KEY_PREFIX,
    InvalidAccountIdError,
    MemoryKeyStore,
    RedisKeyStore,
    hash_key,
    key_id_of,
)


@pytest.fixture(params=["memory", "redis"])
def store(request, redis_client, redis_prefix):
    if request.param == "memory":
        return MemoryKeyStore()
    return RedisKeyStore(redis_client, prefix=redis_prefix, cache_s=0.3)


async def test_create_lookup_list_revoke(store) -> None:
    key = await store.create("acct-1")
    assert key.startswith(KEY_PREFIX) and len(key) > 40
    assert await store.lookup(key) == "acct-1"
    assert await store.lookup(key + "x") is None
    other = await store.create("acct-1")
    await store.create("acct-2")
    listed = await store.list("acct-1")
    assert sorted(i.key_id for i in listed) == sorted([key_id_of(key), key_id_of(other)])
    assert {i.account_id for i in listed} == {"acct-1"}
    assert await store.revoke(key_id_of(key))
    assert not await store.revoke(key_id_of(key))
    assert [i.key_id for i in await store.list("acct-1")] == [key_id_of(other)]


async def test_only_hashes_are_stored(redis_client, redis_prefix) -> None:
    store = RedisKeyStore(redis_client, prefix=redis_prefix)
    key = await store.create("acct-1")
    stored = [k.decode() async for k in redis_client.scan_iter(match=f"{redis_prefix}*")]
    dumped = b"".join([await redis_client.dump(k) or b"" for k in stored])
    assert key.encode() not in dumped
    assert f"{redis_prefix}apikey:{hash_key(key)}" in stored


async def test_a_revoked_key_stops_working_within_the_cache_time(
    redis_client, redis_prefix
) -> None:
    now = [100.0]  # gateway b's cache clock, moved by the test
    gateway_a = RedisKeyStore(redis_client, prefix=redis_prefix, cache_s=0.3)
    gateway_b = RedisKeyStore(
        redis_client, prefix=redis_prefix, cache_s=0.3, monotonic=lambda: now[0]
    )
    key = await gateway_a.create("acct-1")
    assert await gateway_b.lookup(key) == "acct-1"  # now cached on b
    await gateway_a.revoke(key_id_of(key))
    now[0] = 100.0 + 0.299
    assert await gateway_b.lookup(key) == "acct-1"  # b's cache still answers for up to 0.3 s
    now[0] = 100.0 + 0.3  # the cached entry's own expiry, to the bit
    assert await gateway_b.lookup(key) is None
    assert await gateway_a.lookup(key) is None  # the revoke deleted the key in Redis


@pytest.mark.parametrize("account_id", ["", "a b", "x" * 65, "acct/1"])
async def test_bad_account_ids_are_refused(store, account_id) -> None:
    with pytest.raises(InvalidAccountIdError):
        await store.create(account_id)


def test_keys_commands_create_list_and_revoke(redis_prefix) -> None:
    from typer.testing import CliRunner

    from edgeserve.cli import build_app
    from tests.conftest import REDIS_URL

    app, runner = build_app(), CliRunner()
    common = ["--redis-url", REDIS_URL, "--prefix", redis_prefix]
    created = runner.invoke(app, ["keys", "create", "--account", "acct-cli", *common])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip().splitlines()[0]
    assert key.startswith(KEY_PREFIX)
    listed = runner.invoke(app, ["keys", "list", "--account", "acct-cli", *common])
    assert listed.stdout.split("\t")[:2] == [key_id_of(key), "acct-cli"]
    revoked = runner.invoke(app, ["keys", "revoke", key_id_of(key), *common])
    assert (revoked.exit_code, revoked.stdout.strip()) == (0, f"revoked {key_id_of(key)}")
    again = runner.invoke(app, ["keys", "revoke", key_id_of(key), *common])
    assert again.exit_code == 1
    bad = runner.invoke(app, ["keys", "create", "--account", "no spaces", *common])
    assert bad.exit_code == 2


async def test_while_redis_is_away_only_keys_confirmed_recently_work() -> None:
    import redis.asyncio as aioredis

    from scheduler.store_watch import StoreAway, StoreWatch
    from tests.redis_server import RedisServer

    now = [100.0]
    server = RedisServer()
    server.start()
    client = aioredis.Redis.from_url(server.url)
    watch = StoreWatch(timeout_s=0.5, retry_s=1.0, monotonic=lambda: now[0])
    store = RedisKeyStore(
        client, "t:", cache_s=1.0, monotonic=lambda: now[0], watch=watch, known_for_s=600.0
    )
    try:
        seen, stale, revoked, revoked_here = [await store.create("acct-1") for _ in range(4)]
        unseen = await store.create("acct-2")
        assert await store.lookup(stale) == "acct-1"  # confirmed at 100
        now[0] = 400.0
        assert await store.lookup(seen) == "acct-1"  # confirmed at 400
        assert await store.lookup(revoked) == "acct-1"
        assert await store.lookup(revoked_here) == "acct-1"
        assert await store.revoke(key_id_of(revoked))
        now[0] = 402.0  # past the 1 s cache: Redis says it is gone, and it is forgotten
        assert await store.lookup(revoked) is None
        # Revoked through this gateway: forgotten at once, never looked up again here.
        assert await store.revoke(key_id_of(revoked_here))

        server.stop()
        now[0] = 701.0  # 601 s after `stale`'s confirmation, 301 s after `seen`'s
        assert await store.lookup(seen) == "acct-1"
        for key in (stale, revoked, revoked_here, unseen, "es-never-issued"):
            with pytest.raises(StoreAway):
                await store.lookup(key)
        now[0] = 1000.0
        assert await store.lookup(seen) == "acct-1"  # 600 s: the bound itself
        now[0] = 1000.5
        with pytest.raises(StoreAway):
            await store.lookup(seen)
    finally:
        await client.aclose()
        server.stop()
