"""Gateway overhead: latency it adds over calling a node directly, and requests/s it sustains.

Side by side in one run, against `minimal_upstream.py` (a node API with no model):

    direct     load generator -> upstream                 POST /internal/v1/generate (16 chunks)
    gateway    load generator -> gateway -> upstream      Workers AI run, non-streaming and streaming

Latency: one request at a time (p50/p99, and the gateway's added p50/p99).
Throughput: `--concurrency` connections for `--seconds` each. The gateway is
one uvicorn process (uvloop + httptools) with in-process stores (keys,
capacity, reservations) as in `edgeserve up`, no limiter or usage sink.

    .venv/bin/python benchmarks/bench_gateway.py [--seconds 5] [--concurrency 32]
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

KEY = "es-bench-key"
ACCOUNT = "bench"
INTERNAL_TOKEN = "bench-internal"
NUM_CHUNKS = 16
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the gateway process ----------------------------------------------------------------


def serve_gateway(port: int, upstream_port: int, telemetry: Any = None) -> None:
    """One gateway process in front of the minimal upstream (in-process stores, as `up`)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.keys import MemoryKeyStore
    from gateway.settings import GatewaySettings
    from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
    from scheduler.placement import LocalReservations, Placer

    registry = LocalCapacityRegistry()
    keys = MemoryKeyStore()

    async def on_startup() -> None:
        await keys.add(KEY, ACCOUNT)
        record = CapacityRecord(
            "upstream", f"http://127.0.0.1:{upstream_port}", "mixed", ("smollm2",),
            4096, 4096, 16, "fp32", 0, 0, 0.0, time.time(), 1e9,
        )  # fmt: skip
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


async def run(args: argparse.Namespace, upstream_port: int, gateway_port: int) -> None:
    await wait_port(upstream_port)
    await wait_port(gateway_port)
    cases: list[tuple[str, int, bytes, str]] = [
        ("direct (node API, 16 chunks)", upstream_port, direct_request(), "direct"),
        ("gateway non-streaming", gateway_port, gateway_request(False), "json"),
        ("gateway streaming, 16 chunks", gateway_port, gateway_request(True), "stream"),
    ]
    for _, port, raw, kind in cases:  # warm up connections, caches, code paths
        await latencies(port, raw, kind, 200)
    rows = []
    for name, port, raw, kind in cases:
        lat = await latencies(port, raw, kind, args.requests)
        rps = await throughput(port, raw, kind, args.concurrency, args.seconds)
        rows.append((name, pct(lat, 0.5), pct(lat, 0.99), statistics.fmean(lat) * 1000, rps))
    direct_p50, direct_p99 = rows[0][1], rows[0][2]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"latency: {args.requests} sequential requests; throughput: {args.concurrency} connections x {args.seconds:.0f} s"
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--requests", type=int, default=2000, help="sequential requests for latency"
    )
    parser.add_argument(
        "--serve-gateway",
        nargs=2,
        type=int,
        metavar=("PORT", "UPSTREAM_PORT"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.serve_gateway:
        serve_gateway(*args.serve_gateway)
        return
    upstream_port, gateway_port = free_port(), free_port()
    root = HERE.parent
    env = os.environ | {"PYTHONPATH": str(root)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "minimal_upstream.py"), "--port", str(upstream_port)],
            env=env,
        ),
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "bench_gateway.py"),
                "--serve-gateway",
                str(gateway_port),
                str(upstream_port),
            ],
            env=env,
            cwd=root,
        ),
    ]
    try:
        import uvloop

        runner: Callable[[Awaitable[None]], None] = uvloop.run  # type: ignore[assignment]
        runner(run(args, upstream_port, gateway_port))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
