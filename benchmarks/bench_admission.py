"""Admission cost: acquire + release pairs through LocalLimiter and RedisLimiter, side by side.

One request's admission is one `acquire` (one EVALSHA of `gateway/admission/lua/acquire.lua`)
and one `release` (one EVALSHA of `release.lua`); the in-process LocalLimiter gives the
same answers without Redis. One account and model, limits high enough that every request
is admitted; `--concurrency` requests in flight at once (gathered in waves). Keys live
under a fresh prefix and are deleted at the end.

    .venv/bin/python benchmarks/bench_admission.py [--pairs 5000] [--concurrency 1,64]
    .venv/bin/python benchmarks/bench_admission.py --smoke   # 50 pairs (CI)

REDIS_URL names the Redis (default redis://127.0.0.1:6379/0); without one reachable the
Redis rows are skipped and say so.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
import uuid

import redis.asyncio as redis

from gateway.admission import (
    AdmissionSettings,
    Limiter,
    LimitPolicy,
    Limits,
    LocalLimiter,
    RedisLimiter,
)

LIMITS = Limits(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)


async def pairs(limiter: Limiter, n: int, concurrency: int, tag: str) -> tuple[float, float, float]:
    """(pairs/s, acquire p50 µs, acquire p99 µs) over `n` acquire + release pairs."""
    latencies: list[float] = []

    async def one(i: int) -> None:
        start = time.perf_counter()
        admission = await limiter.acquire("acct", "m", f"{tag}-{i}", 100)
        latencies.append(time.perf_counter() - start)
        assert admission.admitted, admission
        await limiter.release("acct", "m", f"{tag}-{i}", 42)

    start = time.perf_counter()
    for base in range(0, n, concurrency):
        await asyncio.gather(*(one(i) for i in range(base, min(n, base + concurrency))))
    wall = time.perf_counter() - start
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1e6
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e6
    return n / wall, p50, p99


async def run(num_pairs: int, warmup: int, concurrencies: list[int]) -> None:
    policy = LimitPolicy(default=LIMITS)
    limiters: dict[str, Limiter] = {"local": LocalLimiter(policy)}
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url, max_connections=128)
    prefix = f"bench-admission-{uuid.uuid4().hex[:8]}"
    try:
        await client.ping()
        settings = AdmissionSettings(policy=policy, key_prefix=prefix, redis_timeout_s=5)
        limiters["redis"] = RedisLimiter(client, settings)
    except (redis.ConnectionError, OSError) as exc:
        print(f"redis at {url} not reachable ({exc}): Redis rows skipped")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(f"{num_pairs} pairs a row after {warmup} warm-up pairs")
    print(f"{'limiter':8} {'conc':>4} {'pairs/s':>10} {'p50 us':>8} {'p99 us':>8}")
    try:
        for conc in concurrencies:
            rates = {}
            for name, limiter in limiters.items():
                await pairs(limiter, warmup, conc, f"warm-{name}-{conc}")
                rate, p50, p99 = await pairs(limiter, num_pairs, conc, f"{name}-{conc}")
                rates[name] = rate
                print(f"{name:8} {conc:>4} {rate:>10.0f} {p50:>8.0f} {p99:>8.0f}")
            if "redis" in rates:
                print(
                    f"  local/redis at concurrency {conc}: {rates['local'] / rates['redis']:.1f}x"
                )
    finally:
        if "redis" in limiters:
            keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await client.delete(*keys)
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--concurrency", default="1,64", help="comma-separated")
    parser.add_argument("--smoke", action="store_true", help="50 pairs a row (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.warmup = 50, 10
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    asyncio.run(run(args.pairs, args.warmup, concurrencies))


if __name__ == "__main__":
    main()
