"""The engine: tokens/s on this machine's CPU, GPU decode and prefill steps, fair prefill,
and the real SmolLM2 on a GPU against the CPU.

    .venv/bin/python benchmarks/bench_engine.py [cpu] [--weights int4,fp32]
    TRITON_INTERPRET=0 python3 benchmarks/bench_engine.py gpu [--sections correctness,graphs,8b]
    .venv/bin/python benchmarks/bench_engine.py fair-prefill [--long-tokens 2048]
    TRITON_INTERPRET=0 python3 benchmarks/bench_engine.py fair-prefill --seeded llama-1b --device cuda
    TRITON_INTERPRET=0 python3 benchmarks/bench_engine.py step-graphs [--models llama-1b,llama-8b]
    .venv/bin/python benchmarks/bench_engine.py real-smollm2 --record .exp/smollm2_cpu.npz
    TRITON_INTERPRET=0 python3 benchmarks/bench_engine.py real-smollm2 --compare .exp/smollm2_cpu.npz
    .venv/bin/python benchmarks/bench_engine.py --smoke      # every mode, tiny, CPU (CI)

cpu: prefill (one step over the whole prompts) and steady-state decode tokens/s at batch 1
and 8, weight formats alternated, best of `--repeats`.

gpu (seeded weights at real shapes; the work per step is the real one):
  correctness: greedy tokens through the Triton paths equal the torch references' (fp32 and
  fp8 KV); injected ownership faults caught on the device.
  graphs: decode tok/s replayed from CUDA graphs against eager steps, bf16 and INT4 weights,
  and the graph's replay alone (the GPU's time).
  8b: Llama-3-8B-shaped decode from CUDA graphs: bf16 weights, INT4 computing in bf16, INT4
  computing in fp16 (`--activations fp16`), engines alternated.

fair-prefill: a long prompt starts; a step later short chat requests join. Fair prefill off
(`long_prefill_tokens=0`) against the default, alternated in one process: each request's
time to its first and last token from when it joined. `--seeded SHAPE` runs a seeded model
(INT4 g128) instead of the real SmolLM2, with short prompts of the real run's lengths.

step-graphs: steps that prefill, eager against replayed from piecewise CUDA graphs: time
to the first token of a long prompt, and mixed steps (four decoding requests beside a
prompt's chunks).

real-smollm2: `--record` writes the CPU reference (greedy answers of fp32 and INT4 weights,
fp32 logits at the last prompt positions); `--compare` runs each GPU format against it:
answers, logit differences, decode tok/s at batch 1 and 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpu_node.cache.kv_cache import bytes_per_page
from gpu_node.cache.kv_quant import DTYPE_NAMES
from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.config import ModelConfig
from gpu_node.models.llama import fuse_projections
from gpu_node.models.model_store import resolve_model
from gpu_node.models.weights import moe_model, seeded_llama
from gpu_node.quant.linear import quantize_model
from scheduler.sequence import SamplingParams

# chat prompts of the real-model runs (here and bench_paged_attention.py accuracy)
PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a Python list comprehension is.",
    "What is 17 times 3?",
    "Give me a synonym for 'happy'.",
    "What does HTTP stand for?",
    "Translate 'good morning' into Spanish.",
)
SHORT = ["Hi", "What is 2 + 2?", "Name three colours.", "Count from one to five."]


# -- cpu --------------------------------------------------------------------------------


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


def cpu_mode(args: argparse.Namespace) -> None:
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


# -- gpu: seeded models at real shapes ----------------------------------------------------


class NullTokenizer:
    """The engine needs a tokenizer only to detokenize and stop; a benchmark needs neither."""

    stop_token_ids = frozenset()
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=True):
        return ""


SMOLLM2 = ModelConfig(
    architecture="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
    num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip
LLAMA_1B = ModelConfig(
    architecture="llama", num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32,
    num_kv_heads=8, head_dim=64, vocab_size=32768, max_position_embeddings=40960,
    rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip
LLAMA_8B = ModelConfig(
    architecture="llama", num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
    num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip
TINY = dataclasses.replace(
    LLAMA_1B,
    num_layers=2,
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def decode_step_ms(engine, batch, context, steps, device):
    """Prefill `batch` sequences of `context` tokens, then time `steps` decode steps."""
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{i}", [(i * 31 + j) % 30000 + 1 for j in range(context)], params)
    while (
        any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    engine.step()
    engine.step()
    ms = median_ms(engine.step, device, steps)
    for i in range(batch):
        engine.abort(f"s{i}")
    return ms


def median_ms(fn, device, iters):
    """Median milliseconds of `fn()` between two device syncs."""
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def make_engine(model, device, **overrides):
    config = EngineConfig(**{"model": "bench", "device": device, "page_size": 16, "max_num_seqs": 256,
                             "max_num_batched_tokens": 16384, "cuda_graph_batch": 0,
                             "cuda_graph_tokens": 0, **overrides})  # fmt: skip
    return LLMEngine(config, model, NullTokenizer())


MODEL_SHAPES = {"tiny": TINY, "smollm2": SMOLLM2, "llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B}


def seeded_model(shape, device, dtype):
    """seeded_llama at `shape` in `dtype`; the 8B shape is drawn on the device (its fp32
    build on the host would take minutes)."""
    return seeded_llama(shape, seed=0, device=device, draw_on_device=shape is LLAMA_8B).to(dtype)


def alternated_decode(variants, batch, steps, device):
    """Decode step ms of each variant (name -> (model, EngineConfig overrides)), engines
    alternated twice at context 512, graphs up to batch 8: the best of each, and a line of
    every pass's steps and the graph's replay alone."""
    times = {w: [] for w in variants}
    replays = {w: [] for w in variants}
    for _ in range(2):
        for name, (model, overrides) in variants.items():
            engine = make_engine(model, device, num_pages=batch * 40 + 8, cuda_graph_batch=8,
                                 **overrides)  # fmt: skip
            times[name].append(decode_step_ms(engine, batch, 512, steps, device))
            if engine.runner.graphs is not None and engine.runner.graphs.captured:
                replays[name].append(replay_ms(engine.runner.graphs, device))
            del engine
    detail = (f"    steps ms: { {w: [round(t, 3) for t in v] for w, v in times.items()} }; the graph's "
              f"replay alone (GPU) ms: { {w: round(min(v), 3) for w, v in replays.items() if v} }")  # fmt: skip
    return {w: min(t) for w, t in times.items()}, detail


def check_kernels_match_references(model, device, kv_dtype):
    """Greedy tokens through the Triton paths equal those through the torch references."""
    from gpu_node.cache.kv_cache import KVCache

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = {f"c{i}": [(i * 97 + j) % 30000 + 1 for j in range(20 + 37 * i)] for i in range(6)}
    runs = []
    for use_kernels in (True, False):
        original = KVCache.uses_kernels
        KVCache.uses_kernels = property(
            lambda self, u=use_kernels: u and self.device.type == "cuda"
        )
        try:
            engine = make_engine(model, device, kv_dtype=kv_dtype, num_pages=256)
            runs.append(engine.generate(prompts, params))
        finally:
            KVCache.uses_kernels = original
    same = sum(runs[0][k] == runs[1][k] for k in prompts)
    print(
        f"  {kv_dtype}: kernels vs references, greedy 24 tokens: {same}/{len(prompts)} sequences identical"
    )


def check_fault_detected_on_device(model, device, trials=20):
    import random

    from gpu_node.faults import FaultInjector

    detected = 0
    for trial in range(trials):
        engine = make_engine(model, device, kv_dtype="fp8", num_pages=256)
        for i in range(4):
            engine.add_request(
                f"f{i}",
                [(i * 7 + j) % 3000 + 1 for j in range(40 + 9 * i)],
                SamplingParams(max_tokens=12, ignore_eos=True),
            )
        for _ in range(3):
            engine.step()
        rng = random.Random(trial)
        victim, other = rng.sample([s.request_id for s in engine.scheduler.running], 2)
        injector = FaultInjector(engine, rng)
        if trial % 3 == 0:
            injector.point_at_foreign_page(victim, other)
        elif trial % 3 == 1:
            injector.free_page_under(victim)
        else:
            injector.hand_page_twice(victim, other)
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.finish_reason
        detected += finals[victim] == "error" and all(
            r == "length" for k, r in finals.items() if k != victim
        )
    print(f"  injected faults detected on {device}: {detected}/{trials}, others unaffected")


def replay_ms(graphs, device, iters=50):
    """Median ms of replaying the last-captured decode graph alone (no host step around
    it): what the GPU takes, against the whole step's time."""
    return median_ms(graphs.replay_last, device, iters)


