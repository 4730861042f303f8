"""A client that cancels mid-stream is billed exactly the tokens it received.

The client half-closes its connection (it will send nothing more) after reading k
chunks, then keeps reading to the end: every byte the gateway wrote before it
noticed the disconnect reaches the client, so "received" is exact on both sides.
The tokens behind the received text come from the same greedy request run on the
engine directly, chunk by chunk.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from scheduler.sequence import SamplingParams
from tests.conftest import ACCOUNT_ID, SMOLLM2, start_stack

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # raw: the model keeps counting
MAX_TOKENS = 60
EVENT = re.compile(rb"data: (\{.*?\})\n\n")


def token_prefixes(engine: Any) -> dict[str, int]:
    """Text received so far -> tokens behind it, after each streamed step of the greedy run."""

    async def go() -> dict[str, int]:
        text, seen = "", {"": 0}
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        ids = engine.tokenizer.encode(PROMPT)
        async for out in engine.generate(f"ref-{uuid.uuid4().hex}", ids, params):
            text += out.text
            seen.setdefault(text, out.num_completion_tokens)  # empty steps: the first count stays
            if out.text:
                seen[text] = out.num_completion_tokens
        return seen

    return asyncio.run(go())


WORKERS_AI_PATH = f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"


def post_on_a_socket(url: str, api_key: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw connection to the gateway with one POST of `body` sent on it (the tests below
    half-close it themselves, which no HTTP client lets them do)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"Connection: close\r\n\r\n"
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head + payload)
    return sock


def stream_and_cancel(url: str, api_key: str, after_chunks: int) -> tuple[str, str]:
    """(request id, text received) for a Workers AI stream half-closed after `after_chunks`."""
    body = {
        "prompt": PROMPT,
        "raw": True,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    with post_on_a_socket(url, api_key, WORKERS_AI_PATH, body) as sock:
        data = b""
        while (
            sum(1 for m in EVENT.finditer(data) if json.loads(m[1]).get("response")) < after_chunks
        ):
            data += sock.recv(65536)
        sock.shutdown(socket.SHUT_WR)  # cancel: nothing more from us
        while chunk := sock.recv(65536):
            data += chunk
    request_id = re.search(rb"x-request-id: (\S+)\r\n", data, re.IGNORECASE)[1].decode()
    text = "".join(json.loads(m[1]).get("response", "") for m in EVENT.finditer(data))
    return request_id, text


@pytest.mark.parametrize("after_chunks", [1, 4, 9])
def test_a_cancelled_stream_bills_exactly_the_tokens_its_client_received(
    stack: Any, engine: Any, after_chunks: int
) -> None:
    prefixes = token_prefixes(engine)
    request_id, text = stream_and_cancel(stack.url, stack.api_key, after_chunks)
    assert text in prefixes, text  # whole steps only
    event = stack.sink.event_of(request_id)
    assert event.status == "cancelled"
    assert event.output_tokens == prefixes[text]
    assert prefixes[text] < MAX_TOKENS  # it really was cut short
    assert event.input_tokens == len(engine.tokenizer.encode(PROMPT))


def send_and_leave(url: str, api_key: str, path: str, body: dict[str, Any], engine: Any) -> bytes:
    """Everything the gateway wrote back to a client that half-closed its connection (it
    will send nothing more) once the node's engine holds its non-streaming request: nothing,
    since a server writes nothing to a client it has seen leave."""
    before = engine.stats().num_computed_tokens
    with post_on_a_socket(url, api_key, path, body) as sock:
        deadline = time.monotonic() + 30
        while not (engine.engine.has_unfinished() or engine.stats().num_computed_tokens > before):
            assert time.monotonic() < deadline, "the request never reached the node"
            time.sleep(0.005)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            WORKERS_AI_PATH,
            {"prompt": PROMPT, "raw": True, "max_tokens": MAX_TOKENS, "temperature": 0},
        ),
        (
            "/v1/completions",
            {"model": SMOLLM2, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        ),
    ],
)
def test_a_client_that_leaves_a_whole_answer_cancels_it_and_is_billed_no_output(
    stack: Any, engine: Any, path: str, body: dict[str, Any]
) -> None:
    """Without a stream nothing reaches the client before the end: one that leaves ends the
    generation on the node and pays for its prompt alone."""
    before = len(stack.sink.events)
    assert send_and_leave(stack.url, stack.api_key, path, body, engine) == b""
    event = stack.sink.event_after(before)
    assert (event.status, event.output_tokens) == ("cancelled", 0)
    assert event.input_tokens == len(engine.tokenizer.encode(PROMPT))
    # The node dropped it: nothing is left running there, long before 60 tokens' time.
    deadline = time.monotonic() + 30
    while engine.engine.has_unfinished():
        assert time.monotonic() < deadline, "the node kept generating"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def slow_prefill() -> Iterator[Any]:
    """A stack whose engine prefills 32 tokens a step, so a long prompt takes many steps."""
    from gpu_node.async_engine import AsyncEngine
    from gpu_node.config import EngineConfig

    engine = AsyncEngine.from_config(
        EngineConfig(
            model="smollm2",
            max_model_len=1024,
            kv_memory_bytes=48 * 1024 * 1024,
            max_num_batched_tokens=32,
        )
    )
    engine.start()
    started = start_stack(engine)
    yield started, engine
    started.gateway.stop()
    started.node.stop()
    engine.shutdown()


def test_a_client_that_leaves_while_its_prompt_runs_stops_it_there_at_once(
    slow_prefill: Any,
) -> None:
    """Cancelled between two prefill chunks, not after the whole prompt; billed as any
    cancelled request (its prompt, no output)."""
    stack, engine = slow_prefill
    prompt = ", ".join(str(i) for i in range(1, 161))
    num_prompt = len(engine.tokenizer.encode(prompt))
    assert num_prompt > 20 * 32  # more than 20 steps of prefill
    body = {"prompt": prompt, "raw": True, "max_tokens": 4, "temperature": 0}
    before_events, before = len(stack.sink.events), engine.stats().num_computed_tokens
    assert send_and_leave(stack.url, stack.api_key, WORKERS_AI_PATH, body, engine) == b""
    event = stack.sink.event_after(before_events)
    assert (event.status, event.input_tokens, event.output_tokens) == ("cancelled", num_prompt, 0)
    deadline = time.monotonic() + 30
    while (stats := engine.stats()).num_running or stats.num_waiting:  # the engine's snapshot
        assert time.monotonic() < deadline, "the node kept prefilling"
        time.sleep(0.02)
    computed = engine.stats().num_computed_tokens - before
    assert computed < num_prompt // 2, computed  # stopped early in its prefill (or before)
