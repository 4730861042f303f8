"""Admission through the real gateway and the real SmolLM2 node on loopback.

Limits headers on every answer, the official openai client retrying on its own
after Retry-After, fail-closed 503s while Redis is away (a redis-server this test
starts and stops), and the fleet capacity queue (wait, deadline, rejectIfBusy).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.admission import (
    AdmissionSettings,
    LimitPolicy,
    Limits,
    LocalLimiter,
    RedisLimiter,
)
from tests.conftest import ACCOUNT_ID, SMOLLM2
from tests.loopback import API_KEY, Node, running_node, start_gateway
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

AUTH = {"authorization": f"Bearer {API_KEY}"}
RUN = f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
HI = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
# estimate_tokens for HI: 2 chars // 3 + 8 + max_tokens
HI_RESERVED = 0 + 8 + 4
# A raw continuation the model keeps counting through rather than ending: a stream held open.
COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "raw": True, "temperature": 0}


@pytest.fixture(scope="module")
def node(engine: Any) -> Iterator[Node]:
    yield from running_node(engine)


LIMITS = {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000, "max_concurrent": 100}


def limiter(kind: type[LocalLimiter] = LocalLimiter, **limits: int) -> LocalLimiter:
    return kind(LimitPolicy(default=Limits(**(LIMITS | limits))))


class SignallingLimiter(LocalLimiter):
    """A real in-process limiter that also keeps the ids of the requests it released."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released: list[str] = []

    async def release(
        self, account_id: str, model: str, request_id: str, actual_tokens: int
    ) -> None:
        await super().release(account_id, model, request_id, actual_tokens)
        self.released.append(request_id)

    def wait_released(self, request_id: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while request_id not in self.released:
            assert time.monotonic() < deadline, f"{request_id}'s slot was never released"
            time.sleep(0.01)


def limit_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("x-ratelimit-")}


