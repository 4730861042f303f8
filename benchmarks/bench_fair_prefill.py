"""How long short requests wait behind a long prompt, with fair prefill on and off.

    .venv/bin/python benchmarks/bench_fair_prefill.py [--long-tokens 2048] [--shorts 4]
    TRITON_INTERPRET=0 python3 benchmarks/bench_fair_prefill.py --seeded llama-1b --device cuda

One long prompt starts; a step later, short chat requests join. With fair prefill
off (`long_prefill_tokens=0`) prefills run in arrival order, so the short ones wait
for the whole long prefill. With it on (the default), the short ones are admitted
past it. Both engines share one model and alternate runs in the same process, so the
ratios hold on a noisy machine. Printed: each request's time to first token and to
its last token, seconds from when it joined, medians over the repeats.

`--seeded SHAPE` runs bench_engine_gpu.py's seeded model of that shape instead of the
real SmolLM2 (on a GPU, where SmolLM2's file is not), INT4 g128 unless `--weights bf16`,
with short prompts of the real run's lengths. Imports only torch, triton, numpy and ours.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from gpu_node.config import EngineConfig
from gpu_node.llm_engine import LLMEngine
from scheduler.sequence import SamplingParams

SHORT = ["Hi", "What is 2 + 2?", "Name three colours.", "Count from one to five."]


def run(engine: LLMEngine, long_ids: list[int], shorts: list[list[int]], max_tokens: int):
    """(ttft, total) in seconds per request, from the moment each joined."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    joined = {"long": time.perf_counter()}
    engine.add_request("long", long_ids, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    step = 0
    while engine.has_unfinished() or step < 2:
        if step == 1:
            for i, ids in enumerate(shorts):
                joined[f"short{i}"] = time.perf_counter()
                engine.add_request(f"short{i}", ids, params)
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                last[out.request_id] = now
        step += 1
    return {r: (first[r] - joined[r], last[r] - joined[r]) for r in joined}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--shorts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeded", default=None, help="a bench_engine_gpu.py model shape")
    parser.add_argument("--weights", choices=("int4", "bf16"), default="int4")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    pages = -(-(args.long_tokens + 64 * (args.shorts + 1)) // 16) * 2
    if args.seeded is None:

        def engine(long_prefill_tokens: int | None) -> LLMEngine:
            config = EngineConfig(
                model=args.model,
                device=args.device,
                num_pages=pages,
                max_model_len=args.long_tokens + 256,
                max_num_batched_tokens=args.budget,
                long_prefill_tokens=long_prefill_tokens,
            )
            return LLMEngine.from_config(config)

        policies = {"off": engine(0), "fair": engine(None)}
        tok = policies["off"].tokenizer
        shorts = [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": SHORT[i % len(SHORT)]}])
            )
            for i in range(args.shorts)
        ]
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_engine_gpu import MODEL_SHAPES, make_engine, seeded_model

        from gpu_node.quant.linear import quantize_model

        shape = MODEL_SHAPES[args.seeded]
        model = seeded_model(shape, args.device, torch.bfloat16)
        if args.weights == "int4":
            quantize_model(model, group_size=128, skip=("lm_head", "embed_tokens"))
        model = model.to(args.device)
        args.model = f"{args.seeded} (seeded, {args.weights})"
        policies = {
            name: make_engine(
                model,
                args.device,
                kv_dtype="bf16",
                num_pages=pages,
                max_num_batched_tokens=args.budget,
                long_prefill_tokens=lpt,
                cuda_graph_batch=8,
                cuda_graph_tokens=args.budget,  # steps that prefill from step graphs, as served
            )
            for name, lpt in (("off", 0), ("fair", None))
        }
        shorts = [
            [(5 * i + j) % 3000 + 50 for j in range((31, 38, 34, 36)[i % 4])]
            for i in range(args.shorts)
        ]
    long_ids = [(13 * j) % 5000 + 100 for j in range(args.long_tokens)]
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {p: [] for p in policies}
    for _ in range(args.repeats):
        for name, eng in policies.items():
            runs[name].append(run(eng, long_ids, shorts, args.max_tokens))

    def median(policy: str, kind: str, index: int) -> float:
        values = [t[index] for r in runs[policy] for req, t in r.items() if req.startswith(kind)]
        return statistics.median(values)

    print(
        f"model {args.model}, long prompt {args.long_tokens} tokens, {args.shorts} short "
        f"requests ({', '.join(str(len(s)) for s in shorts)} tokens) joining a step "
        f"later, {args.max_tokens} tokens each, budget {args.budget}, {args.repeats} repeats "
        f"(torch threads {torch.get_num_threads()})"
    )
    print(f"{'':24}{'off':>10}{'fair':>10}{'off/fair':>10}")
    for label, kind, index in [
        ("short: first token s", "short", 0),
        ("short: last token s", "short", 1),
        ("long: first token s", "long", 0),
        ("long: last token s", "long", 1),
    ]:
        off, on = median("off", kind, index), median("fair", kind, index)
        print(f"{label:24}{off:10.2f}{on:10.2f}{off / on:10.2f}")


if __name__ == "__main__":
    main()
