"""Admin HTTP handlers for account limits, guarded by an admin bearer token.

    GET    {prefix}/accounts/{account_id}/limits[?model=M]   overrides and effective limits
    PUT    {prefix}/accounts/{account_id}/limits             {"model"?, "requests_per_minute"?,
                                                              "tokens_per_minute"?, "max_concurrent"?}
    DELETE {prefix}/accounts/{account_id}/limits[?model=M]   drops one override

Bodies use the Workers AI envelope; errors map through ERRORS below. `AdminToken` is the
one check of the admin bearer token; every admin route (the dashboard's too) asks it.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.admission.errors import InvalidLimits, InvalidRequest
from gateway.admission.limits import LimitPolicy
from gateway.admission.manage import clear_limits, describe_limits, update_limits
from gateway.admission.store import LimitStore
from gateway.json_body import BodyTooLargeError, load_json, read_body

MAX_BODY_BYTES = 64 * 1024  # a limits update is a few fields

# error kind -> (HTTP status, Workers AI error code); codes as in gateway/errors.py.
ERRORS: dict[str, tuple[int, int]] = {
    "unauthorized": (401, 10000),
    "invalid": (400, 5004),
    "not_found": (404, 7003),
    "unavailable": (503, 7010),
}


class LimitsUpdate(BaseModel):
    """PUT body: the fields to change; the rest keep their current value."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    requests_per_minute: StrictInt | None = Field(default=None, gt=0)
    tokens_per_minute: StrictInt | None = Field(default=None, gt=0)
    max_concurrent: StrictInt | None = Field(default=None, gt=0)


def admin_ok(result: Any) -> JSONResponse:
    return JSONResponse({"result": result, "success": True, "errors": [], "messages": []})


def admin_error(kind: str, message: str) -> JSONResponse:
    """An error envelope; `kind` is a key of ERRORS."""
    status, code = ERRORS[kind]
    body = {"result": None, "success": False, "errors": [{"code": code, "message": message}]}
    headers = {"www-authenticate": "Bearer"} if kind == "unauthorized" else None
    return JSONResponse({**body, "messages": []}, status_code=status, headers=headers)


class AdminToken:
    """The admin bearer token, compared in constant time."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("admin_token must be set; an unguarded admin API is refused")
        self._token = token.encode()

    def allows(self, request: Request) -> bool:
        """Whether `request` carries `Authorization: Bearer <the admin token>`."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self._token
        )

    def refusal(self) -> JSONResponse:
        return admin_error("unauthorized", "a valid admin bearer token is required")


class LimitsAdmin:
    """The handlers; `routes()` mounts them under `prefix`."""

    def __init__(
        self, store: LimitStore, policy: LimitPolicy, admin_token: str, timeout_s: float = 2.0
    ) -> None:
        self._store = store
        self._policy = policy
        self._admin = AdminToken(admin_token)
        self._timeout_s = timeout_s  # bound on store calls, so the API answers 503, not hangs

    def routes(self, prefix: str = "/admin/v1") -> list[Route]:
        path = f"{prefix}/accounts/{{account_id}}/limits"
        return [Route(path, self.handle, methods=["GET", "PUT", "DELETE"])]

    async def handle(self, request: Request) -> JSONResponse:
        if not self._admin.allows(request):
            return self._admin.refusal()
        account_id = request.path_params["account_id"]
        try:
            async with asyncio.timeout(self._timeout_s):
                if request.method == "PUT":
                    return await self._put(request, account_id)
                model = request.query_params.get("model")
                if request.method == "DELETE" and not await clear_limits(
                    self._store, account_id, model
                ):
                    return admin_error("not_found", "no such override")
                return admin_ok(await describe_limits(self._store, self._policy, account_id, model))
        except (InvalidLimits, InvalidRequest) as exc:
            return admin_error("invalid", str(exc))
        except (RedisError, OSError, TimeoutError):
            return admin_error("unavailable", "the limit store is unreachable; try again shortly")

    async def _put(self, request: Request, account_id: str) -> JSONResponse:
        try:
            update = LimitsUpdate.model_validate(
                load_json(await read_body(request, MAX_BODY_BYTES))
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return admin_error("invalid", f"{where}: {first['msg']}")
        except ValueError:  # not JSON, not UTF-8, nested too deeply, an integer too long
            return admin_error("invalid", "the body is not JSON")
        except BodyTooLargeError as exc:
            return admin_error("invalid", str(exc))
        if (update.requests_per_minute, update.tokens_per_minute, update.max_concurrent) == (
            None,
            None,
            None,
        ):
            return admin_error(
                "invalid",
                "give at least one of requests_per_minute, tokens_per_minute, max_concurrent",
            )
        await update_limits(
            self._store,
            self._policy,
            account_id,
            update.model,
            requests_per_minute=update.requests_per_minute,
            tokens_per_minute=update.tokens_per_minute,
            max_concurrent=update.max_concurrent,
        )
        return admin_ok(await describe_limits(self._store, self._policy, account_id, update.model))
