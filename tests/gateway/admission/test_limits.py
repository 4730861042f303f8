"""What an account may use: `Limits` checked, shared and resolved most specific first."""

from __future__ import annotations

import pytest

from gateway.admission import InvalidLimits, InvalidRequest, LimitPolicy, Limits
from gateway.admission.limits import AccountLimits, check_identifier


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"requests_per_minute": 0}, "requests_per_minute must be a positive integer, got 0"),
        ({"tokens_per_minute": True}, "tokens_per_minute must be a positive integer, got True"),
        ({"max_concurrent": "3"}, "max_concurrent must be a positive integer, got '3'"),
    ],
)
def test_a_limit_is_a_positive_integer(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidLimits) as raised:
        Limits(**fields)  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_updated_replaces_only_the_fields_given() -> None:
    assert Limits(10, 1_000, 4).updated(tokens_per_minute=50) == Limits(10, 50, 4)
    assert Limits(10, 1_000, 4).updated() == Limits(10, 1_000, 4)


def test_a_gateways_share_floors_and_never_falls_below_one() -> None:
    assert Limits(10, 1_000, 4).share(3) == Limits(3, 333, 1)
    assert Limits(10, 1_000, 4).share(0) == Limits(10, 1_000, 4)
    assert Limits(1, 1, 1).share(8) == Limits(1, 1, 1)


def test_limits_round_trip_through_a_dict_and_refuse_unknown_fields() -> None:
    limits = Limits(10, 1_000, 4)
    assert limits.to_dict() == {
        "requests_per_minute": 10,
        "tokens_per_minute": 1_000,
        "max_concurrent": 4,
    }
    assert Limits.from_dict(limits.to_dict()) == limits
    assert Limits.from_dict({"max_concurrent": 2}) == Limits(max_concurrent=2)
    with pytest.raises(InvalidLimits, match=r"unknown limit field\(s\): burst, rpm"):
        Limits.from_dict({"rpm": 1, "burst": 2})


def test_the_most_specific_limits_win() -> None:
    default, small_model = Limits(300, 200_000, 32), Limits(30, 20_000, 3)
    policy = LimitPolicy(default=default, per_model={"small": small_model})
    account, account_big = Limits(100, 1_000, 8), Limits(5, 500, 1)
    assert policy.resolve(AccountLimits(), "big") == default
    assert policy.resolve(AccountLimits(), "small") == small_model
    overrides = AccountLimits(account=account, per_model={"big": account_big})
    assert policy.resolve(overrides, "big") == account_big
    assert policy.resolve(overrides, "small") == account  # the account's own beats a default
    assert policy.resolve(AccountLimits(per_model={"big": account_big}), "small") == small_model


def test_identifiers_that_cannot_name_a_key_are_refused() -> None:
    assert check_identifier("account", "acct-1@team/x") == "acct-1@team/x"
    for bad in ("", "a b", "a{b}", "x" * 257):
        with pytest.raises(InvalidRequest) as raised:
            check_identifier("account", bad)
        assert str(raised.value) == (
            f"account {bad!r} must be 1-256 characters of letters, digits and @/_.:+=-"
        )
