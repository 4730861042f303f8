"""Test-only fault injection into a running engine's page bookkeeping.

Each fault breaks the invariant that a sequence touches only its own KV pages,
the way an allocator or block-table bug would; the engine's integrity checks
must catch it before any token of the faulty sequence's next step is sent.
Never used by the serving path.
"""

from __future__ import annotations

import random

from gpu_node.engine.llm_engine import LLMEngine
from scheduler.block_manager import FREE, sequence_tag
from scheduler.sequence import Sequence


class FaultInjector:
    def __init__(self, engine: LLMEngine, rng: random.Random):
        self.engine = engine
        self.block_manager = engine.block_manager
        self.rng = rng

    def _seq(self, request_id: str) -> Sequence:
        return self.engine._requests[request_id].seq

    def point_at_foreign_page(self, request_id: str, victim_id: str) -> int:
        """Points one of `request_id`'s block-table entries at a page of `victim_id`."""
        seq, victim = self._seq(request_id), self._seq(victim_id)
        page = self.rng.choice(victim.block_table)
        seq.block_table[self.rng.randrange(len(seq.block_table))] = page
        return page

    def free_page_under(self, request_id: str) -> int:
        """Frees one of a running sequence's pages behind its back (it stays in its table)."""
        seq = self._seq(request_id)
        page = self.rng.choice(seq.block_table)
        self.block_manager.set_owner([page], FREE)
        self.block_manager._free.appendleft(page)  # handed out again first
        return page

    def hand_page_twice(self, owner_id: str, other_id: str) -> int:
        """Hands a page `owner_id` holds to `other_id` as well, as a double allocation would."""
        owner, other = self._seq(owner_id), self._seq(other_id)
        page = self.rng.choice(owner.block_table)
        self.block_manager.set_owner([page], sequence_tag(other), [len(other.block_table)])
        other.block_table.append(page)
        return page
