"""Decides, step by step, which sequences run and how many tokens each computes.

Continuous batching: sequences join and leave the running set between steps.
Each step packs decode tokens and prefill chunks under a token budget
(`max_num_batched_tokens`); running sequences go first, oldest first, so a
long prompt is prefilled in chunks while earlier requests keep decoding.

Memory-aware admission: a waiting sequence is admitted only when the pages for
its whole prompt fit with `reserve_pages` left over (the reserve is headroom
for running sequences' decode growth). When a running sequence needs a page
and none is free, the newest running sequence is preempted: its pages are
freed and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    reserve_pages: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.reserve_pages < 0:
            raise ValueError(f"invalid scheduler config: {self}")


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq`, starting at `seq.num_computed_tokens`."""

    seq: Sequence
    num_new_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Removes `seq` wherever it is and frees its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[Sequence] = []

        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self.block_manager.allocate(seq, seq.num_computed_tokens + num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.chunks.append(ScheduledChunk(seq, num_new))
                scheduled.append(seq)
                budget -= num_new

        # Nothing is admitted in a step that had to preempt: memory is short.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            pages = self.block_manager.allocate(seq, seq.num_tokens, self.config.reserve_pages)
            if pages is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
