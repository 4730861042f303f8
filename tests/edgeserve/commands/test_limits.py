"""`edgeserve limits set|show` against a real Redis."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis
import typer
from typer.testing import CliRunner

from edgeserve.commands.limits import register
from tests.conftest import REDIS_URL


@pytest.fixture
def cli_prefix() -> Iterator[str]:
    prefix = f"test-admission-cli-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def invoke(*args: str) -> tuple[int, str, str]:
    app = typer.Typer()
    register(app)

    @app.callback()
    def root() -> None:  # keeps `limits` a sub-command, as under the real `edgeserve`
        pass

    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_set_then_show(cli_prefix: str) -> None:
    common = ["--redis-url", REDIS_URL, "--prefix", cli_prefix, "--account", "acct-9"]
    code, out, _ = invoke("limits", "set", *common, "--rpm", "60", "--concurrency", "3")
    assert code == 0
    assert json.loads(out)["account"] == {
        "requests_per_minute": 60,
        "tokens_per_minute": 200_000,
        "max_concurrent": 3,
    }
    code, out, _ = invoke("limits", "set", *common, "--model", "m1", "--tpm", "5000")
    assert code == 0
    code, out, _ = invoke("limits", "show", *common, "--model", "m1")
    assert code == 0
    assert json.loads(out) == {
        "account_id": "acct-9",
        "model": "m1",
        "effective": {"requests_per_minute": 60, "tokens_per_minute": 5000, "max_concurrent": 3},
        "account": {"requests_per_minute": 60, "tokens_per_minute": 200_000, "max_concurrent": 3},
        "models": {
            "m1": {"requests_per_minute": 60, "tokens_per_minute": 5000, "max_concurrent": 3}
        },
    }


def test_bad_input_and_unreachable_redis_exit_non_zero(cli_prefix: str) -> None:
    common = ["--redis-url", REDIS_URL, "--prefix", cli_prefix]
    code, _, err = invoke("limits", "set", *common, "--account", "a")
    assert code == 2 and "give at least one of --rpm, --tpm, --concurrency" in err
    code, _, err = invoke("limits", "set", *common, "--account", "a", "--rpm", "0")
    assert code == 2
    code, _, err = invoke("limits", "show", *common, "--account", "bad account")
    assert code == 2 and "account id 'bad account'" in err
    code, _, err = invoke(
        "limits", "show", "--redis-url", "redis://127.0.0.1:1/0", "--account", "a"
    )
    assert code == 1 and "cannot reach Redis at redis://127.0.0.1:1/0" in err


def test_a_model_limit_by_public_name_is_kept_under_its_node_model_and_prefixes_agree(
    cli_prefix: str,
) -> None:
    """Admission buckets by the node model (`smollm2`): a limit set by the catalog name must
    land there. And `--prefix x:` (as `edgeserve gateway --prefix` is written) names the keys
    `--prefix x` does, the ones the gateways read."""
    common = ["--redis-url", REDIS_URL, "--account", "acct-7"]
    code, _, _ = invoke("limits", "set", *common, "--prefix", f"{cli_prefix}:", "--model",
                        "@cf/huggingface/smollm2-135m-instruct", "--rpm", "2")  # fmt: skip
    assert code == 0
    code, out, _ = invoke("limits", "show", *common, "--prefix", cli_prefix, "--model", "smollm2")
    assert code == 0
    shown = json.loads(out)
    assert (shown["model"], shown["effective"]["requests_per_minute"]) == ("smollm2", 2)
    assert list(shown["models"]) == ["smollm2"]
    client = redis.Redis.from_url(REDIS_URL)
    assert [k.decode() for k in client.scan_iter(match=f"{cli_prefix}*")] == [
        f"{cli_prefix}:limits:acct-7"
    ]
    client.close()
