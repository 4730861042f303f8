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
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model,
        kv_dtype=args.kv_dtype,
        num_pages=512,
        max_num_batched_tokens=8 * args.prompt_len,
    )
    engine = LLMEngine.from_config(config)
    print(
        f"model={args.model} kv={args.kv_dtype} threads={torch.get_num_threads()} prompt={args.prompt_len}"
    )
    bench(engine, 1, 16, 4)  # warm-up
    for batch in (1, 8):
        runs = [
            bench(engine, batch, args.prompt_len, args.decode_tokens) for _ in range(args.repeats)
        ]
        prefill = max(r[0] for r in runs)
        decode = max(r[1] for r in runs)
        print(
            f"batch {batch}: prefill {prefill:8.1f} tok/s   decode {decode:7.1f} tok/s (best of {args.repeats})"
        )


if __name__ == "__main__":
    main()
