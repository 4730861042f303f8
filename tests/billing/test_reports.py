from __future__ import annotations

from datetime import date
from decimal import Decimal
from pathlib import Path

import pytest
from rich.console import Console

from billing.errors import InvalidReportQuery
from billing.ledger import Ledger
from billing.prices import PriceTable
from billing.reports import (
    ReportRow,
    build_report,
    parse_group_by,
    to_csv,
    to_json,
    to_table,
)
from tests.billing.samples import DAY1, DAY2, make_event

# The old price holds until 2026-11-02 inclusive; the new one from 2026-11-03.
PRICES = """
currency = "USD"

[[price]]
model = "m"
effective_from = 2026-01-01
input_per_million = 0.027
cached_input_per_million = 0.0135
output_per_million = 0.201

[[price]]
model = "m"
effective_from = 2026-11-03
input_per_million = 0.05
cached_input_per_million = 0.025
output_per_million = 0.40
"""
D1, D2 = date(2026, 11, 2), date(2026, 11, 3)


@pytest.fixture
def prices(tmp_path: Path) -> PriceTable:
    path = tmp_path / "prices.toml"
    path.write_text(PRICES)
    return PriceTable.load(path)


def fill(ledger: Ledger) -> None:
    usage = {"input_tokens": 600_000, "cached_tokens": 100_000, "output_tokens": 250_000}
    ledger.insert_many(
        [
            # Two requests a day, each half of 1M in / 200k cached / 500k out.
            make_event("d1-a", model="m", **usage),
            make_event("d1-b", model="m", **(usage | {"input_tokens": 400_000})),
            make_event("d2-a", model="m", started_at=DAY2, ended_at=DAY2 + 1, **usage),
            make_event(
                "d2-b", model="m", started_at=DAY2, ended_at=DAY2 + 1,
                **(usage | {"input_tokens": 400_000}),
            ),
            make_event("b-1", account_id="acct-b", model="unpriced-model", ended_at=DAY1 + 9),
        ]
    )  # fmt: skip


def test_a_report_over_a_price_change_prices_each_day_at_that_days_price(
    ledger: Ledger, prices: PriceTable
) -> None:
    fill(ledger)
    report = build_report(ledger, prices, D1, D2, account_id="acct-a")
    # day 1: 800k*0.027 + 200k*0.0135 + 500k*0.201 per million = 0.0216 + 0.0027 + 0.1005
    # day 2: 800k*0.05  + 200k*0.025  + 500k*0.40  per million = 0.04   + 0.005  + 0.2
    assert report.rows == (
        ReportRow("acct-a", "m", D1, 2, 1_000_000, 200_000, 500_000, Decimal("0.1248")),
        ReportRow("acct-a", "m", D2, 2, 1_000_000, 200_000, 500_000, Decimal("0.245")),
    )
    assert report.total == ReportRow(
        None, None, None, 4, 2_000_000, 400_000, 1_000_000, Decimal("0.3698")
    )
    assert report.unpriced_models == ()

    by_model = build_report(ledger, prices, D1, D2, account_id="acct-a", group_by=("model",))
    assert by_model.rows == (
        ReportRow(None, "m", None, 4, 2_000_000, 400_000, 1_000_000, Decimal("0.3698")),
    )


def test_unpriced_usage_is_shown_without_a_cost_and_named(
    ledger: Ledger, prices: PriceTable
) -> None:
    fill(ledger)
    report = build_report(ledger, prices, D1, D1)
    assert report.rows == (
        ReportRow("acct-a", "m", D1, 2, 1_000_000, 200_000, 500_000, Decimal("0.1248")),
        ReportRow("acct-b", "unpriced-model", D1, 1, 100, 0, 20, None),
    )
    assert report.total.cost == Decimal("0.1248")
    assert report.unpriced_models == ("unpriced-model",)


