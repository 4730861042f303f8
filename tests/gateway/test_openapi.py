"""`/openapi.json`: every route, every status with its dialect's error body, the success
bodies; and a seeded schemathesis run against a real gateway on loopback that holds the
gateway's answers to the document (status codes, content types, body schemas)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from gateway.openapi import build_openapi
from tests.conftest import ACCOUNT_ID, INTERNAL_TOKEN, SMOLLM2, ServerThread, free_port

API_KEY = "es-openapi-key"
ADMIN_TOKEN = "admin-openapi-token-0123456789"
ACCOUNT_AI = "/client/v4/accounts/{account_id}/ai"
# POST /v1/responses is documented with the Responses API (gateway/responses_api.py).
UNDOCUMENTED: set[str] = set()


def gateway_app(tmp_path: Path) -> Any:
    """A gateway with every optional route mounted (usage, limits admin, dashboard), one
    API key, a ledger holding a day of usage, and one node serving SmolLM2 whose address
    answers nothing: requests that reach placement end as a node's failure would."""
    from billing.events import UsageEvent
    from billing.ledger import SqliteLedger
    from gateway.admission import LimitPolicy, LocalLimiter
    from gateway.app import create_app
    from gateway.keys import MemoryKeyStore
    from gateway.settings import GatewaySettings
    from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
    from scheduler.placement import LocalReservations, Placer

    keys = MemoryKeyStore()
    asyncio.run(keys.add(API_KEY, ACCOUNT_ID))
    registry = LocalCapacityRegistry()
    record = CapacityRecord(
        node_id="nowhere", address=f"http://127.0.0.1:{free_port()}", role="mixed",
        models=("smollm2",), num_pages=64, num_free_pages=64, page_size=16, kv_dtype="fp32",
        num_running=0, num_waiting=0, load=0.0, published_at=time.time(), ttl_s=3600.0,
        activations="fp32", max_request_tokens=1024,
    )  # fmt: skip
    asyncio.run(registry.publish(record))
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    now = time.time()
    ledger.insert(UsageEvent("r-1", ACCOUNT_ID, "smollm2", "nowhere", 12, 3, 4, now - 1, now, "ok"))
    limiter = LocalLimiter(LimitPolicy())
    return create_app(
        GatewaySettings(internal_token=INTERNAL_TOKEN, admin_token=ADMIN_TOKEN),
        keys=keys,
        placer=Placer(CapacityView(registry, max_age_s=60.0), LocalReservations()),
        limiter=limiter,
        limit_store=limiter.store,
        ledger=ledger,
    )


def _starlette_routes(app: Any) -> list[Route]:
    while not hasattr(app, "routes"):
        app = app.app  # through the middleware, to the Starlette app
    return [r for r in app.routes if isinstance(r, Route)]


def test_every_route_mounted_is_documented_with_its_methods(tmp_path: Path) -> None:
    spec = build_openapi()
    mounted = {}
    for route in _starlette_routes(gateway_app(tmp_path)):
        path = route.path.replace(":path}", "}")
        mounted[path] = {m.lower() for m in route.methods or ()} - {"head"}
    documented = {path: set(ops) for path, ops in spec["paths"].items()}
    assert {p: m for p, m in mounted.items() if p not in UNDOCUMENTED} == documented


def test_only_the_routes_mounted_are_documented() -> None:
    from gateway.app import create_app
    from gateway.keys import MemoryKeyStore
    from gateway.settings import GatewaySettings
    from scheduler.capacity import CapacityView, LocalCapacityRegistry
    from scheduler.placement import LocalReservations, Placer

    placer = Placer(CapacityView(LocalCapacityRegistry(), max_age_s=1.0), LocalReservations())
    app = create_app(GatewaySettings(internal_token="t"), keys=MemoryKeyStore(), placer=placer)
    spec = build_openapi(_starlette_routes(app))
    assert not [p for p in spec["paths"] if p.startswith(("/admin", "/dashboard"))]
    assert f"{ACCOUNT_AI}/usage" not in spec["paths"]
    assert "/v1/chat/completions" in spec["paths"] and "/healthz" in spec["paths"]


