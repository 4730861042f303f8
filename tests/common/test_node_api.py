"""The node's internal API as both sides read and write it: one NDJSON line an event, fields
at their defaults left out, and requests checked once at the edge."""

from __future__ import annotations

import pydantic
import pytest

from common.node_api import (
    ChatMessage,
    ErrorEvent,
    Finish,
    GenerateRequest,
    NodeError,
    TokenChunk,
    Usage,
    event_line,
    read_event,
)


def test_an_event_is_one_line_without_its_defaults() -> None:
    assert event_line(TokenChunk(text="Hi", token_ids=[1])) == b'{"text":"Hi","token_ids":[1]}\n'
    first = TokenChunk(text="a", token_ids=[7], prompt_tokens=5, cached_tokens=0)
    assert event_line(first) == (
        b'{"text":"a","token_ids":[7],"prompt_tokens":5,"cached_tokens":0}\n'
    )
    finish = Finish(finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=2,
                                                      cached_tokens=0))  # fmt: skip
    assert event_line(finish) == (
        b'{"finish_reason":"stop","usage":{"prompt_tokens":5,"completion_tokens":2,'
        b'"cached_tokens":0}}\n'
    )


def test_text_with_any_line_break_stays_on_its_line() -> None:
    chunk = TokenChunk(text="a\nb\r\u2028c\u0085", token_ids=[1, 2])
    line = event_line(chunk)
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    assert read_event(line) == chunk


def test_each_kind_of_event_reads_back_as_itself() -> None:
    events = [
        TokenChunk(text="x", token_ids=[3], prompt_tokens=4, cached_tokens=2,
                   prefilled_tokens=4),
        Finish(finish_reason="length", usage=Usage(prompt_tokens=4, completion_tokens=1,
                                                   cached_tokens=2)),
        ErrorEvent(error=NodeError(code="over_capacity", message="full")),
    ]  # fmt: skip
    assert [read_event(event_line(e)) for e in events] == events
    assert [type(read_event(event_line(e).decode())) for e in events] == [
        TokenChunk, Finish, ErrorEvent,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "line",
    [
        b'{"text": "1", "token_ids": [16]',  # cut short
        b"[1, 2]",
        b'{"finish_reason": "stop"}',  # no usage
        b'{"text": 7, "token_ids": [16]}',
        b'{"text": "a", "token_ids": [], "colour": "red"}',  # a field no event has
    ],
)
def test_a_line_that_is_no_event_is_a_value_error(line: bytes) -> None:
    with pytest.raises(ValueError):
        read_event(line)


def test_a_request_is_checked_at_the_edge_and_cannot_change() -> None:
    request = GenerateRequest(
        request_id="r1", model="smollm2", messages=[ChatMessage(role="user", content="Hi")],
        prefill_from="http://10.0.0.7:8081",
    )  # fmt: skip
    assert (request.max_tokens, request.temperature, request.stop) == (256, 0.0, [])
    with pytest.raises(pydantic.ValidationError):
        request.max_tokens = 5  # type: ignore[misc]
    for bad in (
        {"request_id": ""},
        {"request_id": "r" * 201},
        {"prefill_from": "ftp://10.0.0.7"},
        {"prefill_from": "http://a b"},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"max_token": 5},  # a misspelt field is refused, not ignored
    ):
        with pytest.raises(pydantic.ValidationError):
            GenerateRequest.model_validate({"request_id": "r1", "model": "smollm2"} | bad)
