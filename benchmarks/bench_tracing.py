"""Tracing overhead: gateway requests/s with tracing off, sampled and on, side by side in one run.

Three gateway processes, identical but for their telemetry, in front of the same
`minimal_upstream.py` (a node API with no model):

    off        TelemetrySettings(is_tracing=False): GenAI metrics only (always on)
    sampled    tracing on, 10 % of traces sampled, exported over OTLP/HTTP
    on         tracing on, every trace sampled and exported over OTLP/HTTP

Spans go through the SDK's BatchSpanProcessor and the OTLP/HTTP exporter to an
OTLP sink process that answers 200 and drops them (what a collector costs is
not the gateway's). Cases are measured in interleaved rounds so a busier
moment of a shared machine falls on all of them alike.

    .venv/bin/python benchmarks/bench_tracing.py [--seconds 4] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from bench_gateway import free_port as _free_port
from bench_gateway import (
    gateway_request,
    latencies,
    pct,
    throughput,
    wait_port,
)
from bench_gateway import serve_gateway as serve_gateway_with

HERE = Path(__file__).resolve().parent
MODES = {"off": None, "sampled": 0.1, "on": 1.0}  # mode -> sampling ratio (None: no tracing)


def serve_gateway(port: int, upstream_port: int, mode: str, otlp_port: int) -> None:
    from common.telemetry import TelemetrySettings, setup_telemetry

    ratio = MODES[mode]
    settings = TelemetrySettings(
        f"bench-gateway-{mode}",
        is_tracing=ratio is not None,
        sampling_ratio=ratio or 1.0,
        otlp_traces_endpoint=f"http://127.0.0.1:{otlp_port}/v1/traces",
    )
    serve_gateway_with(port, upstream_port, setup_telemetry(settings))


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


async def run(args: argparse.Namespace, ports: dict[str, int], upstream_port: int) -> None:
    await wait_port(upstream_port)
    for port in ports.values():
        await wait_port(port)
    kinds = (
        ("non-streaming", gateway_request(False), "json"),
        ("streaming", gateway_request(True), "stream"),
    )
    for port in ports.values():  # warm up every gateway on both paths
        for _, raw, kind in kinds:
            await latencies(port, raw, kind, 200)
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
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"{args.rounds} interleaved rounds; per round and case: {args.requests} sequential requests"
        f" (latency), {args.concurrency} connections x {args.seconds:.0f} s (throughput)"
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
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=500, help="sequential requests for latency")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--serve-gateway",
        nargs=4,
        metavar=("PORT", "UPSTREAM", "MODE", "OTLP"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--serve-otlp", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_gateway:
        port, upstream, mode, otlp = args.serve_gateway
        serve_gateway(int(port), int(upstream), mode, int(otlp))
        return
    if args.serve_otlp:
        serve_otlp(args.serve_otlp)
        return
    upstream_port, otlp_port = _free_port(), _free_port()
    ports = {mode: _free_port() for mode in MODES}
    root = HERE.parent
    env = os.environ | {"PYTHONPATH": f"{root}{os.pathsep}{HERE}"}
    me = [sys.executable, str(HERE / "bench_tracing.py")]
    commands = [
        [sys.executable, str(HERE / "minimal_upstream.py"), "--port", str(upstream_port)],
        [*me, "--serve-otlp", str(otlp_port)],
        *(
            [*me, "--serve-gateway", str(port), str(upstream_port), mode, str(otlp_port)]
            for mode, port in ports.items()
        ),
    ]
    procs = [subprocess.Popen(command, env=env, cwd=root) for command in commands]
    try:
        import uvloop

        uvloop.run(run(args, ports, upstream_port))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
