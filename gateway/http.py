"""What every public handler shares: the gateway's state, auth, body parsing, and responses."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.catalog import CatalogModel, ModelCatalog
from gateway.dispatch import Dispatcher
from gateway.errors import (
    AuthenticationError,
    BadRequestError,
    ClientClosedError,
    Dialect,
    GatewayError,
    ModelNotFoundError,
    NotReadyError,
    PayloadTooLargeError,
    PermissionDeniedError,
    UnsupportedMediaError,
    error_body,
    error_headers,
    error_status,
)
from gateway.json_body import BodyTooLargeError, json_bytes, load_json, read_body
from gateway.keys import KeyStore
from gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from gateway.upstream import Upstream

LEFT_MID_BODY = "the client closed the connection before its request body arrived"

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Gateway:
    """Everything a handler needs, built once by `create_app`."""

    settings: GatewaySettings
    catalog: ModelCatalog
    keys: KeyStore
    dispatcher: Dispatcher
    is_ready: Callable[[], bool]


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


def request_id_of(request: Request) -> str:
    return request.scope["state"]["request_id"]  # type: ignore[no-any-return]


SESSION_HEADER = "x-session-affinity"


def session_id_of(request: Request) -> str | None:
    """The client's session (`x-session-affinity`), whose requests placement sends back to
    the node holding its prefix; None without one."""
    return request.headers.get(SESSION_HEADER, "").strip() or None


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


class SettlingJSON(JSONBytes):
    """A whole answer whose upstream is still open: the status line (with the request id)
    goes out, then the upstream closes (its end recorded for billing), then the body. A
    gateway that dies in between leaves a bill its client can name (docs/billing.md)."""

    def __init__(self, content: Any, upstream: Upstream, headers: dict[str, str]) -> None:
        super().__init__(content, headers=headers)
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await asyncio.shield(self.upstream.close())
        await send({"type": "http.response.body", "body": self.body})


async def settled(upstream: Upstream, build: Callable[[], Any]) -> SettlingJSON:
    """`build()`'s JSON as a SettlingJSON of `upstream` (collected with keep_open); should
    building fail, the upstream is closed before the error goes on."""
    try:
        return SettlingJSON(build(), upstream, upstream.headers)
    except BaseException:
        await asyncio.shield(upstream.close())
        raise


def error_response(error: GatewayError, dialect: Dialect) -> Response:
    return JSONBytes(error_body(error, dialect), error_status(error, dialect), error_headers(error))


Handler = Callable[[Request], Awaitable[Response]]


def endpoint(dialect: Dialect) -> Callable[[Handler], Handler]:
    """Turns every GatewayError raised by the handler into a response in its dialect; nothing else leaks."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except GatewayError as exc:
                return error_response(exc, dialect)

        return run

    return wrap


async def authenticate(request: Request) -> str:
    """The account that owns the request's API key; checks the path account when there is one."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <API key>'")
    account_id = await gateway_of(request).keys.lookup(key.strip())
    if account_id is None:
        raise AuthenticationError("invalid API key")
    path_account = request.path_params.get("account_id")
    if path_account is not None and path_account != account_id:
        raise PermissionDeniedError(f"this API key may not act for account {path_account!r}")
    return account_id


def require_ready(request: Request) -> None:
    if not gateway_of(request).is_ready():
        raise NotReadyError("the model is still loading; retry shortly", retry_after_s=1.0)


async def resolve_model(request: Request, name: str) -> CatalogModel:
    """The catalog entry `name` means (a public name, an alias, or the path a node serves),
    with the served model's own sampling defaults; ModelNotFoundError (404) otherwise."""
    gateway = gateway_of(request)
    model = gateway.catalog.resolve(name, await gateway.dispatcher.served_models())
    if model is None:
        raise ModelNotFoundError(f"no such model: {name!r}", param="model")
    return model


async def parse_body(request: Request, schema: type[M]) -> M:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaError(
            f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed"
        )
    try:
        raw = await read_body(request, gateway_of(request).settings.max_body_bytes)
    except BodyTooLargeError as exc:
        raise PayloadTooLargeError(str(exc)) from None
    except ClientDisconnect:  # it left mid-body: nobody to answer, a 499 in the access log
        raise ClientClosedError(LEFT_MID_BODY) from None
    try:
        data = load_json(raw)
    except ValueError as exc:  # not UTF-8, not JSON, nested too deeply, an integer too long
        raise BadRequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequestError("the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


# The names pydantic adds to an error's location for the member of a union it tried
# (`stop.str`, `content.list[dict[str,any]]`): types, not fields, so left out of `param`.
_TYPE_TAGS = frozenset({"str", "constrained-str", "int", "float", "bool", "none"})


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(
        str(p)
        for p in loc
        if isinstance(p, int) or not (p in _TYPE_TAGS or "[" in p or p.startswith("function-"))
    )


def validation_error(exc: ValidationError) -> BadRequestError:
    problems, param = [], None
    for err in exc.errors(include_url=False):
        where = _location(err["loc"])
        param = param or (where or None)
        # A validator's own ValueError reads as its text, without pydantic's "Value error, ".
        msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        problems.append(f"{where}: {msg}" if where else msg)
    return BadRequestError("invalid request: " + "; ".join(problems), param=param)
