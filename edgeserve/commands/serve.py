"""`edgeserve up | node | gateway`: start the service on one machine or as a fleet."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import typer

from edgeserve.engine_options import (
    ACTIVATIONS,
    CUDA_GRAPH_BATCH,
    CUDA_GRAPH_TOKENS,
    DEVICE,
    KV_DTYPE,
    PREFIX_CACHE_BLOCKS,
    resolve_activations,
    resolve_device,
    resolve_kv_dtype,
)
from edgeserve.loading import _embedder_factory, _engine_factory, _telemetry
from edgeserve.node_process import NodeProcess, NodeSpec
from edgeserve.servers import (
    BODY_DEADLINE,
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    KEEP_ALIVE_HELP,
    MAX_CONNECTIONS,
    MAX_HEADER_BYTES,
    MAX_REQUESTS_PER_CONNECTION,
    bound_port,
    connection_limits,
    listen,
    run_servers,
    url_host,
    uvicorn_server,
)
from edgeserve.settings import DEFAULT_REDIS_URL, journal_path, redis_client
from edgeserve.stores import (
    DATABASE_URL_ALIAS,
    LEDGER,
    ledger_flag,
    redacted,
)
from edgeserve.threads import apply_environment
from edgeserve.up_file import UpFile
from edgeserve.wiring import gateway_stores

if TYPE_CHECKING:
    import uvicorn

    from gateway.settings import GatewaySettings
    from gpu_node.server import NodeService
DEFAULT_ACCOUNT_ID = "local"
ADMIN_TOKEN_ENV = "EDGESERVE_ADMIN_TOKEN"
INTERNAL_TOKEN_ENV = "EDGESERVE_INTERNAL_TOKEN"
# The internal token opens every node's API: as long as the admin token's floor.
MIN_INTERNAL_TOKEN_CHARS = 16

_QUEUE_DEADLINE = typer.Option(
    10.0, min=0.0, help="seconds a request waits for a node when every node is busy"
)
_ACCESS_LOG = typer.Option(
    False,
    "--access-log",
    help="one JSON line per request on stderr (also with EDGESERVE_LOG_LEVEL=debug)",
)


async def _until_ready(service: NodeService | NodeProcess, servers: list[uvicorn.Server]) -> bool:
    """Waits until the first request can be served: the model loaded, the node's capacity
    published where placement reads it, every server listening. False when the model
    failed to load (the reason is `service.load_error`)."""
    while service.load_error is None:
        if service.is_ready and all(server.started for server in servers):
            try:
                records = await service.registry.list_live() if service.registry else None
            except OSError:  # also Redis's errors: not published yet, then
                records = []
            node_id = service.settings.node_id
            if records is None or any(r.node_id == node_id for r in records):
                return True
        await asyncio.sleep(0.05)
    return False


def _ready_line(
    model: str, weights: str | None, device: str, kv_dtype: str, where: str, seconds: float
) -> str:
    """One line that says the service is ready and what it serves."""
    from gpu_node.config import EngineConfig

    return (
        f"ready in {seconds:.1f} s: {model} ({weights or EngineConfig.weights} weights) on "
        f"{device}, KV cache {kv_dtype}, at {where}"
    )


async def _serve_until_stopped(
    servers: list[uvicorn.Server],
    service: NodeService | NodeProcess,
    on_ready: Callable[[float], Awaitable[None]],
) -> None:
    """Serves until a signal; `on_ready(seconds since start)` once the first request can be
    served. A model that fails to load stops the servers and exits 1, the reason on stderr."""
    started_at = time.monotonic()
    is_loaded: list[bool] = []

    async def watch() -> None:
        if await _until_ready(service, servers):
            is_loaded.append(True)
            await on_ready(time.monotonic() - started_at)
            return
        typer.echo(f"error: the model failed to load: {service.load_error}", err=True)
        for server in servers:
            server.should_exit = True

    watcher = asyncio.create_task(watch())
    try:
        await run_servers(servers, on_signal=service.begin_drain)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if service.load_error is not None and not is_loaded:
        raise typer.Exit(1)


DEFAULT_EMBEDDING_MODEL = "minilm"
_EMBEDDING_MODEL_HELP = (
    "encoder served beside the model for embeddings: a known name or a checkpoint "
    "directory; none: no embeddings"
)


def _embedding_model(chosen: str | None, default: str | None) -> str | None:
    """The encoder to serve: the one chosen (`none`: none), else `default` where its
    weights have been pulled (a missing default is not an error: embeddings stay off)."""
    from gpu_node.errors import ModelNotFoundError
    from gpu_node.models.model_store import resolve_model

    if chosen is not None:
        return None if chosen.lower() == "none" else chosen
    if default is None:
        return None
    try:
        resolve_model(default)
    except ModelNotFoundError:
        return None
    return default


def _internal_token(given: str | None) -> str:
    token = given or os.environ.get(INTERNAL_TOKEN_ENV)
    if not token:
        raise typer.BadParameter(
            f"set --internal-token or {INTERNAL_TOKEN_ENV} (shared by gateways and nodes)"
        )
    return _check_internal_token(token, "--internal-token" if given else INTERNAL_TOKEN_ENV)


def _check_internal_token(token: str, source: str) -> str:
    if len(token) < MIN_INTERNAL_TOKEN_CHARS:
        raise typer.BadParameter(
            f"the internal token must be at least {MIN_INTERNAL_TOKEN_CHARS} characters, got "
            f"{len(token)} (`openssl rand -hex 24` makes one)",
            param_hint=source,
        )
    return token


def _gateway_settings(**fields: Any) -> GatewaySettings:
    """GatewaySettings, or the reason they are refused as a command-line error."""
    from gateway.settings import GatewaySettings

    try:
        return GatewaySettings(**fields)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(node)
    app.command()(gateway)


def up(
    host: str = typer.Option("127.0.0.1", help="address the gateway listens on"),
    port: int = typer.Option(8080, help="gateway port"),
    redis_url: str | None = typer.Option(
        None, help="share stores through Redis instead of in-process"
    ),
    prefix: str = typer.Option("edgeserve:", help="Redis key prefix"),
    model: str = typer.Option("smollm2", help="node model name or GGUF path"),
    embedding_model: str | None = typer.Option(
        None, help=_EMBEDDING_MODEL_HELP + f" (default: {DEFAULT_EMBEDDING_MODEL} once pulled)"
    ),
    kv_dtype: str = KV_DTYPE,
    weights: str | None = typer.Option(None, help="fp32 | bf16 | int4 (engine default when unset)"),
    activations: str = ACTIVATIONS,
    max_model_len: int | None = typer.Option(None, help="context window cap"),
    kv_memory_mb: int | None = typer.Option(None, help="KV cache size (engine default when unset)"),
    prefix_cache_blocks: int = PREFIX_CACHE_BLOCKS,
    device: str = DEVICE,
    cuda_graph_batch: int | None = CUDA_GRAPH_BATCH,
    cuda_graph_tokens: int | None = CUDA_GRAPH_TOKENS,
    queue_deadline_s: float = _QUEUE_DEADLINE,
    ledger: str | None = LEDGER,
    access_log: bool = _ACCESS_LOG,
    header_timeout_s: float = HEADER_TIMEOUT,
    max_header_bytes: int = MAX_HEADER_BYTES,
    body_timeout_s: float = BODY_TIMEOUT,
    body_deadline_s: float = BODY_DEADLINE,
    keep_alive_timeout_s: float = typer.Option(5.0, help=KEEP_ALIVE_HELP),
    max_connections: int | None = MAX_CONNECTIONS,
    max_requests_per_connection: int = MAX_REQUESTS_PER_CONNECTION,
) -> None:
    """Gateway + one node, the node in a process of its own (edgeserve/node_process.py):
    ready in one command, no Redis needed.

    With --redis-url the stores are shared through Redis and a billing worker runs in
    this process, moving the usage stream into the ledger. Its files (models, journal,
    ledger, the address and key `edgeserve run` finds it by) live in EDGESERVE_HOME."""
    engine_device = resolve_device(device)
    activations = resolve_activations(activations, weights, engine_device)
    kv_dtype = resolve_kv_dtype(kv_dtype, engine_device, activations)
    encoder = _embedding_model(embedding_model, DEFAULT_EMBEDDING_MODEL)
    account_id = os.environ.get("EDGESERVE_ACCOUNT_ID", DEFAULT_ACCOUNT_ID)
    chosen_api_key = os.environ.get("EDGESERVE_API_KEY")
    admin_token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(24)
    internal_token = os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(24)
    _check_internal_token(internal_token, INTERNAL_TOKEN_ENV)
    limits = connection_limits(
        max_connections, header_timeout_s=header_timeout_s, max_header_bytes=max_header_bytes,
        body_timeout_s=body_timeout_s, body_deadline_s=body_deadline_s,
        keep_alive_timeout_s=keep_alive_timeout_s,
        max_requests_per_connection=max_requests_per_connection,
    )  # fmt: skip
    # The gateway is the node's one client: its pooled connections must expire before the
    # node closes them (a node that resets a connection is distrusted).
    node_limits = dataclasses.replace(limits, keep_alive_timeout_s=limits.header_timeout_s)
    gateway_sock = listen(host, port)
    port = bound_port(gateway_sock)  # the one bound, where --port 0 asked for any
    node_sock = listen("127.0.0.1", 0)
    node_port = bound_port(node_sock)
    settings = _gateway_settings(
        internal_token=internal_token, admin_token=admin_token, queue_deadline_s=queue_deadline_s
    )

    async def main() -> None:
        from gateway.app import create_app

        stores = await gateway_stores(
            redis_url, prefix, port, settings, local=redis_url is None, ledger=ledger,
            run_billing_worker=True,
        )  # fmt: skip
        api_key = await stores.add_up_key(
            account_id, chosen_api_key, owner=f"{socket.gethostname()}-{port}"
        )
        gateway_telemetry = _telemetry("edgeserve-gateway", access_log=access_log)
        node = NodeProcess(
            NodeSpec(
                node_id=f"{socket.gethostname()}-{node_port}", internal_token=internal_token,
                engine=dict(
                    model=model, kv_dtype=kv_dtype, weights=weights, max_model_len=max_model_len,
                    kv_memory_mb=kv_memory_mb, prefix_cache_blocks=prefix_cache_blocks,
                    device=engine_device, cuda_graph_batch=cuda_graph_batch,
                    activations=activations, cuda_graph_tokens=cuda_graph_tokens,
                ),
                limits=dataclasses.asdict(node_limits), port=node_port,
                fd=node_sock[0].fileno(), embedding_model=encoder, access_log=access_log,
            ),
            stores.registry,
        )  # fmt: skip
        gateway_app = create_app(
            settings,
            is_ready=lambda: node.is_ready, telemetry=gateway_telemetry, **stores.app_kwargs(),
        )  # fmt: skip
        servers = [uvicorn_server(gateway_app, gateway_sock, limits)]
        url = f"http://{url_host(host)}:{port}"
        typer.echo(
            f"edgeserve is starting at {url} (the model loads in the background; 503 until "
            "then, and a line saying ready when it can answer)"
        )
        typer.echo(f"  account id: {account_id}")
        typer.echo(f"  API key:    {api_key}")
        typer.echo(f"  admin token: {admin_token}  (/admin/v1, usage of every account)")
        typer.echo(f"  ledger:     {stores.ledger_location}")
        typer.echo(
            f"  node:       http://127.0.0.1:{node_port}  (its /metrics takes "
            f"'Authorization: Bearer {internal_token}', the internal token)"
        )
        typer.echo("  try:")
        typer.echo(
            f"    curl {url}/client/v4/accounts/{account_id}/ai/run/@cf/huggingface/smollm2-135m-instruct \\\n"
            f"      -H 'Authorization: Bearer {api_key}' -d '{{\"prompt\": \"Tell me a joke\"}}'"
        )
        typer.echo(f"  or: edgeserve run {model}")
        if encoder is not None:
            typer.echo(f"  embeddings: {encoder} at {url}/v1/embeddings")
        found_by = UpFile(url, account_id, api_key, model)

        async def on_ready(seconds: float) -> None:
            found_by.write()
            typer.echo(_ready_line(model, weights, engine_device, kv_dtype, url, seconds))

        def on_node_exit(code: int) -> None:
            typer.echo(f"error: the node process ended (exit code {code}); stopping", err=True)
            for server in servers:
                server.should_exit = True

        node.start(on_exit=on_node_exit)
        for sock in node_sock:  # the node process holds it now
            sock.close()
        try:
            await _serve_until_stopped(servers, node, on_ready)
        finally:
            await node.stop()
            found_by.remove()
            gateway_telemetry.shutdown()  # flushes the spans still batched
        if node.has_exited:
            raise typer.Exit(1)

    asyncio.run(main())


def node(
    host: str = typer.Option("127.0.0.1", help="address the node listens on"),
    port: int = typer.Option(8081),
    advertise: str | None = typer.Option(
        None, help="base URL gateways use (default http://HOST:PORT)"
    ),
    node_id: str | None = typer.Option(None, help="default HOSTNAME-PORT"),
    redis_url: str = typer.Option(DEFAULT_REDIS_URL, envvar="REDIS_URL"),
    prefix: str = typer.Option("edgeserve:", help="Redis key prefix"),
    internal_token: str | None = typer.Option(None, help="or EDGESERVE_INTERNAL_TOKEN"),
    model: str = typer.Option("smollm2"),
    embedding_model: str | None = typer.Option(None, help=_EMBEDDING_MODEL_HELP + " (default)"),
    kv_dtype: str = KV_DTYPE,
    weights: str | None = typer.Option(None),
    activations: str = ACTIVATIONS,
    max_model_len: int | None = typer.Option(None),
    kv_memory_mb: int | None = typer.Option(None, help="KV cache size (engine default when unset)"),
    prefix_cache_blocks: int = PREFIX_CACHE_BLOCKS,
    device: str = DEVICE,
    cuda_graph_batch: int | None = CUDA_GRAPH_BATCH,
    cuda_graph_tokens: int | None = CUDA_GRAPH_TOKENS,
    role: str = typer.Option("mixed", help="mixed | prefill | decode"),
    tensor_parallel: int = typer.Option(
        1, min=1, help="split the model across this many GPUs (one process each; the CPU: gloo)"
    ),
    heartbeat_s: float = typer.Option(1.0),
    ttl_s: float = typer.Option(3.0),
    header_timeout_s: float = HEADER_TIMEOUT,
    max_header_bytes: int = MAX_HEADER_BYTES,
    body_timeout_s: float = BODY_TIMEOUT,
    body_deadline_s: float = BODY_DEADLINE,
    # Longer than a gateway's pooled connections live (5 s), so that a gateway never sends
    # on a connection the node is closing (a node that resets a connection is distrusted).
    keep_alive_timeout_s: float = typer.Option(10.0, help=KEEP_ALIVE_HELP),
    max_connections: int | None = MAX_CONNECTIONS,
    max_requests_per_connection: int = MAX_REQUESTS_PER_CONNECTION,
) -> None:
    """One GPU node: the engine behind the internal API, publishing its capacity to Redis.
    It says ready on stderr once its model is loaded and published."""
    from scheduler.capacity import ROLES, check_node_id

    if role not in ROLES:
        raise typer.BadParameter(f"must be one of {', '.join(ROLES)}", param_hint="--role")
    if tensor_parallel > 1 and role != "mixed":
        raise typer.BadParameter(
            f"a {role} node hands KV over, which is not served under tensor parallelism: "
            "run it with --role mixed",
            param_hint="--tensor-parallel",
        )
    node_id = f"{socket.gethostname()}-{port}" if node_id is None else node_id
    try:
        check_node_id(node_id)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--node-id") from None
    apply_environment(device)  # before torch loads: OpenMP reads it once
    engine_device = resolve_device(device)
    activations = resolve_activations(activations, weights, engine_device)
    kv_dtype = resolve_kv_dtype(kv_dtype, engine_device, activations)
    token = _internal_token(internal_token)
    encoder = _embedding_model(embedding_model, None)
    limits = connection_limits(
        max_connections, header_timeout_s=header_timeout_s, max_header_bytes=max_header_bytes,
        body_timeout_s=body_timeout_s, body_deadline_s=body_deadline_s,
        keep_alive_timeout_s=keep_alive_timeout_s,
        max_requests_per_connection=max_requests_per_connection,
    )  # fmt: skip
    sock = listen(host, port)
    port = bound_port(sock)  # the one bound, where --port 0 asked for any

    async def main() -> None:
        from billing.sink import RedisUsageSink
        from gpu_node.server import NodeService, NodeSettings, create_node_app
        from scheduler.capacity import RedisCapacityRegistry

        client = redis_client(redis_url)
        telemetry = _telemetry("edgeserve-node")
        # The node's record of each request, on the fleet's usage stream (journaled while
        # Redis is away): what billing completes a stream from when its gateway died.
        usage_sink = RedisUsageSink(client, f"{prefix}usage", journal_path(port))
        service = NodeService(
            NodeSettings(
                node_id=node_id, address=advertise or f"http://{host}:{port}",
                internal_token=token, role=role, heartbeat_s=heartbeat_s, ttl_s=ttl_s,
            ),
            RedisCapacityRegistry(client, prefix),
            engine_factory=_engine_factory(
                model, kv_dtype, weights, max_model_len, kv_memory_mb, prefix_cache_blocks,
                engine_device, cuda_graph_batch, activations, cuda_graph_tokens, tensor_parallel,
            ),
            embedder_factory=None if encoder is None else _embedder_factory(encoder, engine_device),
            usage_sink=usage_sink,
        )  # fmt: skip
        typer.echo(f"node {service.settings.node_id} listening on {host}:{port}", err=True)
        where = f"http://{url_host(host)}:{port} as {service.settings.node_id} ({role})"

        async def on_ready(seconds: float) -> None:
            line = _ready_line(model, weights, engine_device, kv_dtype, where, seconds)
            typer.echo(line, err=True)

        await usage_sink.start()
        try:
            await _serve_until_stopped(
                [uvicorn_server(create_node_app(service, telemetry), sock, limits)],
                service,
                on_ready,
            )
        finally:
            await usage_sink.aclose()
            await client.aclose()
            telemetry.shutdown()

    asyncio.run(main())


def gateway(
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8080),
    redis_url: str = typer.Option(DEFAULT_REDIS_URL, envvar="REDIS_URL"),
    prefix: str = typer.Option("edgeserve:", help="Redis key prefix"),
    internal_token: str | None = typer.Option(None, help="or EDGESERVE_INTERNAL_TOKEN"),
    admin_token: str | None = typer.Option(
        None, envvar=ADMIN_TOKEN_ENV, help="bearer token of /admin/v1 (unset: no admin API)"
    ),
    ledger: str | None = LEDGER,
    database_url: str | None = DATABASE_URL_ALIAS,
    access_log: bool = _ACCESS_LOG,
    on_redis_error: str = typer.Option(
        "open", help="open: local share of the limits | closed: 503 while Redis is away"
    ),
    redis_timeout_s: float = typer.Option(
        0.25, help="bound on each admission call to Redis; past it, --on-redis-error applies"
    ),
    queue_deadline_s: float = _QUEUE_DEADLINE,
    header_timeout_s: float = HEADER_TIMEOUT,
    max_header_bytes: int = MAX_HEADER_BYTES,
    body_timeout_s: float = BODY_TIMEOUT,
    body_deadline_s: float = BODY_DEADLINE,
    keep_alive_timeout_s: float = typer.Option(5.0, help=KEEP_ALIVE_HELP),
    max_connections: int | None = MAX_CONNECTIONS,
    max_requests_per_connection: int = MAX_REQUESTS_PER_CONNECTION,
) -> None:
    """One stateless gateway reading keys, capacity and limits from Redis."""
    token = _internal_token(internal_token)
    if on_redis_error not in ("open", "closed"):
        raise typer.BadParameter("must be 'open' or 'closed'", param_hint="--on-redis-error")
    if not redis_timeout_s > 0:
        raise typer.BadParameter(
            f"must be a positive number of seconds, got {redis_timeout_s}",
            param_hint="--redis-timeout-s",
        )
    settings = _gateway_settings(
        internal_token=token, admin_token=admin_token, queue_deadline_s=queue_deadline_s
    )
    limits = connection_limits(
        max_connections, header_timeout_s=header_timeout_s, max_header_bytes=max_header_bytes,
        body_timeout_s=body_timeout_s, body_deadline_s=body_deadline_s,
        keep_alive_timeout_s=keep_alive_timeout_s,
        max_requests_per_connection=max_requests_per_connection,
    )  # fmt: skip
    sock = listen(host, port)
    port = bound_port(sock)

    async def main() -> None:
        from gateway.app import create_app

        stores = await gateway_stores(
            redis_url, prefix, port, settings, local=False,
            ledger=ledger_flag(ledger, database_url, None),
            on_redis_error=on_redis_error, redis_timeout_s=redis_timeout_s,
        )  # fmt: skip
        telemetry = _telemetry("edgeserve-gateway", access_log=access_log)
        app = create_app(
            settings,
            telemetry=telemetry, **stores.app_kwargs(),
        )  # fmt: skip
        url = f"http://{url_host(host)}:{port}"
        typer.echo(f"gateway listening on {url}", err=True)
        if admin_token is None:
            typer.echo(f"no admin token ({ADMIN_TOKEN_ENV}): /admin/v1 is not mounted", err=True)
        server = uvicorn_server(app, sock, limits)

        async def say_ready() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            typer.echo(
                f"ready: gateway at {url}, its fleet in Redis at {redacted(redis_url)}", err=True
            )

        announcer = asyncio.create_task(say_ready())
        try:
            await run_servers([server])
        finally:
            announcer.cancel()
            telemetry.shutdown()

    asyncio.run(main())
