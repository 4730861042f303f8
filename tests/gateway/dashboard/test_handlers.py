"""The dashboard's routes on a real gateway (gateway/dashboard/handlers.py): the page and its
admin JSON, with the nodes as published records, the ledger a real SQLite one, and the
recent errors the gateway's own 5xx answers. The page in a browser: tests/integration."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.events import UsageEvent
from billing.ledger import SqliteLedger
from gateway.app import create_app
from gateway.keys import MemoryKeyStore
from gateway.settings import GatewaySettings
from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
from scheduler.placement import LocalReservations, Placer
from tests.conftest import SMOLLM2, ServerThread, free_port

KEY = "es-dashboard-key"
ADMIN_TOKEN = "dashboard-admin-token-0123"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
RUN_SMOL = f"/client/v4/accounts/acct/ai/run/{SMOLLM2}"


@dataclass
class Gateway:
    server: ServerThread
    registry: LocalCapacityRegistry
    node: CapacityRecord

    @property
    def url(self) -> str:
        return self.server.url

    def numbers(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}/admin/v1/dashboard", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        return dict(answer.json()["result"])


def start(tmp_path: Path, *, admin_token: str | None = ADMIN_TOKEN, **parts: Any) -> Gateway:
    """A gateway before one published node whose address answers nothing."""
    registry = LocalCapacityRegistry()
    node = CapacityRecord(
        node_id="node-<b>1</b>", address=f"http://127.0.0.1:{free_port()}", role="mixed",
        models=("smollm2",), num_pages=64, num_free_pages=48, page_size=16, kv_dtype="fp8",
        num_running=2, num_waiting=1, load=0.5, published_at=time.time(), ttl_s=120.0,
        activations="bf16",
    )  # fmt: skip
    asyncio.run(registry.publish(node))
    keys = MemoryKeyStore()
    asyncio.run(keys.add(KEY, "acct"))
    placer = Placer(CapacityView(registry, max_age_s=0.0), LocalReservations())
    settings = GatewaySettings(internal_token="t", admin_token=admin_token)
    app = create_app(settings, keys=keys, placer=placer, **parts)
    return Gateway(ServerThread(app).start(), registry, node)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    started = start(tmp_path)
    yield started
    started.server.stop()


def test_the_page_is_static_and_locked_to_the_gateways_own_scripts(gateway: Gateway) -> None:
    page = httpx.get(f"{gateway.url}/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"].startswith(
        "default-src 'none'; script-src 'self'"
    )
    assert page.headers["referrer-policy"] == "no-referrer"
    assert '<script src="/dashboard/app.js" defer></script>' in page.text
    script = httpx.get(f"{gateway.url}/dashboard/app.js")
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
    assert "innerHTML" not in script.text and "textContent" in script.text
    assert httpx.get(f"{gateway.url}/dashboard/style.css").status_code == 200


def test_the_numbers_take_the_admin_token_in_the_header_only(gateway: Gateway) -> None:
    url = f"{gateway.url}/admin/v1/dashboard"
    refused = [
        httpx.get(url),
        httpx.get(url, headers={"authorization": "Bearer not-the-token"}),
        httpx.get(url, headers={"authorization": f"Bearer {KEY}"}),  # an API key is no admin
        httpx.get(url, params={"token": ADMIN_TOKEN}),
        httpx.get(url, cookies={"token": ADMIN_TOKEN}),
    ]
    assert [(r.status_code, r.json()["errors"]) for r in refused] == [
        (401, [{"code": 10000, "message": "a valid admin bearer token is required"}])
    ] * 5
    assert httpx.get(url, headers=ADMIN).status_code == 200


def test_the_numbers_show_the_nodes_the_failures_and_no_ledger(gateway: Gateway) -> None:
    """The node's address answers nothing: the request is a 502, listed among the recent
    errors under its request id, with the message its client got."""
    numbers = gateway.numbers()
    (node,) = numbers["nodes"]
    assert 0 <= node.pop("age_s") < 60
    assert node == {
        "node_id": "node-<b>1</b>", "role": "mixed", "models": ["smollm2"], "num_pages": 64,
        "num_free_pages": 48, "num_used_pages": 16, "page_size": 16, "kv_dtype": "fp8",
        "num_running": 2, "num_waiting": 1, "load": 0.5, "tokens_per_s": 0.0,
    }  # fmt: skip
    assert numbers["models"] == [
        {"model": "smollm2", "num_nodes": 1, "num_pages": 64, "num_free_pages": 48,
         "num_running": 2, "num_waiting": 1, "kv_utilization": 0.25},
    ]  # fmt: skip
    assert (numbers["num_queued"], numbers["usage"], numbers["errors"]) == (0, None, [])
    assert numbers["is_registry_away"] is False

    failed = httpx.post(
        gateway.url + RUN_SMOL,
        json={"prompt": "a secret prompt"},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert failed.status_code == 502
    numbers = gateway.numbers()
    (error,) = numbers["errors"]
    assert 0 <= time.time() - error.pop("at") < 60
    assert error == {
        "method": "POST",
        "path": RUN_SMOL,
        "status": 502,
        "message": "the node chosen for this request could not be reached; retry shortly",
        "request_id": failed.headers["x-request-id"],
    }
    assert numbers["gateway"] == {
        "num_generations": 1,
        "num_failed": 1,
        "num_input_tokens": 0,
        "num_output_tokens": 0,
        "admission_rejections": {},
    }
    # The node was marked down: the next request finds no node (503, also listed).
    assert httpx.post(gateway.url + RUN_SMOL, json={"prompt": "hi"},
                      headers={"authorization": f"Bearer {KEY}"}).status_code == 503  # fmt: skip
    assert [e["status"] for e in gateway.numbers()["errors"]] == [503, 502]  # newest first


def test_the_usage_of_today_comes_from_the_ledger_priced(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    now = time.time()
    for i, (account, num_in, num_out) in enumerate(
        [("acct-a", 1000, 500), ("acct-a", 200, 100), ("acct-b", 10, 0)]
    ):
        ledger.insert(UsageEvent(f"r{i}", account, SMOLLM2, "node-1", num_in, num_out, 0,
                                 now - 1, now, "ok"))  # fmt: skip
    gateway = start(tmp_path, ledger=ledger)
    try:
        usage = gateway.numbers()["usage"]
    finally:
        gateway.server.stop()
        ledger.close()
    assert usage == {
        "day": time.strftime("%Y-%m-%d", time.gmtime(now)),
        "currency": "USD",
        "accounts": [
            # (1200 * 0.027 + 600 * 0.201) / 1e6
            {"account_id": "acct-a", "requests": 2, "input_tokens": 1200, "cached_tokens": 0,
             "output_tokens": 600, "cost": "0.000153"},
            {"account_id": "acct-b", "requests": 1, "input_tokens": 10, "cached_tokens": 0,
             "output_tokens": 0, "cost": "0.00000027"},
        ],
    }  # fmt: skip


def test_a_gateway_still_loading_lists_its_refused_requests_not_its_probes(
    tmp_path: Path,
) -> None:
    gateway = start(tmp_path, is_ready=lambda: False)
    try:
        assert httpx.get(f"{gateway.url}/healthz").status_code == 503
        refused = httpx.post(gateway.url + RUN_SMOL, json={"prompt": "hi"},
                             headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
        assert refused.status_code == 503
        errors = gateway.numbers()["errors"]
    finally:
        gateway.server.stop()
    assert [(e["path"], e["request_id"]) for e in errors] == [
        (RUN_SMOL, refused.headers["x-request-id"])
    ]


def test_without_an_admin_token_there_is_no_dashboard(tmp_path: Path) -> None:
    gateway = start(tmp_path, admin_token=None)
    try:
        assert httpx.get(f"{gateway.url}/dashboard").status_code == 404
        assert httpx.get(f"{gateway.url}/admin/v1/dashboard", headers=ADMIN).status_code == 404
    finally:
        gateway.server.stop()
