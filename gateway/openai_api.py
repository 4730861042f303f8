"""The OpenAI-compatible dialect: /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/models."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from common.node_api import TokenLogprob
from gateway.catalog import CatalogModel
from gateway.errors import ContextWindowError, GatewayError, GrammarError, error_body
from gateway.http import (
    JSONBytes,
    authenticate,
    endpoint,
    gateway_of,
    parse_body,
    request_id_of,
    require_ready,
    resolve_model,
    session_id_of,
    settled,
)
from gateway.jobs import EmbeddingJob, GenerationJob, estimate_input_tokens
from gateway.metering import estimate_tokens
from gateway.relay import SSE_DONE, RelayResponse, sse
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    check_generation_model,
)
from gateway.tool_calls import CallStart, Content, Piece, ToolCallReader
from gateway.upstream import Choice, ChoiceEnd, Finished, TextChunk, collect


def usage(finished: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }


def finish_reason(node_reason: str, has_calls: bool = False) -> str:
    if node_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: each token with its bytes and its top alternatives."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [
        entry(t.token, t.logprob) | {"top_logprobs": [entry(a.token, a.logprob) for a in t.top]}
        for t in logprobs
    ]


def completion_logprobs(logprobs: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion's `logprobs`: tokens, their log-probabilities, the alternatives and
    where each token begins in the text (from `offset`)."""
    offsets = []
    for t in logprobs:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [{a.token: a.logprob for a in t.top} for t in logprobs],
        "text_offset": offsets,
    }


def tool_call_id(request_id: str, choice: int, call: int) -> str:
    return f"call_{request_id}_{choice}_{call}"


class _OpenAIStream:
    """Chunks with one id throughout, each choice's under its index; a usage chunk with
    `choices: []` when asked; then [DONE]."""

    object_name = ""

    def __init__(
        self, completion_id: str, model: str, include_usage: bool, num_choices: int = 1
    ) -> None:
        self._head = {
            "id": completion_id,
            "object": self.object_name,
            "created": int(time.time()),
            "model": model,
        }
        self._include_usage = include_usage
        self._num_choices = num_choices
        self._ended: set[int] = set()

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = self._head | {"choices": choices}
        if self._include_usage:
            body["usage"] = None
        return sse(body | extra)

    def start(self) -> bytes:
        return b""

    def chunk(self, chunk: TextChunk) -> bytes:
        raise NotImplementedError

    def _last(self, index: int, node_reason: str) -> bytes:
        """The closing chunk of choice `index`."""
        raise NotImplementedError

    def end_choice(self, end: ChoiceEnd) -> bytes:
        self._ended.add(end.index)
        return self._last(end.index, end.finish_reason)

    def finish(self, finished: Finished) -> bytes:
        out = b"".join(
            self._last(i, finished.reason_of(i))
            for i in range(self._num_choices)
            if i not in self._ended
        )
        if self._include_usage:
            out += sse(self._head | {"choices": [], "usage": usage(finished)})
        return out + SSE_DONE

    def error(self, error: GatewayError) -> bytes:
        return sse(error_body(error, "openai"))


