"""The price table: per model, per million input, cached-input and output tokens.

Prices are versioned by effective date: each entry applies from its
`effective_from` day (UTC) until the next entry for the same model, so adding a
new price never changes what a past day cost. Money is `Decimal` throughout;
TOML numbers are parsed straight to Decimal so `0.1` stays exactly 0.1.

File format (see billing/prices.toml):

    currency = "USD"

    [[price]]
    model = "@cf/huggingface/smollm2-135m-instruct"
    effective_from = 2026-01-01
    input_per_million = 0.027
    cached_input_per_million = 0.0135
    output_per_million = 0.201
"""

from __future__ import annotations

import bisect
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any

from billing.errors import PriceConfigError

MILLION = Decimal(1_000_000)
_RATE_FIELDS = ("input_per_million", "cached_input_per_million", "output_per_million")


@dataclass(frozen=True, slots=True)
class Price:
    """One model's rates from `effective_from` on."""

    model: str
    effective_from: date
    input_per_million: Decimal
    cached_input_per_million: Decimal
    output_per_million: Decimal

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> Decimal:
        """Exact cost; cached tokens are the part of the input billed at the cached rate."""
        uncached = input_tokens - cached_tokens
        return (
            uncached * self.input_per_million
            + cached_tokens * self.cached_input_per_million
            + output_tokens * self.output_per_million
        ) / MILLION


class PriceTable:
    """Looks up the price in force for a model on a day.

    One currency per table: reports add costs across models, which only means
    something in one currency.
    """

    def __init__(self, currency: str, prices: list[Price]) -> None:
        self.currency = currency
        by_model: dict[str, list[Price]] = {}
        for price in prices:
            by_model.setdefault(price.model, []).append(price)
        for model, versions in by_model.items():
            versions.sort(key=lambda p: p.effective_from)
            days = [p.effective_from for p in versions]
            if len(set(days)) != len(days):
                raise PriceConfigError(f"model {model!r} has two prices effective on the same day")
        self._by_model = by_model
        self._days = {m: [p.effective_from for p in v] for m, v in by_model.items()}

    @property
    def models(self) -> list[str]:
        return sorted(self._by_model)

    def price_for(self, model: str, day: date) -> Price | None:
        """The price in force on `day`, or None if the model has none yet (or is unknown)."""
        days = self._days.get(model)
        if days is None:
            return None
        i = bisect.bisect_right(days, day)
        return self._by_model[model][i - 1] if i else None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> PriceTable:
        currency = data.get("currency")
        if not isinstance(currency, str) or not currency:
            raise PriceConfigError('currency: a non-empty string is required (e.g. "USD")')
        entries = data.get("price", [])
        if not isinstance(entries, list):
            raise PriceConfigError("price: must be an array of tables ([[price]])")
        return cls(currency, [_parse_price(i, entry) for i, entry in enumerate(entries)])

    @classmethod
    def load(cls, path: str | Path) -> PriceTable:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f, parse_float=Decimal)
        except OSError as exc:
            raise PriceConfigError(f"cannot read price file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise PriceConfigError(f"price file {path} is not valid TOML: {exc}") from None
        return cls.from_mapping(data)

    @classmethod
    def default(cls) -> PriceTable:
        """The table shipped as billing/prices.toml."""
        text = resources.files("billing").joinpath("prices.toml").read_text()
        return cls.from_mapping(tomllib.loads(text, parse_float=Decimal))


def _parse_price(index: int, entry: Any) -> Price:
    where = f"price[{index}]"
    if not isinstance(entry, dict):
        raise PriceConfigError(f"{where}: must be a table")
    model = entry.get("model")
    if not isinstance(model, str) or not model:
        raise PriceConfigError(f"{where}.model: a non-empty string is required")
    where = f"price[{index}] ({model})"
    effective = entry.get("effective_from")
    # A TOML datetime is also a date subclass; only a plain day is meaningful here.
    if not isinstance(effective, date) or hasattr(effective, "hour"):
        raise PriceConfigError(f"{where}.effective_from: a TOML date (YYYY-MM-DD) is required")
    rates: dict[str, Decimal] = {}
    for name in _RATE_FIELDS:
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, int | Decimal):
            raise PriceConfigError(f"{where}.{name}: a number is required")
        rate = Decimal(value)
        if not rate.is_finite() or rate < 0:
            raise PriceConfigError(f"{where}.{name}: must be finite and non-negative")
        rates[name] = rate
    unknown = set(entry) - {"model", "effective_from", *_RATE_FIELDS}
    if unknown:
        raise PriceConfigError(f"{where}: unknown fields {sorted(unknown)}")
    return Price(model=model, effective_from=effective, **rates)
