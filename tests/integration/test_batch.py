"""Workers AI's async batch end to end: batches queued on a gateway wired to the real Redis,
run on the real SmolLM2 node at low priority, fetched by id, billed, and kept across a
gateway restart."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from billing.ledger import SqliteLedger
from billing.sink import LocalUsageSink
from gateway.batch.store import RedisBatchStore
from gateway.response_bodies import WorkersAIRunResponse
from tests.conftest import ACCOUNT_ID, OTHER_ACCOUNT_ID, REDIS_URL, SMOLLM2, ServerThread
from tests.loopback import API_KEY, OTHER_KEY, Node, running_node, start_gateway

pytestmark = pytest.mark.timeout(180)

RUN = f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"


@pytest.fixture(scope="module")
def node(engine: Any) -> Iterator[Node]:
    yield from running_node(engine)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def batch_gateway(node: Node, prefix: str, **parts: Any) -> ServerThread:
    """A gateway keeping its batches in Redis under `prefix`; `parts` as start_gateway's."""
    settings = parts.pop("settings", {})
    # A client of the server's own loop: the store's calls run there.
    client = aioredis.Redis.from_url(REDIS_URL)
    batches = RedisBatchStore(client, prefix, 3600.0, 64, 30.0)
    return start_gateway(node, batches=batches, settings=settings, **parts)


