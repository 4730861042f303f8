"""`GET /client/v4/accounts/{account_id}/ai/usage?from=&to=&group_by=&account_id=`.

A Starlette-compatible handler factory; the gateway mounts it and supplies
`authorize(request)`, which returns who is asking:

    an account id (str)   an account's API key: sees only that account
    ADMIN                 an admin token: sees any account; `?account_id=*` sees all
    None                  no or unknown credentials -> 401

An account key naming another account, by path or by `?account_id=`, gets 403.
Exceptions `authorize` raises are the gateway's to map. Responses use the
Workers AI envelope `{"result", "success", "errors": [{"code", "message"}],
"messages"}` with the gateway's codes (10000 auth, 5004 bad request).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from billing.errors import InvalidReportQuery
from billing.ledger import Ledger
from billing.prices import PriceTable
from billing.reports import build_report, parse_day, parse_group_by, to_json, window_start

ALL_ACCOUNTS = "*"


@dataclass(frozen=True, slots=True)
class AdminPrincipal:
    """The operator: may read every account's usage."""


ADMIN = AdminPrincipal()
Principal = str | AdminPrincipal
Authorize = Callable[[Request], "Awaitable[Principal | None] | Principal | None"]

# (HTTP status, Workers AI error code), as gateway/errors.py ERROR_TABLE maps them.
_UNAUTHENTICATED = (401, 10000)
_FORBIDDEN = (403, 10000)
_BAD_REQUEST = (400, 5004)


def envelope(result: Any) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


def error_envelope(status_and_code: tuple[int, int], message: str) -> JSONResponse:
    status, code = status_and_code
    body = {
        "result": None,
        "success": False,
        "errors": [{"code": code, "message": message}],
        "messages": [],
    }
    return JSONResponse(body, status_code=status)


def usage_endpoint(
    ledger: Ledger,
    prices: PriceTable,
    authorize: Authorize,
    *,
    max_days: int = 366,
    today: Callable[[], date] = lambda: datetime.now(UTC).date(),
) -> Callable[[Request], Awaitable[Response]]:
    """The handler. Days are UTC and inclusive; `to` defaults to today, `from` to 30 days before it."""

    async def usage(request: Request) -> Response:
        principal = authorize(request)
        if inspect.isawaitable(principal):
            principal = await principal
        if principal is None:
            return error_envelope(_UNAUTHENTICATED, "Authentication error: a valid key is required")
        path_account = request.path_params["account_id"]
        requested = request.query_params.get("account_id", path_account)
        if isinstance(principal, AdminPrincipal):
            account_id = None if requested == ALL_ACCOUNTS else requested
        elif path_account != principal or requested != principal:
            return error_envelope(_FORBIDDEN, "this key may only read its own account's usage")
        else:
            account_id = principal
        try:
            query = request.query_params
            end = parse_day(query["to"], "to") if "to" in query else today()
            start = parse_day(query["from"], "from") if "from" in query else window_start(end)
            if (end - start).days + 1 > max_days:
                raise InvalidReportQuery(f"from..to spans more than {max_days} days")
            group_by = parse_group_by(query.get("group_by"))
            report = await asyncio.to_thread(
                build_report, ledger, prices, start, end, account_id=account_id, group_by=group_by
            )
        except InvalidReportQuery as exc:
            return error_envelope(_BAD_REQUEST, str(exc))
        return JSONResponse(envelope(to_json(report) | {"account_id": requested}))

    return usage
