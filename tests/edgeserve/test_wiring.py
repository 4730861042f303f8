"""What a gateway is wired with (edgeserve/wiring.py): in one process or on a fleet's Redis,
and the API key an `up` prints, which restarts never pile up."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from billing.sink import LocalUsageSink, RedisUsageSink
from edgeserve.wiring import gateway_stores
from gateway.keys import MemoryKeyStore, RedisKeyStore, key_id_of
from gateway.settings import GatewaySettings
from tests.conftest import INTERNAL_TOKEN, REDIS_URL, free_port

SETTINGS = GatewaySettings(internal_token=INTERNAL_TOKEN)


async def test_one_process_keeps_its_stores_in_memory_and_its_key_until_it_ends(
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "ledger.sqlite3"
    stores = await gateway_stores(None, "", free_port(), SETTINGS, local=True, ledger=ledger)
    assert isinstance(stores.keys, MemoryKeyStore) and isinstance(stores.sink, LocalUsageSink)
    assert stores.ledger_location == str(ledger) and ledger.is_file()
    generated = await stores.add_up_key("local", None, "host:8080")
    chosen = await stores.add_up_key("local", "es-chosen", "host:8080")
    assert [await stores.keys.lookup(k) for k in (generated, chosen)] == ["local", "local"]
    await stores.close()


async def test_a_generated_up_key_in_redis_lives_as_long_as_its_up(
    tmp_path: Path, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))  # the usage journal goes there
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = RedisKeyStore(client, redis_prefix, cache_s=0)  # each lookup asks Redis
    marker = f"{redis_prefix}up_key:host:8080"

    async def start() -> tuple[object, str]:
        stores = await gateway_stores(
            REDIS_URL, redis_prefix, free_port(), SETTINGS, local=False,
            ledger=tmp_path / "ledger.sqlite3",
        )  # fmt: skip
        assert isinstance(stores.sink, RedisUsageSink)
        return stores, await stores.add_up_key("local", None, "host:8080")

    try:
        crashed, first = await start()  # never closed: as after SIGKILL
        assert await client.get(marker) == key_id_of(first).encode()
        restarted, second = await start()
        assert [await keys.lookup(k) for k in (first, second)] == [None, "local"]
        assert await client.get(marker) == key_id_of(second).encode()
        await restarted.close()
        assert await keys.lookup(second) is None
        assert await client.get(marker) is None

        chosen = await gateway_stores(
            REDIS_URL, redis_prefix, free_port(), SETTINGS, local=False,
            ledger=tmp_path / "ledger.sqlite3",
        )  # fmt: skip
        assert await chosen.add_up_key("local", "es-chosen-by-the-operator", "host:8080") == (
            "es-chosen-by-the-operator"
        )
        await chosen.close()
        assert await keys.lookup("es-chosen-by-the-operator") == "local"  # never revoked
        assert await client.get(marker) is None
        await crashed.close()
    finally:
        await client.aclose()
