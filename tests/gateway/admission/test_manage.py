"""Reading and changing an account's limits, as the CLI and the admin API share them."""

from __future__ import annotations

from gateway.admission import LimitPolicy, Limits, MemoryLimitStore
from gateway.admission.manage import clear_limits, describe_limits, limits_model, update_limits

POLICY = LimitPolicy(default=Limits(300, 200_000, 32), per_model={"qwen": Limits(30, 9_000, 3)})


def test_a_model_limit_is_kept_under_its_node_model() -> None:
    assert limits_model("@cf/huggingface/smollm2-135m-instruct") == "smollm2"
    assert limits_model("smollm2") == "smollm2"
    assert limits_model("not-in-the-catalog") == "not-in-the-catalog"
    assert limits_model(None) is None


async def test_an_account_without_overrides_is_described_by_the_policy() -> None:
    store = MemoryLimitStore()
    assert await describe_limits(store, POLICY, "acct") == {
        "account_id": "acct",
        "model": None,
        "effective": {"requests_per_minute": 300, "tokens_per_minute": 200_000,
                      "max_concurrent": 32},
        "account": None,
        "models": {},
    }  # fmt: skip
    described = await describe_limits(store, POLICY, "acct", "qwen")
    assert (described["model"], described["effective"]) == (
        "qwen", {"requests_per_minute": 30, "tokens_per_minute": 9_000, "max_concurrent": 3},
    )  # fmt: skip


async def test_an_update_changes_only_the_fields_given_in_its_scope() -> None:
    store = MemoryLimitStore()
    # The account's scope starts from the default; the model's from what applies to it.
    assert await update_limits(store, POLICY, "acct", requests_per_minute=60) == Limits(
        60, 200_000, 32
    )
    assert await update_limits(store, POLICY, "acct", "qwen", max_concurrent=1) == Limits(
        60, 200_000, 1
    )  # the account's override applies to qwen now, not qwen's default
    assert await update_limits(
        store, POLICY, "acct", "@cf/huggingface/smollm2-135m-instruct", tokens_per_minute=500
    ) == Limits(60, 500, 32)
    assert await update_limits(store, POLICY, "acct", "qwen", tokens_per_minute=700) == Limits(
        60, 700, 1
    )  # from qwen's own override
    described = await describe_limits(store, POLICY, "acct", "smollm2")
    assert described["effective"] == {
        "requests_per_minute": 60,
        "tokens_per_minute": 500,
        "max_concurrent": 32,
    }
    assert list(described["models"]) == ["qwen", "smollm2"]
    assert await clear_limits(store, "acct", "@cf/huggingface/smollm2-135m-instruct") is True
    assert await clear_limits(store, "acct", "smollm2") is False
    assert list((await describe_limits(store, POLICY, "acct"))["models"]) == ["qwen"]
