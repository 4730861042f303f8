"""Prefill/decode disaggregation through the gateway: a prefill node runs the prompt, a
decode node takes its KV and decodes; the client sees one node's answer.

Real servers on loopback (two SmolLM2 nodes sharing one set of weights, each with its
own engine and KV pool), the official `openai` client, the gateway's usage events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.telemetry import Telemetry, TelemetrySettings, setup_telemetry
from tests.conftest import (
    ACCOUNT_ID,
    INTERNAL_TOKEN,
    SMOLLM2,
    ListSink,
    chat_prompt_ids,
    free_port,
    run_on_engine,
    start_local_gateway,
    start_node_server,
    wait_for_nodes,
)

QUESTION = "Name three colours and say which one you like best."


def traced(service: str, exporter: InMemorySpanExporter) -> Telemetry:
    settings = TelemetrySettings(service)
    return setup_telemetry(settings, span_processors=[SimpleSpanProcessor(exporter)])


@pytest.fixture(scope="module")
def decode_engine(engine: Any) -> Iterator[Any]:
    """A second engine on the same weights, with a KV pool of its own."""
    from gpu_node.engine.async_engine import AsyncEngine
    from gpu_node.engine.llm_engine import LLMEngine

    inner = engine.engine
    second = AsyncEngine(LLMEngine(inner.config, inner.model, inner.tokenizer))
    second.start()
    yield second
    second.shutdown()


@pytest.fixture(scope="module")
def fleet(engine: Any, decode_engine: Any) -> Iterator[dict[str, Any]]:
    from gateway.keys import MemoryKeyStore, new_key
    from scheduler.capacity import LocalCapacityRegistry

    registry, exporter = LocalCapacityRegistry(), InMemorySpanExporter()
    prefill_telemetry, decode_telemetry = (traced("edgeserve-node", exporter) for _ in range(2))
    prefill_node, prefill_service = start_node_server(
        engine, registry, "prefill-1", "prefill", prefill_telemetry
    )
    decode_node, _ = start_node_server(
        decode_engine, registry, "decode-1", "decode", decode_telemetry
    )
    keys, api_key, sink = MemoryKeyStore(), new_key(), ListSink()
    asyncio.run(keys.add(api_key, ACCOUNT_ID))
    gateway = start_local_gateway(
        registry, keys, usage_sink=sink, telemetry=traced("edgeserve-gateway", exporter)
    )
    wait_for_nodes(registry, 2)
    yield {
        "gateway": gateway, "api_key": api_key, "sink": sink, "prefill": prefill_node,
        "decode": decode_node, "prefill_service": prefill_service, "exporter": exporter,
        "telemetry": {"prefill": prefill_telemetry, "decode": decode_telemetry},
        "registry": registry,
    }  # fmt: skip
    gateway.stop()
    decode_node.stop()
    prefill_node.stop()


def test_a_chat_is_prefilled_on_one_node_and_decoded_on_the_other(
    fleet: dict[str, Any], engine: Any, decode_engine: Any
) -> None:
    ids = chat_prompt_ids(engine, [{"role": "user", "content": QUESTION}])
    reference = run_on_engine(engine, ids, max_tokens=12)
    client = openai.OpenAI(base_url=f"{fleet['gateway'].url}/v1", api_key=fleet["api_key"])
    raw = client.chat.completions.with_raw_response.create(
        model=SMOLLM2, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        temperature=0,
    )  # fmt: skip
    completion = raw.parse()
    assert completion.choices[0].message.content == reference.text
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        reference.prompt_tokens,
        reference.completion_tokens,
    )
    event = fleet["sink"].event_of(raw.headers["x-request-id"])
    assert (event.node_id, event.input_tokens, event.output_tokens) == (
        "decode-1",
        len(ids),
        reference.completion_tokens,
    )
    # both pools are whole again: the prefill node's pages went back at the handoff
    for eng in (engine, decode_engine):
        stats = eng.stats()
        assert stats.num_free_pages == stats.num_pages


def test_a_stream_through_the_decode_node_matches_too(fleet: dict[str, Any], engine: Any) -> None:
    ids = chat_prompt_ids(engine, [{"role": "user", "content": "Hi"}])
    reference = run_on_engine(engine, ids, max_tokens=8)
    client = openai.OpenAI(base_url=f"{fleet['gateway'].url}/v1", api_key=fleet["api_key"])
    stream = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        temperature=0, stream=True,
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference.text
    assert fleet["sink"].event_of(stream.response.headers["x-request-id"]).node_id == "decode-1"


def test_the_decode_node_says_which_prefill_node_failed(fleet: dict[str, Any]) -> None:
    """Straight to the decode node's internal API: a prefill node nobody listens on."""
    gone = f"http://127.0.0.1:{free_port()}"
    body = {
        "request_id": "r-gone", "model": "smollm2", "prompt": "Hi", "max_tokens": 2,
        "prefill_from": gone,
    }  # fmt: skip
    response = httpx.post(
        f"{fleet['decode'].url}/internal/v1/generate",
        json=body,
        headers={"authorization": f"Bearer {INTERNAL_TOKEN}"},
        timeout=30,
    )
    assert response.status_code == 503
    assert response.json() == {
        "error": {
            "code": "over_capacity",
            "message": f"prefill node {gone} unreachable: ConnectError",
        }
    }
    refused = httpx.post(
        f"{fleet['prefill'].url}/internal/v1/prefill",
        json=body | {"prefill_from": fleet["decode"].url},
        headers={"authorization": f"Bearer {INTERNAL_TOKEN}"},
        timeout=30,
    )
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "code": "invalid_request",
        "message": "a prefill call cannot itself be prefilled elsewhere",
    }
    unauthorized = httpx.post(f"{fleet['prefill'].url}/internal/v1/prefill", json=body, timeout=30)
    assert unauthorized.status_code == 401


