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
import uuid
from typing import Any

import pytest

from scheduler.sequence import SamplingParams
from tests.conftest import ACCOUNT_ID, SMOLLM2

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


def stream_and_cancel(url: str, api_key: str, after_chunks: int) -> tuple[str, str]:
    """(request id, text received) for a Workers AI stream half-closed after `after_chunks`."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {"prompt": PROMPT, "raw": True, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0}
    ).encode()
    head = (
        f"POST /client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
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
