"""Saves a screenshot of the live dashboard with traffic on it.

Starts a gateway and a SmolLM2 node on loopback in this process (the `edgeserve up`
shape, with a SQLite ledger in a temporary directory), opens /dashboard in Debian's
headless Chromium, sends a few requests, and saves the page once its numbers show them.

    .venv/bin/python scripts/dashboard_demo.py /tmp/dashboard.png [--requests 8]

Needs /usr/bin/chromium (`apt-get install chromium`) and the `playwright` package (the
test extra); the model is pulled once if it is not there yet.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
MODEL = "@cf/huggingface/smollm2-135m-instruct"
ACCOUNTS = ("acct-docs", "acct-search")
PROMPTS = (
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """uvicorn in a thread of its own."""

    def __init__(self, app: Any, port: int) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


def load_engine() -> Any:
    from gpu_node.config import EngineConfig
    from gpu_node.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(EngineConfig(model="smollm2", max_model_len=2048))


def start_fleet(ledger: Any, admin_token: str, keys_of: dict[str, str]) -> list[Server]:
    from billing.sink import LocalUsageSink
    from gateway.app import create_app
    from gateway.keys import MemoryKeyStore
    from gateway.settings import GatewaySettings
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import CapacityView, LocalCapacityRegistry
    from scheduler.placement import LocalReservations, Placer

    internal_token = secrets.token_urlsafe(24)
    registry = LocalCapacityRegistry()
    node_port = free_port()
    service = NodeService(
        NodeSettings(
            node_id=f"{socket.gethostname()}-{node_port}",
            address=f"http://127.0.0.1:{node_port}",
            internal_token=internal_token,
        ),
        registry,
        engine_factory=load_engine,
    )
    node = Server(create_node_app(service), node_port)
    keys = MemoryKeyStore()
    for key, account in keys_of.items():
        asyncio.run(keys.add(key, account))
    gateway = Server(
        create_app(
            GatewaySettings(internal_token=internal_token, admin_token=admin_token),
            keys=keys,
            placer=Placer(CapacityView(registry, max_age_s=0.5), LocalReservations()),
            usage_sink=LocalUsageSink(ledger),
            ledger=ledger,
            is_ready=lambda: service.is_ready,
        ),
        free_port(),
    )
    return [gateway, node]


def wait_ready(url: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/healthz").status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was not ready in {timeout_s:.0f} s")
        time.sleep(0.5)


def send(url: str, key: str, account: str, prompt: str) -> None:
    answer = httpx.post(
        f"{url}/client/v4/accounts/{account}/ai/run/{MODEL}",
        json={"prompt": prompt, "max_tokens": 48},
        headers={"authorization": f"Bearer {key}"},
        timeout=300,
    )
    answer.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("screenshot", type=Path, help="where to save the PNG")
    parser.add_argument("--requests", type=int, default=8, help="requests to send (default 8)")
    args = parser.parse_args()

    from playwright.sync_api import expect, sync_playwright

    from billing.ledger import SqliteLedger
    from gpu_node.models.model_store import pull

    pull("smollm2")
    admin_token = secrets.token_urlsafe(24)
    keys_of = {f"es-demo-{secrets.token_hex(8)}": account for account in ACCOUNTS}
    with tempfile.TemporaryDirectory(prefix="edgeserve-demo-") as home:
        ledger = SqliteLedger(Path(home) / "ledger.sqlite3")
        servers = start_fleet(ledger, admin_token, keys_of)
        gateway = servers[0]
        try:
            print(f"waiting for the model to load at {gateway.url} ...", flush=True)
            wait_ready(gateway.url)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{gateway.url}/dashboard")
                page.fill("#token", admin_token)
                page.click("#login button[type=submit]")
                expect(page.locator("#nodes tbody tr[data-node]")).to_have_count(1)
                keys = list(keys_of.items())
                for i in range(args.requests):
                    key, account = keys[i % len(keys)]
                    send(gateway.url, key, account, PROMPTS[i % len(PROMPTS)])
                expect(page.locator("#num-generations")).to_have_text(str(args.requests))
                first = page.locator(f'#usage tbody tr[data-account="{ACCOUNTS[0]}"] td.requests')
                expect(first).to_have_text(str((args.requests + 1) // 2), timeout=30_000)
                time.sleep(3)  # a few more points on the plots
                args.screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.screenshot), full_page=True)
                browser.close()
        finally:
            for server in servers:
                server.stop()
            ledger.close()
    print(f"saved {args.screenshot}")


if __name__ == "__main__":
    main()
