"""The admin limits API, served by uvicorn on loopback over a real Redis store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as redis
import uvicorn
from starlette.applications import Starlette

from gateway.admission import LimitPolicy, Limits, RedisLimitStore
from gateway.admission.admin import LimitsAdmin

TOKEN = "admin-secret"
POLICY = LimitPolicy(default=Limits(300, 200_000, 32), per_model={"big": Limits(100, 50_000, 4)})


@pytest.fixture
async def admin(redis_client: redis.Redis, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(
        routes=LimitsAdmin(RedisLimitStore(redis_client, prefix), POLICY, TOKEN).routes()
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    headers = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers) as client:
        yield client
    server.should_exit = True
    await task


URL = "/admin/v1/accounts/acct-1/limits"


async def test_put_then_get_account_and_model_overrides(admin: httpx.AsyncClient) -> None:
    response = await admin.get(URL)
    assert response.status_code == 200
    assert response.json() == {
        "result": {
            "account_id": "acct-1",
            "model": None,
            "effective": {
                "requests_per_minute": 300,
                "tokens_per_minute": 200_000,
                "max_concurrent": 32,
            },
            "account": None,
            "models": {},
        },
        "success": True,
        "errors": [],
        "messages": [],
    }

    response = await admin.put(URL, json={"requests_per_minute": 60})
    assert response.status_code == 200
    assert response.json()["result"]["account"] == {
        "requests_per_minute": 60,
        "tokens_per_minute": 200_000,
        "max_concurrent": 32,
    }
    # A model override starts from what applies to that model (the account's override).
    response = await admin.put(URL, json={"model": "big", "max_concurrent": 2})
    assert response.json()["result"]["effective"] == {
        "requests_per_minute": 60,
        "tokens_per_minute": 200_000,
        "max_concurrent": 2,
    }
    shown = (await admin.get(URL, params={"model": "other"})).json()["result"]
    assert shown["effective"] == {
        "requests_per_minute": 60,
        "tokens_per_minute": 200_000,
        "max_concurrent": 32,
    }
    assert list(shown["models"]) == ["big"]

    response = await admin.delete(URL, params={"model": "big"})
    assert response.status_code == 200 and response.json()["result"]["models"] == {}
    response = await admin.delete(URL, params={"model": "big"})
    assert response.status_code == 404
    assert response.json()["errors"] == [{"code": 7003, "message": "no such override"}]


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"}],
)
async def test_requests_without_the_admin_token_are_refused(
    admin: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    admin.headers.pop("authorization")
    response = await admin.put(URL, json={"requests_per_minute": 1}, headers=headers)
    assert response.status_code == 401
    assert response.json() == {
        "result": None,
        "success": False,
        "errors": [{"code": 10000, "message": "a valid admin bearer token is required"}],
        "messages": [],
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "the body is not JSON"),
        (b'{"requests_per_minute": 0}', "requests_per_minute: Input should be greater than 0"),
        (b'{"requests_per_minute": "5"}', "requests_per_minute: Input should be a valid integer"),
        (b'{"rpm": 5}', "rpm: Extra inputs are not permitted"),
        (b"{}", "give at least one of requests_per_minute, tokens_per_minute, max_concurrent"),
        (
            b'{"model": "a b", "max_concurrent": 1}',
            "model 'a b' must be 1-256 characters of letters, digits and @/_.:+=-",
        ),
    ],
)
async def test_bad_bodies_get_400_in_the_envelope(
    admin: httpx.AsyncClient, body: bytes, message: str
) -> None:
    response = await admin.put(URL, content=body)
    assert response.status_code == 400
    assert response.json()["errors"] == [{"code": 5004, "message": message}]


async def test_store_down_is_a_503() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    app = Starlette(
        routes=LimitsAdmin(RedisLimitStore(dead, "x"), POLICY, TOKEN, timeout_s=0.2).routes()
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        response = await client.get(URL, headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 503
    assert response.json()["errors"][0]["code"] == 7010
    await dead.aclose()


def test_an_empty_admin_token_is_refused() -> None:
    with pytest.raises(ValueError, match="admin_token must be set"):
        LimitsAdmin(RedisLimitStore(redis.Redis(), "x"), POLICY, "")