def graph_vs_eager(tiny, device, dtype, kv16, steps, names):
    """tok/s of the same decode steps with and without CUDA graphs, alternated twice."""
    models = {
        "smollm2": lambda: seeded_llama(TINY if tiny else SMOLLM2, seed=0, device=device),
        "llama-1b": lambda: seeded_llama(TINY if tiny else LLAMA_1B, seed=0, device=device),
        "moe-medium": lambda: moe_model("moe-small" if tiny else "moe-medium", device=device),
    }
    for label, build in models.items():
        if label not in names:
            continue
        context, batches, rounds = (64, (2,), 1) if tiny else (512, (1, 8, 32), 2)
        for weights in ("bf16", "int4 g32") if tiny else ("bf16", "int4 g32", "int4 g128"):
            model = build().to(dtype)
            if weights != "bf16":
                group = 32 if tiny else int(weights[len("int4 g") :])
                quantize_model(model, group_size=group, skip=("lm_head", "embed_tokens", "router"))
            fuse_projections(model)  # as a GPU node serves it (gpu_node/models/weights.py)
            for batch in batches:
                times = {0: [], 32: []}
                replays = []
                for _ in range(rounds):
                    for graphs in (0, 32):
                        engine = make_engine(model, device, kv_dtype=kv16, num_pages=batch * 40 + 8,
                                             cuda_graph_batch=graphs)  # fmt: skip
                        times[graphs].append(decode_step_ms(engine, batch, context, steps, device))
                        if engine.runner.graphs is not None and engine.runner.graphs.captured:
                            replays.append(replay_ms(engine.runner.graphs, device))
                        del engine
                eager, graph = min(times[0]), min(times[32])
                gpu = f"  replay alone {min(replays):.3f} ms of {graph:.3f}" if replays else ""
                print(f"  {label:10s} {weights:9s} batch {batch:2d}: eager {batch * 1e3 / eager:8.1f} tok/s"
                      f"  graphs {batch * 1e3 / graph:8.1f} tok/s  {eager / graph:5.2f}x{gpu}")  # fmt: skip
            del model
            if device == "cuda":
                torch.cuda.empty_cache()