class ChatStream(_OpenAIStream):
    """Chat chunks: `delta.content`; with tools offered, calls as `delta.tool_calls` (the
    function's name once whole, then its arguments as they come) and finish_reason
    `tool_calls`; with logprobs, each chunk's tokens' under `logprobs.content`."""

    object_name = "chat.completion.chunk"

    def __init__(
        self,
        completion_id: str,
        model: str,
        include_usage: bool,
        num_choices: int = 1,
        *,
        request_id: str = "",
        reads_tools: bool = False,
        has_logprobs: bool = False,
    ) -> None:
        super().__init__(completion_id, model, include_usage, num_choices)
        self._request_id = request_id
        self._readers = [ToolCallReader() for _ in range(num_choices)] if reads_tools else None
        self._has_logprobs = has_logprobs
        self._pending: list[list[TokenLogprob]] = [[] for _ in range(num_choices)]

    def start(self) -> bytes:
        return b"".join(
            self._event([self._choice(i, {"role": "assistant", "content": ""}, None)])
            for i in range(self._num_choices)
        )

    def _choice(self, index: int, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        logprobs = None
        if self._has_logprobs:
            pending, self._pending[index] = self._pending[index], []
            logprobs = {"content": chat_logprobs(pending), "refusal": None}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _deltas(self, index: int, pieces: list[Piece]) -> bytes:
        out = b""
        for piece in pieces:
            if isinstance(piece, Content):
                delta: dict[str, Any] = {"content": piece.text}
            elif isinstance(piece, CallStart):
                call = {
                    "index": piece.index,
                    "id": tool_call_id(self._request_id, index, piece.index),
                    "type": "function",
                    "function": {"name": piece.name, "arguments": ""},
                }
                delta = {"tool_calls": [call]}
            else:
                call = {"index": piece.index, "function": {"arguments": piece.text}}
                delta = {"tool_calls": [call]}
            out += self._event([self._choice(index, delta, None)])
        return out

    def chunk(self, chunk: TextChunk) -> bytes:
        self._pending[chunk.index] += chunk.logprobs
        if self._readers is None:
            pieces: list[Piece] = [Content(chunk.text)] if chunk.text else []
        else:
            pieces = self._readers[chunk.index].feed(chunk.text)
        if not pieces and self._pending[chunk.index]:
            pieces = [Content("")]  # the tokens' logprobs go now, their text later
        return self._deltas(chunk.index, pieces)

    def _last(self, index: int, node_reason: str) -> bytes:
        reader = None if self._readers is None else self._readers[index]
        out = b"" if reader is None else self._deltas(index, reader.finish())
        has_calls = reader is not None and reader.num_calls > 0
        reason = finish_reason(node_reason, has_calls)
        return out + self._event([self._choice(index, {}, reason)])


class CompletionStream(_OpenAIStream):
    object_name = "text_completion"

    def __init__(
        self,
        completion_id: str,
        model: str,
        include_usage: bool,
        num_choices: int = 1,
        *,
        has_logprobs: bool = False,
    ) -> None:
        super().__init__(completion_id, model, include_usage, num_choices)
        self._has_logprobs = has_logprobs
        self._offsets = [0] * num_choices

    def _choice(
        self, index: int, text: str, logprobs: Sequence[TokenLogprob], reason: str | None
    ) -> dict[str, Any]:
        listed = None
        if self._has_logprobs:
            listed = completion_logprobs(logprobs, self._offsets[index])
        self._offsets[index] += len(text)
        return {"index": index, "text": text, "logprobs": listed, "finish_reason": reason}

    def chunk(self, chunk: TextChunk) -> bytes:
        if not chunk.text and not chunk.logprobs:
            return b""
        return self._event([self._choice(chunk.index, chunk.text, chunk.logprobs, None)])

    def _last(self, index: int, node_reason: str) -> bytes:
        return self._event([self._choice(index, "", (), finish_reason(node_reason))])


async def open_generation(
    request: Request, model_cls: Any, default_max_tokens: int
) -> tuple[Any, Any]:
    """Authenticates, validates and admits one generation; returns the body and its upstream."""
    account_id = await authenticate(request)
    require_ready(request)
    body = await parse_body(request, model_cls)
    body.check_supported()
    model = await resolve_model(request, body.model)
    check_generation_model(model)
    payload = body.node_payload(default_max_tokens, model.sampling)
    job = GenerationJob(
        request_id_of(request),
        account_id,
        model,
        payload,
        estimate_tokens(payload),
        stream=body.stream,
        max_tokens_name=body.max_tokens_name,
        session_id=session_id_of(request),
    )
    try:
        return body, await gateway_of(request).dispatcher.open(job, request.receive)
    except ContextWindowError as exc:  # the node's count of the prompt: past the window
        exc.param = exc.param or body.prompt_field
        raise
    except GrammarError as exc:  # the tools' schemas, else the response format's
        exc.param = "tools" if getattr(body, "offers_tools", False) else body.format_field
        raise


def _answer(
    object_name: str,
    completion_id: str,
    model: str,
    choices: list[dict[str, Any]],
    finished: Finished,
) -> dict[str, Any]:
    """A non-streamed completion: its choices and the usage."""
    return {
        "id": completion_id,
        "object": object_name,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(finished),
    }


def chat_message(choice: Choice, request_id: str, index: int, reads_tools: bool) -> dict[str, Any]:
    """One whole chat choice: its message (text, tool calls), logprobs and finish reason."""
    text, calls = choice.text, []
    if reads_tools:
        reader = ToolCallReader()
        pieces = reader.feed(choice.text) + reader.finish()
        text = "".join(p.text for p in pieces if isinstance(p, Content))
        calls = [
            {
                "id": tool_call_id(request_id, index, i),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for i, (name, arguments) in enumerate(zip(reader.names, reader.arguments, strict=True))
        ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if text or not calls else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    logprobs = None
    if choice.logprobs is not None:
        logprobs = {"content": chat_logprobs(choice.logprobs), "refusal": None}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason(choice.finish_reason, bool(calls)),
    }


@endpoint("openai")
async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    settings = gateway_of(request).settings
    body, upstream = await open_generation(
        request, ChatCompletionRequest, settings.default_chat_max_tokens
    )
    request_id = request_id_of(request)
    completion_id = f"chatcmpl-{request_id}"
    model = upstream.job.model.name
    if body.stream:
        stream = ChatStream(
            completion_id, model, body.include_usage, body.num_choices, request_id=request_id,
            reads_tools=body.offers_tools, has_logprobs=bool(body.logprobs),
        )  # fmt: skip
        return RelayResponse(upstream, stream, upstream.headers)  # type: ignore[return-value]
    choices, finished = await collect(upstream, request.receive, keep_open=True)
    return await settled(
        upstream,
        lambda: _answer(
            "chat.completion", completion_id, model,
            [chat_message(c, request_id, i, body.offers_tools) for i, c in enumerate(choices)],
            finished,
        ),
    )  # fmt: skip


@endpoint("openai")
async def completions(request: Request) -> Response:
    """POST /v1/completions (raw prompt, no chat template)."""
    settings = gateway_of(request).settings
    body, upstream = await open_generation(
        request, CompletionRequest, settings.default_completion_max_tokens
    )
    completion_id = f"cmpl-{request_id_of(request)}"
    model = upstream.job.model.name
    if body.stream:
        stream = CompletionStream(
            completion_id, model, body.include_usage, body.num_choices,
            has_logprobs=body.logprobs is not None,
        )  # fmt: skip
        return RelayResponse(upstream, stream, upstream.headers)  # type: ignore[return-value]
    choices, finished = await collect(upstream, request.receive, keep_open=True)

    def answer() -> dict[str, Any]:
        answers = [
            {
                "index": i,
                "text": c.text,
                "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs),
                "finish_reason": finish_reason(c.finish_reason),
            }
            for i, c in enumerate(choices)
        ]
        return _answer("text_completion", completion_id, model, answers, finished)

    return await settled(upstream, answer)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@endpoint("openai")
async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""
    account_id = await authenticate(request)
    require_ready(request)
    body = await parse_body(request, EmbeddingsRequest)
    model = await resolve_model(request, body.model)
    body.check_for(model)
    texts, token_ids = body.inputs()
    job = EmbeddingJob(
        request_id_of(request),
        account_id,
        model,
        texts,
        token_ids,
        estimate_input_tokens(texts, token_ids, model.context_window),
        session_id=session_id_of(request),
    )
    try:
        answer, headers = await gateway_of(request).dispatcher.embed(job, request.receive)
    except ContextWindowError as exc:
        exc.param = exc.param or "input"
        raise
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
        for i, v in enumerate(answer.vectors)
    ]
    tokens = answer.prompt_tokens
    result = {
        "object": "list",
        "data": data,
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return JSONBytes(result, headers=headers)


async def _model_object(request: Request, model: CatalogModel) -> dict[str, Any]:
    """OpenAI's model object, and the context window (prompt + max_tokens) served now."""
    window = await gateway_of(request).dispatcher.context_window(model)
    return {
        "id": model.name, "object": "model", "created": 0, "owned_by": "edgeserve",
        "context_window": window,
    }  # fmt: skip


@endpoint("openai")
async def list_models(request: Request) -> Response:
    """GET /v1/models: the models live nodes serve now."""
    await authenticate(request)
    gateway = gateway_of(request)
    served = gateway.catalog.served(await gateway.dispatcher.served_models())
    data = [await _model_object(request, m) for m in served]
    return JSONBytes({"object": "list", "data": data})


@endpoint("openai")
async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model_id}: one catalog entry by its id or an alias (ids hold slashes)."""
    await authenticate(request)
    name = request.path_params["model_id"]
    return JSONBytes(await _model_object(request, await resolve_model(request, name)))
