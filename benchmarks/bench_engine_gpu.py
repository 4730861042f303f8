"""Engine-level GPU figures, side by side in one run (seeded weights at real shapes).

    python benchmarks/bench_engine_gpu.py            # on a CUDA machine
    python benchmarks/bench_engine_gpu.py --tiny     # smoke run on CPU

1. Decode step time with fp8 vs bf16 KV pages (batch x context), and KV tokens per GiB.
2. Integrity checks on vs off: decode step time, same engine shape, alternated runs.
3. Single-stream decode tok/s with INT4 vs bf16 weights (dense llama shape, and MoE).
4. Decode steps replayed from CUDA graphs vs launched eagerly: tok/s at batch 1, 8 and
   32, bf16 and INT4 weights, SmolLM2's shape, the dense llama shape and moe-medium
   (`--models` picks among them).
5. INT4 decode tok/s with CUDA graphs, the tuning table's launches (w4a16_mma_tuned.json)
   against the heuristic's, alternated twice: SmolLM2's shape and the dense llama shape
   (`--models`), groups of 32 and 128, batch 1 and 8.
6. Single-stream (and batch 8) decode tok/s of a Llama-3-8B-shaped model (32 layers, 4096
   wide, vocab 128256), CUDA graphs, bf16 against INT4 groups of 128, asymmetric and
   symmetric, engines alternated twice: the dense counterpart of "INT4 raised
   single-request decode from 60 to 92 tok/s". Also the bytes a decode step reads, the
   graph's replay alone, and INT4 with the small kernels' early release off.
7. The same Llama-3-8B-shaped decode, INT4 computing in fp16 (`--activations fp16`: the
   W4A16 kernels' 5-instruction dequantization) against bf16, beside bf16 weights.

Sections 1-3 run eager steps (`cuda_graph_batch=0`, `cuda_graph_tokens=0`), as in the
sessions before graphs.

Weights are seeded (the real GGUF is not on the GPU machine); the work per step
is the same as with real weights. Imports only torch, triton, numpy and our code.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from gpu_node.config import EngineConfig
from gpu_node.kernels import launch, w4a16_mma_plan
from gpu_node.kv_cache import bytes_per_page
from gpu_node.kv_quant import DTYPE_NAMES
from gpu_node.llm_engine import LLMEngine
from gpu_node.models.config import ModelConfig
from gpu_node.models.llama import fuse_projections
from gpu_node.quant.linear import model_bytes, quantize_model
from gpu_node.weights import moe_model, seeded_llama
from scheduler.sequence import SamplingParams


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


def check_kernels_match_references(model, device, kv_dtype):
    """Greedy tokens through the Triton paths equal those through the torch references."""
    from gpu_node.kv_cache import KVCache

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


def check_fault_detected_on_device(model, device):
    import random

    from gpu_node.faults import FaultInjector

    detected = 0
    for trial in range(20):
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
    print(f"  injected faults detected on {device}: {detected}/20, others unaffected")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sections", default="01234", help="which sections to run, e.g. 2")
    parser.add_argument(
        "--models",
        default="smollm2,llama-1b,moe-medium",
        help="section 4's models, e.g. moe-medium",
    )
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = TINY if args.tiny else LLAMA_1B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"device: {name}  torch {torch.__version__}  model shape: {shape.num_layers} layers x {shape.hidden_size}"
    )
    model = seeded_llama(shape, seed=0, device=device).to(dtype)

    sections = args.sections
    steps = 4 if args.tiny else 20
    kv16 = "fp32" if args.tiny else "bf16"
    if "0" in sections:
        print("\n0. correctness on this device")
        small = seeded_llama(TINY, seed=3, device=device)
        for kv in ("fp32", "fp8"):
            check_kernels_match_references(small, device, kv)
        check_fault_detected_on_device(small, device)
    if "1" in sections:
        print("\n1. decode step, fp8 vs bf16 KV pages (median ms/step)")
        grid = (
            [(1, 256), (8, 256)] if args.tiny else [(1, 4096), (16, 4096), (64, 2048), (32, 8192)]
        )
        for batch, context in grid:
            pages = batch * (context // 16 + 4) + 8
            row = {}
            for kv in (kv16, "fp8"):
                engine = make_engine(model, device, kv_dtype=kv, num_pages=pages)
                row[kv] = decode_step_ms(engine, batch, context, steps, device)
                del engine
                if device == "cuda":
                    torch.cuda.empty_cache()
            print(f"  batch {batch:3d} ctx {context:5d}: {kv16} {row[kv16]:7.2f}  fp8 {row['fp8']:7.2f}  "
                  f"{kv16}/fp8 {row[kv16] / row['fp8']:.2f}x")  # fmt: skip
        gib = 1 << 30
        for kv in ("bf16", "fp8"):
            per_page = bytes_per_page(kv, shape.num_layers, 16, shape.num_kv_heads, shape.head_dim)
            print(f"  KV tokens per GiB, {kv}: {gib // per_page * 16}")
    if "2" in sections:
        print("\n2. integrity checks on vs off (median ms/step, alternated 3 times)")
        batch, context = (8, 256) if args.tiny else (32, 4096)
        pages = batch * (context // 16 + 4) + 8
        results = {True: [], False: []}
        for _ in range(3):
            for check in (True, False):
                engine = make_engine(
                    model, device, kv_dtype="fp8", num_pages=pages, check_integrity=check
                )
                results[check].append(decode_step_ms(engine, batch, context, steps, device))
                del engine
        on, off = statistics.median(results[True]), statistics.median(results[False])
        print(
            f"  batch {batch} ctx {context} fp8: on {on:.3f} ms  off {off:.3f} ms  cost {100 * (on - off) / off:+.2f}%"
        )
    if "3" in sections:
        print("\n3. single-stream decode tok/s, INT4 vs bf16 weights")
        for label, build in (
            ("dense", lambda: seeded_llama(shape, seed=0, device=device).to(dtype)),
            (
                "moe-medium",
                lambda: moe_model("moe-small" if args.tiny else "moe-medium", device=device).to(
                    dtype
                ),
            ),
        ):
            row = {}
            # INT4 in groups of 128, and of 32 (SmolLM2's GGUF Q4_1) with bf16 activations
            # (tensor cores) and with fp32 ones (the CUDA-core kernels the service's INT4
            # layers ran before the twelfth session).
            variants = {"bf16": (None, dtype), "int4": (128, dtype), "int4 g32": (32, dtype)}
            variants["int4 g32 fp32"] = (32, torch.float32)
            for weights, (group, act) in variants.items():
                m = build().to(act)
                if group is not None:
                    quantize_model(
                        m,
                        group_size=32 if args.tiny else group,
                        skip=("lm_head", "embed_tokens", "router"),
                    )
                engine = make_engine(m, device, kv_dtype=kv16, num_pages=64)
                ms = decode_step_ms(engine, 1, 128, steps, device)
                row[weights] = 1e3 / ms
                del engine, m
                if device == "cuda":
                    torch.cuda.empty_cache()
            print(
                f"  {label:10s}: "
                + "  ".join(f"{w} {tps:7.1f} tok/s" for w, tps in row.items())
                + "  "
                + "  ".join(f"{w}/bf16 {row[w] / row['bf16']:.2f}x" for w in row if w != "bf16")
            )

    if "4" in sections:
        print("\n4. decode tok/s, CUDA graphs vs eager steps (context 512, median of steps)")
        graph_vs_eager(args.tiny, device, dtype, kv16, steps, args.models.split(","))
    if "5" in sections:
        print("\n5. INT4 decode with CUDA graphs: tuned launches vs the heuristic", flush=True)
        tuned_vs_heuristic(args.tiny, device, dtype, kv16, steps, args.models.split(","))
    if "6" in sections:
        print(
            "\n6. Llama-3-8B-shaped decode with CUDA graphs: INT4 against bf16 weights", flush=True
        )
        dense_8b(args.tiny, device, dtype, kv16, steps)
    if "7" in sections:
        print("\n7. Llama-3-8B-shaped INT4 decode with CUDA graphs: fp16 against bf16 activations",
              flush=True)  # fmt: skip
        fp16_activations_8b(args.tiny, device, steps)


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
        for weights in ("bf16", "int4 g32", "int4 g128"):
            model = build().to(dtype)
            if weights != "bf16":
                group = 32 if tiny else int(weights[len("int4 g") :])
                quantize_model(model, group_size=group, skip=("lm_head", "embed_tokens", "router"))
            fuse_projections(model)  # as a GPU node serves it (gpu_node/weights.py)
            for batch in (1, 8, 32):
                times = {0: [], 32: []}
                replays = []
                for _ in range(2):
                    for graphs in (0, 32):
                        engine = make_engine(model, device, kv_dtype=kv16, num_pages=batch * 40 + 8,
                                             cuda_graph_batch=graphs)  # fmt: skip
                        times[graphs].append(decode_step_ms(engine, batch, 512, steps, device))
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


TUNED_TABLE = w4a16_mma_plan.tuned_table


def use_tuning_table(on: bool) -> None:
    """Plans from here on take the tuning table's configs (on) or the heuristic's alone (a
    table without entries)."""
    w4a16_mma_plan.tuned_table = TUNED_TABLE if on else dict
    w4a16_mma_plan.default_plan.cache_clear()


def tuned_vs_heuristic(tiny, device, dtype, kv16, steps, names):
    """tok/s of the same graph-replayed INT4 decode steps, each engine capturing its graphs
    under the tuned plans or under the heuristic's, alternated twice (best of each)."""
    models = {
        "smollm2": TINY if tiny else SMOLLM2,
        "llama-1b": TINY if tiny else LLAMA_1B,
    }
    for label, shape in models.items():
        if label not in names:
            continue
        for group in (32, 128):
            model = seeded_llama(shape, seed=0, device=device).to(dtype)
            quantize_model(model, group_size=group, skip=("lm_head", "embed_tokens", "router"))
            fuse_projections(model)
            for batch in (1, 8):
                times = {True: [], False: []}
                for _ in range(2):
                    for tuned in (True, False):
                        use_tuning_table(tuned)
                        engine = make_engine(model, device, kv_dtype=kv16, num_pages=batch * 40 + 8,
                                             cuda_graph_batch=32)  # fmt: skip
                        times[tuned].append(decode_step_ms(engine, batch, 512, steps, device))
                        del engine
                use_tuning_table(True)
                on, off = min(times[True]), min(times[False])
                print(f"  {label:10s} int4 g{group:<3d} batch {batch:2d}: heuristic {batch * 1e3 / off:8.1f} tok/s"
                      f"  tuned {batch * 1e3 / on:8.1f} tok/s  {off / on:5.3f}x", flush=True)  # fmt: skip
            del model
            if device == "cuda":
                torch.cuda.empty_cache()


