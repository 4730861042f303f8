"""Any text a model generates crosses the node's stream and the gateway's answers intact.

The node writes NDJSON; the gateway splits it on the `\\n` byte alone (`node_lines`) and
writes its own JSON and SSE with U+0085, U+2028 and U+2029 escaped (`json_bytes`), so no
line splitter on either hop can cut an event. A property test sends every class of code
point through those steps, and the real SmolLM2 node answers a prompt that makes it
generate U+2028, U+2029 and U+0085, in both dialects, streamed and not, billed `ok`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder

from billing.ledger import SqliteLedger
from billing.sink import LocalUsageSink
from common.node_api import TokenChunk, event_line, read_event
from gateway.json_body import json_bytes
from gateway.openai_api import ChatStream
from gateway.upstream import Finished, _split_lines
from gateway.workers_ai import WorkersAIStream
from tests.conftest import ACCOUNT_ID, SMOLLM2
from tests.loopback import API_KEY, Node, running_node, start_gateway

pytestmark = pytest.mark.timeout(180)

# Every general category of code point but the surrogates (no UTF-8 text holds one).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
LINE_BREAKS = ("\u2028", "\u2029", "\u0085")


def _chunked(data: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    """`data` in pieces cut at `cuts` (inside a character or a line end alike)."""

    async def pieces() -> AsyncIterator[bytes]:
        start = 0
        for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
            yield data[start:cut]
            start = cut

    return pieces()


async def _lines(data: bytes, cuts: list[int]) -> list[str]:
    return [line async for line in _split_lines(_chunked(data, cuts))]


def _sse_data(stream: bytes) -> list[str]:
    """The `data` of each event as the official openai client decodes the stream."""
    decoder = SSEDecoder()
    return [event.data for event in decoder.iter_bytes(iter([stream]))]


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=6), cuts=st.lists(st.integers(0, 10_000)))
def test_node_events_split_back_into_the_events_the_node_wrote(
    texts: list[str], cuts: list[int]
) -> None:
    events = [TokenChunk(text=t, token_ids=[i]) for i, t in enumerate(texts)]
    wire = b"".join(event_line(e) for e in events)
    assert [read_event(line) for line in asyncio.run(_lines(wire, cuts))] == events


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_gateway_json_and_sse_carry_any_text_on_one_line(text: str) -> None:
    body = json_bytes({"response": text})
    assert b"\n" not in body and b"\r" not in body
    decoded = body.decode()
    assert all(c not in decoded for c in LINE_BREAKS)
    assert decoded.splitlines() == [decoded]  # no reader's line splitter cuts it
    assert json.loads(body) == {"response": text}

    finished = Finished("stop", 3, 1, 0)
    workers_ai = WorkersAIStream()
    data = _sse_data(workers_ai.chunk(text) + workers_ai.finish(finished))
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["response"] for d in data[:-1]] == [text, ""]
    chat = ChatStream("chatcmpl-1", SMOLLM2, include_usage=True)
    data = _sse_data(chat.start() + chat.chunk(text) + chat.finish(finished))
    assert data[-1] == "[DONE]"
    deltas = [json.loads(d)["choices"] for d in data[:-1]]
    assert [c[0]["delta"].get("content") for c in deltas if c] == ["", text, None]


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
        data = _sse_data(response.read())
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
        data = _sse_data(response.read())
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


# ---- a node that breaks its own wire ----------------------------------------------------

BROKEN_EVENTS = {
    "not-json": b'{"text": "1", "token_ids": [16]',
    "no-usage": b'{"finish_reason": "stop"}',
    "text-not-str": b'{"text": 7, "token_ids": [16]}',
    "not-an-object": b"[1, 2]",
}


def _broken_node(line: bytes) -> Any:
    """A stand-in for a node whose stream breaks after its first token (no real node writes
    such lines, which is why it stands in): the first event, then `line`."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def generate(request: Any) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            yield b'{"text":"1","token_ids":[16],"prompt_tokens":5,"cached_tokens":0}\n'
            yield line + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return Starlette(routes=[Route("/internal/v1/generate", generate, methods=["POST"])])


@pytest.mark.parametrize("line", BROKEN_EVENTS.values(), ids=BROKEN_EVENTS.keys())
def test_a_node_event_that_cannot_be_read_is_the_nodes_failure_billed_as_an_error(
    line: bytes,
) -> None:
    from scheduler.capacity import CapacityRecord, LocalCapacityRegistry
    from tests.conftest import ListSink, ServerThread

    broken = ServerThread(_broken_node(line)).start()
    registry = LocalCapacityRegistry()
    record = CapacityRecord(
        "node-broken", broken.url, "mixed", ("smollm2",), 1000, 1000, 16, "fp32", 0, 0, 0.0,
        time.time(), 300.0, "fp32",
    )  # fmt: skip
    asyncio.run(registry.publish(record))
    sink = ListSink()
    gateway = start_gateway(Node(broken, registry), usage_sink=sink)
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 8, "temperature": 0}
    try:
        whole = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert whole.status_code == 502
        assert whole.json()["error"] == {
            "message": "the node serving this request failed mid-answer",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
        with httpx.stream(
            "POST", f"{gateway.url}/v1/completions", json=body | {"stream": True},
            headers=headers, timeout=30,
        ) as response:  # fmt: skip
            assert response.status_code == 200
            data = _sse_data(response.read())
        assert json.loads(data[0])["choices"][0]["text"] == "1"
        assert json.loads(data[-1])["error"]["code"] == "upstream_error"  # no [DONE]
        for response_id in (whole.headers["x-request-id"], response.headers["x-request-id"]):
            event = sink.event_of(response_id)
            assert (event.status, event.node_id) == ("error", "node-broken")
    finally:
        gateway.stop()
        broken.stop()