def fp16_activations_8b(tiny, device, steps):
    """tok/s of graph-replayed decode steps of one seeded model: bf16 weights, and INT4
    (groups of 128, the same codes) computing in bf16 and in fp16 (EngineConfig.activations;
    the KV cache in the activations' dtype), engines alternated twice (best of each),
    context 512."""
    if tiny:
        print("  fp16 activations take the GPU's tensor-core kernels: skipped on the CPU")
        return
    variants = {}
    for name, dtype, activations in (("bf16", torch.bfloat16, "auto"),
                                     ("int4 bf16", torch.bfloat16, "bf16"),
                                     ("int4 fp16", torch.float16, "fp16")):  # fmt: skip
        model = seeded_llama(LLAMA_8B, seed=0, device=device, draw_on_device=True)
        if name != "bf16":
            quantize_model(model, group_size=128, skip=("lm_head", "embed_tokens"))
        overrides = {"kv_dtype": DTYPE_NAMES[dtype], "activations": activations}
        variants[name] = (fuse_projections(model.to(dtype)), overrides)
    for batch in (1, 8):
        best, detail = alternated_decode(variants, batch, steps, device)
        print(f"  batch {batch}: " + "  ".join(f"{w} {batch * 1e3 / ms:7.1f} tok/s" for w, ms in best.items())
              + f"  int4 bf16/bf16 {best['bf16'] / best['int4 bf16']:.2f}x  int4 fp16/bf16 "
              f"{best['bf16'] / best['int4 fp16']:.2f}x  fp16/bf16 activations "
              f"{best['int4 bf16'] / best['int4 fp16']:.3f}x", flush=True)  # fmt: skip
        print(detail, flush=True)
    del variants
    torch.cuda.empty_cache()


