"""A node whose context window (64 tokens) is smaller than the default max_tokens (256):
a request that names no max_tokens is answered up to the end of the window, in either
dialect; one that names too many is refused, as before."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import (
    ACCOUNT_ID,
    SMOLLM2,
    ListSink,
    chat_prompt_ids,
    run_on_engine,
    start_local_gateway,
    start_node_server,
    wait_for_nodes,
)

WINDOW = 64
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def small(smollm2_path: Any) -> Iterator[tuple[Any, str, str]]:
    """(engine, gateway URL, API key) around a SmolLM2 node of a 64-token window."""
    from gateway.keys import MemoryKeyStore, new_key
    from gpu_node.config import EngineConfig
    from gpu_node.engine.async_engine import AsyncEngine
    from scheduler.capacity import LocalCapacityRegistry

    engine = AsyncEngine.from_config(
        EngineConfig(model="smollm2", max_model_len=WINDOW, kv_memory_bytes=8 * 1024 * 1024)
    )
    engine.start()
    registry = LocalCapacityRegistry()
    node, _ = start_node_server(engine, registry, "small-node")
    keys = MemoryKeyStore()
    key = new_key()
    asyncio.run(keys.add(key, ACCOUNT_ID))
    gateway = start_local_gateway(registry, keys, usage_sink=ListSink())
    wait_for_nodes(registry)
    yield engine, gateway.url, key
    gateway.stop()
    node.stop()
    engine.shutdown()


def test_no_max_tokens_is_answered_within_a_small_window(small) -> None:
    engine, url, key = small
    prompt_ids = chat_prompt_ids(engine, HI)
    room = WINDOW - len(prompt_ids)
    assert 0 < room < 256
    reference = run_on_engine(engine, prompt_ids, max_tokens=room, temperature=0)
    auth = {"authorization": f"Bearer {key}"}
    oai = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": SMOLLM2, "messages": HI, "temperature": 0},
        headers=auth,
        timeout=60,
    )
    assert oai.status_code == 200, oai.text
    body = oai.json()
    assert body["choices"][0]["message"]["content"] == reference.text
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": reference.completion_tokens,
        "total_tokens": len(prompt_ids) + reference.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    wai = httpx.post(
        f"{url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}",
        json={"prompt": "Hi", "temperature": 0},
        headers=auth,
        timeout=60,
    )
    assert wai.status_code == 200, wai.text
    assert wai.json()["result"]["response"] == reference.text


def test_a_max_tokens_named_past_a_small_window_is_still_refused(small) -> None:
    _, url, key = small
    auth = {"authorization": f"Bearer {key}"}
    message = "max_tokens (256) leaves no room for a prompt in the context window of 64 tokens"
    oai = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": SMOLLM2, "messages": HI, "max_tokens": 256},
        headers=auth,
    )
    assert (oai.status_code, oai.json()["error"]["message"]) == (400, message)
    wai = httpx.post(
        f"{url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}",
        json={"prompt": "Hi", "max_tokens": 256},
        headers=auth,
    )
    assert (wai.status_code, wai.json()["errors"]) == (413, [{"code": 3006, "message": message}])
