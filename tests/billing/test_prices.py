from __future__ import annotations

from datetime import date
from decimal import Decimal
from pathlib import Path

import pytest

from billing.errors import PriceConfigError
from billing.prices import Price, PriceTable

SMOL = "@cf/huggingface/smollm2-135m-instruct"

TWO_VERSIONS = """
currency = "USD"

[[price]]
model = "m"
effective_from = 2026-11-03
input_per_million = 0.05
cached_input_per_million = 0.025
output_per_million = 0.40

[[price]]
model = "m"
effective_from = 2026-01-01
input_per_million = 0.1
cached_input_per_million = 0
output_per_million = 1
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prices.toml"
    path.write_text(text)
    return path


def test_default_table_prices_every_shipped_model() -> None:
    """Under the names usage events carry: the gateway catalog's public names (an entry
    named "moe-small" had never matched an event, so moe-small usage went unpriced)."""
    from gateway.catalog import DEFAULT_MODELS

    table = PriceTable.default()
    assert table.currency == "USD"
    assert table.models == [
        "@cf/edgeserve/moe-small",
        "@cf/google/gemma-3-270m",
        SMOL,
        "@cf/sentence-transformers/all-minilm-l6-v2",
    ]
    assert table.models == sorted(m.name for m in DEFAULT_MODELS)
    assert table.price_for(SMOL, date(2026, 11, 30)) == Price(
        SMOL, date(2026, 1, 1), Decimal("0.027"), Decimal("0.0135"), Decimal("0.201")
    )
    assert table.price_for(SMOL, date(2025, 12, 31)) is None
    assert table.price_for("unknown", date(2026, 11, 30)) is None


def test_each_day_gets_the_latest_price_effective_on_or_before_it(tmp_path: Path) -> None:
    table = PriceTable.load(write(tmp_path, TWO_VERSIONS))
    old = table.price_for("m", date(2026, 11, 2))
    new = table.price_for("m", date(2026, 11, 3))
    assert old is not None and old.effective_from == date(2026, 1, 1)
    assert new is not None and new.effective_from == date(2026, 11, 3)
    # TOML floats are read as exact decimals.
    assert new.input_per_million == Decimal("0.05")
    assert table.price_for("m", date(2030, 1, 1)) == new


def test_cost_bills_cached_tokens_at_the_cached_rate_exactly() -> None:
    price = Price("m", date(2026, 1, 1), Decimal("0.027"), Decimal("0.0135"), Decimal("0.201"))
    assert price.cost(1_000_000, 200_000, 500_000) == Decimal("0.1248")
    assert price.cost(100, 0, 20) == Decimal("0.00000672")
    assert price.cost(0, 0, 0) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[price]]\nmodel='m'", "currency: a non-empty string is required"),
        ("currency='USD'\nprice=1", "price: must be an array of tables"),
        ("currency='USD'\n[[price]]\neffective_from=2026-01-01", r"price\[0\].model"),
        (
            "currency='USD'\n[[price]]\nmodel='m'\neffective_from='2026-01-01'",
            r"price\[0\] \(m\).effective_from: a TOML date",
        ),
        (
            "currency='USD'\n[[price]]\nmodel='m'\neffective_from=2026-01-01\n"
            "input_per_million=1\ncached_input_per_million=1\noutput_per_million=-1",
            r"price\[0\] \(m\).output_per_million: must be finite and non-negative",
        ),
        (
            "currency='USD'\n[[price]]\nmodel='m'\neffective_from=2026-01-01\n"
            "input_per_million='1'\ncached_input_per_million=1\noutput_per_million=1",
            r"input_per_million: a number is required",
        ),
        (
            "currency='USD'\n[[price]]\nmodel='m'\neffective_from=2026-01-01\ninput_per_million=1\n"
            "cached_input_per_million=1\noutput_per_million=1\nouput_per_million=2",
            r"unknown fields \['ouput_per_million'\]",
        ),
        ("currency = ", "is not valid TOML"),
    ],
)
def test_bad_price_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(PriceConfigError, match=message):
        PriceTable.load(write(tmp_path, text))


def test_two_prices_on_one_day_for_one_model_are_rejected(tmp_path: Path) -> None:
    entry = (
        "[[price]]\nmodel='m'\neffective_from=2026-01-01\ninput_per_million=1\n"
        "cached_input_per_million=1\noutput_per_million=1\n"
    )
    with pytest.raises(PriceConfigError, match="two prices effective on the same day"):
        PriceTable.load(write(tmp_path, "currency='USD'\n" + entry + entry))


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(PriceConfigError, match="cannot read price file"):
        PriceTable.load(tmp_path / "absent.toml")