def test_json_and_csv_renderings_are_exact(ledger: Ledger, prices: PriceTable) -> None:
    fill(ledger)
    report = build_report(ledger, prices, D1, D2, group_by=("account", "day"))
    assert to_json(report) == {
        "from": "2026-11-02",
        "to": "2026-11-03",
        "currency": "USD",
        "group_by": ["account", "day"],
        "rows": [
            {
                "account_id": "acct-a",
                "day": "2026-11-02",
                "requests": 2,
                "input_tokens": 1_000_000,
                "cached_tokens": 200_000,
                "output_tokens": 500_000,
                "cost": "0.1248",
            },
            {
                "account_id": "acct-b",
                "day": "2026-11-02",
                "requests": 1,
                "input_tokens": 100,
                "cached_tokens": 0,
                "output_tokens": 20,
                "cost": None,
            },
            {
                "account_id": "acct-a",
                "day": "2026-11-03",
                "requests": 2,
                "input_tokens": 1_000_000,
                "cached_tokens": 200_000,
                "output_tokens": 500_000,
                "cost": "0.245",
            },
        ],
        "total": {
            "requests": 5,
            "input_tokens": 2_000_100,
            "cached_tokens": 400_000,
            "output_tokens": 1_000_020,
            "cost": "0.3698",
        },
        "unpriced_models": ["unpriced-model"],
    }
    assert to_csv(report) == (
        "account_id,day,requests,input_tokens,cached_tokens,output_tokens,cost,currency\n"
        "acct-a,2026-11-02,2,1000000,200000,500000,0.1248,USD\n"
        "acct-b,2026-11-02,1,100,0,20,,USD\n"
        "acct-a,2026-11-03,2,1000000,200000,500000,0.245,USD\n"
    )


def test_the_terminal_table_shows_rows_totals_and_unpriced_models(
    ledger: Ledger, prices: PriceTable
) -> None:
    fill(ledger)
    console = Console(width=160, record=True, color_system=None)
    console.print(to_table(build_report(ledger, prices, D1, D2)))
    lines = [line.strip() for line in console.export_text().splitlines()]
    assert lines == [
        "Usage 2026-11-02 .. 2026-11-03 (UTC days, USD)",
        "┏━━━━━━━━━┳━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━┓",
        "┃ Account ┃ Model          ┃ Day        ┃ Requests ┃   Input ┃ Cached ┃  Output ┃     Cost ┃",
        "┡━━━━━━━━━╇━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━┩",
        "│ acct-a  │ m              │ 2026-11-02 │        2 │ 1000000 │ 200000 │  500000 │   0.1248 │",
        "│ acct-b  │ unpriced-model │ 2026-11-02 │        1 │     100 │      0 │      20 │ unpriced │",
        "│ acct-a  │ m              │ 2026-11-03 │        2 │ 1000000 │ 200000 │  500000 │    0.245 │",
        "├─────────┼────────────────┼────────────┼──────────┼─────────┼────────┼─────────┼──────────┤",
        "│ Total   │                │            │        5 │ 2000100 │ 400000 │ 1000020 │   0.3698 │",
        "└─────────┴────────────────┴────────────┴──────────┴─────────┴────────┴─────────┴──────────┘",
        "no price for: unpriced-model",
    ]


def test_bad_queries_raise_typed_errors(ledger: Ledger, prices: PriceTable) -> None:
    with pytest.raises(
        InvalidReportQuery, match=r"to \(2026-11-02\) is before from \(2026-11-03\)"
    ):
        build_report(ledger, prices, D2, D1)
    with pytest.raises(InvalidReportQuery, match="unknown key"):
        parse_group_by("model,week")
    assert parse_group_by(" day , model ") == ("model", "day")
    assert parse_group_by("") == ("account", "model", "day")
    assert parse_group_by(" , ") == ("account", "model", "day")  # was () (ungrouped)
    assert parse_group_by(None) == ("account", "model", "day")
