"""What storing the KV cache in bf16 or fp8 costs SmolLM2 in accuracy, against fp32 KV.

Run from the repository root (CPU is fine; `--device cuda` uses the Triton kernels):

    .venv/bin/python benchmarks/kv_accuracy.py [--windows 4] [--window 512] [--out DIR]

Text: the standard library's `pydoc_data.topics` (every Python install has it), keys in
sorted order, cut into windows of `--window` tokens. Each window is one sequence,
prefilled through the paged cache in chunks of `--chunk` tokens, so every position
attends to K/V as the cache stores them (the current chunk included), exactly as
decode would. Reported per KV dtype: perplexity, mean KL(fp32-KV || this-KV) of the
next-token distributions, and greedy agreement with fp32 KV over a set of prompts.
The model computes in fp32 throughout; only the KV storage changes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch

from gpu_node import model_store
from gpu_node.attention import PagedAttention, StepMetadata
from gpu_node.gguf_loader import GGUFModel
from gpu_node.kv_cache import KVCache
from gpu_node.tokenizer import ChatTokenizer
from gpu_node.weights import load_llama
from scheduler.block_manager import owner_tag

KV_DTYPES = ("fp32", "bf16", "fp8")
PAGE_SIZE = 16
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


class OneSequence:
    """One sequence on its own KV pool: feed tokens, get logits for every one of them."""

    def __init__(self, model, kv_dtype: str, max_tokens: int, device: str):
        config = model.config
        self.model = model
        self.device = device
        num_pages = math.ceil(max_tokens / PAGE_SIZE)
        self.kv = KVCache(
            config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim,
            kv_dtype, device,
        )  # fmt: skip
        tag = owner_tag(1, 0)
        self.tags = torch.tensor([tag], device=device)
        self.page_owner = torch.full((num_pages,), tag, device=device)
        self.block_table = torch.arange(num_pages, dtype=torch.int32, device=device)[None, :]
        self.scale = config.head_dim**-0.5
        self.length = 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Appends tokens [T]; returns their next-token logits [T, V] (fp32)."""
        count = len(token_ids)
        positions = torch.arange(self.length, self.length + count, device=self.device)
        metadata = StepMetadata(
            query_lens=[count],
            context_lens=[self.length + count],
            block_tables=self.block_table,
            slot_mapping=positions,  # the block table is the identity: slot == position
            seq_tags=self.tags,
            token_seq=torch.zeros(count, dtype=torch.long, device=self.device),
            page_owner=self.page_owner,
        )
        attention = PagedAttention(self.kv, metadata, self.scale)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        logits = self.model(ids, positions, attention)
        if bool((attention.violations > 0).any()):
            raise RuntimeError("ownership violation on a sequence that owns every page")
        self.length += count
        return logits


def text_windows(tokenizer: ChatTokenizer, num_windows: int, window: int) -> list[list[int]]:
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_windows * window:
        raise ValueError(f"pydoc_data.topics has {len(ids)} tokens, fewer than asked for")
    return [ids[i * window : (i + 1) * window] for i in range(num_windows)]


def window_log_probs(model, kv_dtype, ids, chunk, device) -> torch.Tensor:
    """log-softmax of the next-token logits at every position but the last: [L - 1, V]."""
    sequence = OneSequence(model, kv_dtype, len(ids), device)
    logits = torch.cat([sequence.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)])
    return torch.log_softmax(logits[:-1].double(), dim=-1)


def greedy(model, tokenizer, kv_dtype, prompt, max_new_tokens, device) -> list[int]:
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    sequence = OneSequence(model, kv_dtype, len(ids) + max_new_tokens, device)
    logits = sequence.feed(ids)[-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
        logits = sequence.feed([token])[-1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.time()
    gguf = GGUFModel(model_store.pull("smollm2", quiet=True))
    model = load_llama(gguf, torch.float32, device=args.device).eval()
    tokenizer = ChatTokenizer(gguf)

    windows = text_windows(tokenizer, args.windows, args.window)
    results: dict = {"windows": args.windows, "window": args.window, "chunk": args.chunk}
    reference = None
    for kv_dtype in KV_DTYPES:
        nll, kl, count = 0.0, 0.0, 0
        for index, ids in enumerate(windows):
            log_probs = window_log_probs(model, kv_dtype, ids, args.chunk, args.device)
            targets = torch.tensor(ids[1:], device=log_probs.device)
            nll -= float(log_probs.gather(1, targets[:, None]).sum())
            count += len(targets)
            if kv_dtype == "fp32":
                reference = reference or []
                reference.append(log_probs)
            else:
                assert reference is not None
                ref = reference[index]
                kl += float((ref.exp() * (ref - log_probs)).sum())
        results[kv_dtype] = {"perplexity": math.exp(nll / count), "mean_kl": kl / count}

    answers = {
        kv: [greedy(model, tokenizer, kv, p, args.max_new_tokens, args.device) for p in PROMPTS]
        for kv in KV_DTYPES
    }
    for kv_dtype in KV_DTYPES:
        same = [a == b for a, b in zip(answers[kv_dtype], answers["fp32"], strict=True)]
        results[kv_dtype]["greedy_identical"] = f"{sum(same)}/{len(PROMPTS)}"
        results[kv_dtype]["answers"] = [tokenizer.decode(a) for a in answers[kv_dtype]]
    results["seconds"] = round(time.time() - started, 1)

    print(
        f"SmolLM2-135M-Instruct, fp32 compute, {args.windows} windows x {args.window} tokens of "
        f"pydoc_data.topics, chunk {args.chunk}, device {args.device}\n"
    )
    print("| KV | perplexity | mean KL vs fp32 KV (nats) | greedy identical to fp32 KV |")
    print("|---|---|---|---|")
    for kv_dtype in KV_DTYPES:
        row = results[kv_dtype]
        print(
            f"| {kv_dtype} | {row['perplexity']:.4f} | {row['mean_kl']:.2e} | "
            f"{row['greedy_identical']} |"
        )
    print(f"\nfp8 answer to {PROMPTS[0]!r}: {results['fp8']['answers'][0]!r}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_accuracy.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
