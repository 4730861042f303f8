"""Where a single-stream decode step spends its host time (cProfile), seeded weights.

    python benchmarks/profile_decode_host.py [--weights bf16|int4] [--steps 40] [--tiny]
        [--model llama-1b|llama-8b|smollm2] [--graphs]

Builds bench_engine_gpu.py's 16-layer 2048-wide llama (or `--model`'s shape; the tiny
shape on CPU), runs one sequence to its decode phase, then profiles `steps` engine steps
(`--graphs`: replayed from CUDA graphs, as a GPU node runs them). It prints the median
step time without and with the profiler, and the functions with the most time of their
own and in total.
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

from bench_engine_gpu import MODEL_SHAPES, SMOLLM2, TINY, make_engine, median_ms, seeded_model, sync

from gpu_node.models.llama import fuse_projections
from gpu_node.quant.linear import quantize_model
from scheduler.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", choices=("bf16", "int4"), default="bf16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--model", choices=tuple(MODEL_SHAPES), default="llama-1b")
    parser.add_argument("--graphs", action="store_true", help="decode steps from CUDA graphs")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else MODEL_SHAPES[args.model]
    model = seeded_model(shape, device, torch.float32 if args.tiny else torch.bfloat16)
    if args.weights == "int4":
        group = 32 if shape is SMOLLM2 else 128  # 576 is no multiple of 128
        model = quantize_model(model, group_size=group, skip=("lm_head", "embed_tokens"))
    if args.graphs:
        fuse_projections(model)  # as a GPU node serves it
    kv = "fp32" if args.tiny else "fp8"
    engine = make_engine(
        model, device, kv_dtype=kv, num_pages=64, cuda_graph_batch=8 if args.graphs else 0
    )
    engine.add_request("s", list(range(1, 65)), SamplingParams(max_tokens=8 * args.steps + 8))
    for _ in range(4):  # prefill, then a few decode steps: compiled, captured, warm
        engine.step()
    plain_ms = median_ms(engine.step, device, args.steps)
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
        f"{args.model} {args.weights} weights, {kv} KV on {device}, graphs {args.graphs}: median "
        f"step {plain_ms:.3f} ms, under the profiler "
        f"{statistics.median(times) * 1e3:.3f} ms"
    )
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
