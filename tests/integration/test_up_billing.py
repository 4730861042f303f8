"""`edgeserve up --redis-url`: the admin token is printed and works, and the in-process billing
worker moves each request's usage event from the Redis stream into the SQLite ledger, where
the usage route reads it back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from tests.conftest import REDIS_URL, SMOLLM2, free_port

ADMIN_TOKEN = "admin-up-test-token-0123456789"


def test_up_with_redis_bills_through_its_own_worker_and_mounts_the_admin_api(
    smollm2_path, redis_prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    account = f"acct-up-{uuid.uuid4().hex[:8]}"
    # A DATABASE_URL in the environment (the suite's own) would name the ledger instead.
    env = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"} | {
        "EDGESERVE_API_KEY": f"es-up-{uuid.uuid4().hex}",
        "EDGESERVE_ACCOUNT_ID": account,
        "EDGESERVE_ADMIN_TOKEN": ADMIN_TOKEN,
        "XDG_DATA_HOME": str(tmp_path / "data"),  # the default SQLite ledger lands here
    }
    key = env["EDGESERVE_API_KEY"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from edgeserve.cli import main; main()", "up", "--port", str(port),
         "--redis-url", REDIS_URL, "--prefix", redis_prefix,
         "--max-model-len", "1024", "--kv-memory-mb", "32"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    auth = {"authorization": f"Bearer {key}"}
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "edgeserve up never served"
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read() if proc.stdout else "up exited")
            try:
                response = httpx.post(
                    f"{base}/client/v4/accounts/{account}/ai/run/{SMOLLM2}",
                    json={"prompt": "Hi", "max_tokens": 3, "temperature": 0},
                    headers=auth,
                    timeout=30,
                )
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if response.status_code == 200:
                break
            assert response.status_code == 503
            time.sleep(0.2)
        usage = response.json()["result"]["usage"]
        request_id = response.headers["x-request-id"]

        # stream -> in-process worker -> ledger -> usage route
        rows: list[dict[str, object]] = []
        while not rows:
            assert time.monotonic() < deadline, "the usage event never reached the ledger"
            report = httpx.get(
                f"{base}/client/v4/accounts/{account}/ai/usage",
                params={"group_by": "account"},
                headers=auth,
            )
            assert report.status_code == 200
            rows = report.json()["result"]["rows"]
            time.sleep(0.1)
        assert [(r["requests"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
            (1, usage["prompt_tokens"], usage["completion_tokens"])
        ]

        limits = f"{base}/admin/v1/accounts/{account}/limits"
        assert httpx.get(limits, headers=auth).status_code == 401
        shown = httpx.get(limits, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        assert shown.status_code == 200

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read() if proc.stdout else ""
        assert f"admin token: {ADMIN_TOKEN}" in out
        ledger_path = tmp_path / "data" / "edgeserve" / "ledger.sqlite3"
        assert f"ledger:     {ledger_path}" in out

        from billing.ledger import SqliteLedger

        ledger = SqliteLedger(ledger_path)
        try:
            row = ledger.get(request_id)
        finally:
            ledger.close()
        assert row is not None
        assert (row.account_id, row.input_tokens, row.output_tokens, row.status) == (
            account,
            usage["prompt_tokens"],
            usage["completion_tokens"],
            "ok",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
