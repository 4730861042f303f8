"""Any text a model generates crosses the node's stream and the gateway's answers intact.

The node writes NDJSON; the gateway splits it on the `\\n` byte alone (`node_lines`) and
writes its own JSON and SSE with U+0085, U+2028 and U+2029 escaped (`json_bytes`), so no
line splitter on either hop can cut an event (each step's property test:
tests/gateway/test_upstream.py, tests/gateway/test_json_body.py). Here the real SmolLM2 node
answers a prompt that makes it generate U+2028, U+2029 and U+0085, in both dialects,
streamed and not, billed `ok`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.ledger import SqliteLedger
from billing.sink import LocalUsageSink
from tests.conftest import ACCOUNT_ID, SMOLLM2, sse_data
from tests.loopback import API_KEY, Node, running_node, start_gateway

pytestmark = pytest.mark.timeout(180)

LINE_BREAKS = ("\u2028", "\u2029", "\u0085")


# ---- the real node ---------------------------------------------------------------------

# SmolLM2 at temperature 0 continues this pattern with the separator in its own output.
PROMPTS = {c: f"a{c}b{c}a{c}b{c}a{c}b{c}a{c}" for c in LINE_BREAKS}


@pytest.fixture(scope="module")
def node(engine: Any) -> Iterator[Node]:
    yield from running_node(engine)


def _completion(url: str, prompt: str, stream: bool) -> tuple[str, str, str]:
    """(request id, text, finish reason) of one OpenAI completion."""
    body = {"model": SMOLLM2, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    headers = {"authorization": f"Bearer {API_KEY}"}
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return response.headers["x-request-id"], choice["text"], choice["finish_reason"]
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True}, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        data = sse_data(response.read())
    assert data[-1] == "[DONE]"
    choices = [json.loads(d)["choices"][0] for d in data[:-1]]
    text = "".join(c["text"] for c in choices)
    return response.headers["x-request-id"], text, choices[-1]["finish_reason"]


def _workers_ai(url: str, prompt: str, stream: bool) -> tuple[str, str, str]:
    """(request id, text, "stop" or "length" as far as the answer tells) of one Workers AI run."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "raw": True}
    run = f"{url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
    headers = {"authorization": f"Bearer {API_KEY}"}
    if not stream:
        response = httpx.post(run, json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        result = response.json()["result"]
        return response.headers["x-request-id"], result["response"], "-"
    with httpx.stream(
        "POST", run, json=body | {"stream": True}, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        data = sse_data(response.read())
    assert data[-1] == "[DONE]"
    text = "".join(json.loads(d).get("response", "") for d in data[:-1])
    return response.headers["x-request-id"], text, "-"


@pytest.mark.parametrize("separator", LINE_BREAKS, ids=["nel", "ls", "ps"])
def test_generated_line_separators_reach_the_client_intact_and_billed_ok(
    node: Node, tmp_path: Path, separator: str
) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    gateway = start_gateway(node, usage_sink=LocalUsageSink(ledger), ledger=ledger)
    try:
        prompt = PROMPTS[separator]
        answers = [
            ask(gateway.url, prompt, stream)
            for ask in (_completion, _workers_ai)
            for stream in (False, True)
        ]
        texts = {text for _, text, _ in answers}
        assert len(texts) == 1, answers  # one answer, however it travelled
        (text,) = texts
        assert separator in text, text
        deadline = time.monotonic() + 10
        while ledger.count() < len(answers):
            assert time.monotonic() < deadline, "the usage events never reached the ledger"
            time.sleep(0.05)
        for request_id, _, _ in answers:
            row = ledger.get(request_id)
            assert row is not None and row.status == "ok", row
            assert row.output_tokens == 8
    finally:
        gateway.stop()
