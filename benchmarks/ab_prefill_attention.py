"""Prefill on a GPU with each chunk's attention through SDPA's fused kernels (`attend_fused`,
what the engine runs) against the materialised-mask reference (`attend_ref`), side by side.

    TRITON_INTERPRET=0 python3 benchmarks/ab_prefill_attention.py [--model llama-1b]
        [--prompt-tokens 8192] [--budgets 2048,512] [--rounds 3]

A seeded model (bench_engine_gpu.py's shapes, INT4 g128, bf16 KV) prefills one prompt in
chunks of the step budget, then decodes 8 tokens; the variants alternate in one process.
Printed: median time to the first token per variant and budget, their ratio, and whether
the 8 greedy tokens agree. Imports only torch, triton, numpy and our code.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine_gpu import MODEL_SHAPES, make_engine, seeded_model

import gpu_node.attention as attention
from gpu_node.quant.linear import quantize_model
from scheduler.sequence import SamplingParams

VARIANTS = {"fused": attention.attend_fused, "reference": attention.attend_ref}


def first_token_s(engine, prompt: list[int], name: str) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request(name, prompt, params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
            if first is None and out.token_ids:
                first = time.perf_counter() - start
    assert first is not None
    return first, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=tuple(MODEL_SHAPES), default="llama-1b")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--budgets", default="2048,512")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = seeded_model(MODEL_SHAPES[args.model], "cuda", torch.bfloat16)
    quantize_model(model, group_size=128, skip=("lm_head", "embed_tokens"))
    prompt = [(13 * j) % 5000 + 100 for j in range(args.prompt_tokens)]
    pages = -(-(args.prompt_tokens + 64) // 16)
    print(f"{args.model} (seeded, INT4 g128, bf16 KV), prompt {args.prompt_tokens} tokens")
    for budget in (int(b) for b in args.budgets.split(",")):
        engine = make_engine(
            model, "cuda", kv_dtype="bf16", num_pages=pages, max_num_batched_tokens=budget
        )
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        answers: dict[str, list[int]] = {}
        for r in range(args.rounds + 1):  # the first round warms up
            for name, attend in VARIANTS.items():
                attention.attend_fused = attend  # what PagedAttention calls on a GPU
                seconds, tokens = first_token_s(engine, prompt, f"{name}-{budget}-{r}")
                if r:
                    times[name].append(seconds)
                answers[name] = tokens
        attention.attend_fused = VARIANTS["fused"]
        fused, ref = (statistics.median(times[v]) for v in ("fused", "reference"))
        print(
            f"  budget {budget:5d}: first token fused {fused * 1e3:7.1f} ms, reference "
            f"{ref * 1e3:7.1f} ms, {ref / fused:.2f}x; 8 greedy tokens agree: "
            f"{answers['fused'] == answers['reference']}"
        )


if __name__ == "__main__":
    main()