def test_limit_headers_on_plain_streamed_and_refused_answers(node) -> None:
    gateway = start_gateway(node, limiter=limiter(requests_per_minute=3, tokens_per_minute=10_000))
    try:
        plain = httpx.post(f"{gateway.url}{RUN}", json=HI, headers=AUTH, timeout=60)
        assert plain.status_code == 200
        assert limit_headers(plain) == {
            "x-ratelimit-limit-requests": "3",
            "x-ratelimit-remaining-requests": "2",
            "x-ratelimit-reset-requests": plain.headers["x-ratelimit-reset-requests"],
            "x-ratelimit-limit-tokens": "10000",
            "x-ratelimit-remaining-tokens": str(10_000 - HI_RESERVED),
            "x-ratelimit-reset-tokens": plain.headers["x-ratelimit-reset-tokens"],
        }
        usage = plain.json()["result"]["usage"]
        used = usage["prompt_tokens"] + usage["completion_tokens"]

        with httpx.stream(
            "POST", f"{gateway.url}{RUN}", json=HI | {"stream": True}, headers=AUTH, timeout=60
        ) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["content-type"] == "text/event-stream; charset=utf-8"
            # The first reservation was corrected to the real count when it ended.
            headers = limit_headers(streamed)
            assert headers == {
                "x-ratelimit-limit-requests": "3",
                "x-ratelimit-remaining-requests": "1",
                "x-ratelimit-reset-requests": headers["x-ratelimit-reset-requests"],
                "x-ratelimit-limit-tokens": "10000",
                "x-ratelimit-remaining-tokens": str(10_000 - used - HI_RESERVED),
                "x-ratelimit-reset-tokens": headers["x-ratelimit-reset-tokens"],
            }
            assert streamed.read().endswith(b"data: [DONE]\n\n")

        # Admitted, then refused by the node (prompt past the context): still the headers.
        too_long = httpx.post(
            f"{gateway.url}{RUN}",
            json={"prompt": "word " * 1200, "max_tokens": 4},
            headers=AUTH,
            timeout=60,
        )
        assert (too_long.status_code, too_long.json()["errors"][0]["code"]) == (413, 3006)
        assert too_long.headers["x-ratelimit-remaining-requests"] == "0"

        refused = httpx.post(f"{gateway.url}{RUN}", json=HI, headers=AUTH, timeout=60)
        assert refused.status_code == 429
        assert refused.json()["errors"] == [
            {"code": 3036, "message": "rate limited: too many requests for this account"}
        ]
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        retry_after = int(refused.headers["retry-after"])
        assert 1 <= retry_after <= 60
        retry_ms = int(refused.headers["retry-after-ms"])
        assert retry_after == -(-retry_ms // 1000)
    finally:
        gateway.stop()


def test_the_openai_client_retries_after_retry_after_and_then_succeeds(node) -> None:
    """Concurrency 1: a held stream makes the client's first try a 429 (retry-after-ms 1000);
    the hook frees the slot, and the client's own retry a second later is answered 200."""
    gate = limiter(SignallingLimiter, max_concurrent=1)
    assert isinstance(gate, SignallingLimiter)
    gateway = start_gateway(node, limiter=gate)
    seen: list[tuple[int, dict[str, str]]] = []
    holder_client = httpx.Client(timeout=60)
    holder = holder_client.send(
        holder_client.build_request(
            "POST",
            f"{gateway.url}{RUN}",
            json=COUNTING | {"max_tokens": 600, "stream": True},
            headers=AUTH,
        ),
        stream=True,
    )
    try:
        assert holder.status_code == 200
        # The slot is held while this stream is open (dropping the iterator would close it).
        chunks = holder.iter_bytes()
        next(chunks)

        def on_response(response: httpx.Response) -> None:
            seen.append((response.status_code, dict(response.headers)))
            if response.status_code == 429:
                # Frees the slot before the client's retry a second later: the gateway
                # releases it once it has cancelled the stream on the node.
                holder.close()
                gate.wait_released(holder.headers["x-request-id"])

        http_client = httpx.Client(event_hooks={"response": [on_response]}, timeout=60)
        client = openai.OpenAI(
            api_key=API_KEY, base_url=f"{gateway.url}/v1", http_client=http_client, max_retries=2
        )
        start = time.monotonic()
        completion = client.chat.completions.create(
            model=SMOLLM2,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
        )
        elapsed = time.monotonic() - start
        assert [status for status, _ in seen] == [429, 200]
        refused = seen[0][1]
        assert (refused["retry-after"], refused["retry-after-ms"]) == ("1", "1000")
        assert refused["x-ratelimit-limit-requests"] == "1000"
        assert elapsed >= 1.0  # it waited as told before retrying
        assert completion.usage is not None
        assert completion.choices[0].message.content
        assert completion.usage.completion_tokens <= 4
        assert seen[1][1]["x-ratelimit-limit-requests"] == "1000"
    finally:
        holder.close()
        holder_client.close()
        gateway.stop()


def test_fail_closed_answers_503_in_both_dialects_while_redis_is_away(node) -> None:
    server = RedisServer()
    server.start()
    import redis.asyncio as aioredis

    settings = AdmissionSettings(
        on_redis_error="closed",
        redis_timeout_s=0.2,
        redis_retry_s=0.3,
        key_prefix=f"test-e2e-{uuid.uuid4().hex[:8]}",
    )
    limiter_ = RedisLimiter(aioredis.Redis.from_url(server.url), settings)
    gateway = start_gateway(node, limiter=limiter_)
    try:
        ok = httpx.post(f"{gateway.url}{RUN}", json=HI, headers=AUTH, timeout=60)
        assert ok.status_code == 200
        assert ok.headers["x-ratelimit-limit-requests"] == "300"  # the Workers AI default
        server.stop()

        start = time.monotonic()
        wai = httpx.post(f"{gateway.url}{RUN}", json=HI, headers=AUTH, timeout=10)
        oai = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]},
            headers=AUTH,
            timeout=10,
        )
        # Bounded by redis_timeout_s (0.2 s each), never a hang (the client's 10 s timeout).
        assert time.monotonic() - start < 5.0
        message = "the rate-limit store is unreachable; try again shortly"
        assert (wai.status_code, wai.headers["retry-after"], wai.json()) == (
            503,
            "1",
            {
                "result": None,
                "success": False,
                "errors": [{"code": 7010, "message": message}],
                "messages": [],
            },
        )
        assert (oai.status_code, oai.headers["retry-after-ms"], oai.json()) == (
            503,
            "1000",
            {
                "error": {
                    "message": message,
                    "type": "server_error",
                    "param": None,
                    "code": "service_unavailable",
                }
            },
        )

        server.start()  # the same port: the gateway recovers by itself
        deadline = time.monotonic() + 10
        while True:
            again = httpx.post(f"{gateway.url}{RUN}", json=HI, headers=AUTH, timeout=60)
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            assert again.status_code == 503
            time.sleep(0.1)
        assert again.status_code == 200
    finally:
        gateway.stop()
        server.stop()


