"""Embeddings through the real gateway and a real node serving all-MiniLM-L6-v2 beside
SmolLM2: both dialects, the official openai client, checked against transformers'
AutoModel with the checkpoint's pooling; billed, limited, traced and listed."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.conftest import ACCOUNT_ID, INTERNAL_TOKEN, SMOLLM2, ServerThread, free_port
from tests.loopback import API_KEY, OTHER_KEY, Node, start_gateway

MINILM = "@cf/sentence-transformers/all-minilm-l6-v2"
RUN = f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{MINILM}"
AUTH = {"authorization": f"Bearer {API_KEY}"}
SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Paris is the capital of France.",
    "Embeddings map text to vectors.",
    "¿Dónde está la biblioteca?",
    "GPU kernels fuse the dequantization into the matrix multiply to save bandwidth.",
]


@pytest.fixture(scope="module")
def node(engine: Any, minilm_path: Path) -> Iterator[Node]:
    """One node serving SmolLM2 and all-MiniLM-L6-v2 (as `edgeserve up` does by default)."""
    from gpu_node.engine.embedder import Embedder
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import LocalCapacityRegistry

    registry = LocalCapacityRegistry()
    port = free_port()
    settings = NodeSettings(
        node_id="node-1", address=f"http://127.0.0.1:{port}", internal_token=INTERNAL_TOKEN,
        heartbeat_s=0.2, ttl_s=30.0,
    )  # fmt: skip
    embedder = Embedder.from_directory(minilm_path, name="minilm")
    service = NodeService(settings, registry, engine=engine, embedder=embedder)
    server = ServerThread(create_node_app(service), port).start()
    deadline = time.monotonic() + 10
    while not asyncio.run(registry.list_live()):
        assert time.monotonic() < deadline, "the node never published its capacity"
        time.sleep(0.05)
    yield Node(server, registry)
    server.stop()


@pytest.fixture(scope="module")
def reference(minilm_path: Path) -> Any:
    """sentence -> the vector transformers' AutoModel gives it, mean-pooled over its tokens
    and normalized, as the checkpoint's sentence-transformers files say."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    model = transformers.AutoModel.from_pretrained(minilm_path).eval()

    def embed(text: str) -> torch.Tensor:
        batch = tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(0), dim=0)

    return embed


@pytest.fixture
def gateway(node: Node) -> Iterator[ServerThread]:
    server = start_gateway(node)
    yield server
    server.stop()


def cosine(a: list[float] | torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), b, dim=0))