def gpu_mode(args: argparse.Namespace) -> None:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}")
    sections = args.sections.split(",")
    steps = 4 if args.tiny else 20
    kv16 = "fp32" if args.tiny else "bf16"
    if "correctness" in sections:
        print("\ncorrectness on this device")
        small = seeded_llama(TINY, seed=3, device=device)
        for kv in ("fp32", "fp8"):
            check_kernels_match_references(small, device, kv)
        check_fault_detected_on_device(small, device, trials=3 if args.tiny else 20)
        gib = 1 << 30
        for kv in ("bf16", "fp8"):
            per_page = bytes_per_page(kv, LLAMA_1B.num_layers, 16, LLAMA_1B.num_kv_heads,
                                      LLAMA_1B.head_dim)  # fmt: skip
            print(f"  KV tokens per GiB at the llama-1b shape, {kv}: {gib // per_page * 16}")
    if "graphs" in sections:
        print("\ndecode tok/s, CUDA graphs vs eager steps (median of steps)")
        graph_vs_eager(args.tiny, device, dtype, kv16, steps, args.models.split(","))
    if "8b" in sections:
        print("\nLlama-3-8B-shaped decode with CUDA graphs: bf16 weights, INT4 from bf16 and fp16",
              flush=True)  # fmt: skip
        fp16_activations_8b(args.tiny, device, steps)


# -- steps that prefill: fair prefill, step graphs ------------------------------------------


