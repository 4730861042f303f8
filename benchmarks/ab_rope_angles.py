"""Batch-1 decode tok/s with RoPE's cos and sin computed once a step vs twice a layer.

    .venv/bin/python benchmarks/ab_rope_angles.py                  # SmolLM2, INT4, CPU
    TRITON_INTERPRET=0 python3 benchmarks/ab_rope_angles.py --gpu  # seeded 16-layer llama, bf16

The model's forward shares one step's angles through `RotaryEmbedding.at`; the other
arm replaces `at` with a no-op, so every layer computes them for q and for k again (as
before the thirteenth session). The two arms alternate on one engine, best of
`--repeats` each, so a noisy moment hits both.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import bench
from bench_engine_gpu import LLAMA_1B, make_engine

from gpu_node.config import EngineConfig
from gpu_node.llm_engine import LLMEngine
from gpu_node.models.llama import RotaryEmbedding
from gpu_node.weights import seeded_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    if args.gpu:
        model = seeded_llama(LLAMA_1B, seed=0, device="cuda").to(torch.bfloat16)
        engine = make_engine(model, "cuda", kv_dtype="fp8", num_pages=64)
        label = "seeded 16-layer 2048-wide llama, bf16 weights, fp8 KV, cuda"
    else:
        config = EngineConfig(model="smollm2", kv_dtype="fp32", weights="int4", num_pages=512)
        engine = LLMEngine.from_config(config)
        label = f"SmolLM2 int4 weights, fp32 KV, cpu, {torch.get_num_threads()} threads"
    arms = {
        "once a step": RotaryEmbedding.at,
        "twice a layer": lambda self, positions: contextlib.nullcontext(),
    }
    bench(engine, 1, 16, 4)  # warm-up
    best = dict.fromkeys(arms, 0.0)
    try:
        for _ in range(args.repeats):
            for name, at in arms.items():
                RotaryEmbedding.at = at  # type: ignore[method-assign]
                best[name] = max(best[name], bench(engine, 1, 128, 64)[1])
    finally:
        RotaryEmbedding.at = arms["once a step"]  # type: ignore[method-assign]
    print(label)
    for name, tps in best.items():
        print(f"  angles {name}: {tps:.1f} tok/s")
    print(f"  ratio: {best['once a step'] / best['twice a layer']:.3f}x")


if __name__ == "__main__":
    main()
