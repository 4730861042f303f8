"""Hands out KV pages. Check-then-act: running out is a return value, not an exception.

Every page carries an owner tag (`page_owner[page]`) kept in step with
allocation, so attention can verify that a sequence only touches its own
pages. A tag is `(seq_id << 16) | generation` (`owner_tag`, the one tag format of
the scheduler, the engine and the kernels), where the generation counts the
sequence's allocations (it changes when a preempted sequence is re-admitted);
seq ids start at 1 and are never reused, so a freed and reused page never matches
a stale tag. Tag 0 (`FREE`) marks a free page. Beside the tag the host keeps the
block-table column each page was handed out for (`page_column_host`), so a table
that names one of its own pages twice, or at another position, is caught too.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from scheduler.sequence import Sequence

FREE = 0  # page_owner of a free page: no tag is 0, since seq ids start at 1
GENERATION_BITS = 16
MAX_SEQ_ID = 2 ** (63 - GENERATION_BITS) - 1


def owner_tag(seq_id: int, generation: int) -> int:
    """(seq_id << 16) | (generation mod 2**16), an int64 that is never FREE."""
    if not 1 <= seq_id <= MAX_SEQ_ID:
        raise ValueError(f"seq_id must be in [1, {MAX_SEQ_ID}], got {seq_id}")
    if generation < 0:
        raise ValueError(f"generation must be >= 0, got {generation}")
    return (seq_id << GENERATION_BITS) | (generation & ((1 << GENERATION_BITS) - 1))


def sequence_tag(seq: Sequence) -> int:
    return owner_tag(seq.seq_id, seq.num_preemptions)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockManager:
    """Owns the free list and the ownership table of one KV pool."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        # int64 [num_pages], on the KV cache's device so kernels can check it, and
        # its host mirror, so the per-step check never waits for the device.
        self.page_owner = torch.zeros(num_pages, dtype=torch.int64, device=device)
        self.page_owner_host = np.zeros(num_pages, dtype=np.int64)
        # The block-table column each page was handed out for (meaningful while owned).
        self.page_column_host = np.zeros(num_pages, dtype=np.int64)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def num_missing_pages(self, seq: Sequence, num_tokens: int) -> int:
        """Pages `seq` still needs to hold `num_tokens` tokens."""
        return max(0, pages_for(num_tokens, self.page_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_missing_pages(seq, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> list[int] | None:
        """Grows `seq.block_table` to cover `num_tokens` tokens.

        Returns the new pages (possibly none), or None, changing nothing, when
        fewer than the missing pages plus `reserve` are free.
        """
        missing = self.num_missing_pages(seq, num_tokens)
        if missing + reserve > len(self._free):
            return None
        new_pages = [self._free.popleft() for _ in range(missing)]
        if new_pages:
            first = len(seq.block_table)
            self.set_owner(new_pages, sequence_tag(seq), list(range(first, first + missing)))
            seq.block_table.extend(new_pages)
        return new_pages

    def free(self, seq: Sequence) -> None:
        """Returns the pages `seq` owns to the free list, in block-table order.

        Ownership, not the block table, decides: a page the table points to but
        another sequence owns is left alone (no double free), and a page the
        sequence owns but lost from its table is still returned (no leak).
        """
        tag = sequence_tag(seq)
        owned = set(np.flatnonzero(self.page_owner_host == tag).tolist())
        in_table = [p for p in dict.fromkeys(seq.block_table) if p in owned]
        released = in_table + sorted(owned.difference(in_table))
        if released:
            self.set_owner(released, FREE)
            self._free.extend(released)
        seq.block_table = []

    def set_owner(self, pages: list[int], tag: int, columns: list[int] | None = None) -> None:
        """Writes the ownership table, device copy and host mirror together, and the
        block-table columns the pages are handed out for (none when freeing)."""
        self.page_owner[pages] = tag
        self.page_owner_host[pages] = tag
        if columns is not None:
            self.page_column_host[pages] = columns
