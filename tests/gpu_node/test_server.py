"""The node's internal API on loopback, around the real SmolLM2 engine."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.conftest import INTERNAL_TOKEN, ServerThread, chat_prompt_ids, free_port, run_on_engine

AUTH = {"authorization": f"Bearer {INTERNAL_TOKEN}"}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def node(engine):
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import LocalCapacityRegistry

    registry = LocalCapacityRegistry()
    port = free_port()
    service = NodeService(
        NodeSettings(
            "node-t", f"http://127.0.0.1:{port}", INTERNAL_TOKEN, heartbeat_s=0.1, ttl_s=30.0
        ),
        registry,
        engine=engine,
    )
    server = ServerThread(create_node_app(service), port).start()
    server.registry = registry  # type: ignore[attr-defined]
    yield server
    server.stop()


def lines(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.text.splitlines() if line]


def generate(node, **body) -> httpx.Response:
    payload = {
        "request_id": f"r-{time.monotonic_ns()}",
        "account_id": "a",
        "model": "smollm2",
    } | body
    return httpx.post(f"{node.url}/internal/v1/generate", json=payload, headers=AUTH, timeout=60)


def wait_all_pages_free(node, timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        capacity = httpx.get(f"{node.url}/internal/v1/capacity", headers=AUTH).json()
        if capacity["num_free_pages"] == capacity["num_pages"] or time.monotonic() > deadline:
            return capacity
        time.sleep(0.05)


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": INTERNAL_TOKEN}]
)
def test_every_internal_call_needs_the_token(node, headers) -> None:
    for method, path in [
        ("GET", "/internal/v1/health"),
        ("GET", "/internal/v1/capacity"),
        ("POST", "/internal/v1/generate"),
        ("DELETE", "/internal/v1/requests/x"),
    ]:
        response = httpx.request(method, f"{node.url}{path}", headers=headers)
        assert response.status_code == 401
        assert response.json() == {
            "error": {"code": "unauthorized", "message": "missing or wrong internal token"}
        }


def test_health_and_capacity(node, engine) -> None:
    assert httpx.get(f"{node.url}/internal/v1/health", headers=AUTH).json() == {
        "status": "ok",
        "node_id": "node-t",
        "model": "smollm2",
    }
    capacity = wait_all_pages_free(node)
    stats = engine.stats()
    assert {
        k: capacity[k] for k in ("node_id", "address", "role", "models", "num_pages", "page_size")
    } == {
        "node_id": "node-t",
        "address": node.url,
        "role": "mixed",
        "models": ["smollm2"],
        "num_pages": stats.num_pages,
        "page_size": stats.page_size,
    }
    assert capacity["ttl_s"] == 30.0
    # the longest request it takes: the context window or the KV pool, the smaller
    assert capacity["max_request_tokens"] == engine.max_request_tokens
    assert engine.max_request_tokens == min(engine.max_model_len, stats.num_pages * stats.page_size)
    # The heartbeat published the same record to the registry.
    published = asyncio.run(node.registry.list_live())
    assert [r.node_id for r in published] == ["node-t"]
    assert published[0].max_request_tokens == engine.max_request_tokens
    # SmolLM2's GGUF states no sampling values: the catalog's defaults stand
    assert published[0].generation_defaults == capacity["generation_defaults"] == {}


def test_generate_streams_the_engines_exact_tokens_then_usage(node, engine) -> None:
    reference = run_on_engine(engine, chat_prompt_ids(engine, MESSAGES), max_tokens=6)
    response = generate(node, messages=MESSAGES, max_tokens=6)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    events = lines(response)
    chunks, final = events[:-1], events[-1]
    assert chunks[0]["prompt_tokens"] == reference.prompt_tokens
    assert "".join(c["text"] for c in chunks) == reference.text
    assert sum(len(c["token_ids"]) for c in chunks) == 6
    assert final == {
        "finish_reason": "length",
        "usage": {
            "prompt_tokens": reference.prompt_tokens,
            "completion_tokens": 6,
            "cached_tokens": 0,
        },
    }


def test_raw_prompt_and_token_ids_give_the_same_answer(node, engine) -> None:
    ids = engine.tokenizer.encode("The capital of France is")
    reference = run_on_engine(engine, ids, max_tokens=4)
    by_text = lines(generate(node, prompt="The capital of France is", raw=True, max_tokens=4))
    by_ids = lines(generate(node, prompt_token_ids=ids, max_tokens=4))
    for events in (by_text, by_ids):
        assert "".join(e.get("text", "") for e in events) == reference.text
        assert events[-1]["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("body", "status", "code", "message"),
    [
        (
            {"prompt": "hi", "max_tokens": -1},
            400,
            "invalid_request",
            "max_tokens must be positive, got -1",
        ),
        (
            {"prompt": "hi", "max_tokens": "x"},
            400,
            "invalid_request",
            "max_tokens: Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            {"prompt": "hi", "messages": MESSAGES},
            400,
            "invalid_request",
            "give exactly one of prompt_token_ids, prompt, messages",
        ),
        ({"prompt": "", "raw": True}, 400, "invalid_request", "the prompt is empty"),
        (
            {"prompt": "hi", "model": "other"},
            404,
            "model_not_found",
            "this node serves 'smollm2', not 'other'",
        ),
        (
            {"prompt_token_ids": [1] * 1000, "max_tokens": 100},
            413,
            "request_too_large",
            "prompt (1000 tokens) + max_tokens (100) exceeds the context window of 1024 tokens",
        ),
    ],
)
def test_bad_requests_get_typed_errors(node, body, status, code, message) -> None:
    response = generate(node, **body)
    assert response.status_code == status
    assert response.json() == {"error": {"code": code, "message": message}}


def test_malformed_json_is_a_400(node) -> None:
    response = httpx.post(f"{node.url}/internal/v1/generate", content=b"{nope", headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"


def test_a_client_that_leaves_mid_stream_frees_its_pages(node) -> None:
    with httpx.Client(timeout=60) as client:
        body = {
            "request_id": "leaver",
            "model": "smollm2",
            "prompt": "Count to one hundred.",
            "max_tokens": 400,
        }
        with client.stream(
            "POST", f"{node.url}/internal/v1/generate", json=body, headers=AUTH
        ) as response:
            stream = response.iter_lines()
            next(stream)
            next(stream)
            busy = httpx.get(f"{node.url}/internal/v1/capacity", headers=AUTH).json()
            assert busy["num_running"] == 1
            assert busy["num_free_pages"] < busy["num_pages"]
    # Closing the connection mid-stream aborted the request on the engine.
    capacity = wait_all_pages_free(node)
    assert (capacity["num_free_pages"], capacity["num_running"]) == (capacity["num_pages"], 0)


def test_delete_cancels_a_running_request(node) -> None:
    with httpx.Client(timeout=60) as client:
        body = {
            "request_id": "to-cancel",
            "model": "smollm2",
            "prompt": "Write a long story.",
            "max_tokens": 400,
        }
        with client.stream(
            "POST", f"{node.url}/internal/v1/generate", json=body, headers=AUTH
        ) as response:
            stream = response.iter_lines()
            next(stream)
            assert (
                client.delete(
                    f"{node.url}/internal/v1/requests/to-cancel", headers=AUTH
                ).status_code
                == 204
            )
            rest = [json.loads(line) for line in stream if line]
    assert rest[-1]["finish_reason"] == "cancelled"
    assert wait_all_pages_free(node)["num_running"] == 0


def test_a_cancel_that_overtakes_its_request_refuses_it_when_it_comes(node) -> None:
    with httpx.Client(timeout=60) as client:
        gone = client.delete(f"{node.url}/internal/v1/requests/early-cancel", headers=AUTH)
        assert gone.status_code == 204
        refused = generate(node, request_id="early-cancel", prompt="Hi", max_tokens=4)
        assert refused.status_code == 409
        assert refused.json() == {
            "error": {"code": "cancelled", "message": "request early-cancel was cancelled"}
        }
        # Refused once: the id is not held against a later request, nor are others affected.
        again = generate(node, request_id="early-cancel", prompt="Hi", max_tokens=4)
        assert again.status_code == 200 and lines(again)[-1]["usage"]["prompt_tokens"] > 0


def test_a_draining_node_leaves_the_registry_and_refuses_new_work(engine) -> None:
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import LocalCapacityRegistry

    registry = LocalCapacityRegistry()
    port = free_port()
    service = NodeService(
        NodeSettings("node-d", f"http://127.0.0.1:{port}", INTERNAL_TOKEN, heartbeat_s=0.05),
        registry,
        engine=engine,
    )
    server = ServerThread(create_node_app(service), port).start()
    try:
        deadline = time.monotonic() + 5
        while not asyncio.run(registry.list_live()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.run(service.begin_drain())  # on the node's loop, as a signal would be
        assert asyncio.run(registry.list_live()) == []
        time.sleep(0.15)  # a heartbeat that was due does not bring it back
        assert asyncio.run(registry.list_live()) == []
        health = httpx.get(f"{server.url}/internal/v1/health", headers=AUTH)
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        refused = generate(server, prompt="hi", max_tokens=1)
        assert (refused.status_code, refused.json()) == (
            503,
            {
                "error": {
                    "code": "over_capacity",
                    "message": "node not accepting requests: draining",
                }
            },
        )
    finally:
        server.stop()


def test_a_publish_in_flight_when_the_drain_begins_does_not_bring_the_node_back(engine) -> None:
    from gpu_node.server import NodeService, NodeSettings
    from scheduler.capacity import LocalCapacityRegistry

    class SlowRegistry(LocalCapacityRegistry):
        """The real in-process registry, its writes taking a while to land (as a Redis
        round trip on another connection can)."""

        async def publish(self, record: Any) -> None:
            await asyncio.sleep(0.2)
            await super().publish(record)

    async def go() -> list[Any]:
        registry = SlowRegistry()
        service = NodeService(
            NodeSettings("node-s", "http://127.0.0.1:1", INTERNAL_TOKEN), registry, engine=engine
        )
        beat = asyncio.create_task(service.publish())
        await asyncio.sleep(0.05)  # the heartbeat's record is on its way
        await service.begin_drain()
        await beat
        return await registry.list_live()

    assert asyncio.run(go()) == []


def test_a_registry_that_never_answers_holds_neither_the_heartbeat_nor_the_drain(engine) -> None:
    from gpu_node.server import NodeService, NodeSettings
    from scheduler.capacity import LocalCapacityRegistry

    class StuckRegistry(LocalCapacityRegistry):
        """The real in-process registry, its writes stuck (a connection that never answers)."""

        async def publish(self, record: Any) -> None:
            await asyncio.Event().wait()

    async def go() -> None:
        registry = StuckRegistry()
        settings = NodeSettings(
            "node-x", "http://127.0.0.1:1", INTERNAL_TOKEN, registry_timeout_s=0.2
        )
        service = NodeService(settings, registry, engine=engine)
        beat = asyncio.create_task(service.publish())
        await asyncio.sleep(0.05)  # the heartbeat holds the registry lock, stuck
        await asyncio.wait_for(service.begin_drain(), 10)  # a hang would fail here
        assert service.is_draining
        with pytest.raises(TimeoutError):
            await beat  # given up on its timeout, so the heartbeat loop goes on
        assert await registry.list_live() == []

    asyncio.run(go())


def test_a_default_max_tokens_is_shortened_to_what_the_context_leaves(node, engine) -> None:
    """max_tokens the client never named (the gateway's default) is shortened to the room the
    context leaves instead of being refused: the engine's exact answer for that room."""
    prompt = [28 + i % 500 for i in range(1000)]
    refused = generate(node, prompt_token_ids=prompt, max_tokens=256)
    assert (refused.status_code, refused.json()["error"]["code"]) == (413, "request_too_large")
    answered = generate(node, prompt_token_ids=prompt, max_tokens=256, max_tokens_is_default=True)
    assert answered.status_code == 200
    reference = run_on_engine(engine, prompt, max_tokens=24)  # 1024 - 1000
    events = lines(answered)
    assert "".join(e.get("text", "") for e in events) == reference.text
    assert events[-1]["usage"]["completion_tokens"] == reference.completion_tokens


@pytest.fixture(scope="module")
def small_pool_node():
    """A node whose KV pool (8 pages of 16: 128 tokens) holds less than its context window."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.async_engine import AsyncEngine
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import LocalCapacityRegistry

    small = AsyncEngine.from_config(EngineConfig(model="smollm2", max_model_len=1024, num_pages=8))
    small.start()
    port = free_port()
    service = NodeService(
        NodeSettings("node-s", f"http://127.0.0.1:{port}", INTERNAL_TOKEN, heartbeat_s=0.1),
        LocalCapacityRegistry(),
        engine=small,
    )
    server = ServerThread(create_node_app(service), port).start()
    yield server
    server.stop()
    small.shutdown()


def test_a_request_past_the_kv_pool_is_too_large_naming_the_pool(small_pool_node) -> None:
    response = generate(small_pool_node, prompt_token_ids=[28] * 100, max_tokens=40)
    assert response.status_code == 413
    assert response.json() == {
        "error": {
            "code": "request_too_large",
            "message": "prompt (100 tokens) + max_tokens (40) exceeds the 128 tokens this "
            "node's KV cache holds (context window 1024)",
        }
    }
    shortened = generate(
        small_pool_node, prompt_token_ids=[28] * 100, max_tokens=40, max_tokens_is_default=True
    )
    assert shortened.status_code == 200
    assert lines(shortened)[-1]["usage"]["completion_tokens"] <= 28
    # With no max_tokens of the client's, a prompt that fills the pool names no max_tokens.
    full = generate(
        small_pool_node, prompt_token_ids=[28] * 128, max_tokens=40, max_tokens_is_default=True
    )
    assert (full.status_code, full.json()["error"]["message"]) == (
        413,
        "prompt (128 tokens) exceeds the 128 tokens this node's KV cache holds "
        "(context window 1024) with room for an answer",
    )


def test_the_token_rate_covers_the_last_seconds() -> None:
    from gpu_node.service import TokenRate

    rate = TokenRate(window_s=5.0)
    assert rate.update(0, 100.0) == 0.0
    assert rate.update(50, 101.0) == 50.0
    assert rate.update(150, 103.0) == 50.0  # 150 tokens in 3 s
    assert rate.update(150, 106.0) == 20.0  # since 101.0, the newest sample 5 s old
    assert rate.update(150, 112.0) == 0.0  # nothing ran in the last 6 s


@pytest.fixture(scope="module")
def embed_node(engine, minilm_path):
    """A node serving SmolLM2 and, beside it, all-MiniLM-L6-v2 as `minilm`."""
    from gpu_node.engine.embedder import Embedder
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import LocalCapacityRegistry

    embedder = Embedder.from_directory(minilm_path, name="minilm")
    port = free_port()
    service = NodeService(
        NodeSettings("node-e", f"http://127.0.0.1:{port}", INTERNAL_TOKEN, heartbeat_s=0.1),
        LocalCapacityRegistry(),
        engine=engine,
        embedder=embedder,
    )
    server = ServerThread(create_node_app(service), port).start()
    server.embedder = embedder  # type: ignore[attr-defined]
    yield server
    server.stop()


def embed(node, **body) -> httpx.Response:
    payload = {"request_id": f"e-{time.monotonic_ns()}", "model": "minilm"} | body
    return httpx.post(f"{node.url}/internal/v1/embed", json=payload, headers=AUTH, timeout=60)


@pytest.mark.slow
def test_embed_answers_the_encoders_vectors_and_the_tokens_it_read(embed_node) -> None:
    import torch

    texts = ["The capital of France is Paris.", "A man is eating food."]
    response = embed(embed_node, texts=texts)
    assert response.status_code == 200, response.text
    body = response.json()
    ids = embed_node.embedder.tokenize(texts)
    expected = embed_node.embedder.embed(ids).vectors
    assert body["prompt_tokens"] == sum(len(i) for i in ids) == 17
    assert torch.tensor(body["vectors"]).equal(expected)
    by_ids = embed(embed_node, token_ids=ids).json()
    assert by_ids == body
    capacity = httpx.get(f"{embed_node.url}/internal/v1/capacity", headers=AUTH).json()
    assert capacity["models"] == ["smollm2", "minilm"]


@pytest.mark.slow
def test_embed_refuses_what_it_cannot_encode(embed_node, node) -> None:
    long = "word " * 600
    too_long = embed(embed_node, texts=["ok", long])
    assert (too_long.status_code, too_long.json()) == (
        413,
        {"error": {"code": "request_too_large", "message": (
            "input[1] is 602 tokens; this model takes at most 512 (ask for truncation to cut it)"
        )}},
    )  # fmt: skip
    cut = embed(embed_node, texts=["ok", long], truncate=True).json()
    assert cut["prompt_tokens"] == 3 + 512
    for body, status, code, message in [
        ({"texts": ["a"], "token_ids": [[101]]}, 400, "invalid_request",
         "give exactly one of texts, token_ids"),
        ({"token_ids": [[101, 30522]]}, 400, "invalid_request",
         "input[0] holds a token id outside 0..30521"),
        ({"texts": ["a"], "model": "bge"}, 404, "model_not_found",
         "this node embeds with 'minilm', not 'bge'"),
    ]:  # fmt: skip
        refused = embed(embed_node, **body)
        assert (refused.status_code, refused.json()["error"]) == (
            status, {"code": code, "message": message}
        )  # fmt: skip
    assert embed(embed_node, texts=[]).status_code == 400
    without = embed(node, texts=["a"])
    assert (without.status_code, without.json()["error"]["message"]) == (
        503, "node cannot embed: it serves no encoder"
    )  # fmt: skip


# -- constrained decoding, logprobs, n (the engine side of issue 41) ----------------------

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "role", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "grammar, code, words",
    [
        ({"kind": "json_schema", "value": '{"type": "strnig"}'}, "invalid_grammar", "strnig"),
        ({"kind": "json_schema", "value": "{not json"}, "invalid_grammar", "not JSON"),
        ({"kind": "regex", "value": "(a"}, "invalid_grammar", "invalid regex grammar"),
        ({"kind": "lark", "value": "start: 'a'"}, "invalid_request", "grammar.kind"),
    ],
)
def test_an_invalid_grammar_is_a_400_naming_the_problem(node, grammar, code, words) -> None:
    response = generate(node, messages=MESSAGES, grammar=grammar)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == code and words in error["message"], error


def test_a_grammar_holds_the_streamed_answer_with_its_logprobs(node) -> None:
    import jsonschema

    response = generate(
        node,
        messages=[{"role": "user", "content": "Give a user as JSON."}],
        grammar={"kind": "json_schema", "value": json.dumps(PERSON_SCHEMA)},
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        max_tokens=80,
    )
    assert response.status_code == 200
    events = lines(response)
    chunks, finish = events[:-1], events[-1]
    assert finish["finish_reason"] == "stop"
    jsonschema.validate(json.loads("".join(c["text"] for c in chunks)), PERSON_SCHEMA)
    for chunk in chunks:
        assert [lp["token_id"] for lp in chunk.get("logprobs", [])] == chunk["token_ids"]
        for lp in chunk.get("logprobs", []):
            assert lp["logprob"] <= 0.0 and 1 <= len(lp["top"]) <= 2
            assert lp["top"][0]["logprob"] >= lp["top"][-1]["logprob"]


def test_n_choices_stream_tagged_and_end_after_the_last(node) -> None:
    response = generate(node, messages=MESSAGES, temperature=1.0, seed=5, n=3, max_tokens=12)
    assert response.status_code == 200
    events = lines(response)
    finishes = [e for e in events if "finish_reason" in e]
    assert sorted(f.get("index", 0) for f in finishes) == [0, 1, 2]
    assert events[-1] in finishes
    texts = {
        i: "".join(e["text"] for e in events if "text" in e and e.get("index", 0) == i)
        for i in range(3)
    }
    assert len(set(texts.values())) > 1
    firsts = [e for e in events if "prompt_tokens" in e]
    assert sorted(e.get("index", 0) for e in firsts) == [0, 1, 2]
    wait_all_pages_free(node)
