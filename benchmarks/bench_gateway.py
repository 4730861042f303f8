"""Gateway overhead and the cost of tracing, against a node API with no model.

Side by side in one run, behind the same minimal upstream (answers
`POST /internal/v1/generate` at once with `max_tokens` NDJSON chunks, so what is
measured is the gateway):

    overhead   load generator -> upstream                 POST /internal/v1/generate (16 chunks)
               load generator -> gateway -> upstream      Workers AI run, non-streaming and streaming
    tracing    three gateways, tracing off / 10 % sampled / every request, spans exported
               over OTLP/HTTP to a sink that drops them; interleaved rounds

Latency: one request at a time (p50/p99, and the gateway's added p50/p99).
Throughput: `--concurrency` connections for `--seconds` each. Each gateway is one uvicorn
process (uvloop + httptools) with in-process stores as in `edgeserve up`, no limiter or
usage sink.

    .venv/bin/python benchmarks/bench_gateway.py [overhead] [--seconds 5] [--concurrency 32]
    .venv/bin/python benchmarks/bench_gateway.py tracing [--seconds 4] [--rounds 3]
    .venv/bin/python benchmarks/bench_gateway.py --smoke     # both, a few requests each (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

KEY = "es-bench-key"
ACCOUNT = "bench"
INTERNAL_TOKEN = "bench-internal"
NUM_CHUNKS = 16
HERE = Path(__file__).resolve().parent
# gateway telemetry -> sampling ratio; "plain" has no telemetry object, "off" has one
# with tracing off (GenAI metrics only)
TRACING = {"off": None, "sampled": 0.1, "on": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the processes: upstream, OTLP sink, gateway ------------------------------------------


CAPACITY = {
    "node_id": "upstream",
    "address": "",
    "role": "mixed",
    "models": ["smollm2"],
    "num_pages": 4096,
    "num_free_pages": 4096,
    "page_size": 16,
    "kv_dtype": "fp32",
    "num_running": 0,
    "num_waiting": 0,
    "load": 0.0,
    "published_at": 0.0,
    "ttl_s": 3.0,
}


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type
    return head + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _generate(body: bytes) -> bytes:
    request = json.loads(body)
    num_tokens = int(request.get("max_tokens", 16))
    lines = [b'{"text":"tok ","token_ids":[1],"prompt_tokens":8,"cached_tokens":0}\n']
    lines += [b'{"text":"tok ","token_ids":[1]}\n'] * (num_tokens - 1)
    usage = {"prompt_tokens": 8, "completion_tokens": num_tokens, "cached_tokens": 0}
    lines.append(json.dumps({"finish_reason": "length", "usage": usage}).encode() + b"\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(line), line) for line in lines)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + chunks + b"0\r\n\r\n"


class UpstreamProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length bodies only (what httpx sends)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            method, path, _ = head.split(" ", 2)
            assert self._transport is not None
            self._transport.write(self._answer(method, path, body))

    def _answer(self, method: str, path: str, body: bytes) -> bytes:
        if method == "POST" and path == "/internal/v1/generate":
            return _generate(body)
        if method == "DELETE":
            return b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n"
        if path == "/internal/v1/capacity":
            return _response("200 OK", json.dumps(CAPACITY).encode())
        if path == "/internal/v1/health":
            return _response("200 OK", b'{"status":"ok"}')
        return _response("404 Not Found", b'{"error":{"code":"not_found","message":"no route"}}')


class OtlpSink(asyncio.Protocol):
    """Answers every HTTP/1.1 request 200 with an empty body (an OTLP receiver that drops)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            length = 0
            for line in self._buffer[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            self._buffer = self._buffer[end + 4 + length :]
            assert self._transport is not None
            self._transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"
            )