def test_statuses_and_error_bodies_follow_the_error_table_in_each_dialect() -> None:
    spec = build_openapi()
    run = spec["paths"][f"{ACCOUNT_AI}/run/{{model_name}}"]["post"]["responses"]
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    account_chat = spec["paths"][f"{ACCOUNT_AI}/v1/chat/completions"]["post"]["responses"]
    # Workers AI: an unknown model is 400, past the window 413; OpenAI: 404 and 400
    assert sorted(run) == ["200", "400", "401", "403", "409", "413", "415", "429", "500", "502", "503"]  # fmt: skip
    assert sorted(chat) == ["200", "400", "401", "404", "409", "413", "415", "429", "500", "502", "503"]  # fmt: skip
    assert sorted(account_chat) == sorted([*chat, "403"])  # the path's account vs the key's
    schema = "#/components/schemas/{}".format
    assert run["413"]["content"]["application/json"]["schema"] == {"$ref": schema("WorkersAIError")}
    assert chat["429"]["content"]["application/json"]["schema"] == {"$ref": schema("OpenAIError")}
    assert "context window" in run["413"]["description"]
    assert "tokens per minute" in chat["429"]["description"]
    assert run["200"]["content"]["application/json"]["schema"] == {
        "$ref": schema("WorkersAIRunResponse")
    }
    assert "text/event-stream" in chat["200"]["content"]
    models = spec["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert sorted(models) == ["200", "401", "404", "500", "503"]
    limits = spec["paths"]["/admin/v1/accounts/{account_id}/limits"]
    assert sorted(limits["delete"]["responses"]) == ["200", "400", "401", "404", "500", "503"]
    assert limits["put"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": schema("LimitsUpdate")
    }
    assert spec["paths"]["/healthz"]["get"]["security"] == []
    assert "security" not in spec["paths"]["/v1/models"]["get"]  # the document's: bearer


def test_request_bodies_are_the_request_models() -> None:
    spec = build_openapi()
    schemas = spec["components"]["schemas"]

    def refs(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for ref in refs(spec):  # every $ref resolves
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    run = spec["paths"][f"{ACCOUNT_AI}/run/{{model_name}}"]["post"]
    assert run["requestBody"]["content"]["application/json"]["schema"] == {
        "oneOf": [
            {"$ref": "#/components/schemas/WorkersAITextRequest"},
            {"$ref": "#/components/schemas/WorkersAIEmbeddingRequest"},
            {"$ref": "#/components/schemas/WorkersAIBatchRequest"},
        ]
    }
    assert [p["name"] for p in run["parameters"]] == ["account_id", "model_name", "queueRequest"]
    assert schemas["EmbeddingsRequest"]["properties"]["encoding_format"]["enum"] == [
        "float", "base64",
    ]  # fmt: skip
    wai = schemas["WorkersAITextRequest"]["properties"]
    assert wai["max_tokens"]["default"] == 256
    assert wai["temperature"]["default"] is None  # the model's own (gateway/catalog.py)
    assert "stream_options" in schemas["ChatCompletionRequest"]["properties"]
    assert schemas["ChatCompletion"]["additionalProperties"] is False


def test_real_answers_match_their_documented_schemas(stack: Any) -> None:
    """What the real node answers through the real gateway, held to the document: the
    success bodies the fuzzing below cannot reach (its node answers nothing)."""
    spec = build_openapi()

    def status_of(method: str, path: str, template: str, body: Any = None, key: str = "") -> int:
        headers = {"authorization": f"Bearer {key or stack.api_key}"}
        response = httpx.request(
            method, f"{stack.url}{path}", json=body, headers=headers, timeout=60
        )
        documented = spec["paths"][template][method.lower()]["responses"]
        assert str(response.status_code) in documented, (path, response.status_code, response.text)
        schema = documented[str(response.status_code)]["content"]["application/json"]["schema"]
        jsonschema.validate(response.json(), {**schema, "components": spec["components"]})
        return response.status_code

    account_ai = ACCOUNT_AI.format(account_id=ACCOUNT_ID)
    run, path = f"{ACCOUNT_AI}/run/{{model_name}}", f"{account_ai}/run/{SMOLLM2}"
    short = {"max_tokens": 3, "temperature": 0}
    assert status_of("POST", path, run, {"prompt": "Hi"} | short) == 200
    assert status_of("POST", path, run, {"prompt": "Hi", "max_tokens": 99_999}) == 413
    assert status_of("POST", f"{account_ai}/run/nope", run, {"prompt": "Hi"}) == 400
    chat = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]} | short
    chat |= {"logprobs": True, "top_logprobs": 2, "n": 2}
    assert status_of("POST", "/v1/chat/completions", "/v1/chat/completions", chat) == 200
    completion = {"model": SMOLLM2, "prompt": "Hi", "logprobs": 1} | short
    assert status_of("POST", "/v1/completions", "/v1/completions", completion) == 200
    completion["model"] = "nope"
    assert status_of("POST", "/v1/completions", "/v1/completions", completion) == 404
    assert status_of("GET", "/v1/models", "/v1/models") == 200
    assert status_of("GET", "/v1/models", "/v1/models", key="not-a-key") == 401
    assert status_of("GET", f"/v1/models/{SMOLLM2}", "/v1/models/{model_id}") == 200
    search = f"{ACCOUNT_AI}/models/search"
    assert status_of("GET", f"{account_ai}/models/search", search) == 200
    assert status_of("GET", f"{account_ai}/models/search?page=0", search) == 400
    assert status_of("GET", "/healthz", "/healthz") == 200


