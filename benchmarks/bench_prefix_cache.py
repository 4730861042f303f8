"""Time to first token with a prompt's shared prefix cached vs cold (prefix caching).

    .venv/bin/python benchmarks/bench_prefix_cache.py [--prefix-tokens 480] [--rounds 5]
    .venv/bin/python benchmarks/bench_prefix_cache.py --smoke    # 32-token preamble (CI)

One engine with the prefix cache on. Each round asks two prompts that share
`--prefix-tokens` tokens (a long system-style preamble) and differ after it. The
first ask of a new preamble is cold; the second, with a different tail, finds the
preamble's pages cached. Each round uses a fresh preamble so its cold ask is cold.
Prints the median time of the step that produces the first token, both ways, and
their ratio, measured side by side. Real SmolLM2 weights (INT4 on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from scheduler.sequence import SamplingParams


def first_token_ms(engine: LLMEngine, request_id: str, ids: list[int]) -> tuple[float, int]:
    engine.add_request(request_id, ids, SamplingParams(max_tokens=1), cache_salt="acct")
    start = time.perf_counter()
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens
    return (time.perf_counter() - start) * 1e3, cached


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix-tokens", type=int, default=480)
    parser.add_argument("--tail-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a 32-token preamble, one round")
    args = parser.parse_args()
    if args.smoke:
        args.prefix_tokens, args.tail_tokens, args.rounds = 32, 8, 1
    config = EngineConfig(
        model="smollm2", num_pages=512, max_num_batched_tokens=2048, prefix_cache_blocks=256
    )
    engine = LLMEngine.from_config(config)
    cold, warm = [], []
    for r in range(args.rounds + 1):  # round 0 warms up
        preamble = [(r * 7919 + j * 31) % 40000 + 100 for j in range(args.prefix_tokens)]
        tail_a = [(j * 13) % 900 + 50 for j in range(args.tail_tokens)]
        tail_b = [(j * 17) % 900 + 60 for j in range(args.tail_tokens)]
        t_cold, c_cold = first_token_ms(engine, f"cold-{r}", preamble + tail_a)
        t_warm, c_warm = first_token_ms(engine, f"warm-{r}", preamble + tail_b)
        assert c_cold == 0 and c_warm == args.prefix_tokens // 16 * 16, (c_cold, c_warm)
        if r:
            cold.append(t_cold)
            warm.append(t_warm)
    cold_ms, warm_ms = statistics.median(cold), statistics.median(warm)
    print(
        f"SmolLM2 int4, cpu {torch.get_num_threads()} threads; prompt {args.prefix_tokens} + "
        f"{args.tail_tokens} tokens, {args.prefix_tokens // 16 * 16} cached"
    )
    print(f"  first token, cold: {cold_ms:.1f} ms   cached prefix: {warm_ms:.1f} ms")
    print(f"  ratio: {cold_ms / warm_ms:.2f}x")


if __name__ == "__main__":
    main()