def serve_otlp(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(OtlpSink, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def serve_gateway(port: int, upstream_port: int, mode: str, otlp_port: int) -> None:
    """One gateway process in front of the upstream (in-process stores, as `up`)."""
    import uvicorn

    from common.telemetry import TelemetrySettings, setup_telemetry
    from gateway.app import create_app
    from gateway.keys import MemoryKeyStore
    from gateway.settings import GatewaySettings
    from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
    from scheduler.placement import LocalReservations, Placer

    telemetry = None
    if mode != "plain":
        ratio = TRACING[mode]
        telemetry = setup_telemetry(
            TelemetrySettings(
                f"bench-gateway-{mode}",
                is_tracing=ratio is not None,
                sampling_ratio=ratio or 1.0,
                otlp_traces_endpoint=f"http://127.0.0.1:{otlp_port}/v1/traces",
            )
        )
    registry = LocalCapacityRegistry()
    keys = MemoryKeyStore()

    async def on_startup() -> None:
        await keys.add(KEY, ACCOUNT)
        record = CapacityRecord(
            node_id="upstream",
            address=f"http://127.0.0.1:{upstream_port}",
            role="mixed",
            models=("smollm2",),
            num_pages=4096,
            num_free_pages=4096,
            page_size=16,
            kv_dtype="fp32",
            num_running=0,
            num_waiting=0,
            load=0.0,
            published_at=time.time(),
            ttl_s=1e9,
            activations="fp32",
        )
        await registry.publish(record)

    app = create_app(
        GatewaySettings(internal_token=INTERNAL_TOKEN),
        keys=keys,
        placer=Placer(CapacityView(registry, max_age_s=1.0), LocalReservations()),
        on_startup=on_startup,
        telemetry=telemetry,
    )
    uvicorn.run(
        app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
        access_log=False, backlog=2048,
    )  # fmt: skip


def serve_upstream(port: int) -> None:
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            UpstreamProtocol, "127.0.0.1", port, backlog=1024
        )
        async with server:
            await server.serve_forever()

    uvloop.run(main())


# -- the load generator: a raw keep-alive HTTP/1.1 client -------------------------------


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        if "content-length" in headers:
            return status, await self.reader.readexactly(int(headers["content-length"]))
        body = bytearray()
        while True:  # chunked
            size = int((await self.reader.readline()).strip(), 16)
            if size == 0:
                await self.reader.readline()
                return status, bytes(body)
            body += (await self.reader.readexactly(size + 2))[:-2]

    def close(self) -> None:
        self.writer.close()


def http_post(path: str, body: dict[str, object], token: str) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data


def direct_request() -> bytes:
    body = {
        "request_id": "r",
        "account_id": ACCOUNT,
        "model": "smollm2",
        "prompt": "Hello",
        "max_tokens": NUM_CHUNKS,
    }
    return http_post("/internal/v1/generate", body, INTERNAL_TOKEN)


def gateway_request(stream: bool) -> bytes:
    body = {"prompt": "Hello", "max_tokens": NUM_CHUNKS, "stream": stream}
    return http_post(f"/client/v4/accounts/{ACCOUNT}/ai/run/smollm2", body, KEY)


def check(status: int, body: bytes, kind: str) -> None:
    if status != 200:
        raise SystemExit(f"{kind}: status {status}: {body[:300]!r}")
    if kind == "stream" and body.count(b"data: ") != NUM_CHUNKS + 2:  # chunks, usage, [DONE]
        raise SystemExit(f"stream: expected {NUM_CHUNKS + 2} events, got {body!r}")


async def latencies(port: int, raw: bytes, kind: str, n: int) -> list[float]:
    conn = await Connection.open(port)
    out = []
    for _ in range(n):
        start = time.perf_counter()
        status, body = await conn.request(raw)
        out.append(time.perf_counter() - start)
        check(status, body, kind)
    conn.close()
    return out


async def throughput(port: int, raw: bytes, kind: str, concurrency: int, seconds: float) -> float:
    conns = [await Connection.open(port) for _ in range(concurrency)]
    deadline = time.perf_counter() + seconds
    done = 0

    async def worker(conn: Connection) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            status, body = await conn.request(raw)
            check(status, body, kind)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    return done / elapsed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def wait_port(port: int) -> None:
    for _ in range(300):
        try:
            conn = await Connection.open(port)
            conn.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


async def run_overhead(args: argparse.Namespace, upstream_port: int, gateway_port: int) -> None:
    await wait_port(upstream_port)
    await wait_port(gateway_port)
    cases: list[tuple[str, int, bytes, str]] = [
        ("direct (node API, 16 chunks)", upstream_port, direct_request(), "direct"),
        ("gateway non-streaming", gateway_port, gateway_request(False), "json"),
        ("gateway streaming, 16 chunks", gateway_port, gateway_request(True), "stream"),
    ]
    for _, port, raw, kind in cases:  # warm up connections, caches, code paths
        await latencies(port, raw, kind, args.warmup)
    rows = []
    for name, port, raw, kind in cases:
        lat = await latencies(port, raw, kind, args.requests)
        rps = await throughput(port, raw, kind, args.concurrency, args.seconds)
        rows.append((name, pct(lat, 0.5), pct(lat, 0.99), statistics.fmean(lat) * 1000, rps))
    direct_p50, direct_p99 = rows[0][1], rows[0][2]
    print(
        f"latency: {args.requests} sequential requests; throughput: {args.concurrency} connections x {args.seconds:g} s"
    )
    print(
        f"{'case':32} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'req/s':>8} {'+p50 ms':>8} {'+p99 ms':>8}"
    )
    for name, p50, p99, mean, rps in rows:
        added = (
            "" if name.startswith("direct") else f"{p50 - direct_p50:8.2f} {p99 - direct_p99:8.2f}"
        )
        print(f"{name:32} {p50:8.2f} {p99:8.2f} {mean:8.2f} {rps:8.0f} {added}")
    print(
        f"gateway/direct req/s: non-streaming {rows[1][4] / rows[0][4]:.2f}, streaming {rows[2][4] / rows[0][4]:.2f}"
    )


async def run_tracing(args: argparse.Namespace, ports: dict[str, int], upstream_port: int) -> None:
    await wait_port(upstream_port)
    for port in ports.values():
        await wait_port(port)
    kinds = (
        ("non-streaming", gateway_request(False), "json"),
        ("streaming", gateway_request(True), "stream"),
    )
    for port in ports.values():  # warm up every gateway on both paths
        for _, raw, kind in kinds:
            await latencies(port, raw, kind, args.warmup)
    rps: dict[tuple[str, str], list[float]] = {}
    lat: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        order = list(ports) if round_index % 2 == 0 else list(reversed(ports))
        for name, raw, kind in kinds:
            for mode in order:
                lat.setdefault((mode, name), []).extend(
                    await latencies(ports[mode], raw, kind, args.requests)
                )
                rps.setdefault((mode, name), []).append(
                    await throughput(ports[mode], raw, kind, args.concurrency, args.seconds)
                )
    print(
        f"{args.rounds} interleaved rounds; per round and case: {args.requests} sequential requests"
        f" (latency), {args.concurrency} connections x {args.seconds:g} s (throughput)"
    )
    print(
        f"{'case':34} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'min':>7} {'max':>7} {'vs off':>7}"
    )
    for name, _, _ in kinds:
        base = statistics.median(rps[("off", name)])
        for mode in ports:
            values = rps[(mode, name)]
            median = statistics.median(values)
            row = f"{name + ', tracing ' + mode:34} {pct(lat[(mode, name)], 0.5):8.2f}"
            row += f" {pct(lat[(mode, name)], 0.99):8.2f} {median:8.0f} {min(values):7.0f}"
            print(row + f" {max(values):7.0f} {median / base:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=("overhead", "tracing"), default="overhead")
    parser.add_argument("--seconds", type=float, default=None, help="throughput, per case")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None, help="sequential, for latency")
    parser.add_argument("--rounds", type=int, default=3, help="tracing: interleaved rounds")
    parser.add_argument("--smoke", action="store_true", help="both modes, a few requests each")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-otlp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-gateway", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        return serve_upstream(args.serve_upstream)
    if args.serve_otlp:
        return serve_otlp(args.serve_otlp)
    if args.serve_gateway:
        port, upstream, mode, otlp = args.serve_gateway
        return serve_gateway(int(port), int(upstream), mode, int(otlp))
    if args.smoke:
        args.seconds, args.concurrency, args.requests, args.rounds = 0.2, 4, 20, 1
        args.warmup = 20
        modes = ["overhead", "tracing"]
    else:
        args.warmup = 200
        modes = [args.mode]
        if args.seconds is None:
            args.seconds = 5.0 if args.mode == "overhead" else 4.0
        if args.requests is None:
            args.requests = 2000 if args.mode == "overhead" else 500
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    upstream_port, otlp_port = free_port(), free_port()
    gateways = {"plain": free_port()} if "overhead" in modes else {}
    if "tracing" in modes:
        gateways |= {mode: free_port() for mode in TRACING}
    root = HERE.parent
    env = os.environ | {"PYTHONPATH": str(root)}
    me = [sys.executable, str(HERE / "bench_gateway.py")]
    commands = [
        [*me, "--serve-upstream", str(upstream_port)],
        [*me, "--serve-otlp", str(otlp_port)],
    ]
    commands += [
        [*me, "--serve-gateway", str(port), str(upstream_port), mode, str(otlp_port)]
        for mode, port in gateways.items()
    ]
    procs = [subprocess.Popen(command, env=env, cwd=root) for command in commands]
    try:
        import uvloop

        if "overhead" in modes:
            uvloop.run(run_overhead(args, upstream_port, gateways["plain"]))
        if "tracing" in modes:
            ports = {mode: gateways[mode] for mode in TRACING}
            uvloop.run(run_tracing(args, ports, upstream_port))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