def first_token_s(engine, prompt: list[int], name: str) -> tuple[float, list[int]]:
    """Seconds to the first of 8 greedy tokens after `prompt`, and the 8 tokens."""
    device = engine.config.device
    engine.add_request(name, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    sync(device)
    start = time.perf_counter()
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
            if first is None and out.token_ids:
                first = time.perf_counter() - start
    assert first is not None
    return first, tokens


def fair_run(engine: LLMEngine, long_ids: list[int], shorts: list[list[int]], max_tokens: int):
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


def fair_prefill_mode(args: argparse.Namespace) -> None:
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
        label = args.model
    else:
        shape = MODEL_SHAPES[args.seeded]
        model = seeded_model(shape, args.device, torch.bfloat16)
        if args.weights == "int4":
            quantize_model(model, group_size=128, skip=("lm_head", "embed_tokens"))
        model = model.to(args.device)
        label = f"{args.seeded} (seeded, {args.weights})"
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
            runs[name].append(fair_run(eng, long_ids, shorts, args.max_tokens))

    def median(policy: str, kind: str, index: int) -> float:
        values = [t[index] for r in runs[policy] for req, t in r.items() if req.startswith(kind)]
        return statistics.median(values)

    print(
        f"model {label}, long prompt {args.long_tokens} tokens, {args.shorts} short "
        f"requests ({', '.join(str(len(s)) for s in shorts)} tokens) joining a step "
        f"later, {args.max_tokens} tokens each, budget {args.budget}, {args.repeats} repeats "
        f"(torch threads {torch.get_num_threads()})"
    )
    print(f"{'':24}{'off':>10}{'fair':>10}{'off/fair':>10}")
    for row, kind, index in [
        ("short: first token s", "short", 0),
        ("short: last token s", "short", 1),
        ("long: first token s", "long", 0),
        ("long: last token s", "long", 1),
    ]:
        off, on = median("off", kind, index), median("fair", kind, index)
        print(f"{row:24}{off:10.2f}{on:10.2f}{off / on:10.2f}")


VARIANTS = ("eager", "graphs")


def engine_for(model, device: str, variant: str, budget: int, pages: int):
    return make_engine(
        model, device, kv_dtype="bf16" if device == "cuda" else "fp32", num_pages=pages, max_num_batched_tokens=budget,
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
    device = engine.config.device
    """Wall ms of each step while `prompt` is prefilled beside four decoding requests."""
    # enough tokens to decode through the whole prefill (aborted after it)
    decode_tokens = 2 * -(-len(prompt) // engine.config.max_num_batched_tokens) + 16
    for i in range(4):
        engine.add_request(
            f"{name}-d{i}",
            [100 + i] * 24,
            SamplingParams(max_tokens=decode_tokens, ignore_eos=True),
        )
    for _ in range(3):
        engine.step()  # the four prompts, then decode steps
    engine.add_request(name, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    walls, tokens = [], []
    while True:
        sync(device)
        start = time.perf_counter()
        outs = engine.step()
        sync(device)
        walls.append((time.perf_counter() - start) * 1e3)
        tokens.extend(t for out in outs if out.request_id == name for t in out.token_ids)
        if tokens:
            break
    for i in range(4):
        engine.abort(f"{name}-d{i}")
    while engine.has_unfinished():
        engine.step()
    return walls[:-1], tokens  # the last step samples the long prompt's first token


def step_graphs_mode(args: argparse.Namespace) -> None:
    import functools

    device = args.device
    budgets = [int(b) for b in args.budgets.split(",")]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}")
    for model_name in args.models.split(","):
        shape = MODEL_SHAPES[model_name]
        model = seeded_model(shape, device, torch.bfloat16 if device == "cuda" else torch.float32)
        quantize_model(model, group_size=128 if device == "cuda" else 32,
                       skip=("lm_head", "embed_tokens"))  # fmt: skip
        fuse_projections(model)
        prompt = [(13 * j) % 5000 + 100 for j in range(args.prompt_tokens)]
        pages = -(-(args.prompt_tokens + 64) // 16) + 64
        print(f"{model_name} (seeded, INT4, fused projections), prompt {len(prompt)} tokens")
        for budget in budgets:
            engines = {v: engine_for(model, device, v, budget, pages) for v in VARIANTS}
            times, answers = alternate(
                engines, functools.partial(first_token_s, prompt=prompt), args.rounds
            )
            eager, graphs = (statistics.median(times[v]) * 1e3 for v in VARIANTS)
            print(
                f"  budget {budget:5d}: first token eager {eager:7.1f} ms, graphs {graphs:7.1f} "
                f"ms, {eager / graphs:.2f}x; 8 greedy tokens agree: "
                f"{answers['eager'] == answers['graphs']}"
            )
            del engines
        budget = min(budgets)
        half = prompt[: len(prompt) // 2]
        engines = {v: engine_for(model, device, v, budget, pages + 64) for v in VARIANTS}
        steps, answers = alternate(
            engines, functools.partial(mixed_steps_ms, prompt=half), args.rounds
        )
        eager, graphs = (statistics.median(steps[v]) for v in VARIANTS)
        print(
            f"  budget {budget:5d}, 4 decoding + a {len(half)}-token prompt: mixed step eager "
            f"{eager:6.2f} ms, graphs {graphs:6.2f} ms, {eager / graphs:.2f}x "
            f"({len(steps['eager'])} steps each); first tokens agree: "
            f"{answers['eager'] == answers['graphs']}"
        )
        del engines, model
        if device == "cuda":
            torch.cuda.empty_cache()


# -- the real SmolLM2 on a GPU against the CPU ----------------------------------------------

LOGIT_POSITIONS = 8  # the last this many prompt positions of each prompt

# (weights, kv dtype, activations) as a GPU node can be started with them
GPU_FORMATS = (
    ("int4", "bf16", "auto"),
    ("int4", "fp8", "auto"),
    ("int4", "fp16", "fp16"),
    ("bf16", "bf16", "auto"),
    ("fp32", "fp32", "auto"),
)


@dataclasses.dataclass(frozen=True)
class RealRun:
    """What a real-smollm2 run asks: the prompts, answer length, decode steps timed; and
    engines already built, by (weights, kv dtype, activations, device), reused across calls."""

    prompts: tuple[str, ...] = PROMPTS
    new_tokens: int = 32
    decode_tokens: int = 128
    engines: dict = dataclasses.field(default_factory=dict)

    def engine(self, weights: str, kv_dtype: str, activations: str, device: str) -> LLMEngine:
        key = (weights, kv_dtype, activations, device)
        if key not in self.engines:
            config = EngineConfig(
                model=resolve_model("smollm2").as_posix(), weights=weights, kv_dtype=kv_dtype,
                activations=activations, device=device, num_pages=512, max_num_seqs=16,
            )  # fmt: skip
            self.engines[key] = LLMEngine.from_config(config)
        return self.engines[key]


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def greedy_answers(engine: LLMEngine, run: RealRun) -> list[list[int]]:
    prompts = {str(i): chat_ids(engine, p) for i, p in enumerate(run.prompts)}
    out = engine.generate(prompts, SamplingParams(max_tokens=run.new_tokens))
    return [out[str(i)] for i in range(len(run.prompts))]


def last_logits(engine: LLMEngine, run: RealRun) -> np.ndarray:
    """fp32 [prompts, LOGIT_POSITIONS, vocab]: the model's logits at each prompt's end."""
    from gpu_node.engine.attention import PagedAttention
    from scheduler.scheduler import ScheduledChunk
    from scheduler.sequence import Sequence

    rows = []
    for i, text in enumerate(run.prompts):
        ids = chat_ids(engine, text)
        seq = Sequence(seq_id=10_000 + i, request_id=f"l{i}", prompt_token_ids=ids,
                       params=SamplingParams())  # fmt: skip
        engine.block_manager.allocate(seq, len(ids))
        input_ids, positions, metadata = engine.runner.prepare([ScheduledChunk(seq, len(ids))])
        with torch.inference_mode():
            logits = engine.model(
                input_ids, positions, PagedAttention(engine.kv_cache, metadata, engine.runner.scale)
            )
        engine.block_manager.free(seq)
        rows.append(logits[-LOGIT_POSITIONS:].float().cpu().numpy())
    return np.stack(rows)


def decode_tok_s(engine: LLMEngine, batch: int, device: str, run: RealRun) -> float:
    """Output tokens a second over `run.decode_tokens` decode steps of `batch` sequences
    (prefill excluded: the clock starts after every sequence has its first token)."""
    params = SamplingParams(max_tokens=run.decode_tokens + 1, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{b}", chat_ids(engine, run.prompts[b % len(run.prompts)]), params)
    while (
        any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    sync(device)
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    sync(device)
    return produced / (time.perf_counter() - start)


def record(path: str, run: RealRun) -> None:
    fp32 = run.engine("fp32", "fp32", "auto", "cpu")
    int4 = run.engine("int4", "fp32", "auto", "cpu")
    answers_fp32, answers_int4 = greedy_answers(fp32, run), greedy_answers(int4, run)
    pad = run.new_tokens
    np.savez_compressed(
        path,
        answers_fp32=np.array([a + [-1] * (pad - len(a)) for a in answers_fp32]),
        answers_int4=np.array([a + [-1] * (pad - len(a)) for a in answers_int4]),
        logits_fp32=last_logits(fp32, run),
    )
    print(f"CPU fp32: {fp32.tokenizer.decode(answers_fp32[0])!r}")
    print(f"CPU int4: {int4.tokenizer.decode(answers_int4[0])!r}")
    same = sum(a == b for a, b in zip(answers_fp32, answers_int4, strict=True))
    print(f"CPU int4 greedy answers equal to fp32's: {same}/{len(run.prompts)}; wrote {path}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(path: str, device: str, formats: list[tuple[str, str, str]], run: RealRun) -> None:
    ref = np.load(path)
    cpu = [[t for t in row if t >= 0] for row in ref["answers_fp32"].tolist()]
    cpu_int4 = [[t for t in row if t >= 0] for row in ref["answers_int4"].tolist()]
    logits_ref = ref["logits_fp32"]
    engines = {}
    for weights, kv, act in formats:
        label = f"{weights} weights, {kv} KV, activations {act}"
        engine = run.engine(weights, kv, act, device)
        engines[label] = engine
        answers = greedy_answers(engine, run)
        logits = last_logits(engine, run)
        diffs = [first_difference(a, b) for a, b in zip(answers, cpu, strict=True)]
        same = sum(d is None for d in diffs)
        same_int4 = sum(a == b for a, b in zip(answers, cpu_int4, strict=True))
        argmax = (logits.argmax(-1) == logits_ref.argmax(-1)).mean()
        print(f"\n{label}")
        print(f"  answer: {engine.tokenizer.decode(answers[0])!r}")
        print(f"  greedy answers equal to the CPU fp32 model's: {same}/{len(run.prompts)} "
              f"(first differences at tokens {[d for d in diffs if d is not None]}); "
              f"to the CPU int4 kernel's: {same_int4}/{len(run.prompts)}")  # fmt: skip
        print(f"  logits, last {LOGIT_POSITIONS} prompt positions: max |diff| "
              f"{np.abs(logits - logits_ref).max():.3f} (logits up to "
              f"{np.abs(logits_ref).max():.1f}), argmax agrees at {argmax:.1%}", flush=True)  # fmt: skip
    print(
        f"\ndecode tok/s (CUDA graphs on a GPU; {run.decode_tokens} steps after the first "
        "token; best of 2 alternated)"
    )
    for batch in (1, 8):
        best: dict[str, float] = {}
        for _ in range(2):
            for label, engine in engines.items():
                tps = decode_tok_s(engine, batch, device, run)
                best[label] = max(best.get(label, 0.0), tps)
        for label, tps in best.items():
            print(f"  batch {batch}: {label:42s} {tps:8.1f} tok/s", flush=True)


def real_smollm2_mode(args: argparse.Namespace) -> None:
    run = RealRun(decode_tokens=args.decode_tokens)
    if args.record:
        record(args.record, run)
    if args.compare:
        formats = (
            list(GPU_FORMATS)
            if args.formats == "all"
            else [tuple(f.split(":")) for f in args.formats.split(",")]
        )
        compare(args.compare, args.device, formats, run)  # type: ignore[arg-type]


# -- main -----------------------------------------------------------------------------------


def smoke() -> None:
    """Every mode's code on the CPU at tiny sizes: seconds, for CI."""
    parse = build_parser().parse_args
    print("== cpu")
    cpu_mode(parse(["cpu", "--weights", "int4", "--prompt-len", "16", "--decode-tokens", "2",
                    "--repeats", "1"]))  # fmt: skip
    print("== gpu (tiny, on the CPU)")
    gpu_mode(parse(["gpu", "--tiny", "--sections", "correctness,graphs,8b", "--models",
                    "llama-1b"]))  # fmt: skip
    print("== fair-prefill (seeded tiny)")
    fair_prefill_mode(parse(["fair-prefill", "--seeded", "tiny", "--weights", "bf16",
                             "--long-tokens", "80", "--budget", "32", "--max-tokens", "2",
                             "--shorts", "2", "--repeats", "1"]))  # fmt: skip
    print("== step-graphs (seeded tiny)")
    step_graphs_mode(parse(["step-graphs", "--device", "cpu", "--models", "tiny",
                            "--prompt-tokens", "64", "--budgets", "32", "--rounds", "1"]))  # fmt: skip
    print("== real-smollm2 (one prompt, CPU)")
    run = RealRun(prompts=PROMPTS[:1], new_tokens=4, decode_tokens=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "smollm2_cpu.npz")
        record(path, run)
        compare(path, "cpu", [("int4", "fp32", "auto")], run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="every mode, tiny, CPU (CI)")
    modes = parser.add_subparsers(dest="mode")
    cpu = modes.add_parser("cpu", help="tokens/s on this machine's CPU")
    cpu.add_argument("--model", default="smollm2")
    cpu.add_argument("--kv-dtype", default="fp32")
    cpu.add_argument("--weights", default="int4,fp32", help="comma-separated, compared")
    cpu.add_argument("--prompt-len", type=int, default=128)
    cpu.add_argument("--decode-tokens", type=int, default=64)
    cpu.add_argument("--repeats", type=int, default=3)
    gpu = modes.add_parser("gpu", help="decode on a GPU, seeded weights at real shapes")
    gpu.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    gpu.add_argument("--sections", default="correctness,graphs,8b")
    gpu.add_argument("--models", default="smollm2,llama-1b,moe-medium", help="graphs' models")
    fair = modes.add_parser("fair-prefill", help="short requests behind a long prompt")
    fair.add_argument("--model", default="smollm2")
    fair.add_argument("--long-tokens", type=int, default=2048)
    fair.add_argument("--shorts", type=int, default=4)
    fair.add_argument("--max-tokens", type=int, default=16)
    fair.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    fair.add_argument("--repeats", type=int, default=3)
    fair.add_argument("--seeded", choices=tuple(MODEL_SHAPES), help="a seeded model shape")
    fair.add_argument("--weights", choices=("int4", "bf16"), default="int4")
    fair.add_argument("--device", default="cpu")
    graphs = modes.add_parser("step-graphs", help="steps that prefill, eager vs graphs")
    graphs.add_argument("--models", default="llama-1b")
    graphs.add_argument("--prompt-tokens", type=int, default=8192)
    graphs.add_argument("--budgets", default="2048,512")
    graphs.add_argument("--rounds", type=int, default=3)
    graphs.add_argument("--device", default="cuda")
    real = modes.add_parser("real-smollm2", help="the real SmolLM2 on a GPU against the CPU")
    real.add_argument("--record", help="write the CPU reference here (.npz)")
    real.add_argument("--compare", help="compare a GPU run with this CPU reference")
    real.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    real.add_argument("--formats", default="all",
                      help="weights:kv:activations,... (default: the five GPU formats)")  # fmt: skip
    real.add_argument("--decode-tokens", type=int, default=128)
    return parser


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if args.mode in (None, "cpu"):
        return cpu_mode(parser.parse_args(["cpu"]) if args.mode is None else args)
    if args.mode == "real-smollm2" and not (args.record or args.compare):
        parser.error("real-smollm2: give --record or --compare")
    {"gpu": gpu_mode, "fair-prefill": fair_prefill_mode, "step-graphs": step_graphs_mode,
     "real-smollm2": real_smollm2_mode}[args.mode](args)  # fmt: skip


if __name__ == "__main__":
    main()
