"""The CPU's default decode path against the fp32 reference: argmax agreement over code and
prose, and greedy answers.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_accuracy.py [--windows 4] [--window 256]
    PYTHONPATH=. .venv/bin/python benchmarks/cpu_accuracy.py --smoke      # CI, seconds

One GGUF (SmolLM2 by default) three ways, fp32 KV:
- **reference**: fp32 weights (each dequantized exactly from the file) through torch;
- **C kernels** (the CPU default, kernels/cpu): INT4 projections and the Q8_0 head as the
  file stores them, activations quantized to int8 a block of 32 inside the GEMVs;
- **torch INT4**: the INT4 projections through torch's int4 kernel (bf16 activations),
  the fp32 head: the path without a C compiler.

Teacher-forced one token a step (decode steps, the steps the C kernels take whole), over
windows of prose (`pydoc_data.topics`) and code (the standard library's own source): the
share of positions whose argmax is the reference's, and the mean KL of each next-token
distribution to the reference's. Then greedy answers to kv_accuracy's 24 chat prompts
(32 tokens, decoded as one batch): identical to the reference's, and the mean share of
each answer before it departs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

import torch

from benchmarks.kv_accuracy import (
    PROMPTS,
    OneSequence,
    greedy_batch,
    shared_share,
    text_windows,
    until_eos,
)
from gpu_node.kernels import cpu as cpu_kernels
from gpu_node.models import model_store
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.models.weights import load_llama, use_cpu_kernels

CODE_MODULES = ("json.decoder", "textwrap", "argparse", "dataclasses", "heapq", "fractions")


def code_windows(tokenizer: ChatTokenizer, num_windows: int, window: int) -> list[list[int]]:
    """Windows of the standard library's Python source."""
    import importlib

    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE_MODULES)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_windows * window:
        raise ValueError(f"the code corpus has {len(ids)} tokens, fewer than asked for")
    return [ids[i * window : (i + 1) * window] for i in range(num_windows)]


def models(name: str) -> tuple[dict[str, torch.nn.Module], ChatTokenizer]:
    gguf = GGUFModel(model_store.pull(name, quiet=True))
    paths = {"reference": load_llama(gguf, torch.float32)}
    if cpu_kernels.available():
        paths["C kernels"] = use_cpu_kernels(load_llama(gguf, torch.float32, int4=True), gguf)
    paths["torch INT4"] = load_llama(gguf, torch.float32, int4=True)
    return paths, ChatTokenizer(gguf)


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Log-probabilities [L, V] of each next token, fed one token a step."""
    sequence = OneSequence(model, "fp32", len(ids))
    return torch.cat([torch.log_softmax(sequence.feed([t]).double(), -1) for t in ids])


def measure(name: str, num_windows: int, window: int, num_prompts: int, new_tokens: int) -> dict:
    started = time.time()
    paths, tokenizer = models(name)
    corpora = {
        "prose": text_windows(tokenizer, num_windows, window),
        "code": code_windows(tokenizer, num_windows, window),
    }
    result: dict = {"windows": num_windows, "window": window, "prompts": num_prompts}
    for corpus, windows in corpora.items():
        reference = [teacher_forced(paths["reference"], ids) for ids in windows]
        for path, model in paths.items():
            if path == "reference":
                continue
            same, kl, count = 0, 0.0, 0
            for ref, ids in zip(reference, windows, strict=True):
                mine = teacher_forced(model, ids)
                same += int((mine.argmax(-1) == ref.argmax(-1)).sum())
                kl += float((ref.exp() * (ref - mine)).sum())
                count += len(ids)
            result.setdefault(path, {})[corpus] = {"argmax": same / count, "mean_kl": kl / count}
    chats = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
        for p in PROMPTS[:num_prompts]
    ]
    answers = {
        path: [
            until_eos(a, tokenizer.eos_token_id)
            for a in greedy_batch(model, "fp32", chats, new_tokens)
        ]
        for path, model in paths.items()
    }
    for path in paths:
        if path == "reference":
            continue
        pairs = list(zip(answers[path], answers["reference"], strict=True))
        result[path]["identical"] = sum(a == b for a, b in pairs)
        result[path]["shared"] = sum(shared_share(a, b) for a, b in pairs) / len(pairs)
    result["seconds"] = round(time.time() - started, 1)
    return result


def report(name: str, result: dict, new_tokens: int) -> None:
    print(
        f"\n{name}, fp32 KV, {torch.get_num_threads()} threads: teacher-forced over "
        f"{result['windows']} x {result['window']} tokens each of prose and code; "
        f"{result['prompts']} prompts x {new_tokens} greedy tokens ({result['seconds']} s)\n"
    )
    print("| path | argmax = reference, prose | code | mean KL prose | code | identical | shared |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path, row in result.items():
        if not isinstance(row, dict):
            continue
        prose, code = row["prose"], row["code"]
        print(
            f"| {path} | {100 * prose['argmax']:.2f}% | {100 * code['argmax']:.2f}% | "
            f"{prose['mean_kl']:.2e} | {code['mean_kl']:.2e} | "
            f"{row['identical']}/{result['prompts']} | {100 * row['shared']:.0f}% |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CI: tiny sizes")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=4, help="windows of each corpus")
    parser.add_argument("--window", type=int, default=256, help="tokens a window")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="greedy prompts")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens a prompt")
    args = parser.parse_args()
    if args.smoke:
        args.windows, args.window, args.prompts, args.new_tokens = 1, 8, 2, 3
    result = measure(args.model, args.windows, args.window, args.prompts, args.new_tokens)
    report(args.model, result, args.new_tokens)
    if not args.smoke:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
