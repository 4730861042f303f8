"""`edgeserve up` as a newcomer runs it: one command, 503 while loading, then answers; SIGTERM
stops it; and the API keys a restarted `up --redis-url` leaves in Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from tests.conftest import REDIS_URL, free_port


def test_up_answers_503_while_loading_then_serves_and_stops_on_sigterm(
    smollm2_path, tmp_path
) -> None:
    port = free_port()
    ledger_path = tmp_path / "own" / "ledger.sqlite3"  # not the per-user one
    env = os.environ | {
        "EDGESERVE_API_KEY": "es-up-test",
        "EDGESERVE_ACCOUNT_ID": "acct-up",
        "EDGESERVE_INTERNAL_TOKEN": "internal-up-test-token",
        "PYTHONUNBUFFERED": "1",  # the banner can be read while it runs
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "from edgeserve.cli import main; main()", "up", "--port", str(port),
         "--max-model-len", "1024", "--kv-memory-mb", "32", "--ledger", str(ledger_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/client/v4/accounts/acct-up/ai/run/smollm2"
    headers = {"authorization": "Bearer es-up-test"}
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    try:
        statuses = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                response = httpx.post(url, json=body, headers=headers, timeout=30)
            except httpx.TransportError:
                time.sleep(0.05)  # not listening yet
                continue
            statuses.append(response.status_code)
            if response.status_code == 200:
                break
            assert response.status_code == 503
            assert response.headers["retry-after"] == "1"
            assert response.json()["errors"] == [
                {"code": 3040, "message": "the model is still loading; retry shortly"}
            ]
            time.sleep(0.2)
        assert statuses[0] == 503  # it listened before the model was loaded
        assert statuses[-1] == 200
        assert response.json()["result"]["usage"]["completion_tokens"] == 2
        # The node's metrics, at the address and with the token the banner gives.
        assert proc.stdout is not None
        banner = []
        while not banner or "  node:" not in banner[-1]:
            banner.append(proc.stdout.readline())
        node_url = banner[-1].split()[1]
        assert "'Authorization: Bearer internal-up-test-token'" in banner[-1]
        metrics = httpx.get(f"{node_url}/metrics",
                            headers={"authorization": "Bearer internal-up-test-token"})  # fmt: skip
        assert metrics.status_code == 200
        assert "edgeserve_tokens_computed_total" in metrics.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        out = "".join(banner) + proc.stdout.read()
        assert f"edgeserve is starting at http://127.0.0.1:{port}" in out
        assert "account id: acct-up" in out
        assert "API key:    es-up-test" in out
        assert "curl http://127.0.0.1:" in out
        assert f"ledger:     {ledger_path}" in out
        from billing.ledger import SqliteLedger

        ledger = SqliteLedger(ledger_path)
        try:
            row = ledger.get(response.headers["x-request-id"])
        finally:
            ledger.close()
        assert row is not None and (row.account_id, row.output_tokens, row.status) == (
            "acct-up",
            2,
            "ok",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_serves_a_checkpoint_directory_by_its_name_with_its_own_sampling(tmp_path) -> None:
    """`up --model DIR`: the checkpoint is listed as @cf/local/<dir name>, answers to its
    short name, and a request naming no temperature samples as its generation_config.json
    says (temperature 0 here: two such answers equal the greedy one token for token; at the
    catalog's 0.6, a random model's 16 tokens would differ)."""
    import json

    from tests.gpu_node.models.hf_tiny import write_checkpoint

    directory = tmp_path / "Tiny-Qwen3"
    directory.mkdir()
    write_checkpoint("qwen3", directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.0}))
    port = free_port()
    env = os.environ | {
        "EDGESERVE_HOME": str(tmp_path / "home"),
        "EDGESERVE_API_KEY": "es-up-dir",
        "EDGESERVE_INTERNAL_TOKEN": "internal-up-dir-token",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "from edgeserve.cli import main; main()", "up", "--port", str(port),
         "--model", str(directory), "--device", "cpu", "--kv-memory-mb", "16"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base, headers = f"http://127.0.0.1:{port}", {"authorization": "Bearer es-up-dir"}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        listed = httpx.get(f"{base}/v1/models", headers=headers).json()["data"]
        assert [m["id"] for m in listed] == ["@cf/local/tiny-qwen3"]

        def answer(**sampling: float) -> str:
            body = {"model": "tiny-qwen3", "prompt": "The capital of France is",
                    "max_tokens": 16} | sampling  # fmt: skip
            response = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 16
            return response.json()["choices"][0]["text"]

        greedy = answer(temperature=0)
        assert answer() == answer() == greedy
        assert answer(temperature=1.0, seed=7) != greedy
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


# -- the API key of `up --redis-url` -------------------------------------------------------

EDGESERVE = [sys.executable, "-c", "from edgeserve.cli import main; main()"]


class Up:
    """`edgeserve up --redis-url` as a process, stopped once it has printed its API key."""

    def __init__(self, port: int, prefix: str, tmp_path: Path, **env: str) -> None:
        self.proc = subprocess.Popen(
            [*EDGESERVE, "up", "--port", str(port), "--device", "cpu", "--redis-url", REDIS_URL,
             "--prefix", prefix, "--ledger", str(tmp_path / "ledger.sqlite3")],
            env=os.environ | {"EDGESERVE_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"} | env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("  API key:"):
            line = self.proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        self.api_key = lines[-1].split()[-1]
        deadline = time.monotonic() + 60
        while True:  # serving (503 while the model loads): its signal handlers are set
            try:
                httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "up never listened"
                time.sleep(0.05)

    def stop(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _account_keys(prefix: str, *keys: str) -> tuple[list[str], list[str | None]]:
    """The ids of account `local`'s keys, and the account each of `keys` resolves to."""
    from gateway.keys import RedisKeyStore

    async def read() -> tuple[list[str], list[str | None]]:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            store = RedisKeyStore(client, prefix)
            listed = [info.key_id for info in await store.list("local")]
            return listed, [await store.lookup(key) for key in keys]
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_a_restarted_up_leaves_one_generated_key_in_redis(
    smollm2_path, redis_prefix: str, tmp_path: Path
) -> None:
    from gateway.keys import key_id_of

    port = free_port()
    crashed = Up(port, redis_prefix, tmp_path)
    crashed.stop(signal.SIGKILL)  # no chance to revoke its key
    assert _account_keys(redis_prefix, crashed.api_key) == ([key_id_of(crashed.api_key)], ["local"])
    restarted = Up(port, redis_prefix, tmp_path)
    assert _account_keys(redis_prefix, crashed.api_key, restarted.api_key) == (
        [key_id_of(restarted.api_key)], [None, "local"],
    )  # fmt: skip
    restarted.stop(signal.SIGTERM)
    assert _account_keys(redis_prefix, restarted.api_key) == ([], [None])
    chosen = Up(port, redis_prefix, tmp_path, EDGESERVE_API_KEY="es-chosen-by-the-operator")
    chosen.stop(signal.SIGTERM)
    assert _account_keys(redis_prefix, "es-chosen-by-the-operator") == (
        [key_id_of("es-chosen-by-the-operator")], ["local"],
    )  # fmt: skip
