"""A node that is quiet but alive is waited for: the gateway's silence probe (after
node_silence_s with nothing on a stream) finds it answering, and the request goes on.

The real SmolLM2 node on loopback; a prompt whose prefill outlasts node_silence_s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ACCOUNT_ID, SMOLLM2
from tests.loopback import API_KEY, Node, running_node, start_gateway

pytestmark = pytest.mark.timeout(120)

SILENCE_S = 0.05


@pytest.fixture(scope="module")
def node(engine: Any) -> Iterator[Node]:
    yield from running_node(engine)


def test_a_node_quiet_past_node_silence_s_that_answers_its_probe_is_waited_for(node) -> None:
    gateway = start_gateway(
        node, settings={"node_silence_s": SILENCE_S, "node_probe_timeout_s": 5.0}
    )
    try:
        prompt = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens
        started = time.monotonic()
        response = httpx.post(
            f"{gateway.url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}",
            json={"prompt": prompt, "raw": True, "max_tokens": 2, "temperature": 0},
            headers={"authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        took = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert response.json()["result"]["usage"]["completion_tokens"] == 2
        assert took > 4 * SILENCE_S  # the node was silent long enough to be probed
    finally:
        gateway.stop()
