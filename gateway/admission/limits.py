"""What an account may use: `Limits`, the per-account overrides, and how they resolve."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gateway.admission.errors import InvalidLimits, InvalidRequest
from scheduler.capacity import IDENTIFIER, IDENTIFIER_RULE


def check_identifier(kind: str, value: str) -> str:
    """Returns `value` when it can name an account or a model (account ids and model names
    become parts of Redis keys, scheduler.capacity.IDENTIFIER), else raises InvalidRequest."""
    if not isinstance(value, str) or IDENTIFIER.fullmatch(value) is None:
        raise InvalidRequest(f"{kind} {value!r} must be {IDENTIFIER_RULE}")
    return value


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-minute budgets of one (account, model) bucket.

    The request default is Workers AI's text-generation limit (300 requests/min);
    Workers AI publishes no token or concurrency figure, so those defaults are ours.
    """

    requests_per_minute: int = 300
    tokens_per_minute: int = 200_000
    max_concurrent: int = 32

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidLimits(f"{name} must be a positive integer, got {value!r}")

    def updated(
        self,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        max_concurrent: int | None = None,
    ) -> Limits:
        """A copy with the given fields replaced (None keeps the current value)."""
        changes = {
            "requests_per_minute": requests_per_minute,
            "tokens_per_minute": tokens_per_minute,
            "max_concurrent": max_concurrent,
        }
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def share(self, num_gateways: int) -> Limits:
        """This gateway's part when `num_gateways` enforce the limits without a shared store.

        Floors (never below 1) so the parts never add up to more than the whole.
        """
        n = max(1, num_gateways)
        return Limits(
            requests_per_minute=max(1, self.requests_per_minute // n),
            tokens_per_minute=max(1, self.tokens_per_minute // n),
            max_concurrent=max(1, self.max_concurrent // n),
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "max_concurrent": self.max_concurrent,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Limits:
        unknown = set(data) - {"requests_per_minute", "tokens_per_minute", "max_concurrent"}
        if unknown:
            raise InvalidLimits(f"unknown limit field(s): {', '.join(sorted(unknown))}")
        return cls(**data)  # type: ignore[arg-type]


def _frozen(mapping: Mapping[str, Limits]) -> Mapping[str, Limits]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, slots=True)
class AccountLimits:
    """The overrides stored for one account: its own limits and per-model ones."""

    account: Limits | None = None
    per_model: Mapping[str, Limits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_model", _frozen(self.per_model))


@dataclass(frozen=True, slots=True)
class LimitPolicy:
    """Configured defaults: one for every model, and optional per-model defaults."""

    default: Limits = Limits()
    per_model: Mapping[str, Limits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_model", _frozen(self.per_model))

    def resolve(self, overrides: AccountLimits, model: str) -> Limits:
        """Most specific wins: (account, model) override, account override, model default, default."""
        if model in overrides.per_model:
            return overrides.per_model[model]
        if overrides.account is not None:
            return overrides.account
        return self.per_model.get(model, self.default)