def submit(url: str, requests: list[Any], key: str = API_KEY) -> str:
    response = httpx.post(
        f"{url}{RUN}", params={"queueRequest": "true"}, json={"requests": requests},
        headers=bearer(key), timeout=30,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True
    assert body["result"]["status"] == "queued"
    assert body["result"]["model"] == SMOLLM2
    return str(body["result"]["request_id"])


def poll(url: str, batch_id: str, key: str = API_KEY, account_id: str = ACCOUNT_ID) -> Any:
    return httpx.post(
        f"{url}/client/v4/accounts/{account_id}/ai/run/{SMOLLM2}",
        params={"queueRequest": "true"}, json={"request_id": batch_id}, headers=bearer(key),
        timeout=30,
    )  # fmt: skip


def wait_done(url: str, batch_id: str, timeout_s: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        response = poll(url, batch_id)
        assert response.status_code == 200, response.text
        result = response.json()["result"]
        if "responses" in result:
            return dict(result)
        assert result["status"] in ("queued", "running")
        assert time.monotonic() < deadline, f"the batch is still {result['status']}"
        time.sleep(0.2)


def interactive(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(result, seconds) of one Workers AI run, as a client waits for it."""
    start = time.perf_counter()
    response = httpx.post(f"{url}{RUN}", json=body, headers=bearer(API_KEY), timeout=60)
    seconds = time.perf_counter() - start
    assert response.status_code == 200, response.text
    return response.json()["result"], seconds


BODIES: list[Any] = [
    {"prompt": "Name a colour.", "max_tokens": 8, "temperature": 0, "external_reference": "a"},
    {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0},
]


def test_a_batch_answers_as_interactive_requests_do_and_is_billed_per_request(
    node: Node, redis_prefix: str, tmp_path: Path
) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    gateway = batch_gateway(node, redis_prefix, usage_sink=LocalUsageSink(ledger), ledger=ledger)
    try:
        expected = [interactive(gateway.url, body)[0] for body in BODIES]
        batch_id = submit(gateway.url, [*BODIES, {"prompt": "x", "max_tokens": "many"}, 7])
        done = wait_done(gateway.url, batch_id)

        responses = done["responses"]
        # as /openapi.json declares it
        WorkersAIRunResponse.model_validate(poll(gateway.url, batch_id).json())
        assert [r["id"] for r in responses] == [0, 1, 2, 3]
        assert responses[0] == {
            "id": 0, "external_reference": "a", "result": expected[0], "success": True,
        }  # fmt: skip
        assert responses[1] == {"id": 1, "result": expected[1], "success": True}
        # Bad input is its request's error, the batch's other answers stand.
        assert responses[2]["success"] is False and responses[2]["result"] is None
        assert responses[2]["errors"][0]["code"] == 5004
        assert "max_tokens" in responses[2]["errors"][0]["message"]
        assert responses[3]["success"] is False
        assert done["usage"] == {
            name: sum(e["usage"][name] for e in expected)
            for name in ("prompt_tokens", "completion_tokens", "total_tokens")
        }

        # Each request that ran is a ledger row of its own, with the tokens it answered.
        deadline = time.monotonic() + 10
        while (ledger.get(f"{batch_id}-0"), ledger.get(f"{batch_id}-1")).count(None):
            assert time.monotonic() < deadline, "the batch's usage never reached the ledger"
            time.sleep(0.05)
        for i, result in enumerate(expected):
            row = ledger.get(f"{batch_id}-{i}")
            assert row is not None
            assert (row.account_id, row.model, row.status) == (ACCOUNT_ID, SMOLLM2, "ok")
            assert (row.input_tokens, row.output_tokens) == (
                result["usage"]["prompt_tokens"],
                result["usage"]["completion_tokens"],
            )
        assert ledger.count() == 2 + len(expected)  # the interactive ones and the batch's

        # Another account, even knowing the id, finds nothing; nor does an id never given.
        theirs = poll(gateway.url, batch_id, OTHER_KEY, OTHER_ACCOUNT_ID)
        assert theirs.status_code == 404
        assert theirs.json()["success"] is False
        assert theirs.json()["errors"][0]["code"] == 7003
        assert poll(gateway.url, "7c5f0a8e-0000-4000-8000-000000000000").status_code == 404
    finally:
        gateway.stop()
        ledger.close()


def test_a_batch_queued_before_a_gateway_restart_completes_after_it(
    node: Node, redis_prefix: str
) -> None:
    # The first gateway never finds room (it waits an hour for quiet): it only queues.
    first = batch_gateway(node, redis_prefix, settings={"batch_idle_s": 3600.0})
    try:
        batch_id = submit(first.url, BODIES)
        assert poll(first.url, batch_id).json()["result"]["status"] == "queued"
    finally:
        first.stop()
    second = batch_gateway(node, redis_prefix)
    try:
        done = wait_done(second.url, batch_id)
        assert [r["success"] for r in done["responses"]] == [True, True]
        expected = [interactive(second.url, body)[0] for body in BODIES]
        assert [r["result"] for r in done["responses"]] == expected
    finally:
        second.stop()


@pytest.mark.slow
def test_queued_requests_leave_interactive_latency_alone(node: Node, redis_prefix: str) -> None:
    """A client runs requests back to back, alternately on a gateway holding 50 queued
    requests and on one holding none (both on the one node): its median latency beside
    the queued requests stays within 10% of its median alone. Alternating evens out a
    shared machine's drift in speed; each gateway then sees one request's gap between two
    of its own, so the batch's gateway waits 3 s of quiet rather than 0.5 s."""
    beside_gateway = batch_gateway(node, redis_prefix, settings={"batch_idle_s": 3.0})
    alone_gateway = start_gateway(node)
    body = {"prompt": "Write a sentence about the sea.", "max_tokens": 8, "temperature": 0}
    try:
        for url in (beside_gateway.url, alone_gateway.url):
            interactive(url, body)  # warm: the prefix cache and connections
        queued = {"prompt": "Count to three.", "max_tokens": 4, "temperature": 0}
        batch_id = submit(beside_gateway.url, [queued] * 50)
        alone: list[float] = []
        beside: list[float] = []
        for _ in range(12):
            beside.append(interactive(beside_gateway.url, body)[1])
            alone.append(interactive(alone_gateway.url, body)[1])
        status = poll(beside_gateway.url, batch_id).json()["result"].get("status", "done")
        ratio = statistics.median(beside) / statistics.median(alone)
        print(
            f"\ninteractive p50 alone {statistics.median(alone) * 1000:.0f} ms, beside 50 "
            f"queued {statistics.median(beside) * 1000:.0f} ms (x{ratio:.3f}); the batch "
            f"was {status} when the client stopped"
        )
        assert ratio <= 1.10
        done = wait_done(beside_gateway.url, batch_id, timeout_s=60)
        assert all(r["success"] for r in done["responses"])
    finally:
        beside_gateway.stop()
        alone_gateway.stop()
