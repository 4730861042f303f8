"""Prefill and decode tokens/s of the engine on this machine, batch 1 and batch 8.

    .venv/bin/python benchmarks/bench_engine.py [--kv-dtype fp32] [--decode-tokens 64]

Prefill: one step over the whole prompt(s). Decode: steady-state steps where
every sequence emits one token. Both are measured in the same run, so their
ratio is robust to a noisy machine even when the absolute numbers are not.
"""

from __future__ import annotations

import argparse
import time

import torch

from gpu_node.config import EngineConfig
from gpu_node.llm_engine import LLMEngine
from scheduler.sequence import SamplingParams


def bench(
    engine: LLMEngine, batch: int, prompt_len: int, decode_tokens: int
) -> tuple[float, float]:
    params = SamplingParams(max_tokens=decode_tokens + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"b{batch}-{i}", [(7 * i + j) % 1000 + 100 for j in range(prompt_len)], params
        )
    start = time.perf_counter()
    engine.step()  # the whole prefill fits the token budget: one step
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    decode_s = time.perf_counter() - start
    return batch * prompt_len / prefill_s, batch * steps / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--kv-dtype", default="fp32")
    parser.add_argument("--weights", default="int4,fp32", help="comma-separated, compared")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engines = {
        weights: LLMEngine.from_config(
            EngineConfig(
                model=args.model,
                kv_dtype=args.kv_dtype,
                weights=weights,
                num_pages=512,
                max_num_batched_tokens=8 * args.prompt_len,
            )
        )
        for weights in args.weights.split(",")
    }
    print(
        f"model={args.model} kv={args.kv_dtype} threads={torch.get_num_threads()} "
        f"prompt={args.prompt_len} decode={args.decode_tokens} (best of {args.repeats}, alternated)"
    )
    for engine in engines.values():
        bench(engine, 1, 16, 4)  # warm-up
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(args.repeats):  # alternate formats so a noisy moment hits all of them
        for weights, engine in engines.items():
            for batch in (1, 8):
                prefill, decode = bench(engine, batch, args.prompt_len, args.decode_tokens)
                old = best.get((weights, batch), (0.0, 0.0))
                best[weights, batch] = (max(old[0], prefill), max(old[1], decode))
    print("| weights | batch | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|")
    for (weights, batch), (prefill, decode) in best.items():
        print(f"| {weights} | {batch} | {prefill:.0f} | {decode:.1f} |")
    names = list(engines)
    for other in names[1:]:
        for batch in (1, 8):
            ratio = best[names[0], batch][1] / best[other, batch][1]
            print(f"decode {names[0]}/{other}, batch {batch}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
