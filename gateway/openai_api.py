"""The OpenAI-compatible dialect: /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/models."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.catalog import CatalogModel
from gateway.errors import ContextWindowError, GatewayError, error_body
from gateway.http import (
    JSONBytes,
    authenticate,
    endpoint,
    gateway_of,
    parse_body,
    request_id_of,
    require_ready,
    resolve_model,
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
from gateway.upstream import Finished, Upstream, collect


def usage(finished: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }


def finish_reason(finished: Finished) -> str:
    return "length" if finished.finish_reason == "length" else "stop"


class _OpenAIStream:
    """Chunks with one id throughout; a usage chunk with `choices: []` when asked; then [DONE]."""

    object_name = ""

    def __init__(self, completion_id: str, model: str, include_usage: bool) -> None:
        self._head = {
            "id": completion_id,
            "object": self.object_name,
            "created": int(time.time()),
            "model": model,
        }
        self._include_usage = include_usage

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = self._head | {"choices": choices}
        if self._include_usage:
            body["usage"] = None
        return sse(body | extra)

    def _choice(self, text: str, reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> bytes:
        return b""

    def chunk(self, text: str) -> bytes:
        return self._event([self._choice(text, None)])

    def finish(self, finished: Finished) -> bytes:
        out = self._event([self._choice("", finish_reason(finished))])
        if self._include_usage:
            out += sse(self._head | {"choices": [], "usage": usage(finished)})
        return out + SSE_DONE

    def error(self, error: GatewayError) -> bytes:
        return sse(error_body(error, "openai"))


class ChatStream(_OpenAIStream):
    object_name = "chat.completion.chunk"

    def start(self) -> bytes:
        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._event([first])

    def _choice(self, text: str, reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}


class CompletionStream(_OpenAIStream):
    object_name = "text_completion"

    def _choice(self, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


async def _open(request: Request, model_cls: Any, default_max_tokens: int) -> tuple[Any, Any]:
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
    )
    try:
        return body, await gateway_of(request).dispatcher.open(job, request.receive)
    except ContextWindowError as exc:  # the node's count of the prompt: past the window
        exc.param = exc.param or body.prompt_field
        raise


def _answer(
    object_name: str,
    completion_id: str,
    model: str,
    choice: dict[str, Any],
    finished: Finished,
    upstream: Upstream,
) -> Response:
    """A non-streamed completion: one choice, its finish reason, the usage."""
    result = {
        "id": completion_id,
        "object": object_name,
        "created": int(time.time()),
        "model": model,
        "choices": [choice | {"finish_reason": finish_reason(finished)}],
        "usage": usage(finished),
    }
    return JSONBytes(result, headers=upstream.headers)


@endpoint("openai")
async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    settings = gateway_of(request).settings
    body, upstream = await _open(request, ChatCompletionRequest, settings.default_chat_max_tokens)
    completion_id = f"chatcmpl-{request_id_of(request)}"
    if body.stream:
        stream = ChatStream(completion_id, upstream.job.model.name, body.include_usage)
        return RelayResponse(upstream, stream, upstream.headers)  # type: ignore[return-value]
    text, finished = await collect(upstream, request.receive)
    message = {"role": "assistant", "content": text, "refusal": None}
    choice = {"index": 0, "message": message, "logprobs": None}
    return _answer(
        "chat.completion", completion_id, upstream.job.model.name, choice, finished, upstream
    )


@endpoint("openai")
async def completions(request: Request) -> Response:
    """POST /v1/completions (raw prompt, no chat template)."""
    settings = gateway_of(request).settings
    body, upstream = await _open(request, CompletionRequest, settings.default_completion_max_tokens)
    completion_id = f"cmpl-{request_id_of(request)}"
    if body.stream:
        stream = CompletionStream(completion_id, upstream.job.model.name, body.include_usage)
        return RelayResponse(upstream, stream, upstream.headers)  # type: ignore[return-value]
    text, finished = await collect(upstream, request.receive)
    choice = {"index": 0, "text": text, "logprobs": None}
    return _answer(
        "text_completion", completion_id, upstream.job.model.name, choice, finished, upstream
    )


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
