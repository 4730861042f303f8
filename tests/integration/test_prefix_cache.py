"""Prefix caching seen from a client: the repeated prompt's cached tokens in the OpenAI
usage and in the usage event billing prices, the answer unchanged (real servers)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import (
    ACCOUNT_ID,
    OTHER_ACCOUNT_ID,
    SMOLLM2,
    ListSink,
    chat_prompt_ids,
    start_local_gateway,
    start_node_server,
    wait_for_nodes,
)

QUESTION = "Tell me about the sea, the moon and the stars, and how they move together."


@pytest.fixture(scope="module")
def cached_stack(engine: Any) -> Iterator[dict[str, Any]]:
    """A node whose engine keeps 32 prompt pages, on the shared weights, and a gateway."""
    from gateway.keys import MemoryKeyStore, new_key
    from gpu_node.engine.async_engine import AsyncEngine
    from gpu_node.engine.llm_engine import LLMEngine
    from scheduler.capacity import LocalCapacityRegistry

    inner = engine.engine
    config = dataclasses.replace(inner.config, prefix_cache_blocks=32)
    cached = AsyncEngine(LLMEngine(config, inner.model, inner.tokenizer))
    cached.start()
    registry = LocalCapacityRegistry()
    node, _ = start_node_server(cached, registry, "node-c")
    keys, key, other, sink = MemoryKeyStore(), new_key(), new_key(), ListSink()
    asyncio.run(keys.add(key, ACCOUNT_ID))
    asyncio.run(keys.add(other, OTHER_ACCOUNT_ID))
    gateway = start_local_gateway(registry, keys, usage_sink=sink)
    wait_for_nodes(registry)
    yield {"gateway": gateway, "key": key, "other": other, "sink": sink, "engine": cached}
    gateway.stop()
    node.stop()
    cached.shutdown()


def ask(stack: dict[str, Any], key: str) -> Any:
    client = openai.OpenAI(base_url=f"{stack['gateway'].url}/v1", api_key=key)
    return client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        temperature=0,
    )  # fmt: skip


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_same_answer(
    cached_stack: dict[str, Any],
) -> None:
    n = len(chat_prompt_ids(cached_stack["engine"], [{"role": "user", "content": QUESTION}]))
    first, second = ask(cached_stack, cached_stack["key"]), ask(cached_stack, cached_stack["key"])
    assert second.choices[0].message.content == first.choices[0].message.content
    details = [c.usage.prompt_tokens_details.cached_tokens for c in (first, second)]
    assert details == [0, (n - 1) // 16 * 16]
    assert [c.usage.prompt_tokens for c in (first, second)] == [n, n]
    events = cached_stack["sink"].events[-2:]
    assert [(e.input_tokens, e.cached_tokens) for e in events] == [(n, 0), (n, (n - 1) // 16 * 16)]
    # another account asks the same: nothing of the first account's is reused
    theirs = ask(cached_stack, cached_stack["other"])
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0
    assert cached_stack["sink"].events[-1].account_id == OTHER_ACCOUNT_ID
