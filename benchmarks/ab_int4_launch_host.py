"""Single-stream INT4 decode tok/s on a GPU with the GEMV's per-call host work cached or not.

    TRITON_INTERPRET=0 python3 benchmarks/ab_int4_launch_host.py [--repeats 5] [--group-size 128]

Cached (what ships): `Int4Linear.weight_mma` keeps its Int4WeightMMA wrapper while its
tiles stay, and `w4a16_mma._launch` reuses each shape's launch plan (config, grid,
constexprs: `w4a16_mma_plan.default_plan`). Not cached: a new wrapper (with its checks)
and a new plan every call, as before the thirteenth session. Seeded 16-layer 2048-wide llama (bench_engine_gpu.py's),
bf16 activations, fp8 KV; the arms alternate on one engine, best of `--repeats` each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import bench
from bench_engine_gpu import LLAMA_1B, make_engine

from gpu_node.kernels import w4a16_mma_plan
from gpu_node.quant.int4 import Int4WeightMMA, to_mma
from gpu_node.quant.linear import Int4Linear, quantize_model
from gpu_node.weights import seeded_llama


def _fresh_wrapper(self: Int4Linear) -> Int4WeightMMA:
    if self.layout != "mma":
        return to_mma(self.weight_int4)
    return Int4WeightMMA(self.packed, (self.out_features, self.in_features), self.group_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    model = seeded_llama(LLAMA_1B, seed=0, device="cuda")
    quantize_model(model, group_size=args.group_size)
    engine = make_engine(model.to(torch.bfloat16), "cuda", kv_dtype="fp8", num_pages=64)
    cached = (w4a16_mma_plan.default_plan, Int4Linear.weight_mma)
    uncached = (
        lambda n, k, g, dtype, device, symmetric: w4a16_mma_plan.plan_launch(
            n, k, g, dtype, device, symmetric, None
        ),
        property(_fresh_wrapper),
    )
    arms = {"cached": cached, "not cached": uncached}
    bench(engine, 1, 16, 4)  # warm-up: compiled
    best = dict.fromkeys(arms, 0.0)
    try:
        for _ in range(args.repeats):
            for name, (plan, wrapper) in arms.items():
                w4a16_mma_plan.default_plan = plan  # type: ignore[assignment]
                Int4Linear.weight_mma = wrapper  # type: ignore[method-assign,assignment]
                best[name] = max(best[name], bench(engine, 1, 128, 64)[1])
    finally:
        restored_plan, restored_wrapper = cached
        w4a16_mma_plan.default_plan = restored_plan  # type: ignore[assignment]
        Int4Linear.weight_mma = restored_wrapper  # type: ignore[method-assign,assignment]
    print(f"seeded 16-layer 2048-wide llama, INT4 g{args.group_size}, bf16 activations, fp8 KV")
    for name, tps in best.items():
        print(f"  host work {name}: {tps:.1f} tok/s")
    print(f"  ratio: {best['cached'] / best['not cached']:.3f}x")


if __name__ == "__main__":
    main()
