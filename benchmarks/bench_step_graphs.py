"""Steps that prefill, eager against replayed from piecewise CUDA graphs (step_graphs.py),
side by side in one process on a GPU.

    TRITON_INTERPRET=0 python3 benchmarks/bench_step_graphs.py [--models llama-1b]
        [--prompt-tokens 8192] [--budgets 2048,512] [--rounds 3]

A seeded model (bench_engine_gpu.py's shapes, INT4 g128, q/k/v and gate/up fused as a GPU
node serves it, bf16 KV; decode steps from the decode graphs in both variants):

1. Time to the first token of one long prompt, prefilled in chunks of the step budget.
2. Mixed steps: four requests decode while a long prompt (half the first's) is prefilled
   beside them at the smallest budget; the median wall time of those steps, which is the
   time between two of the decoding requests' tokens.

Variants alternate, a warm-up round first (it records each bucket's graphs). Printed:
medians, their ratio, and whether the greedy tokens agree. Imports only torch, triton,
numpy and our code.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_prefill_attention import first_token_s
from bench_engine_gpu import MODEL_SHAPES, make_engine, seeded_model

from gpu_node.models.llama import fuse_projections
from gpu_node.quant.linear import quantize_model
from scheduler.sequence import SamplingParams

VARIANTS = ("eager", "graphs")


def engine_for(model, variant: str, budget: int, pages: int):
    return make_engine(
        model, "cuda", kv_dtype="bf16", num_pages=pages, max_num_batched_tokens=budget,
        cuda_graph_batch=8, cuda_graph_tokens=budget if variant == "graphs" else 0,
    )  # fmt: skip


def alternate(engines, measure, rounds: int):
    """`measure(engine, name=...) -> (value or values, tokens)` of each variant's engine,
    variants alternated, a warm-up round first: per variant, the measured rounds' values
    and the last round's tokens."""
    values: dict[str, list[float]] = {v: [] for v in engines}
    answers = {}
    for r in range(rounds + 1):
        for v, engine in engines.items():
            got, tokens = measure(engine, name=f"{v}-{r}")
            if r:
                values[v].extend(got if isinstance(got, list) else [got])
            answers[v] = tokens
    return values, answers


def mixed_steps_ms(engine, prompt: list[int], name: str) -> tuple[list[float], list[int]]:
    """Wall ms of each step while `prompt` is prefilled beside four decoding requests."""
    for i in range(4):
        engine.add_request(
            f"{name}-d{i}", [100 + i] * 24, SamplingParams(max_tokens=10_000, ignore_eos=True)
        )
    for _ in range(3):
        engine.step()  # the four prompts, then decode steps
    engine.add_request(name, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    walls, tokens = [], []
    while True:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
        tokens.extend(t for out in outs if out.request_id == name for t in out.token_ids)
        if tokens:
            break
    for i in range(4):
        engine.abort(f"{name}-d{i}")
    while engine.has_unfinished():
        engine.step()
    return walls[:-1], tokens  # the last step samples the long prompt's first token


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="llama-1b")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--budgets", default="2048,512")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.models.split(","):
        shape = MODEL_SHAPES[name]
        model = seeded_model(shape, "cuda", torch.bfloat16)
        quantize_model(model, group_size=128, skip=("lm_head", "embed_tokens"))
        fuse_projections(model)
        prompt = [(13 * j) % 5000 + 100 for j in range(args.prompt_tokens)]
        pages = -(-(args.prompt_tokens + 64) // 16) + 64
        print(
            f"{name} (seeded, INT4 g128, fused projections, bf16 KV), prompt {len(prompt)} tokens"
        )
        for budget in budgets:
            engines = {v: engine_for(model, v, budget, pages) for v in VARIANTS}
            times, answers = alternate(
                engines, functools.partial(first_token_s, prompt=prompt), args.rounds
            )
            eager, graphs = (statistics.median(times[v]) * 1e3 for v in VARIANTS)
            print(
                f"  1. budget {budget:5d}: first token eager {eager:7.1f} ms, graphs {graphs:7.1f} "
                f"ms, {eager / graphs:.2f}x; 8 greedy tokens agree: {answers['eager'] == answers['graphs']}; "
                f"buckets {engines['graphs'].runner.step_graphs.captured}"
            )
            del engines
        budget = min(budgets)
        half = prompt[: len(prompt) // 2]
        engines = {v: engine_for(model, v, budget, pages + 64) for v in VARIANTS}
        steps, answers = alternate(
            engines, functools.partial(mixed_steps_ms, prompt=half), args.rounds
        )
        eager, graphs = (statistics.median(steps[v]) for v in VARIANTS)
        print(
            f"  2. budget {budget:5d}, 4 decoding + a {len(half)}-token prompt: mixed step eager "
            f"{eager:6.2f} ms, graphs {graphs:6.2f} ms, {eager / graphs:.2f}x "
            f"({len(steps['eager'])} steps each); first tokens agree: {answers['eager'] == answers['graphs']}"
        )
        del engines, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
