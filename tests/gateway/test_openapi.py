"""`/openapi.json`'s document: every route of both dialects, built from the request models."""

from __future__ import annotations

from gateway.openapi import build_openapi


def test_openapi_is_generated_from_the_request_models() -> None:
    spec = build_openapi()
    assert spec["openapi"] == "3.1.0"
    assert set(spec["paths"]) == {
        "/client/v4/accounts/{account_id}/ai/run/{model_name}",
        "/client/v4/accounts/{account_id}/ai/models/search",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v1/models/{model_id}",
        "/client/v4/accounts/{account_id}/ai/v1/chat/completions",
        "/client/v4/accounts/{account_id}/ai/v1/completions",
        "/client/v4/accounts/{account_id}/ai/v1/embeddings",
        "/client/v4/accounts/{account_id}/ai/v1/models",
        "/client/v4/accounts/{account_id}/ai/v1/models/{model_id}",
    }
    schemas = spec["components"]["schemas"]
    for path in spec["paths"].values():  # every $ref resolves
        for operation in path.values():
            if "requestBody" in operation:
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                for ref in [one["$ref"] for one in body.get("oneOf", [body])]:
                    assert ref.removeprefix("#/components/schemas/") in schemas
    run = spec["paths"]["/client/v4/accounts/{account_id}/ai/run/{model_name}"]["post"]
    assert run["requestBody"]["content"]["application/json"]["schema"] == {
        "oneOf": [
            {"$ref": "#/components/schemas/WorkersAITextRequest"},
            {"$ref": "#/components/schemas/WorkersAIEmbeddingRequest"},
        ]
    }
    assert schemas["EmbeddingsRequest"]["properties"]["encoding_format"]["enum"] == [
        "float", "base64",
    ]  # fmt: skip
    wai = spec["components"]["schemas"]["WorkersAITextRequest"]["properties"]
    assert wai["max_tokens"]["default"] == 256
    assert wai["temperature"]["default"] is None  # the model's own (gateway/catalog.py)
    assert "stream_options" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
