"""The usage endpoint in a tiny Starlette app, served by uvicorn on loopback, called with httpx."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from billing.http import ADMIN, Principal, usage_endpoint
from billing.ledger import SqliteLedger
from billing.prices import PriceTable
from tests.billing.samples import DAY1, DAY2, make_event
from tests.conftest import free_port

SMOL = "@cf/huggingface/smollm2-135m-instruct"
TOKENS = {"key-a": "acct-a", "key-b": "acct-b", "admin-token": ADMIN}


async def authorize(request: Request) -> Principal | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return TOKENS.get(token) if scheme == "Bearer" else None


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    ledger.insert_many(
        [
            make_event("a-1", input_tokens=1_000_000, output_tokens=1_000_000),
            make_event("a-2", ended_at=DAY2, started_at=DAY2, input_tokens=10, output_tokens=5),
            make_event(
                "b-1", account_id="acct-b", model="@cf/edgeserve/moe-small", output_tokens=2_000_000
            ),
        ]
    )
    handler = usage_endpoint(
        ledger, PriceTable.default(), authorize, max_days=31, today=lambda: date(2026, 11, 3)
    )
    app = Starlette(
        routes=[Route("/client/v4/accounts/{account_id}/ai/usage", handler, methods=["GET"])]
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        yield http
    server.should_exit = True
    await task
    ledger.close()


async def get(http: httpx.AsyncClient, path: str, token: str | None, **params: str) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return await http.get(f"/client/v4/accounts/{path}/ai/usage", params=params, headers=headers)


def error(code: int, message: str) -> dict[str, Any]:
    return {
        "result": None,
        "success": False,
        "errors": [{"code": code, "message": message}],
        "messages": [],
    }


async def test_an_account_reads_its_own_usage_priced(client: httpx.AsyncClient) -> None:
    response = await get(client, "acct-a", "key-a", **{"from": "2026-11-02", "to": "2026-11-03"})
    assert response.status_code == 200
    row = {"account_id": "acct-a", "model": SMOL, "cached_tokens": 0}
    assert response.json() == {
        "result": {
            "account_id": "acct-a",
            "from": "2026-11-02",
            "to": "2026-11-03",
            "currency": "USD",
            "group_by": ["account", "model", "day"],
            "rows": [
                row | {"day": "2026-11-02", "requests": 1, "input_tokens": 1_000_000,
                       "output_tokens": 1_000_000, "cost": "0.228"},
                row | {"day": "2026-11-03", "requests": 1, "input_tokens": 10,
                       "output_tokens": 5, "cost": "0.000001275"},
            ],
            "total": {"requests": 2, "input_tokens": 1_000_010, "cached_tokens": 0,
                      "output_tokens": 1_000_005, "cost": "0.228001275"},
            "unpriced_models": [],
        },
        "success": True,
        "errors": [],
        "messages": [],
    }  # fmt: skip


async def test_account_a_cannot_read_account_b_by_path_or_by_query(
    client: httpx.AsyncClient,
) -> None:
    forbidden = error(10000, "this key may only read its own account's usage")
    by_path = await get(client, "acct-b", "key-a")
    assert (by_path.status_code, by_path.json()) == (403, forbidden)
    by_query = await get(client, "acct-a", "key-a", account_id="acct-b")
    assert (by_query.status_code, by_query.json()) == (403, forbidden)
    all_of_them = await get(client, "acct-a", "key-a", account_id="*")
    assert (all_of_them.status_code, all_of_them.json()) == (403, forbidden)


async def test_no_or_unknown_key_is_401(client: httpx.AsyncClient) -> None:
    unauthenticated = error(10000, "Authentication error: a valid key is required")
    for token in (None, "key-z"):
        response = await get(client, "acct-a", token)
        assert (response.status_code, response.json()) == (401, unauthenticated)


async def test_admin_reads_any_account_or_all(client: httpx.AsyncClient) -> None:
    b = await get(client, "acct-a", "admin-token", account_id="acct-b", group_by="account")
    assert b.status_code == 200
    assert b.json()["result"]["rows"] == [
        {"account_id": "acct-b", "requests": 1, "input_tokens": 100, "cached_tokens": 0,
         "output_tokens": 2_000_000, "cost": "1.00001"},
    ]  # fmt: skip
    everyone = await get(client, "acct-a", "admin-token", account_id="*", group_by="account")
    assert [r["account_id"] for r in everyone.json()["result"]["rows"]] == ["acct-a", "acct-b"]
    # Defaults: the 30 days up to today (2026-11-03 here).
    assert (everyone.json()["result"]["from"], everyone.json()["result"]["to"]) == (
        "2026-10-05",
        "2026-11-03",
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"from": "2026-13-01"}, "from: '2026-13-01' is not a date (YYYY-MM-DD)"),
        ({"to": "yesterday"}, "to: 'yesterday' is not a date (YYYY-MM-DD)"),
        ({"from": "20261101"}, "from: '20261101' is not a date (YYYY-MM-DD)"),
        ({"to": "2026W441"}, "to: '2026W441' is not a date (YYYY-MM-DD)"),
        ({"from": "2026-11-03", "to": "2026-11-02"}, "to (2026-11-02) is before from (2026-11-03)"),
        ({"from": "2026-01-01", "to": "2026-11-02"}, "from..to spans more than 31 days"),
        ({"group_by": "week"}, "group_by: unknown key(s) week; use any of account, model, day"),
        (  # the default window of 30 days would start before the first date (it was a 500)
            {"to": "0001-01-10"},
            "from: a 30-day window ending on 0001-01-10 starts before 0001-01-01",
        ),
    ],
)
async def test_bad_queries_are_400_in_the_envelope(
    client: httpx.AsyncClient, params: dict[str, str], message: str
) -> None:
    response = await get(client, "acct-a", "key-a", **params)
    assert (response.status_code, response.json()) == (400, error(5004, message))


def test_day_one_is_the_second_of_november() -> None:
    from datetime import UTC, datetime

    assert datetime.fromtimestamp(DAY1, UTC).date() == date(2026, 11, 2)
