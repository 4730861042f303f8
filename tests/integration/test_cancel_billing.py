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
    # Its start, recorded once the status line was out: what billing would complete had
    # the gateway died instead.
    (start,) = [e for e in stack.sink.starts if e.request_id == request_id]
    assert (start.kind, start.status, start.node_id) == ("start", "cancelled", "node-1")
    assert (start.input_tokens, start.output_tokens) == (event.input_tokens, 0)
    assert start.started_at == event.started_at


def send_and_leave(url: str, api_key: str, path: str, body: dict[str, Any], engine: Any) -> bytes:
    """Everything the gateway wrote back to a client that half-closed its connection (it
    will send nothing more) once the node's engine has run a step of its non-streaming
    request: nothing, since a server writes nothing to a client it has seen leave."""
    before = engine.stats().num_computed_tokens
    with post_on_a_socket(url, api_key, path, body) as sock:
        wait_until(lambda: engine.stats().num_computed_tokens > before, "it never ran")
        return leave(sock)


def leave(sock: socket.socket) -> bytes:
    """Half-closes `sock` and reads what the gateway still writes, to the end."""
    sock.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def wait_until(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


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
    from gpu_node.config import EngineConfig
    from gpu_node.engine.async_engine import AsyncEngine

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
    """Cancelled between two prefill chunks, not after the whole prompt; billed the prompt
    tokens it had computed, and no output."""
    stack, engine = slow_prefill
    prompt = ", ".join(str(i) for i in range(1, 161))
    num_prompt = len(engine.tokenizer.encode(prompt))
    assert num_prompt > 20 * 32  # more than 20 steps of prefill
    body = {"prompt": prompt, "raw": True, "max_tokens": 4, "temperature": 0}
    before_events, before = len(stack.sink.events), engine.stats().num_computed_tokens
    assert send_and_leave(stack.url, stack.api_key, WORKERS_AI_PATH, body, engine) == b""
    event = stack.sink.event_after(before_events)
    wait_until(lambda: not (engine.stats().num_running or engine.stats().num_waiting), "ran on")
    computed = engine.stats().num_computed_tokens - before
    assert 0 < computed < num_prompt // 2, computed  # stopped early in its prefill
    assert (event.status, event.input_tokens, event.output_tokens) == ("cancelled", computed, 0)


def test_a_request_that_leaves_while_queued_on_the_node_is_billed_nothing(
    slow_prefill: Any,
) -> None:
    """B waits on the node behind A (one long prompt prefills at a time); B's client leaves
    before any of B ran: B's row is cancelled with no tokens. A, left later, pays for what
    it computed."""
    stack, engine = slow_prefill
    first = ", ".join(str(i) for i in range(1, 161))
    second = ", ".join(str(i) for i in range(200, 330))
    before_events, before = len(stack.sink.events), engine.stats().num_computed_tokens
    bodies = [
        {"prompt": p, "raw": True, "max_tokens": 4, "temperature": 0} for p in (first, second)
    ]
    with post_on_a_socket(stack.url, stack.api_key, WORKERS_AI_PATH, bodies[0]) as a:
        wait_until(lambda: engine.stats().num_computed_tokens > before, "A never ran")
        with post_on_a_socket(stack.url, stack.api_key, WORKERS_AI_PATH, bodies[1]) as b:
            wait_until(lambda: engine.stats().num_waiting == 1, "B never queued on the node")
            assert leave(b) == b""
        b_event = stack.sink.event_after(before_events)
        assert (b_event.status, b_event.input_tokens, b_event.output_tokens) == ("cancelled", 0, 0)
        assert leave(a) == b""
    a_event = stack.sink.event_after(before_events + 1)
    wait_until(lambda: not (engine.stats().num_running or engine.stats().num_waiting), "ran on")
    computed = engine.stats().num_computed_tokens - before
    assert (a_event.status, a_event.input_tokens, a_event.output_tokens) == (
        "cancelled",
        computed,
        0,
    )
