"""`edgeserve up` as a newcomer runs it: one command, 503 while loading, then answers; SIGTERM stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import free_port


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
