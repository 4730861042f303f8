"""Usage reports: per account x model x UTC day, priced at each day's effective price.

The ledger sums tokens per account x model x day; each of those rows is priced
with the price in force on its day, and only then are rows rolled up to the
requested grouping, so a report that spans a price change is right to the cent.
Renders to a JSON-ready dict, CSV text and a rich terminal table.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

from rich.table import Table

from billing.errors import InvalidReportQuery
from billing.ledger import DailyUsage, Ledger
from billing.prices import PriceTable

GROUP_KEYS = ("account", "model", "day")
_COLUMN = {"account": "account_id", "model": "model", "day": "day"}


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One group's totals; a key the report does not group by is None."""

    account_id: str | None
    model: str | None
    day: date | None
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: Decimal | None  # None: some of the row's usage has no price for its day


@dataclass(frozen=True, slots=True)
class UsageReport:
    start: date
    end: date
    currency: str
    group_by: tuple[str, ...]
    rows: tuple[ReportRow, ...]
    total: ReportRow  # cost sums the priced rows only; see unpriced_models
    unpriced_models: tuple[str, ...]


def parse_group_by(text: str | None) -> tuple[str, ...]:
    """'model,day' -> ('model', 'day'), in canonical order; None or no key named (empty,
    ',') -> all three."""
    wanted = [part.strip() for part in (text or "").split(",") if part.strip()]
    if not wanted:
        return GROUP_KEYS
    unknown = [w for w in wanted if w not in GROUP_KEYS]
    if unknown:
        raise InvalidReportQuery(
            f"group_by: unknown key(s) {', '.join(unknown)}; use any of {', '.join(GROUP_KEYS)}"
        )
    return tuple(k for k in GROUP_KEYS if k in wanted)


_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def parse_day(text: str, name: str) -> date:
    """A YYYY-MM-DD day, that spelling only (fromisoformat also takes 20261130 and 2026W441)."""
    try:
        if not _DAY.fullmatch(text):
            raise ValueError(text)
        return date.fromisoformat(text)
    except (TypeError, ValueError):
        raise InvalidReportQuery(f"{name}: {text!r} is not a date (YYYY-MM-DD)") from None


DEFAULT_DAYS = 30  # a report's days when its query names no `from`


def window_start(end: date, days: int = DEFAULT_DAYS) -> date:
    """The first day of a `days`-day window that ends on `end` (inclusive)."""
    try:
        return end - timedelta(days=days - 1)
    except OverflowError:
        raise InvalidReportQuery(
            f"from: a {days}-day window ending on {end.isoformat()} starts before 0001-01-01"
        ) from None


def build_report(
    ledger: Ledger,
    prices: PriceTable,
    start: date,
    end: date,
    *,
    account_id: str | None = None,
    group_by: tuple[str, ...] = GROUP_KEYS,
) -> UsageReport:
    """Usage for days start..end (UTC, inclusive), for one account or (None) all accounts."""
    if end < start:
        raise InvalidReportQuery(f"to ({end}) is before from ({start})")
    bad = [k for k in group_by if k not in GROUP_KEYS]
    if bad:
        raise InvalidReportQuery(f"group_by: unknown key(s) {', '.join(bad)}")
    return price_report(ledger.daily_usage(start, end, account_id), prices, start, end, group_by)


def price_report(
    daily: Iterable[DailyUsage],
    prices: PriceTable,
    start: date,
    end: date,
    group_by: tuple[str, ...] = GROUP_KEYS,
) -> UsageReport:
    groups: dict[tuple[Any, ...], _Sum] = {}
    unpriced: set[str] = set()
    total = _Sum()
    for usage in daily:
        price = prices.price_for(usage.model, usage.day)
        cost = (
            None
            if price is None
            else price.cost(usage.input_tokens, usage.cached_tokens, usage.output_tokens)
        )
        if cost is None:
            unpriced.add(usage.model)
        key = tuple(getattr(usage, _COLUMN[k]) if k in group_by else None for k in GROUP_KEYS)
        groups.setdefault(key, _Sum()).add(usage, cost)
        total.add(usage, cost if cost is not None else Decimal(0))
    rows = tuple(groups[key].row(*key) for key in sorted(groups, key=_sort_key))
    return UsageReport(
        start=start,
        end=end,
        currency=prices.currency,
        group_by=group_by,
        rows=rows,
        total=total.row(None, None, None),
        unpriced_models=tuple(sorted(unpriced)),
    )


