"""`/openapi.json`, generated from the pydantic request models (never written by hand)."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    WorkersAIEmbeddingRequest,
    WorkersAITextRequest,
)

_ACCOUNT = {"name": "account_id", "in": "path", "required": True, "schema": {"type": "string"}}
_MODEL = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
_MODEL_ID = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _post(summary: str, schema: str | list[str], params: list[dict[str, Any]]) -> dict[str, Any]:
    """A POST taking one of the request models named (one of several: `oneOf`)."""
    names = [schema] if isinstance(schema, str) else schema
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in names]
    body = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {
        "post": {
            "summary": summary,
            "parameters": params,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": body}},
            },
            "responses": {
                "200": {"description": "JSON, or text/event-stream when `stream` is true"},
                "4XX": {"description": "error in the dialect's shape"},
            },
        }
    }


def _get(summary: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "parameters": params,
            "responses": {"200": {"description": "JSON"}},
        }
    }


def build_openapi() -> dict[str, Any]:
    _, defs = models_json_schema(
        [
            (m, "validation")
            for m in (
                WorkersAITextRequest,
                WorkersAIEmbeddingRequest,
                ChatCompletionRequest,
                CompletionRequest,
                EmbeddingsRequest,
            )
        ],
        ref_template="#/components/schemas/{model}",
    )
    openai_paths: dict[str, Any] = {}
    for base, params in (("/v1", []), ("/client/v4/accounts/{account_id}/ai/v1", [_ACCOUNT])):
        openai_paths[f"{base}/chat/completions"] = _post(
            "OpenAI chat completions", "ChatCompletionRequest", params
        )
        openai_paths[f"{base}/completions"] = _post(
            "OpenAI completions", "CompletionRequest", params
        )
        openai_paths[f"{base}/embeddings"] = _post("OpenAI embeddings", "EmbeddingsRequest", params)
        openai_paths[f"{base}/models"] = _get("OpenAI model list", params)
        openai_paths[f"{base}/models/{{model_id}}"] = _get(
            "OpenAI model, by its id or an alias", [*params, _MODEL_ID]
        )
    return {
        "openapi": "3.1.0",
        "info": {"title": "edgeserve", "version": "1"},
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/client/v4/accounts/{account_id}/ai/run/{model_name}": _post(
                "Workers AI text generation, or text embeddings for an embedding model",
                ["WorkersAITextRequest", "WorkersAIEmbeddingRequest"],
                [_ACCOUNT, _MODEL],
            ),
            "/client/v4/accounts/{account_id}/ai/models/search": _get(
                "Workers AI model catalog", [_ACCOUNT]
            ),
            **openai_paths,
        },
    }
