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

Sliding windows: where every layer of the model attends only its last `window`
positions (the query at p sees positions q with p - window < q <= p, transformers'
rule), a sequence's leading pages fall out of every later step's reach as it grows,
and `release_passed` gives them back to the free list at once. The block table keeps
its positions: a released column holds `RELEASED_PAGE`, `seq.num_released_pages`
counts those columns, and neither the ownership checks nor attention read them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Items

import numpy as np
import torch

from scheduler.sequence import Sequence

FREE = 0  # page_owner of a free page: no tag is 0, since seq ids start at 1
GENERATION_BITS = 16
MAX_SEQ_ID = 2 ** (63 - GENERATION_BITS) - 1
# A released column's entry: an id inside the pool, so range checks that walk a whole
# table pass, yet never read (the window masks its positions) and never the sequence's.
RELEASED_PAGE = 0


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


def release_window(layer_windows: Items[int | None]) -> int | None:
    """The window past which a sequence's pages may be released: the widest layer's, the
    furthest back any layer reads. None where any layer is global (None): that layer
    reads every position for the sequence's whole life, so every page is kept."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(w for w in layer_windows if w is not None)


class BlockManager:
    """Owns the free list and the ownership table of one KV pool."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        window: int | None = None,
    ):
        """`window`: every layer attends at most this many positions, itself included
        (`release_window`), so passed pages are released; None: every page is kept."""
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"need num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.window = window
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

    def num_fitting_tokens(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> int:
        """How many tokens past its first `num_tokens` `seq` could grow by with its table's
        columns and the free pages beyond `reserve` (negative when even those fall short)."""
        num_columns = len(seq.block_table) + len(self._free) - reserve
        return num_columns * self.page_size - num_tokens

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
        held = seq.block_table[seq.num_released_pages :]
        in_table = [p for p in dict.fromkeys(held) if p in owned]
        released = in_table + sorted(owned.difference(in_table))
        if released:
            self.set_owner(released, FREE)
            self._free.extend(released)
        seq.block_table = []
        seq.num_released_pages = 0

    def releases(self, seq: Sequence) -> bool:
        """Whether the passed pages of `seq` are released (so taken chunk by chunk)."""
        return self.window is not None and not seq.keeps_pages

    def num_passed_pages(self, num_computed_tokens: int) -> int:
        """Leading pages no later step of a sequence with `num_computed_tokens` tokens
        computed reads: its next query, at p = num_computed_tokens, sees positions past
        p - window, so the pages wholly below p - window + 1 are passed. 0 while pages
        are kept."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.page_size

    def max_held_pages(self, num_new_tokens: int) -> int | None:
        """The most pages one sequence holds in a step that computes `num_new_tokens`
        tokens from p, its passed pages released: columns (p - W + 1) // S through
        (p + n - 1) // S, at most ceil((W + n - 2) / S) + 1. None while pages are kept."""
        if self.window is None:
            return None
        return pages_for(self.window + num_new_tokens - 2, self.page_size) + 1

    def release_passed(self, seq: Sequence) -> list[int]:
        """Returns the pages of `seq` that no later step reads (`num_passed_pages`) to the
        free list, their columns set to RELEASED_PAGE; the pages freed, in table order
        (none unless `releases(seq)`).

        As in `free`, ownership decides: a page another sequence owns is left alone.
        """
        if not self.releases(seq):
            return []
        first = seq.num_released_pages
        upto = min(self.num_passed_pages(seq.num_computed_tokens), len(seq.block_table))
        if upto <= first:
            return []
        tag = sequence_tag(seq)
        passed = dict.fromkeys(seq.block_table[first:upto])
        released = [p for p in passed if self.page_owner_host[p] == tag]
        if released:
            self.set_owner(released, FREE)
            self._free.extend(released)
        seq.block_table[first:upto] = [RELEASED_PAGE] * (upto - first)
        seq.num_released_pages = upto
        return released

    def set_owner(self, pages: list[int], tag: int, columns: list[int] | None = None) -> None:
        """Writes the ownership table, device copy and host mirror together, and the
        block-table columns the pages are handed out for (none when freeing)."""
        self.page_owner[pages] = tag
        self.page_owner_host[pages] = tag
        if columns is not None:
            self.page_column_host[pages] = columns
