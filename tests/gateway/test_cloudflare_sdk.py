"""The official `cloudflare` Python SDK with a custom base URL against the gateway."""

from __future__ import annotations

import cloudflare
import pytest
from cloudflare import Cloudflare

from tests.conftest import ACCOUNT_ID, SMOLLM2, also_served, chat_prompt_ids, run_on_engine


@pytest.fixture
def client(stack) -> Cloudflare:
    return Cloudflare(api_token=stack.api_key, base_url=f"{stack.url}/client/v4", max_retries=0)


def test_ai_run_returns_the_engines_text_and_usage(engine, client) -> None:
    reference = run_on_engine(
        engine, chat_prompt_ids(engine, [{"role": "user", "content": "Hello"}]), max_tokens=5
    )
    result = client.ai.run(
        SMOLLM2, account_id=ACCOUNT_ID, prompt="Hello", max_tokens=5, temperature=0
    )
    assert result == {
        "response": reference.text,
        "usage": {
            "prompt_tokens": reference.prompt_tokens,
            "completion_tokens": 5,
            "total_tokens": reference.prompt_tokens + 5,
        },
    }


def test_models_list_pages_through_the_catalog(client, stack) -> None:
    with also_served(stack, "moe-small"):
        names = [m["name"] for m in client.ai.models.list(account_id=ACCOUNT_ID, per_page=1)]
    assert names == [SMOLLM2, "@cf/edgeserve/moe-small"]


def test_sdk_errors_carry_the_envelope(stack) -> None:
    wrong = Cloudflare(api_token="es-wrong", base_url=f"{stack.url}/client/v4", max_retries=0)
    with pytest.raises(cloudflare.AuthenticationError) as raised:
        wrong.ai.run(SMOLLM2, account_id=ACCOUNT_ID, prompt="Hello")
    assert raised.value.status_code == 401
    assert raised.value.body == {
        "result": None,
        "success": False,
        "errors": [{"code": 10000, "message": "invalid API key"}],
        "messages": [],
    }