class _Sum:
    def __init__(self) -> None:
        self.requests = self.input_tokens = self.cached_tokens = self.output_tokens = 0
        self.cost: Decimal | None = Decimal(0)

    def add(self, usage: DailyUsage, cost: Decimal | None) -> None:
        self.requests += usage.requests
        self.input_tokens += usage.input_tokens
        self.cached_tokens += usage.cached_tokens
        self.output_tokens += usage.output_tokens
        self.cost = None if cost is None or self.cost is None else self.cost + cost

    def row(self, account_id: str | None, model: str | None, day: date | None) -> ReportRow:
        return ReportRow(
            account_id,
            model,
            day,
            self.requests,
            self.input_tokens,
            self.cached_tokens,
            self.output_tokens,
            self.cost,
        )


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    # Day first (a report reads in time order), then account, then model; None sorts first.
    account, model, day = key
    return (day is not None, day or date.min, account or "", model or "")


def format_money(value: Decimal | None) -> str | None:
    """Plain decimal text, never exponent notation, without trailing zeros ('0.0000027')."""
    if value is None:
        return None
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def _row_dict(report: UsageReport, row: ReportRow) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "account" in report.group_by:
        out["account_id"] = row.account_id
    if "model" in report.group_by:
        out["model"] = row.model
    if "day" in report.group_by:
        out["day"] = row.day.isoformat() if row.day else None
    out.update(
        requests=row.requests,
        input_tokens=row.input_tokens,
        cached_tokens=row.cached_tokens,
        output_tokens=row.output_tokens,
        cost=format_money(row.cost),
    )
    return out


def to_json(report: UsageReport) -> dict[str, Any]:
    """A JSON-ready dict; money is a decimal string so no float ever touches it."""
    total = _row_dict(report, report.total)
    for key in ("account_id", "model", "day"):
        total.pop(key, None)
    return {
        "from": report.start.isoformat(),
        "to": report.end.isoformat(),
        "currency": report.currency,
        "group_by": list(report.group_by),
        "rows": [_row_dict(report, row) for row in report.rows],
        "total": total,
        "unpriced_models": list(report.unpriced_models),
    }


def to_csv(report: UsageReport) -> str:
    columns = [_COLUMN[k] for k in report.group_by]
    columns += ["requests", "input_tokens", "cached_tokens", "output_tokens", "cost", "currency"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in report.rows:
        values = _row_dict(report, row)
        values["cost"] = values["cost"] if values["cost"] is not None else ""
        writer.writerow(values | {"currency": report.currency})
    return buffer.getvalue()


def to_table(report: UsageReport) -> Table:
    """A rich table for the terminal, with the totals as its footer. A narrow terminal
    folds a cell onto more lines, never cuts it short: a cost or a day shown as "0.00…"
    would say nothing."""
    table = Table(
        title=f"Usage {report.start} .. {report.end} (UTC days, {report.currency})",
        show_footer=True,
    )
    labels = {"account": "Account", "model": "Model", "day": "Day"}
    for i, key in enumerate(report.group_by):
        table.add_column(labels[key], footer="Total" if i == 0 else "", overflow="fold")
    total = report.total
    numbers = [
        ("Requests", str(total.requests)),
        ("Input", str(total.input_tokens)),
        ("Cached", str(total.cached_tokens)),
        ("Output", str(total.output_tokens)),
        ("Cost", format_money(total.cost) or ""),
    ]
    for label, footer in numbers:
        table.add_column(label, footer=footer, justify="right", overflow="fold")
    for row in report.rows:
        values = _row_dict(report, row)
        keys = [str(values[_COLUMN[k]]) for k in report.group_by]
        cost = values["cost"] if values["cost"] is not None else "unpriced"
        table.add_row(
            *keys,
            str(row.requests),
            str(row.input_tokens),
            str(row.cached_tokens),
            str(row.output_tokens),
            cost,
        )
    if report.unpriced_models:
        table.caption = f"no price for: {', '.join(report.unpriced_models)}"
    return table
