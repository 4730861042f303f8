"""What the KV dtype costs in accuracy: fp32, bf16 and fp8 KV against fp32 KV, on real models.

    PYTHONPATH=. python benchmarks/kv_accuracy.py                 # SmolLM2 and gemma3-270m
    PYTHONPATH=. python benchmarks/kv_accuracy.py --models smollm2 --prompts 8
    PYTHONPATH=. python benchmarks/kv_accuracy.py --smoke         # CI: SmolLM2, tiny sizes

Each model computes in fp32 on the CPU through the engine's own paged attention
(`PagedAttention` over a `KVCache` of the KV dtype: every position attends to K/V as the
pool stores them). Per KV dtype:

- perplexity over windows of `pydoc_data.topics` (one sequence a window), and the mean
  KL divergence of each position's next-token distribution from fp32 KV's (nats);
- greedy answers (chat template, temperature 0, `--new-tokens` tokens) to PROMPTS, prompts
  written for this benchmark and used nowhere else in the project, compared with fp32 KV's:
  how many are identical, and the mean share of each answer before it departs from fp32
  KV's (the common prefix over the fp32 answer's length).

Figures in docs/benchmarks.md ("FP8 KV accuracy").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch

from gpu_node.cache.kv_cache import KVCache
from gpu_node.engine.attention import PagedAttention, StepMetadata
from gpu_node.models import model_store
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.models.weights import load_llama
from scheduler.block_manager import owner_tag

KV_DTYPES = ("fp32", "bf16", "fp8")
MODELS = ("smollm2", "gemma3-270m")
PAGE_SIZE = 16

PROMPTS = (
    "Why does ice float on liquid water?",
    "List four uses of a paperclip besides holding paper.",
    "Describe the smell of rain in one sentence.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery that only sells bagels.",
    "How many legs does a spider have, and how many does an ant have?",
    "Write a two-line poem about a lighthouse keeper.",
    "Explain in simple terms what a binary search does.",
    "What should I pack for a weekend hiking trip in autumn?",
    "Give one reason why cities plant trees along streets.",
    "What is the boiling point of water at the top of a high mountain, roughly?",
    "Rewrite this sentence more politely: Give me the report now.",
    "Which planet has the most moons that we know of?",
    "Explain what a hash map is to a ten-year-old.",
    "Tell me a fun fact about octopuses.",
    "What is a good way to remember the order of the planets?",
    "Summarize the plot of Little Red Riding Hood in two sentences.",
    "How do vaccines help the immune system?",
    "Write a short product description for a wooden desk lamp.",
    "What are the three states of matter?",
    "Convert 5 kilometres to miles and show the calculation.",
    "Why do cats purr?",
    "Suggest three questions to ask at the end of a job interview.",
    "What does a compiler do?",
)


def log(*parts: object) -> None:
    print(*parts, flush=True)


class OneSequence:
    """One sequence on a KV pool of its own: feed tokens, get the logits of each."""

    def __init__(self, model, kv_dtype: str, max_tokens: int):
        config = model.config
        self.model = model
        num_pages = math.ceil(max_tokens / PAGE_SIZE)
        self.kv = KVCache(
            config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim,
            kv_dtype,
        )  # fmt: skip
        tag = owner_tag(1, 0)
        self.tags = torch.tensor([tag])
        self.page_owner = torch.full((num_pages,), tag)
        self.block_table = torch.arange(num_pages, dtype=torch.int32)[None, :]
        self.windows = config.layer_windows
        self.scale = config.attention_scale
        self.length = 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Appends tokens [T]; returns their next-token logits [T, V] (fp32)."""
        count = len(token_ids)
        positions = torch.arange(self.length, self.length + count)
        metadata = StepMetadata(
            query_lens=[count],
            context_lens=[self.length + count],
            block_tables=self.block_table,
            slot_mapping=positions,  # the block table is the identity: slot == position
            seq_tags=self.tags,
            token_seq=torch.zeros(count, dtype=torch.long),
            page_owner=self.page_owner,
        )
        attention = PagedAttention(self.kv, metadata, self.scale, windows=self.windows)
        logits = self.model(torch.tensor(token_ids), positions, attention)
        if bool((attention.violations > 0).any()):
            raise RuntimeError("ownership violation on a sequence that owns every page")
        self.length += count
        return logits.float()


def text_windows(tokenizer: ChatTokenizer, num_windows: int, window: int) -> list[list[int]]:
    text = "\n\n".join(topics[key] for key in sorted(topics))
    # a prefix of the text about twice what the windows need (~4 characters a token)
    ids = tokenizer.encode(text[: 8 * num_windows * window], add_special_tokens=False)
    if len(ids) < num_windows * window:
        raise ValueError(f"pydoc_data.topics has {len(ids)} tokens, fewer than asked for")
    return [ids[i * window : (i + 1) * window] for i in range(num_windows)]


