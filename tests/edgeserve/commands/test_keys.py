"""`edgeserve keys create|list|revoke` through the real typer app, against a real Redis."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from typer.testing import CliRunner

from edgeserve.cli import build_app
from gateway.keys import KEY_PREFIX, RedisKeyStore, key_id_of
from tests.conftest import REDIS_URL


def _lookup(prefix: str, key: str) -> str | None:
    """The account `key` acts for, as a gateway reads it."""

    async def read() -> str | None:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            return await RedisKeyStore(client, prefix).lookup(key)
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_a_key_is_created_listed_by_its_id_and_revoked(redis_prefix: str) -> None:
    app = build_app()
    where = ["--redis-url", REDIS_URL, "--prefix", redis_prefix]
    before = time.time()
    created = CliRunner().invoke(app, ["keys", "create", "--account", "acme", *where])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip()
    assert key.startswith(KEY_PREFIX)
    key_id = key_id_of(key)
    assert created.stderr == f"key id {key_id} for account acme; this key is not shown again\n"
    assert _lookup(redis_prefix, key) == "acme"

    listed = CliRunner().invoke(app, ["keys", "list", "--account", "acme", *where])
    assert listed.exit_code == 0, listed.output
    [(listed_id, account, created_at)] = [line.split("\t") for line in listed.stdout.splitlines()]
    assert (listed_id, account) == (key_id, "acme")
    assert before - 1 <= int(created_at) <= time.time() + 1
    assert key not in listed.output  # never the key itself
    other = CliRunner().invoke(app, ["keys", "list", "--account", "other", *where])
    assert (other.exit_code, other.stdout) == (0, "")

    revoked = CliRunner().invoke(app, ["keys", "revoke", key_id, *where])
    assert (revoked.exit_code, revoked.stdout) == (0, f"revoked {key_id}\n")
    assert _lookup(redis_prefix, key) is None
    again = CliRunner().invoke(app, ["keys", "revoke", key_id, *where])
    assert (again.exit_code, again.stderr) == (1, f"no key with id {key_id}\n")


def test_an_account_id_a_key_cannot_act_for_is_refused(redis_prefix: str) -> None:
    result = CliRunner().invoke(
        build_app(),
        ["keys", "create", "--account", "acme corp", "--redis-url", REDIS_URL, "--prefix",
         redis_prefix],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "account id must be 1-64 of A-Z a-z 0-9 _ -, got 'acme corp'" in " ".join(
        result.stderr.replace("│", " ").split()
    )
