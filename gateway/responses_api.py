"""OpenAI's Responses API, stateless: `POST /v1/responses` (also under the account path).

A request's `instructions` and `input` items (messages, function calls, their outputs)
become one chat (gateway/schemas.py ResponsesRequest), run as any chat is; its answer is a
response object whose `output` holds a message (its text) and a `function_call` item per
call. Streamed, the answer is Responses' typed events:

    response.created, response.in_progress
    response.output_item.added        a message, or a function call
      response.content_part.added     (a message's output_text part)
      response.output_text.delta ...  (its text, as it comes)
      response.output_text.done, response.content_part.done
      response.function_call_arguments.delta ... / .done   (a call's arguments)
    response.output_item.done
    response.completed                the whole response, with usage
                                      (response.incomplete when cut at max_output_tokens)

No response is kept: `previous_response_id` is refused, and `store` changes nothing.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, error_body
from gateway.http import endpoint, gateway_of, request_id_of, settled
from gateway.json_body import json_bytes
from gateway.openai_api import open_generation
from gateway.relay import RelayResponse
from gateway.schemas import ResponsesRequest
from gateway.tool_calls import CallArguments, CallStart, Content, Piece, ToolCallReader
from gateway.upstream import ChoiceEnd, Finished, TextChunk, collect


def _usage(finished: Finished) -> dict[str, Any]:
    return {
        "input_tokens": finished.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finished.cached_tokens},
        "output_tokens": finished.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


class _Response:
    """The response object of one request, as it stands."""

    def __init__(self, request_id: str, body: ResponsesRequest, model: str) -> None:
        self.request_id = request_id
        self.body = body
        self.model = model
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": f"msg_{self.request_id}",
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" else [],
        }

    def call_item(
        self, index: int, name: str, arguments: str, status: str = "completed"
    ) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{self.request_id}_{index}",
            "call_id": f"call_{self.request_id}_0_{index}",
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def object(self, status: str, finished: Finished | None = None) -> dict[str, Any]:
        body = self.body
        text_format: dict[str, Any] = {"type": "text"}
        if body.text is not None:
            fmt = body.text.format
            text_format = {"type": fmt.type}
            if fmt.type == "json_schema":
                text_format |= {"name": fmt.name or "response", "schema": fmt.schema_,
                                "strict": fmt.strict}  # fmt: skip
        tool_choice: Any = body.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        tools = [
            {"type": "function", "name": t.function.name, "description": t.function.description,
             "parameters": t.function.parameters, "strict": t.function.strict}
            for t in body.tools or () if t.function is not None
        ]  # fmt: skip
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": f"resp_{self.request_id}",
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": text_format},
            "tool_choice": tool_choice,
            "tools": tools,
            "metadata": body.metadata or {},
            "usage": None if finished is None else _usage(finished),
        }


def _status(finished: Finished) -> str:
    return "incomplete" if finished.finish_reason == "length" else "completed"


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_bytes({"type": kind} | fields) + b"\n\n"


class ResponsesStream:
    """Renders one answer as Responses' typed events (module docstring)."""

    def __init__(self, response: _Response, reads_tools: bool) -> None:
        self._response = response
        self._reader = ToolCallReader() if reads_tools else None
        self._sequence = 0
        self._text: str | None = None  # the open message's text; None: no message open
        self._call: int | None = None  # the open call's index in the output

    def _emit(self, kind: str, **fields: Any) -> bytes:
        out = _event(kind, {"sequence_number": self._sequence} | fields)
        self._sequence += 1
        return out

    def start(self) -> bytes:
        created = self._response.object("in_progress")
        return self._emit("response.created", response=created) + self._emit(
            "response.in_progress", response=created
        )

    def chunk(self, chunk: TextChunk) -> bytes:
        if self._reader is None:
            pieces: list[Piece] = [Content(chunk.text)] if chunk.text else []
        else:
            pieces = self._reader.feed(chunk.text)
        return b"".join(self._piece(p) for p in pieces)

    def end_choice(self, end: ChoiceEnd) -> bytes:
        return b""  # one choice only

    def _piece(self, piece: Piece) -> bytes:
        response, out = self._response, b""
        if isinstance(piece, Content):
            if self._text is None:
                out += self._close_call()
                self._text = ""
                item = response.message_item("", "in_progress")
                response.output.append(item)
                index = len(response.output) - 1
                out += self._emit("response.output_item.added", output_index=index, item=item)
                part = {"type": "output_text", "text": "", "annotations": []}
                out += self._emit(
                    "response.content_part.added", item_id=item["id"], output_index=index,
                    content_index=0, part=part,
                )  # fmt: skip
            self._text += piece.text
            index = len(response.output) - 1
            return out + self._emit(
                "response.output_text.delta", item_id=response.output[index]["id"],
                output_index=index, content_index=0, delta=piece.text, logprobs=[],
            )  # fmt: skip
        if isinstance(piece, CallStart):
            out += self._close_message() + self._close_call()
            item = response.call_item(piece.index, piece.name, "", "in_progress")
            response.output.append(item)
            self._call = len(response.output) - 1
            return out + self._emit(
                "response.output_item.added", output_index=self._call, item=item
            )
        assert isinstance(piece, CallArguments) and self._call is not None
        item = response.output[self._call]
        item["arguments"] += piece.text
        return self._emit(
            "response.function_call_arguments.delta", item_id=item["id"],
            output_index=self._call, delta=piece.text,
        )  # fmt: skip

    def _close_message(self) -> bytes:
        if self._text is None:
            return b""
        response, text = self._response, self._text
        index = len(response.output) - 1
        item = response.output[index] = response.message_item(text)
        part = item["content"][0]
        self._text = None
        return (
            self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=text, logprobs=[])
            + self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                         content_index=0, part=part)
            + self._emit("response.output_item.done", output_index=index, item=item)
        )  # fmt: skip

    def _close_call(self) -> bytes:
        if self._call is None:
            return b""
        index, self._call = self._call, None
        item = self._response.output[index]
        item["status"] = "completed"
        return self._emit(
            "response.function_call_arguments.done", item_id=item["id"], output_index=index,
            arguments=item["arguments"],
        ) + self._emit("response.output_item.done", output_index=index, item=item)  # fmt: skip

    def finish(self, finished: Finished) -> bytes:
        out = b""
        if self._reader is not None:
            out += b"".join(self._piece(p) for p in self._reader.finish())
        if not self._response.output:  # an empty answer is still a message
            out += self._piece(Content(""))
        out += self._close_message() + self._close_call()
        status = _status(finished)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._emit(kind, response=self._response.object(status, finished))

    def error(self, error: GatewayError) -> bytes:
        detail = error_body(error, "openai")["error"]
        return self._emit("error", code=detail.get("code"), message=detail["message"],
                          param=detail.get("param"))  # fmt: skip


@endpoint("openai")
async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    settings = gateway_of(request).settings
    body, upstream = await open_generation(
        request, ResponsesRequest, settings.default_chat_max_tokens
    )
    response = _Response(request_id_of(request), body, upstream.job.model.name)
    if body.stream:
        stream = ResponsesStream(response, body.offers_tools)
        return RelayResponse(upstream, stream, upstream.headers)  # type: ignore[return-value]
    (choice,), finished = await collect(upstream, request.receive, keep_open=True)

    def answer() -> dict[str, Any]:
        text = choice.text
        if body.offers_tools:
            reader = ToolCallReader()
            pieces = reader.feed(choice.text) + reader.finish()
            text = "".join(p.text for p in pieces if isinstance(p, Content))
            calls = zip(reader.names, reader.arguments, strict=True)
            response.output += [response.call_item(i, n, a) for i, (n, a) in enumerate(calls)]
        if text or not response.output:
            response.output.insert(0, response.message_item(text))
        return response.object(_status(finished), finished)

    return await settled(upstream, answer)