def token_ids(minilm_path: Path, texts: list[str]) -> list[list[int]]:
    """What the checkpoint's tokenizer makes of `texts`, without its file's padding to 128."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return [e.ids for e in tokenizer.encode_batch(texts)]


def num_tokens(minilm_path: Path, texts: list[str]) -> int:
    return sum(len(ids) for ids in token_ids(minilm_path, texts))


def test_the_openai_client_gets_the_reference_vectors_batched_and_alone(
    gateway: ServerThread, reference: Any, minilm_path: Path
) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0)
    batched = client.embeddings.create(model=MINILM, input=SENTENCES)  # base64 on the wire
    assert [d.index for d in batched.data] == list(range(len(SENTENCES)))
    assert batched.model == MINILM
    assert batched.usage.prompt_tokens == num_tokens(minilm_path, SENTENCES)
    assert batched.usage.total_tokens == batched.usage.prompt_tokens
    for sentence, item in zip(SENTENCES, batched.data, strict=True):
        assert len(item.embedding) == 384
        assert cosine(item.embedding, reference(sentence)) >= 0.9999
        alone = client.embeddings.create(
            model="minilm", input=sentence, encoding_format="float"
        ).data[0]
        assert cosine(alone.embedding, torch.tensor(item.embedding)) >= 0.99999


def test_token_arrays_and_base64_carry_the_same_vectors(
    gateway: ServerThread, minilm_path: Path
) -> None:
    ids = token_ids(minilm_path, SENTENCES[:2])
    url = f"{gateway.url}/v1/embeddings"
    as_text = httpx.post(url, json={"model": MINILM, "input": SENTENCES[:2]}, headers=AUTH)
    as_ids = httpx.post(url, json={"model": MINILM, "input": ids}, headers=AUTH)
    one_array = httpx.post(url, json={"model": MINILM, "input": ids[1]}, headers=AUTH)
    packed = httpx.post(
        url, json={"model": MINILM, "input": SENTENCES[:2], "encoding_format": "base64"},
        headers=AUTH,
    )  # fmt: skip
    assert [r.status_code for r in (as_text, as_ids, one_array, packed)] == [200] * 4
    text_vectors = [d["embedding"] for d in as_text.json()["data"]]
    id_vectors = [d["embedding"] for d in as_ids.json()["data"]]
    for a, b in zip(text_vectors, id_vectors, strict=True):
        assert cosine(a, torch.tensor(b)) >= 0.99999
    assert (
        cosine(one_array.json()["data"][0]["embedding"], torch.tensor(text_vectors[1])) >= 0.99999
    )
    assert as_ids.json()["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    for item, floats in zip(packed.json()["data"], text_vectors, strict=True):
        raw = base64.b64decode(item["embedding"])
        unpacked = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert [round(x, 6) for x in unpacked] == [round(x, 6) for x in floats]


def test_workers_ai_answers_shape_and_data(
    gateway: ServerThread, reference: Any, minilm_path: Path
) -> None:
    response = httpx.post(f"{gateway.url}{RUN}", json={"text": SENTENCES[:3]}, headers=AUTH)
    assert response.status_code == 200
    body = response.json()
    assert (body["success"], body["errors"]) == (True, [])
    assert body["result"]["shape"] == [3, 384]
    for sentence, vector in zip(SENTENCES, body["result"]["data"], strict=False):
        assert cosine(vector, reference(sentence)) >= 0.9999
    one = httpx.post(f"{gateway.url}{RUN}", json={"text": "Hello"}, headers=AUTH)
    assert one.json()["result"]["shape"] == [1, 384]


def test_long_inputs_are_refused_or_truncated_when_asked(gateway: ServerThread) -> None:
    long_text = "word " * 600  # 602 tokens with [CLS] and [SEP]: past the 512 positions
    refused = httpx.post(
        f"{gateway.url}/v1/embeddings", json={"model": MINILM, "input": ["hi", long_text]},
        headers=AUTH,
    )  # fmt: skip
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": "input[1] is 602 tokens; this model takes at most 512 (ask for truncation "
        "to cut it)",
        "type": "invalid_request_error",
        "param": "input",
        "code": "context_length_exceeded",
    }
    workers = httpx.post(f"{gateway.url}{RUN}", json={"text": long_text}, headers=AUTH)
    assert (workers.status_code, workers.json()["errors"][0]["code"]) == (413, 3006)
    cut = httpx.post(
        f"{gateway.url}{RUN}", json={"text": long_text, "truncate_inputs": True}, headers=AUTH
    )
    assert cut.status_code == 200
    assert cut.json()["result"]["shape"] == [1, 384]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": MINILM, "input": ""}, 400, "invalid request: input: must not be empty"),
        ({"model": MINILM, "input": [[1, 2], "a"]}, 400,
         "invalid request: input: mixes strings with other values"),
        ({"model": MINILM, "input": [[101, 999_999, 102]]}, 400,
         "input[0] holds a token id outside 0..30521"),
        ({"model": MINILM, "input": "a", "dimensions": 128}, 400,
         f"{MINILM} does not shorten its vectors: 'dimensions' may only be its own size, 384"),
        ({"model": SMOLLM2, "input": "a"}, 400,
         f"{SMOLLM2} generates text; embeddings take an embedding model"),
        ({"model": "@cf/nobody/none", "input": "a"}, 404, "no such model: '@cf/nobody/none'"),
    ],
)  # fmt: skip
def test_bad_embedding_requests_get_openai_errors(
    gateway: ServerThread, body: dict[str, Any], status: int, message: str
) -> None:
    response = httpx.post(f"{gateway.url}/v1/embeddings", json=body, headers=AUTH)
    assert (response.status_code, response.json()["error"]["message"]) == (status, message)


def test_dimensions_equal_to_the_models_size_are_accepted(gateway: ServerThread) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/embeddings", json={"model": MINILM, "input": "a", "dimensions": 384},
        headers=AUTH,
    )  # fmt: skip
    assert (response.status_code, len(response.json()["data"][0]["embedding"])) == (200, 384)


def test_an_embedding_model_does_not_generate_text(gateway: ServerThread) -> None:
    chat = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": MINILM, "messages": [{"role": "user", "content": "Hi"}]}, headers=AUTH,
    )  # fmt: skip
    assert (chat.status_code, chat.json()["error"]["message"]) == (
        400, f"{MINILM} is an embedding model: it does not generate text",
    )  # fmt: skip
    run = httpx.post(f"{gateway.url}{RUN}", json={"prompt": "Hi"}, headers=AUTH)
    assert (run.status_code, run.json()["errors"][0]["message"]) == (
        400, "invalid request: text: Field required",
    )  # fmt: skip


def test_embeddings_are_listed_with_their_task(gateway: ServerThread) -> None:
    search = httpx.get(
        f"{gateway.url}/client/v4/accounts/{ACCOUNT_ID}/ai/models/search",
        params={"task": "Text Embeddings"}, headers=AUTH,
    )  # fmt: skip
    (entry,) = search.json()["result"]
    assert (entry["name"], entry["task"]["name"]) == (MINILM, "Text Embeddings")
    assert {"property_id": "context_window", "value": "512"} in entry["properties"]
    models = httpx.get(f"{gateway.url}/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == [SMOLLM2, MINILM]
    assert models[1]["context_window"] == 512  # tokens per input, not the node's KV pool


def test_embeddings_are_billed_their_input_tokens_in_the_ledger(
    node: Node, postgres_url: str, minilm_path: Path
) -> None:
    from billing.ledger import PostgresLedger
    from billing.sink import LocalUsageSink

    ledger = PostgresLedger(postgres_url)
    server = start_gateway(node, usage_sink=LocalUsageSink(ledger))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        raw = client.embeddings.with_raw_response.create(model=MINILM, input=SENTENCES[:4])
        workers = httpx.post(f"{server.url}{RUN}", json={"text": SENTENCES[4]}, headers=AUTH)
        assert workers.status_code == 200
        expected = {
            raw.headers["x-request-id"]: num_tokens(minilm_path, SENTENCES[:4]),
            workers.headers["x-request-id"]: num_tokens(minilm_path, SENTENCES[4:5]),
        }
        assert raw.parse().usage.prompt_tokens == expected[raw.headers["x-request-id"]]
        deadline = time.monotonic() + 10
        while len(rows := [ledger.get(request_id) for request_id in expected]) and None in rows:
            assert time.monotonic() < deadline, "the usage events never reached the ledger"
            time.sleep(0.05)
        assert {
            r.request_id: (r.account_id, r.model, r.status, r.node_id, r.input_tokens,
                           r.output_tokens, r.cached_tokens)
            for r in rows if r is not None
        } == {
            request_id: (ACCOUNT_ID, MINILM, "ok", "node-1", tokens, 0, 0)
            for request_id, tokens in expected.items()
        }  # fmt: skip
        metrics = httpx.get(f"{server.url}/metrics").text
        assert any(
            line.startswith("gen_ai_client_token_usage")
            and 'gen_ai_operation_name="embeddings"' in line
            for line in metrics.splitlines()
        )
    finally:
        server.stop()
        ledger.close()


def test_embedding_tokens_count_against_the_tokens_per_minute_limit(node: Node) -> None:
    from gateway.admission import LimitPolicy, Limits, LocalLimiter

    limits = Limits(requests_per_minute=100, tokens_per_minute=60, max_concurrent=10)
    server = start_gateway(node, limiter=LocalLimiter(LimitPolicy(default=limits)))
    try:
        body = {"model": MINILM, "input": "The cat sits on the mat and looks around the room."}
        first = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-tokens"] == "60"
        used = first.json()["usage"]["prompt_tokens"]
        assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 60 - used
        refused = [
            httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH) for _ in range(4)
        ]
        assert refused[-1].status_code == 429
        assert refused[-1].json()["error"]["message"] == (
            "rate limited: too many tokens for this account"
        )
        other = httpx.post(
            f"{server.url}/v1/embeddings",
            json=body,
            headers={"authorization": f"Bearer {OTHER_KEY}"},
        )
        assert other.status_code == 200  # another account's budget is its own
    finally:
        server.stop()
