"""Where a decode step replayed from a CUDA graph spends its GPU time, kernel by kernel.

    python benchmarks/profile_decode_graph.py [--model smollm2|llama-1b|llama-8b] [--weights bf16|int4]
                                              [--batch 1] [--replays 20] [--tiny]

Builds bench_engine_gpu.py's seeded model, decodes `batch` sequences of 512 tokens
until their step is captured, then replays that graph `replays` times under the torch
profiler. Prints the replay's wall time, the kernels' summed GPU time a replay (the
difference is the time between kernels), and the kernels by total time with their
count a replay. Imports only torch, triton, numpy and our code.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine_gpu import MODEL_SHAPES, TINY, make_engine, seeded_model, sync

from gpu_node.models.llama import fuse_projections
from gpu_node.quant.linear import quantize_model
from scheduler.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=tuple(MODEL_SHAPES), default="smollm2")
    parser.add_argument("--weights", choices=("bf16", "int4"), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else MODEL_SHAPES[args.model]
    model = seeded_model(shape, device, torch.float32 if args.tiny else torch.bfloat16)
    if args.weights == "int4":
        group = 32 if args.tiny or args.model == "smollm2" else 128  # 576 is no multiple of 128
        quantize_model(model, group_size=group, skip=("lm_head", "embed_tokens"))
    fuse_projections(model)  # as a GPU node serves it
    engine = make_engine(model, device, kv_dtype="fp32" if args.tiny else "bf16",
                         num_pages=args.batch * 40 + 8, cuda_graph_batch=32)  # fmt: skip
    for i in range(args.batch):
        ids = [(i * 31 + j) % 30000 + 1 for j in range(512)]
        engine.add_request(f"s{i}", ids, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(4):  # prefill, then decode steps: captured and warm
        engine.step()
    graphs = engine.runner.graphs
    if graphs is None or not graphs.captured:
        print(f"no decode graph on {device}: nothing to profile")
        return
    walls = []
    for _ in range(args.replays):
        sync(device)
        start = time.perf_counter()
        graphs.replay_last()
        sync(device)
        walls.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graphs.replay_last()
        sync(device)
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.device_time)
    total = sum(sum(t) for t in kernels.values()) / args.replays
    count = sum(len(t) for t in kernels.values()) / args.replays
    print(f"{args.model} {args.weights} batch {args.batch}: replay {statistics.median(walls) * 1e3:.3f} ms; "
          f"{count:.0f} kernels a replay, their GPU time {total / 1e3:.3f} ms")  # fmt: skip
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    for name, times in rows[:25]:
        per = len(times) / args.replays
        print(
            f"  {sum(times) / args.replays:8.1f} µs  {per:5.0f}x  {statistics.median(times):6.2f} µs each  {name[:90]}"
        )


if __name__ == "__main__":
    main()
