"""Usage events as the billing tests write them: three days and one event to vary."""

from __future__ import annotations

from billing.events import UsageEvent

# 2026-11-02 12:00:00 UTC and the two days after it.
DAY1 = 1_793_620_800.0
DAY2 = DAY1 + 86_400
DAY3 = DAY2 + 86_400


def make_event(request_id: str, /, **overrides: object) -> UsageEvent:
    values: dict[str, object] = {
        "request_id": request_id,
        "account_id": "acct-a",
        "model": "@cf/huggingface/smollm2-135m-instruct",
        "node_id": "node-1",
        "input_tokens": 100,
        "output_tokens": 20,
        "cached_tokens": 0,
        "started_at": DAY1,
        "ended_at": DAY1 + 1.5,
        "status": "ok",
    }
    values.update(overrides)
    return UsageEvent(**values)  # type: ignore[arg-type]
