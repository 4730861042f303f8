"""The live dashboard: a static page and the admin JSON it polls.

    GET /dashboard, /dashboard/{app.js,style.css,icon.svg}    the page (no data in it)
    GET {admin_prefix}/dashboard                              the numbers, admin token only

The page asks for the admin token, keeps it in the tab's sessionStorage and sends it as
`Authorization: Bearer`, so it never appears in a URL, a log or a referrer.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, date, datetime
from importlib import resources
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing.ledger import Ledger
from billing.prices import PriceTable
from billing.reports import build_report, format_money
from gateway.admission.admin import AdminToken, admin_ok
from gateway.dashboard.fleet import FleetGauges, FleetSnapshot
from gateway.dashboard.recent import RecentErrors

log = logging.getLogger(__name__)

STATIC = {
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("style.css", "text/css; charset=utf-8"),
    "/dashboard/icon.svg": ("icon.svg", "image/svg+xml"),
}
# Scripts and styles from the gateway only (no inline code, no third party), fetches to it only.
STATIC_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
LEDGER_TIMEOUT_S = 2.0


def _ledger_errors() -> tuple[type[BaseException], ...]:
    import psycopg  # only where a ledger is wired in

    return (sqlite3.Error, psycopg.Error, OSError, TimeoutError)


class Dashboard:
    """The page's handlers; `routes()` mounts them."""

    def __init__(
        self,
        admin: AdminToken,
        fleet: FleetGauges,
        registry: CollectorRegistry,
        errors: RecentErrors,
        ledger: Ledger | None = None,
        prices: PriceTable | None = None,
        today: Callable[[], date] = lambda: datetime.now(UTC).date(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._admin = admin
        self._fleet = fleet
        self._registry = registry
        self._errors = errors
        self._ledger = ledger
        self._prices = prices or PriceTable.default()
        self._today = today
        self._clock = clock
        files = resources.files(__package__)
        self._static = {
            path: (files.joinpath(name).read_bytes(), media_type)
            for path, (name, media_type) in STATIC.items()
        }

    def routes(self, admin_prefix: str = "/admin/v1") -> list[Route]:
        return [
            *(Route(path, self.static, methods=["GET"]) for path in self._static),
            Route(f"{admin_prefix}/dashboard", self.numbers, methods=["GET"]),
        ]

    async def static(self, request: Request) -> Response:
        body, media_type = self._static[request.url.path]
        return Response(body, media_type=media_type, headers=STATIC_HEADERS)

    async def numbers(self, request: Request) -> Response:
        """Everything the page shows, as of now (see docs/operations.md, "The dashboard")."""
        if not self._admin.allows(request):
            return self._admin.refusal()
        snapshot = await self._fleet.refresh()
        now = self._clock()
        result = {
            "at": now,
            "is_registry_away": snapshot.is_registry_away,
            "nodes": _nodes(snapshot, now),
            "models": [asdict(m) | {"kv_utilization": m.kv_utilization} for m in snapshot.models],
            "num_queued": snapshot.num_queued,
            "gateway": self._gateway_counters(),
            "usage": await self._usage_today(),
            "errors": [asdict(e) for e in self._errors.latest()],
        }
        return admin_ok(result)

    def _gateway_counters(self) -> dict[str, Any]:
        """This gateway's totals since it started, from its /metrics registry."""
        generations = failed = input_tokens = output_tokens = 0.0
        rejections: dict[str, float] = {}
        for metric in self._registry.collect():
            for sample in metric.samples:
                labels = sample.labels
                if sample.name == "gen_ai_server_request_duration_seconds_count":
                    generations += sample.value
                    if labels.get("error_type"):
                        failed += sample.value
                elif sample.name == "gen_ai_client_token_usage_sum":
                    if labels.get("gen_ai_token_type") == "input":
                        input_tokens += sample.value
                    else:
                        output_tokens += sample.value
                elif sample.name == "edgeserve_admission_rejections_total":
                    rejections[labels["reason"]] = sample.value
        return {
            "num_generations": int(generations),
            "num_failed": int(failed),
            "num_input_tokens": int(input_tokens),
            "num_output_tokens": int(output_tokens),
            "admission_rejections": {k: int(v) for k, v in sorted(rejections.items())},
        }

    async def _usage_today(self) -> dict[str, Any] | None:
        """Today's (UTC) billed usage per account from the ledger; None without a ledger."""
        if self._ledger is None:
            return None
        day = self._today()
        try:
            async with asyncio.timeout(LEDGER_TIMEOUT_S):
                report = await asyncio.to_thread(
                    build_report, self._ledger, self._prices, day, day, group_by=("account",)
                )
        except _ledger_errors() as exc:
            log.warning("the dashboard could not read the ledger: %s", exc)
            return {"day": day.isoformat(), "error": "the ledger did not answer"}
        accounts = [
            {
                "account_id": row.account_id,
                "requests": row.requests,
                "input_tokens": row.input_tokens,
                "cached_tokens": row.cached_tokens,
                "output_tokens": row.output_tokens,
                "cost": format_money(row.cost),
            }
            for row in report.rows
        ]
        return {"day": day.isoformat(), "currency": report.currency, "accounts": accounts}


def _nodes(snapshot: FleetSnapshot, now: float) -> list[dict[str, Any]]:
    return [
        {
            "node_id": r.node_id,
            "role": r.role,
            "models": list(r.models),
            "num_pages": r.num_pages,
            "num_free_pages": r.num_free_pages,
            "num_used_pages": r.num_pages - r.num_free_pages,
            "page_size": r.page_size,
            "kv_dtype": r.kv_dtype,
            "num_running": r.num_running,
            "num_waiting": r.num_waiting,
            "load": r.load,
            "tokens_per_s": r.tokens_per_s,
            "age_s": round(max(0.0, now - r.published_at), 3),
        }
        for r in snapshot.nodes
    ]