@torch.inference_mode()
def greedy_batch(model, kv_dtype: str, prompts: list[list[int]], new_tokens: int):
    """Greedy answers of `new_tokens` tokens to every prompt, decoded as one batch (each
    sequence on pages of its own, as the engine batches them; no stop at EOS here)."""
    config, count = model.config, len(prompts)
    pages_each = [math.ceil((len(p) + new_tokens) / PAGE_SIZE) for p in prompts]
    first_page = [sum(pages_each[:i]) for i in range(count)]
    kv = KVCache(
        config.num_layers, sum(pages_each), PAGE_SIZE, config.num_kv_heads, config.head_dim,
        kv_dtype,
    )  # fmt: skip
    tags = torch.tensor([owner_tag(i + 1, 0) for i in range(count)])
    page_owner = torch.repeat_interleave(tags, torch.tensor(pages_each))
    block_tables = torch.zeros(count, max(pages_each), dtype=torch.int32)
    for i in range(count):
        block_tables[i, : pages_each[i]] = torch.arange(
            first_page[i], first_page[i] + pages_each[i]
        )
    lengths = [0] * count
    chunks = [list(p) for p in prompts]
    answers: list[list[int]] = [[] for _ in range(count)]
    for _ in range(new_tokens):
        positions = torch.cat(
            [torch.arange(n, n + len(c)) for n, c in zip(lengths, chunks, strict=True)]
        )
        token_seq = torch.repeat_interleave(
            torch.arange(count), torch.tensor([len(c) for c in chunks])
        )
        pages = block_tables[token_seq, positions // PAGE_SIZE].long()
        metadata = StepMetadata(
            query_lens=[len(c) for c in chunks],
            context_lens=[n + len(c) for n, c in zip(lengths, chunks, strict=True)],
            block_tables=block_tables,
            slot_mapping=pages * PAGE_SIZE + positions % PAGE_SIZE,
            seq_tags=tags,
            token_seq=token_seq,
            page_owner=page_owner,
        )
        attention = PagedAttention(
            kv, metadata, config.attention_scale, windows=config.layer_windows
        )
        ids = torch.tensor([t for c in chunks for t in c])
        logits = model(ids, positions, attention)
        if bool((attention.violations > 0).any()):
            raise RuntimeError("ownership violation in a batch whose pages are all owned")
        last = torch.cumsum(torch.tensor([len(c) for c in chunks]), 0) - 1
        tokens = logits[last].argmax(-1).tolist()
        for i, token in enumerate(tokens):
            answers[i].append(token)
            lengths[i] += len(chunks[i])
        chunks = [[t] for t in tokens]
    return answers


def until_eos(answer: list[int], eos: int | None) -> list[int]:
    return answer[: answer.index(eos) + 1] if eos in answer else answer


def shared_share(answer: list[int], reference: list[int]) -> float:
    """The share of `reference` that `answer` repeats before it departs from it."""
    common = 0
    for a, b in zip(answer, reference, strict=False):
        if a != b:
            break
        common += 1
    return 1.0 if answer == reference else common / max(1, len(reference))


def measure(name: str, num_windows: int, window: int, prompts, new_tokens: int) -> dict:
    started = time.time()
    gguf = GGUFModel(model_store.pull(name, quiet=True))
    model = load_llama(gguf, torch.float32).eval()
    tokenizer = ChatTokenizer(gguf)
    result: dict = {"windows": num_windows, "window": window, "prompts": len(prompts)}
    reference: list[torch.Tensor] = []
    for kv_dtype in KV_DTYPES:
        nll, kl, count = 0.0, 0.0, 0
        for index, ids in enumerate(text_windows(tokenizer, num_windows, window)):
            logits = OneSequence(model, kv_dtype, len(ids)).feed(ids)
            log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)  # [L - 1, V]
            targets = torch.tensor(ids[1:])
            nll -= float(log_probs.gather(1, targets[:, None]).sum())
            count += len(targets)
            if kv_dtype == "fp32":
                reference.append(log_probs.float())  # fp32: a window of 262k-token logits
            else:
                ref = reference[index].double()
                kl += float((ref.exp() * (ref - log_probs)).sum())
        result[kv_dtype] = {"perplexity": math.exp(nll / count), "mean_kl": kl / count}
    chats = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
        for p in prompts
    ]
    answers = {
        kv: [
            until_eos(a, tokenizer.eos_token_id) for a in greedy_batch(model, kv, chats, new_tokens)
        ]
        for kv in KV_DTYPES
    }
    for kv_dtype in KV_DTYPES:
        pairs = list(zip(answers[kv_dtype], answers["fp32"], strict=True))
        row = result[kv_dtype]
        row["identical"] = sum(a == b for a, b in pairs)
        row["shared"] = sum(shared_share(a, b) for a, b in pairs) / len(pairs)
        row["ppl_vs_fp32"] = row["perplexity"] / result["fp32"]["perplexity"] - 1
    result["fp8_answer_0"] = tokenizer.decode(answers["fp8"][0])
    result["seconds"] = round(time.time() - started, 1)
    return result


def report(name: str, result: dict, new_tokens: int) -> None:
    log(
        f"\n{name}, fp32 compute, CPU: {result['windows']} x {result['window']} tokens of "
        f"pydoc_data.topics; {result['prompts']} prompts x {new_tokens} greedy tokens "
        f"({result['seconds']} s)\n"
    )
    log("| KV | perplexity | vs fp32 KV | mean KL (nats) | identical answers | shared |")
    log("|---|---:|---:|---:|---:|---:|")
    for kv_dtype in KV_DTYPES:
        row = result[kv_dtype]
        log(
            f"| {kv_dtype} | {row['perplexity']:.4f} | {100 * row['ppl_vs_fp32']:+.2f}% | "
            f"{row['mean_kl']:.2e} | {row['identical']}/{result['prompts']} | "
            f"{100 * row['shared']:.0f}% |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CI: SmolLM2 at tiny sizes")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--windows", type=int, default=4, help="perplexity windows")
    parser.add_argument("--window", type=int, default=512, help="tokens a window")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="greedy prompts")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens a prompt")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts: tuple[str, ...] = PROMPTS[: args.prompts]
    if args.smoke:
        models, windows, window, prompts, new_tokens = ["smollm2"], 1, 48, PROMPTS[:2], 4
    else:
        models = args.models.split(",")
        windows, window, new_tokens = args.windows, args.window, args.new_tokens
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name in models:
        results[name] = measure(name, windows, window, prompts, new_tokens)
        report(name, results[name], new_tokens)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
