"""Where a single-stream decode step spends its host time (cProfile), seeded weights.

    python benchmarks/profile_decode_host.py [--weights bf16|int4] [--steps 40] [--tiny]

Builds bench_engine_gpu.py's 16-layer 2048-wide llama (or the tiny shape on CPU), runs
one sequence to its decode phase, then profiles `steps` engine steps. It prints the
median step time and the functions with the most time of their own and in total.
Imports only torch, triton, numpy and our code.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine_gpu import LLAMA_1B, TINY, make_engine, sync

from gpu_node.quant.linear import quantize_model
from gpu_node.weights import seeded_llama
from scheduler.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", choices=("bf16", "int4"), default="bf16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    model = seeded_llama(TINY if args.tiny else LLAMA_1B, seed=0, device=device)
    if args.weights == "int4":
        model = quantize_model(model, group_size=128)
    model = model.to(torch.float32 if args.tiny else torch.bfloat16)
    kv = "fp32" if args.tiny else "fp8"
    engine = make_engine(model, device, kv_dtype=kv, num_pages=64)
    engine.add_request("s", list(range(1, 65)), SamplingParams(max_tokens=4 * args.steps + 8))
    for _ in range(4):  # prefill, then a few decode steps: compiled, warm
        engine.step()
    times = []
    profile = cProfile.Profile()
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        profile.enable()
        engine.step()
        sync(device)
        profile.disable()
        times.append(time.perf_counter() - start)
    print(
        f"{args.weights} weights, {kv} KV on {device}: median step {statistics.median(times) * 1e3:.2f} ms"
    )
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
