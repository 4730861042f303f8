"""Host side of the KV integrity check: time per engine step, by batch and context.

    python benchmarks/bench_integrity_host.py

Every step the engine checks each scheduled sequence's block table against the host
mirror of the ownership table (`gpu_node.model_runner.find_violations_host`) before
it launches the step, so this time adds to every decode step: set it beside the
step's GPU time (docs/bench/fp8_kv.md) to read the check's share. Printed beside
it, measured in the same run: the first version, which found a page named twice by
sorting each row instead of checking each page's handed-out column, and the second,
which made every rule's mask a temporary. Full block
tables, 16 tokens per page, random page ids.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_node.model_runner import find_violations_host

PAGE_SIZE = 16
POINTS = [(1, 32768), (8, 32768), (64, 8192), (64, 32768), (256, 4096)]


def find_violations_sorted(
    tables: np.ndarray, table_lens: np.ndarray, context_lens: np.ndarray, page_size: int,
    page_owner: np.ndarray, seq_tags: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """The first version: tags, then repeats found by sorting each row."""
    num_pages = len(page_owner)
    columns = np.arange(tables.shape[1])
    needed = -(-context_lens // page_size)
    is_used = columns[None, :] < needed[:, None]
    in_range = (tables >= 0) & (tables < num_pages)
    owners = page_owner[np.clip(tables, 0, num_pages - 1)]
    is_foreign = is_used & (~in_range | (owners != seq_tags[:, None]))
    ordered = np.sort(np.where(is_used, tables, -1 - columns[None, :]), axis=1)
    is_repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    return is_foreign.any(axis=1) | is_repeated | (needed > table_lens)


def find_violations_gathers(
    tables: np.ndarray, table_lens: np.ndarray, context_lens: np.ndarray, page_size: int,
    page_owner: np.ndarray, page_column: np.ndarray, seq_tags: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """The second version: the column rule, but clip, range and masks as temporaries."""
    num_pages = len(page_owner)
    columns = np.arange(tables.shape[1])
    needed = -(-context_lens // page_size)
    is_used = columns[None, :] < needed[:, None]
    in_range = (tables >= 0) & (tables < num_pages)
    pages = np.clip(tables, 0, num_pages - 1)
    is_own = in_range & (page_owner[pages] == seq_tags[:, None]) & (page_column[pages] == columns)
    return (is_used & ~is_own).any(axis=1) | (needed > table_lens)


def median_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    rng = np.random.default_rng(0)
    print(
        "| batch | context | table entries | check ms | second version (temporaries) ms "
        "| first version (row sort) ms | vs second | vs first |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch, context in POINTS:
        width = context // PAGE_SIZE
        num_pages = batch * width + 100
        tables = rng.permutation(num_pages)[: batch * width].reshape(batch, width)
        tags = (np.arange(batch, dtype=np.int64) + 1) << 16
        owner = np.zeros(num_pages, dtype=np.int64)
        owner[tables] = np.repeat(tags, width).reshape(batch, width)
        column = np.zeros(num_pages, dtype=np.int64)
        column[tables] = np.arange(width)
        lens = np.full(batch, context, dtype=np.int64)
        table_lens = np.full(batch, width, dtype=np.int64)
        args = (tables, table_lens, lens, PAGE_SIZE, owner, column, tags)
        first = (tables, table_lens, lens, PAGE_SIZE, owner, tags)
        assert not find_violations_host(*args).any() and not find_violations_sorted(*first).any()
        now = median_ms(lambda a=args: find_violations_host(*a))
        second = median_ms(lambda a=args: find_violations_gathers(*a))
        before = median_ms(lambda a=first: find_violations_sorted(*a))
        print(
            f"| {batch} | {context} | {batch * width} | {now:.3f} | {second:.3f} | "
            f"{before:.3f} | {second / now:.2f}x | {before / now:.2f}x |"
        )


if __name__ == "__main__":
    main()