def test_real_embeddings_match_their_documented_schemas(engine: Any, minilm_path: Path) -> None:
    """Both dialects' embeddings, from a real all-MiniLM-L6-v2 encoder, held to the document."""
    from gateway.keys import MemoryKeyStore
    from gpu_node.engine.embedder import Embedder
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import LocalCapacityRegistry
    from tests.conftest import start_local_gateway, wait_for_nodes

    registry, port = LocalCapacityRegistry(), free_port()
    settings = NodeSettings("node-1", f"http://127.0.0.1:{port}", INTERNAL_TOKEN, heartbeat_s=0.2)
    embedder = Embedder.from_directory(minilm_path, name="minilm")
    service = NodeService(settings, registry, engine=engine, embedder=embedder)
    node = ServerThread(create_node_app(service), port).start()
    keys = MemoryKeyStore()
    asyncio.run(keys.add(API_KEY, ACCOUNT_ID))
    gateway = start_local_gateway(registry, keys)
    spec = build_openapi()
    try:
        wait_for_nodes(registry)
        for path, template, body in [
            (f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/minilm", f"{ACCOUNT_AI}/run/{{model_name}}",
             {"text": ["one", "two"]}),
            ("/v1/embeddings", "/v1/embeddings", {"model": "minilm", "input": ["one", "two"]}),
            ("/v1/embeddings", "/v1/embeddings",
             {"model": "minilm", "input": "one", "encoding_format": "base64"}),
        ]:  # fmt: skip
            headers = {"authorization": f"Bearer {API_KEY}"}
            response = httpx.post(f"{gateway.url}{path}", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
            ok = spec["paths"][template]["post"]["responses"]["200"]
            schema = ok["content"]["application/json"]["schema"]
            jsonschema.validate(response.json(), {**schema, "components": spec["components"]})
    finally:
        gateway.stop()
        node.stop()


@pytest.fixture
def gateway_url(tmp_path: Path) -> Iterator[str]:
    server = ServerThread(gateway_app(tmp_path)).start()
    yield server.url
    server.stop()


def no_internal_error(ctx: Any, response: Any, case: Any) -> None:
    """A 500 is a fault of ours, documented or not."""
    assert response.status_code != 500, response.text[:500]


def aim(case: Any, num: int) -> None:
    """Points `case` at the key's account, and every other case at the model the node
    serves: left to chance, nearly every request stops at 403 (another account) or at
    no such model, before admission, placement and the node."""
    if "account_id" in case.path_parameters and not case.path.startswith("/admin"):
        case.path_parameters["account_id"] = ACCOUNT_ID
    if "model_name" in case.path_parameters:
        case.path_parameters["model_name"] = SMOLLM2
    if num % 2 == 0:
        if "model_id" in case.path_parameters:
            case.path_parameters["model_id"] = SMOLLM2
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = SMOLLM2


CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 20


def test_the_gateway_answers_as_its_document_says(gateway_url: str) -> None:
    """Each operation of the document the gateway serves, `EXAMPLES_PER_OPERATION` cases,
    the same ones every run; the API key (the admin token on /admin routes) on each, but
    where a case is made to lack or spoil it."""
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    num_cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        token = ADMIN_TOKEN if operation.path.startswith("/admin") else API_KEY

        # valid requests, and requests the document says are wrong (an operation without
        # parameters or body has none of those)
        positive = operation.as_strategy()
        negative = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)

        @given(case=st.one_of(positive, negative))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            derandomize=True,  # the same cases every run
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            aim(case, num_cases[case.operation.label])
            response = case.call_and_validate(
                headers={"authorization": f"Bearer {token}"},  # noqa: B023 (run at once)
                checks=CHECKS,
                additional_checks=[no_internal_error],
                timeout=10,
            )
            statuses.update([response.status_code])
            num_cases.update([case.operation.label])

        run()
    # every operation ran (schemathesis leaves out the document's own)
    operations = {f"{m.upper()} {p}" for p, ops in build_openapi()["paths"].items() for m in ops}
    assert set(num_cases) == operations - {"GET /openapi.json"}
    print(f"schemathesis: {num_cases.total()} cases, statuses {sorted(statuses.items())}")