MODEL_SHAPES = {"smollm2": SMOLLM2, "llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B}


def seeded_model(shape, device, dtype):
    """seeded_llama at `shape` in `dtype`; the 8B shape is drawn on the device (its fp32
    build on the host would take minutes)."""
    return seeded_llama(shape, seed=0, device=device, draw_on_device=shape is LLAMA_8B).to(dtype)


def alternated_decode(variants, batch, steps, device):
    """Decode step ms of each variant (name -> (model, EngineConfig overrides, whether the small
    kernels release the next launch)), engines alternated twice at context 512, graphs up to
    batch 8: the best of each, and a line of every pass's steps and the graph's replay alone."""
    times = {w: [] for w in variants}
    replays = {w: [] for w in variants}
    for _ in range(2):
        for name, (model, overrides, release) in variants.items():
            launch.SMALL_KERNELS_RELEASE_NEXT = release
            engine = make_engine(model, device, num_pages=batch * 40 + 8, cuda_graph_batch=8,
                                 **overrides)  # fmt: skip
            times[name].append(decode_step_ms(engine, batch, 512, steps, device))
            if engine.runner.graphs is not None and engine.runner.graphs.captured:
                replays[name].append(replay_ms(engine.runner.graphs, device))
            del engine
            launch.SMALL_KERNELS_RELEASE_NEXT = True
    detail = (f"    steps ms: { {w: [round(t, 3) for t in v] for w, v in times.items()} }; the graph's "
              f"replay alone (GPU) ms: { {w: round(min(v), 3) for w, v in replays.items() if v} }")  # fmt: skip
    return {w: min(t) for w, t in times.items()}, detail


def dense_8b(tiny, device, dtype, kv16, steps):
    """tok/s of graph-replayed decode steps, bf16 against INT4 weights of one seeded model,
    engines alternated twice (best of each), context 512."""
    shape = TINY if tiny else LLAMA_8B
    group = 32 if tiny else 128
    models = {}
    for weights in ("bf16", f"int4 g{group}", f"int4 g{group} sym"):
        model = seeded_model(shape, device, dtype)
        if weights != "bf16":
            quantize_model(model, group_size=group, symmetric=weights.endswith("sym"),
                           skip=("lm_head", "embed_tokens"))  # fmt: skip
        models[weights] = fuse_projections(model)
        # what a decode step reads: every weight but the embedding table (one row of it)
        size = model_bytes(model)
        embed = model.embed_tokens.weight
        step_bytes = size.total - embed.numel() * embed.element_size()
        if model.lm_head.weight is embed:
            step_bytes += embed.numel() * embed.element_size()  # tied: the head reads it all
        print(f"  {weights:14s}: {size.total / 1e9:6.2f} GB of weights, {step_bytes / 1e9:6.2f} GB read a step",
              flush=True)  # fmt: skip
    # the INT4 model once more with every launch in order (launch.SMALL_KERNELS_RELEASE_NEXT
    # off: no small kernel lets the GEMV after it launch early)
    variants = {w: (m, {"kv_dtype": kv16}, True) for w, m in models.items()}
    variants[f"int4 g{group} in order"] = (models[f"int4 g{group}"], {"kv_dtype": kv16}, False)
    for batch in (1, 8):
        best, detail = alternated_decode(variants, batch, steps, device)
        print(f"  batch {batch}: " + "  ".join(f"{w} {batch * 1e3 / ms:7.1f} tok/s" for w, ms in best.items())
              + "  " + "  ".join(f"{w}/bf16 {best['bf16'] / ms:.2f}x" for w, ms in best.items() if w != "bf16"),
              flush=True)  # fmt: skip
        print(detail, flush=True)
    del models, variants
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
        variants[name] = (fuse_projections(model.to(dtype)), overrides, True)
    for batch in (1, 8):
        best, detail = alternated_decode(variants, batch, steps, device)
        print(f"  batch {batch}: " + "  ".join(f"{w} {batch * 1e3 / ms:7.1f} tok/s" for w, ms in best.items())
              + f"  int4 bf16/bf16 {best['bf16'] / best['int4 bf16']:.2f}x  int4 fp16/bf16 "
              f"{best['bf16'] / best['int4 fp16']:.2f}x  fp16/bf16 activations "
              f"{best['int4 bf16'] / best['int4 fp16']:.3f}x", flush=True)  # fmt: skip
        print(detail, flush=True)
    del variants
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