def _hold(url: str, max_tokens: int) -> tuple[httpx.Client, httpx.Response, Iterator[bytes]]:
    client = httpx.Client(timeout=60)
    response = client.send(
        client.build_request(
            "POST",
            f"{url}{RUN}",
            json=COUNTING | {"max_tokens": max_tokens, "stream": True},
            headers=AUTH,
        ),
        stream=True,
    )
    assert response.status_code == 200
    chunks = response.iter_bytes()  # dropping this iterator would close the stream
    next(chunks)
    return client, response, chunks


def test_the_capacity_queue_waits_for_a_slot_refuses_at_its_deadline_and_on_reject_if_busy(
    node,
) -> None:
    # The node takes the held request's reservation and 5 tokens more: no second request fits.
    held_tokens = len(COUNTING["prompt"]) // 3 + 8 + 900
    overcommit = (held_tokens + 5) / node.total_tokens()
    gateway = start_gateway(
        node, overcommit=overcommit, settings={"queue_deadline_s": 3.0}, limiter=limiter()
    )
    holder_client, holder, _chunks = _hold(gateway.url, 900)
    try:
        start = time.monotonic()
        busy = httpx.post(
            f"{gateway.url}{RUN}",
            json=HI | {"options": {"rejectIfBusy": True}},
            headers=AUTH,
            timeout=10,
        )
        assert time.monotonic() - start < 2.0  # refused at once, well before the 3 s deadline
        assert (busy.status_code, busy.headers["retry-after"], busy.json()["errors"]) == (
            429,
            "1",
            [
                {
                    "code": 3040,
                    "message": f"no capacity for {SMOLLM2} right now (every node is busy); "
                    "retry shortly",
                }
            ],
        )
        assert busy.headers["x-ratelimit-limit-requests"] == "1000"

        start = time.monotonic()
        late = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": SMOLLM2, "prompt": "Hi", "max_tokens": 4},
            headers=AUTH,
            timeout=10,
        )
        waited = time.monotonic() - start
        assert 3.0 <= waited < 6.0
        assert (late.status_code, late.json()["error"]["code"]) == (429, "no_capacity")
        assert late.json()["error"]["message"] == (
            f"no capacity for {SMOLLM2} right now (every node stayed busy for 3s); retry shortly"
        )

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                httpx.post, f"{gateway.url}{RUN}", json=HI, headers=AUTH, timeout=30
            )
            time.sleep(0.4)
            assert not waiting.done()  # queued behind the held request
            freed_at = time.monotonic()
            holder.close()  # the end of the held request frees its slot and wakes the queue
            answer = waiting.result()
            assert time.monotonic() >= freed_at
        assert answer.status_code == 200
        assert answer.json()["result"]["usage"]["completion_tokens"] >= 1
    finally:
        holder.close()
        holder_client.close()
        gateway.stop()


def test_a_request_larger_than_any_pool_gets_the_nodes_answer_at_once_not_a_queue_wait(
    node,
) -> None:
    gateway = start_gateway(node, limiter=limiter(), settings={"queue_deadline_s": 30.0})
    try:
        too_big = node.total_tokens() + 1
        # The node publishes the longest request it takes (its 1024-token window): a
        # max_tokens past it is the gateway's 413, before admission; one within it that
        # the prompt pushes past it is the node's own count.
        for max_tokens, message in (
            (too_big, f"max_tokens ({too_big}) leaves no room for a prompt in the context "
                      "window of 1024 tokens"),
            (1000, "prompt (31 tokens) + max_tokens (1000) exceeds the context window of 1024 "
                   "tokens"),
        ):  # fmt: skip
            started = time.monotonic()
            response = httpx.post(
                f"{gateway.url}{RUN}", json=HI | {"max_tokens": max_tokens}, headers=AUTH,
                timeout=60,
            )  # fmt: skip
            assert time.monotonic() - started < 5  # not the 30 s queue deadline
            assert response.status_code == 413
            body = response.json()
            assert body["success"] is False and body["errors"] == [
                {"code": 3006, "message": message}
            ]
        assert (
            httpx.post(f"{gateway.url}{RUN}", json=HI, headers=AUTH, timeout=60).status_code == 200
        )
    finally:
        gateway.stop()
