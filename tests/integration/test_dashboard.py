"""The live dashboard in a real headless browser: Debian's Chromium, driven by Playwright,
against a real gateway and the real SmolLM2 node on loopback, with a SQLite ledger.

The page loads, takes the admin token, shows the node, and its numbers move after
requests. Skipped (saying why) where /usr/bin/chromium is missing: scripts/test.sh
installs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    ACCOUNT_ID,
    INTERNAL_TOKEN,
    SMOLLM2,
    ServerThread,
    start_node_server,
    wait_for_nodes,
)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
API_KEY = "es-dashboard-browser-key"
ADMIN_TOKEN = "dashboard-browser-admin-token"
UPDATE_TIMEOUT_MS = 20_000  # the page polls each second; the ledger lags the answer a little

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (scripts/test.sh installs it: "
        "apt-get install chromium)",
    ),
]


class Fleet:
    def __init__(self, engine: Any, ledger_path: Path) -> None:
        from billing.ledger import SqliteLedger
        from billing.sink import LocalUsageSink
        from gateway.app import create_app
        from gateway.keys import MemoryKeyStore
        from gateway.settings import GatewaySettings
        from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
        from scheduler.placement import LocalReservations, Placer

        self.registry = LocalCapacityRegistry()
        self.node, _ = start_node_server(engine, self.registry, "node-1")
        wait_for_nodes(self.registry)
        # A second record as it could come from the shared store: markup in a model name
        # must reach the page as text.
        asyncio.run(self.registry.publish(CapacityRecord(
            node_id="node-2", address="http://127.0.0.1:9", role="decode",
            models=("<img src=x id=injected>",), num_pages=8, num_free_pages=8, page_size=16,
            kv_dtype="fp32", num_running=0, num_waiting=0, load=0.0, published_at=time.time(),
            ttl_s=600.0, activations="fp32",
        )))  # fmt: skip
        keys = MemoryKeyStore()
        asyncio.run(keys.add(API_KEY, ACCOUNT_ID))
        self.ledger = SqliteLedger(ledger_path)
        app = create_app(
            GatewaySettings(
                internal_token=INTERNAL_TOKEN, capacity_max_age_s=0.2, admin_token=ADMIN_TOKEN
            ),
            keys=keys,
            placer=Placer(CapacityView(self.registry, max_age_s=0.2), LocalReservations()),
            usage_sink=LocalUsageSink(self.ledger),
            ledger=self.ledger,
        )
        self.gateway = ServerThread(app).start()

    def stop(self) -> None:
        self.gateway.stop()
        self.node.stop()
        self.ledger.close()


@pytest.fixture
def fleet(engine: Any, tmp_path: Path) -> Iterator[Fleet]:
    started = Fleet(engine, tmp_path / "ledger.sqlite3")
    yield started
    started.stop()


def ask(fleet: Fleet, prompt: str) -> int:
    """One request as a client sends it: the output tokens it was answered with."""
    answer = httpx.post(
        f"{fleet.gateway.url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}",
        json={"prompt": prompt, "max_tokens": 6, "temperature": 0},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return int(answer.json()["result"]["usage"]["completion_tokens"])


def test_the_dashboard_shows_the_node_and_its_numbers_move(fleet: Fleet) -> None:
    from playwright.sync_api import expect, sync_playwright

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.goto(f"{fleet.gateway.url}/dashboard")
            # No token yet: the form, and no numbers.
            expect(page.locator("#login")).to_be_visible()
            expect(page.locator("#board")).to_be_hidden()
            page.fill("#token", "not-the-token")
            page.click("#login button[type=submit]")
            expect(page.locator("#login-error")).to_have_text("That token was refused.")
            problems.clear()  # the browser logs the 401 it was answered
            page.fill("#token", ADMIN_TOKEN)
            page.click("#login button[type=submit]")

            node = page.locator('#nodes tbody tr[data-node="node-1"]')
            expect(node.locator("td.node-id")).to_have_text("node-1")
            expect(node.locator("td").nth(1)).to_have_text("mixed")
            expect(node.locator("td").nth(2)).to_have_text("smollm2")
            expect(node.locator("td.node-tokens")).to_have_text("0.0")
            expect(page.locator("#status")).to_contain_text("live")
            expect(page.locator("#login")).to_be_hidden()
            expect(page.locator("#num-generations")).to_have_text("0")
            expect(page.locator("#usage tbody td.empty")).to_have_text("no billed request today")
            injected = page.locator('#nodes tbody tr[data-node="node-2"] td').nth(2)
            expect(injected).to_have_text("<img src=x id=injected>")
            assert page.locator("#injected").count() == 0

            num_output = sum(ask(fleet, f"Count to {n}.") for n in (3, 4, 5))
            assert num_output > 0
            expect(page.locator("#num-generations")).to_have_text("3", timeout=UPDATE_TIMEOUT_MS)
            expect(page.locator("#num-output-tokens")).to_have_text(str(num_output))
            # the node's rate over its last seconds: the three answers' tokens moved it
            expect(node.locator("td.node-tokens")).not_to_have_text("0.0")
            account = page.locator(f'#usage tbody tr[data-account="{ACCOUNT_ID}"]')
            expect(account.locator("td.requests")).to_have_text("3", timeout=UPDATE_TIMEOUT_MS)
            expect(account.locator("td.output-tokens")).to_have_text(str(num_output))
            expect(account.locator("td.cost")).to_contain_text("USD")
            # The token went in a header, never in the page's address.
            assert ADMIN_TOKEN not in page.url
            # the plot's line, once the page has two rates (three polls) to draw
            expect(page.locator("#tokens-plot polyline")).to_have_count(1)
        finally:
            browser.close()
    assert problems == []
