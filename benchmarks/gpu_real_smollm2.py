"""The real SmolLM2-135M-Instruct (its own Q4_1 GGUF) on a GPU, against the CPU.

Every other GPU figure in docs/ comes from seeded weights at real shapes, because the
92 MB GGUF does not fit the device tool's 64 MiB of carried files in one call. This
script checks what those figures cannot: that the real model, served the way a GPU node
serves it (fused projections, tensor-core W4A16 kernels on its groups of 32, paged
attention, CUDA graphs), gives the CPU's answers.

    # here, on the CPU: the reference a GPU run is compared with
    python benchmarks/gpu_real_smollm2.py --record .exp/smollm2_cpu.npz
    # on the GPU machine
    TRITON_INTERPRET=0 python3 benchmarks/gpu_real_smollm2.py --compare .exp/smollm2_cpu.npz

The reference holds, for 8 chat prompts, the CPU's greedy tokens from fp32 weights (the
Q4_1 blocks dequantized exactly, so the fp32 model is the INT4 model's own arithmetic)
and from INT4 weights (torch's CPU int4 kernel), and the fp32 model's logits at the last
8 prompt positions of each prompt. A GPU run reports, for each weight format, KV dtype
and activation dtype: the answer to the first prompt, how many of the 8 greedy answers
equal the fp32 CPU answer token for token (and where the first difference falls), the
logits' largest difference from the fp32 CPU logits and whether their argmax agrees,
and single-stream and batch-8 decode tok/s, formats alternated twice (best of two).

Imports only torch, numpy, our code and the model's own packages (gguf, tokenizers).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from kv_accuracy import PROMPTS  # the KV accuracy benchmark's chat prompts

from gpu_node.config import EngineConfig
from gpu_node.llm_engine import LLMEngine
from gpu_node.model_store import resolve_model
from scheduler.sequence import SamplingParams

NEW_TOKENS = 32
LOGIT_POSITIONS = 8  # the last this many prompt positions of each prompt

# (weights, kv dtype, activations) as a GPU node can be started with them
GPU_FORMATS = (
    ("int4", "bf16", "auto"),
    ("int4", "fp8", "auto"),
    ("int4", "fp16", "fp16"),
    ("bf16", "bf16", "auto"),
    ("fp32", "fp32", "auto"),
)


def make_engine(weights: str, kv_dtype: str, activations: str, device: str) -> LLMEngine:
    config = EngineConfig(
        model=resolve_model("smollm2").as_posix(), weights=weights, kv_dtype=kv_dtype,
        activations=activations, device=device, num_pages=512, max_num_seqs=16,
    )  # fmt: skip
    return LLMEngine.from_config(config)


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def greedy_answers(engine: LLMEngine) -> list[list[int]]:
    prompts = {str(i): chat_ids(engine, p) for i, p in enumerate(PROMPTS)}
    out = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    return [out[str(i)] for i in range(len(PROMPTS))]


def last_logits(engine: LLMEngine) -> np.ndarray:
    """fp32 [prompts, LOGIT_POSITIONS, vocab]: the model's logits at each prompt's end."""
    from gpu_node.attention import PagedAttention
    from scheduler.scheduler import ScheduledChunk
    from scheduler.sequence import Sequence

    rows = []
    for i, text in enumerate(PROMPTS):
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


def decode_tok_s(engine: LLMEngine, batch: int, device: str, tokens: int = 128) -> float:
    """Output tokens a second over `tokens` decode steps of `batch` sequences (prefill
    excluded: the clock starts after every sequence has its first token)."""
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"d{b}", chat_ids(engine, PROMPTS[b % len(PROMPTS)]), params)
    while (
        any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    if device == "cuda":
        torch.cuda.synchronize()
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
    if device == "cuda":
        torch.cuda.synchronize()
    return produced / (time.perf_counter() - start)


def record(path: str) -> None:
    fp32 = make_engine("fp32", "fp32", "auto", "cpu")
    int4 = make_engine("int4", "fp32", "auto", "cpu")
    answers_fp32, answers_int4 = greedy_answers(fp32), greedy_answers(int4)
    np.savez_compressed(
        path,
        answers_fp32=np.array([a + [-1] * (NEW_TOKENS - len(a)) for a in answers_fp32]),
        answers_int4=np.array([a + [-1] * (NEW_TOKENS - len(a)) for a in answers_int4]),
        logits_fp32=last_logits(fp32),
    )
    print(f"CPU fp32: {fp32.tokenizer.decode(answers_fp32[0])!r}")
    print(f"CPU int4: {int4.tokenizer.decode(answers_int4[0])!r}")
    same = sum(a == b for a, b in zip(answers_fp32, answers_int4, strict=True))
    print(f"CPU int4 greedy answers equal to fp32's: {same}/{len(PROMPTS)}; wrote {path}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(
    path: str, device: str, formats: list[tuple[str, str, str]], decode_tokens: int
) -> None:
    ref = np.load(path)
    cpu = [[t for t in row if t >= 0] for row in ref["answers_fp32"].tolist()]
    cpu_int4 = [[t for t in row if t >= 0] for row in ref["answers_int4"].tolist()]
    logits_ref = ref["logits_fp32"]
    engines = {}
    for weights, kv, act in formats:
        label = f"{weights} weights, {kv} KV, activations {act}"
        engine = make_engine(weights, kv, act, device)
        engines[label] = engine
        answers = greedy_answers(engine)
        logits = last_logits(engine)
        diffs = [first_difference(a, b) for a, b in zip(answers, cpu, strict=True)]
        same = sum(d is None for d in diffs)
        same_int4 = sum(a == b for a, b in zip(answers, cpu_int4, strict=True))
        argmax = (logits.argmax(-1) == logits_ref.argmax(-1)).mean()
        print(f"\n{label}")
        print(f"  answer: {engine.tokenizer.decode(answers[0])!r}")
        print(f"  greedy answers equal to the CPU fp32 model's: {same}/{len(PROMPTS)} "
              f"(first differences at tokens {[d for d in diffs if d is not None]}); "
              f"to the CPU int4 kernel's: {same_int4}/{len(PROMPTS)}")  # fmt: skip
        print(f"  logits, last {LOGIT_POSITIONS} prompt positions: max |diff| "
              f"{np.abs(logits - logits_ref).max():.3f} (logits up to "
              f"{np.abs(logits_ref).max():.1f}), argmax agrees at {argmax:.1%}", flush=True)  # fmt: skip
    print(
        f"\ndecode tok/s (CUDA graphs on a GPU; {decode_tokens} steps after the first token; "
        "best of 2 alternated)"
    )
    for batch in (1, 8):
        best: dict[str, float] = {}
        for _ in range(2):
            for label, engine in engines.items():
                tps = decode_tok_s(engine, batch, device, decode_tokens)
                best[label] = max(best.get(label, 0.0), tps)
        for label, tps in best.items():
            print(f"  batch {batch}: {label:42s} {tps:8.1f} tok/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", help="write the CPU reference here (.npz)")
    parser.add_argument("--compare", help="compare a GPU run with this CPU reference")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--formats", default="all",
                        help="weights:kv:activations,... (default: the five GPU formats)")  # fmt: skip
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.record:
        record(args.record)
    if args.compare:
        formats = (
            list(GPU_FORMATS)
            if args.formats == "all"
            else [tuple(f.split(":")) for f in args.formats.split(",")]
        )
        compare(args.compare, args.device, formats, args.decode_tokens)  # type: ignore[arg-type]
    if not (args.record or args.compare):
        parser.error("give --record or --compare")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
