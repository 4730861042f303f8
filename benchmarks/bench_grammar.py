"""The grammar mask's cost per decode step: a batch under a JSON Schema vs a plain batch.

    .venv/bin/python benchmarks/bench_grammar.py [--device cuda] [--batch 32] [--steps 48]
    .venv/bin/python benchmarks/bench_grammar.py --smoke    # batch 2, 4 steps (CI)

    # a GPU machine without the GGUF: seeded weights of SmolLM2's shape, its tokenizer saved
    .venv/bin/python benchmarks/bench_grammar.py --save-tokenizer .exp/smollm2-tokenizer
    python3 benchmarks/bench_grammar.py --device cuda --seeded --tokenizer .exp/smollm2-tokenizer

One engine, SmolLM2 (INT4). Two runs of `--batch` requests on one prompt, seeded sampling
at temperature 1.0: plain (ignore_eos, so that it decodes as long), then every request held
to a nested JSON Schema (compiled once, before the run). For each decode step with the
whole batch decoding, the step's time and, in the constrained run, the time its masks
took: filling each row's bitmask on the host (xgrammar) and applying them to the logits
on their device, the device synchronized on both sides. Prints the medians and the mask's
share of a plain step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.node_api import GrammarSpec
from gpu_node.config import EngineConfig
from gpu_node.engine.grammar import Grammar
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.models.weights import seeded_llama
from scheduler.sequence import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "bio": {"type": "string", "maxLength": 400},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "pets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string"}},
                "required": ["kind", "name"],
            },
        },
    },
    "required": ["name", "age", "role", "bio", "address", "pets"],
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_steps(
    engine: LLMEngine, ids: list[int], batch: int, steps: int, grammar: Grammar | None, tag: str
) -> tuple[list[float], list[float]]:
    """Runs the batch; the time (ms) of each decode step with all of it decoding, and of
    the masks in each such step (none for a plain batch)."""
    device = engine.config.device
    mask = engine._mask
    last: dict[str, Any] = {}

    def timed_mask(chunks: Any, logits: torch.Tensor) -> None:
        _sync(device)
        start = time.perf_counter()
        mask(chunks, logits)
        _sync(device)
        last["mask_ms"] = (time.perf_counter() - start) * 1e3
        last["rows"] = sum(1 for c in chunks if engine._requests[c.seq.request_id].matcher)

    engine._mask = timed_mask  # type: ignore[method-assign]
    for i in range(batch):
        params = SamplingParams(
            max_tokens=steps + 2, temperature=1.0, seed=i, ignore_eos=grammar is None
        )
        engine.add_request(f"{tag}-{i}", ids, params, grammar=grammar)
    step_ms: list[float] = []
    mask_ms: list[float] = []
    num_steps = 0
    while engine.has_unfinished():
        last.clear()
        _sync(device)
        start = time.perf_counter()
        outs = engine.step()
        _sync(device)
        elapsed = (time.perf_counter() - start) * 1e3
        num_steps += 1
        is_decode = num_steps > 2 and len(outs) == batch and not any(o.finished for o in outs)
        if is_decode and (grammar is None or last.get("rows") == batch):
            step_ms.append(elapsed)
            if grammar is not None:
                mask_ms.append(last["mask_ms"])
    engine._mask = mask  # type: ignore[method-assign]
    return step_ms, mask_ms


def save_tokenizer(tokenizer: ChatTokenizer, directory: Path) -> None:
    """Writes `tokenizer` as a checkpoint directory's tokenizer.json and
    tokenizer_config.json (its special tokens and chat template)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer._tok.to_str())
    config = {**tokenizer.meta.special_tokens, "chat_template": tokenizer.chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    print(f"wrote {directory}/tokenizer.json and tokenizer_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--smoke", action="store_true", help="batch 2, 4 steps")
    parser.add_argument("--seeded", action="store_true", help="seeded weights (--tokenizer)")
    parser.add_argument("--tokenizer", type=Path, help="a directory with tokenizer.json")
    parser.add_argument("--save-tokenizer", type=Path, help="write SmolLM2's tokenizer there")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.steps = 2, 4
    config = EngineConfig(
        model="smollm2", device=args.device, num_pages=2048, max_num_seqs=max(args.batch, 1)
    )
    if args.save_tokenizer is not None:
        save_tokenizer(LLMEngine.from_config(config).tokenizer, args.save_tokenizer)
        return
    if args.seeded:
        from bench_engine import SMOLLM2

        model = seeded_llama(SMOLLM2, seed=0, device=args.device)
        if args.device != "cpu":
            model = model.to(torch.bfloat16)
        engine = LLMEngine(config, model, ChatTokenizer.from_directory(args.tokenizer))
    else:
        engine = LLMEngine.from_config(config)
    ids = engine.tokenizer.encode_chat(
        [{"role": "user", "content": "Describe a made-up person as JSON, with a long bio."}]
    )
    start = time.perf_counter()
    grammar = engine.grammars.compile(GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA)))
    compile_ms = (time.perf_counter() - start) * 1e3
    if not args.smoke:
        decode_steps(engine, ids, 2, 4, None, "warm")  # first steps, kernels, CUDA graphs
    plain, _ = decode_steps(engine, ids, args.batch, args.steps, None, "plain")
    constrained, masks = decode_steps(engine, ids, args.batch, args.steps, grammar, "json")
    if not (plain and constrained):
        raise SystemExit("no step had the whole batch decoding: raise --steps")
    plain_ms, constrained_ms = statistics.median(plain), statistics.median(constrained)
    mask_ms = statistics.median(masks)
    where = f"cpu {torch.get_num_threads()} threads" if args.device == "cpu" else args.device
    weights = "seeded bf16" if args.seeded and args.device != "cpu" else "int4"
    weights = "seeded fp32" if args.seeded and args.device == "cpu" else weights
    print(f"SmolLM2 {weights}, {where}; batch {args.batch}, decode steps timed: plain "
          f"{len(plain)}, constrained {len(constrained)}; first compile {compile_ms:.0f} ms")  # fmt: skip
    print(f"  step, plain:        {plain_ms:8.2f} ms")
    print(f"  step, constrained:  {constrained_ms:8.2f} ms")
    print(f"  mask per step:      {mask_ms:8.3f} ms  ({mask_ms / args.batch * 1e3:.1f} us a row)")
    print(f"  mask / plain step:  {100 * mask_ms / plain_ms:8.2f} %")


if __name__ == "__main__":
    main()
