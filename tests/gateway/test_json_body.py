"""The gateway's own JSON and SSE carry any text a model generates on one line: `json_bytes`
escapes U+0085, U+2028 and U+2029, so no reader's line splitter can cut an event."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.json_body import json_bytes
from gateway.openai_api import ChatStream
from gateway.upstream import Finished, TextChunk
from gateway.workers_ai import WorkersAIStream
from tests.conftest import SMOLLM2, sse_data

# Every general category of code point but the surrogates (no UTF-8 text holds one).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
LINE_BREAKS = ("\u2028", "\u2029", "\u0085")


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
    data = sse_data(workers_ai.chunk(TextChunk(text, 1)) + workers_ai.finish(finished))
    assert data[-1] == "[DONE]"
    sent = [text] if text else []  # a chunk with no text sends nothing
    assert [json.loads(d)["response"] for d in data[:-1]] == [*sent, ""]
    chat = ChatStream("chatcmpl-1", SMOLLM2, include_usage=True)
    data = sse_data(chat.start() + chat.chunk(TextChunk(text, 1)) + chat.finish(finished))
    assert data[-1] == "[DONE]"
    deltas = [json.loads(d)["choices"] for d in data[:-1]]
    assert [c[0]["delta"].get("content") for c in deltas if c] == ["", *sent, None]