def test_one_trace_runs_from_the_gateway_through_the_decode_node_to_the_prefill_node(
    fleet: dict[str, Any],
) -> None:
    response = httpx.post(
        f"{fleet['gateway'].url}/v1/chat/completions",
        json={"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        headers={"authorization": f"Bearer {fleet['api_key']}"},
        timeout=60,
    )
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    deadline = time.monotonic() + 5
    while True:  # the decode node's span ends just after its last byte
        spans = [
            s
            for s in fleet["exporter"].get_finished_spans()
            if (s.attributes or {}).get("edgeserve.request_id") == request_id
        ]
        names = sorted(s.name for s in spans)
        if "generate smollm2" in names or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    by_name = {s.name: s for s in spans}
    assert {"generate smollm2", "prefill smollm2"} <= set(by_name), names
    decode, prefill = by_name["generate smollm2"], by_name["prefill smollm2"]
    assert (decode.attributes or {})["edgeserve.node_id"] == "decode-1"
    assert (prefill.attributes or {})["edgeserve.node_id"] == "prefill-1"
    assert prefill.parent is not None and prefill.parent.span_id == decode.context.span_id
    assert decode.parent is not None
    assert len({s.context.trace_id for s in spans}) == 1  # the gateway's trace, one for all
    assert (prefill.attributes or {})["gen_ai.usage.output_tokens"] == 1
    # the request counts once in the nodes' GenAI histograms: on the decode node
    labels = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "edgeserve",
        "gen_ai_request_model": "smollm2",
        "gen_ai_response_model": "smollm2",
        "error_type": "",
    }
    counts = {
        role: telemetry.registry.get_sample_value(
            "gen_ai_server_request_duration_seconds_count", labels
        )
        for role, telemetry in fleet["telemetry"].items()
    }
    assert counts["prefill"] is None and counts["decode"] >= 1


def test_the_retry_after_a_dead_prefill_node_goes_to_neither_node_of_the_placement(
    fleet: dict[str, Any],
) -> None:
    """A prefill node died within its record's TTL, the freest of the fleet: the decode node
    cannot fetch from it and answers 503. The one retry had excluded the decode node alone
    and went, whole, to the dead prefill node (still the freest): a 502 for a request a
    live node could serve."""
    from dataclasses import replace

    registry = fleet["registry"]
    live = {r.node_id: r for r in asyncio.run(registry.list_live())}
    real = live["prefill-1"]
    ghost = replace(
        real, node_id="a-ghost", address=f"http://127.0.0.1:{free_port()}",
        num_pages=2 * real.num_pages, num_free_pages=2 * real.num_pages,
        published_at=time.time(), ttl_s=60.0,
    )  # fmt: skip
    asyncio.run(registry.publish(ghost))
    try:
        time.sleep(0.3)  # past the gateway's view of 0.2 s
        response = httpx.post(
            f"{fleet['gateway'].url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}",
            json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
            headers={"authorization": f"Bearer {fleet['api_key']}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        event = fleet["sink"].event_of(response.headers["x-request-id"])
        assert (event.node_id, event.status) == ("prefill-1", "ok")
    finally:
        asyncio.run(registry.remove("a-ghost"))
