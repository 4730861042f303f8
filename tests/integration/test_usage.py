"""Usage reports through the gateway: requests on the real SmolLM2 node land in the ledger
(LocalUsageSink, the `edgeserve up` shape) and `GET .../ai/usage` shows each account its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.ledger import SqliteLedger
from billing.prices import PriceTable
from billing.reports import format_money
from billing.sink import LocalUsageSink
from tests.conftest import ACCOUNT_ID, OTHER_ACCOUNT_ID, SMOLLM2
from tests.loopback import (
    ADMIN_TOKEN,
    API_KEY,
    OTHER_KEY,
    Node,
    running_node,
    start_gateway,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node(engine: Any) -> Iterator[Node]:
    yield from running_node(engine)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def usage_url(base: str, account_id: str) -> str:
    return f"{base}/client/v4/accounts/{account_id}/ai/usage"


def chat(url: str, key: str, content: str, stream: bool) -> tuple[str, dict[str, Any]]:
    """(request id, usage) of one OpenAI chat completion as its client saw it."""
    body: dict[str, Any] = {
        "model": SMOLLM2,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        "temperature": 0,
    }
    if not stream:
        response = httpx.post(
            f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60
        )
        assert response.status_code == 200
        return response.headers["x-request-id"], response.json()["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60
    ) as response:
        assert response.status_code == 200
        events = [
            json.loads(line.removeprefix("data: "))
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
        return response.headers["x-request-id"], events[-1]["usage"]


def test_each_account_reads_its_own_usage_and_the_admin_reads_all(
    node: Node, tmp_path: Path
) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    gateway = start_gateway(node, usage_sink=LocalUsageSink(ledger), ledger=ledger)
    try:
        seen = [
            chat(gateway.url, API_KEY, "Hi", stream=False),
            chat(gateway.url, API_KEY, "Tell me a joke", stream=True),
        ]
        other = httpx.post(
            f"{gateway.url}/client/v4/accounts/{OTHER_ACCOUNT_ID}/ai/run/{SMOLLM2}",
            json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
            headers=bearer(OTHER_KEY),
            timeout=60,
        )
        assert other.status_code == 200
        other_usage = other.json()["result"]["usage"]

        # Every request is a ledger row under its x-request-id, with the tokens its client saw.
        deadline = time.monotonic() + 10
        while ledger.count() < 3:
            assert time.monotonic() < deadline, "the usage events never reached the ledger"
            time.sleep(0.05)
        for request_id, usage in seen:
            row = ledger.get(request_id)
            assert row is not None
            assert (row.account_id, row.model, row.status) == (ACCOUNT_ID, SMOLLM2, "ok")
            assert (row.input_tokens, row.output_tokens, row.cached_tokens) == (
                usage["prompt_tokens"],
                usage["completion_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
            )

        mine = httpx.get(
            usage_url(gateway.url, ACCOUNT_ID),
            params={"group_by": "account,model"},
            headers=bearer(API_KEY),
        )
        assert mine.status_code == 200
        input_tokens = sum(u["prompt_tokens"] for _, u in seen)
        output_tokens = sum(u["completion_tokens"] for _, u in seen)
        cached_tokens = sum(u["prompt_tokens_details"]["cached_tokens"] for _, u in seen)
        price = PriceTable.default().price_for(SMOLLM2, datetime.now(UTC).date())
        assert price is not None
        cost = format_money(price.cost(input_tokens, cached_tokens, output_tokens))
        result = mine.json()["result"]
        assert result["account_id"] == ACCOUNT_ID
        assert result["rows"] == [
            {
                "account_id": ACCOUNT_ID,
                "model": SMOLLM2,
                "requests": 2,
                "input_tokens": input_tokens,
                "cached_tokens": cached_tokens,
                "output_tokens": output_tokens,
                "cost": cost,
            }
        ]

        forbidden = {
            "result": None,
            "success": False,
            "errors": [
                {"code": 10000, "message": "this key may only read its own account's usage"}
            ],
            "messages": [],
        }
        by_path = httpx.get(usage_url(gateway.url, OTHER_ACCOUNT_ID), headers=bearer(API_KEY))
        assert (by_path.status_code, by_path.json()) == (403, forbidden)
        by_query = httpx.get(
            usage_url(gateway.url, ACCOUNT_ID),
            params={"account_id": OTHER_ACCOUNT_ID},
            headers=bearer(API_KEY),
        )
        assert (by_query.status_code, by_query.json()) == (403, forbidden)
        anonymous = httpx.get(usage_url(gateway.url, ACCOUNT_ID))
        assert anonymous.status_code == 401
        unknown = httpx.get(usage_url(gateway.url, ACCOUNT_ID), headers=bearer("es-nobody"))
        assert unknown.status_code == 401

        everyone = httpx.get(
            usage_url(gateway.url, ACCOUNT_ID),
            params={"account_id": "*", "group_by": "account"},
            headers=bearer(ADMIN_TOKEN),
        )
        assert everyone.status_code == 200
        rows = {
            row["account_id"]: (row["requests"], row["input_tokens"], row["output_tokens"])
            for row in everyone.json()["result"]["rows"]
        }
        assert rows == {
            ACCOUNT_ID: (2, input_tokens, output_tokens),
            OTHER_ACCOUNT_ID: (
                1,
                other_usage["prompt_tokens"],
                other_usage["completion_tokens"],
            ),
        }
        # The admin reads one other account by path too.
        theirs = httpx.get(
            usage_url(gateway.url, OTHER_ACCOUNT_ID),
            params={"group_by": "account"},
            headers=bearer(ADMIN_TOKEN),
        )
        assert [r["requests"] for r in theirs.json()["result"]["rows"]] == [1]
    finally:
        gateway.stop()
        ledger.close()


def test_the_admin_api_sets_limits_the_gateway_enforces(node: Node) -> None:
    from gateway.admission import LocalLimiter

    limiter = LocalLimiter()
    gateway = start_gateway(node, limiter=limiter, limit_store=limiter.store)
    try:
        admin = f"{gateway.url}/admin/v1/accounts/{ACCOUNT_ID}/limits"
        assert httpx.put(admin, json={"requests_per_minute": 1}).status_code == 401
        assert (
            httpx.put(admin, json={"requests_per_minute": 1}, headers=bearer(API_KEY)).status_code
            == 401
        )
        changed = httpx.put(admin, json={"requests_per_minute": 1}, headers=bearer(ADMIN_TOKEN))
        assert changed.status_code == 200
        run = f"{gateway.url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        first = httpx.post(run, json=body, headers=bearer(API_KEY), timeout=60)
        second = httpx.post(run, json=body, headers=bearer(API_KEY), timeout=60)
        assert (first.status_code, first.headers["x-ratelimit-limit-requests"]) == (200, "1")
        assert (second.status_code, second.json()["errors"][0]["code"]) == (429, 3036)
    finally:
        gateway.stop()
