"""Decides, step by step, which sequences run and how many tokens each computes.

Continuous batching: sequences join and leave the running set between steps.
Each step packs decode tokens and prefill chunks under a token budget
(`max_num_batched_tokens`): decode tokens first, oldest first, then prefill
chunks, so a long prompt is prefilled in chunks while earlier requests keep
decoding.

Fair prefill: a prompt with more than `long_prefill_tokens` left to compute is
long. While other prefill work waits, a long prefill gets at most that many
tokens at first, and at most `max_long_prefills` long prompts prefill at once;
short prompts behind a long one in the queue are admitted past it. What budget
is left then goes back to the prefills already running, oldest first, and then
to long prompts still waiting, so the budget is never left idle. A short
request arriving behind a long prompt answers its first token within a step or
two instead of after the whole long prefill, and the long prompt is never
starved: it always gets its share.

Memory-aware admission: a waiting sequence is admitted only when the pages for
its whole prompt fit with `reserve_pages` left over (the reserve is headroom
for running sequences' decode growth, so none is kept while none runs). No
sequence is admitted past one that does not fit (memory is handed out in
arrival order). When a running sequence
needs a page and none is free, the newest running sequence is preempted: its
pages are freed and it goes back to the front of the queue to be recomputed.

Where the block manager releases passed pages (a model whose every layer has a
sliding window), a sequence never holds more than its window and one chunk. It is
admitted when the pages of its window are free (ceil((W - 1) / S) + 1, or its
whole sequence's where fewer), taking those of its first chunk only; each later
chunk takes its own as it comes, shrunk to the pages free before anyone is
preempted for it. A sequence that keeps its pages (a prefill for a decode node)
is admitted as anywhere else.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager, pages_for
from scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    reserve_pages: int = 0
    # A prompt with more tokens than this left to compute is long (see the module's
    # docstring); None: a quarter of the budget. 0 turns fair prefill off: prefills then
    # run in arrival order, each taking all the budget it can.
    long_prefill_tokens: int | None = None
    max_long_prefills: int = 1

    def __post_init__(self) -> None:
        if (
            self.max_num_seqs <= 0
            or self.max_num_batched_tokens <= 0
            or self.reserve_pages < 0
            or (self.long_prefill_tokens is not None and self.long_prefill_tokens < 0)
            or self.max_long_prefills <= 0
        ):
            raise ValueError(f"invalid scheduler config: {self}")

    @property
    def long_prefill_threshold(self) -> int:
        """Tokens left above which a prefill is long; 0 when fair prefill is off."""
        if self.long_prefill_tokens is None:
            return max(1, self.max_num_batched_tokens // 4)
        return self.long_prefill_tokens


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
        step = _Step(self.config.max_num_batched_tokens)
        threshold = self.config.long_prefill_threshold

        # Decode tokens first: each running sequence with one token left.
        for seq in list(self.running):
            if step.budget == 0:
                break
            if seq in self.running and _left(seq) <= 1:
                self._take(step, seq, 1)
        # Prefill chunks of running sequences, oldest first; while other prefill work
        # waits, a long one is held to its share. Their pages were taken at admission,
        # except where passed pages are released: there a chunk may preempt.
        prefilling = [s for s in self.running if _left(s) > 1]
        contended = threshold > 0 and (len(prefilling) > 1 or bool(self.waiting))
        for seq in prefilling:
            if step.budget == 0:
                break
            if seq in self.running:
                self._take(step, seq, min(_left(seq), threshold if contended else step.budget))
        # Nothing is admitted in a step that had to preempt: memory is short.
        if not step.out.preempted:
            num_long = sum(1 for s in prefilling if _left(s) > threshold)
            passed_over = self._admit(step, threshold, num_long)
            # The budget left goes to the prefills under way, oldest first, then to the
            # long prompts that were passed over.
            for seq in list(step.sizes):
                if step.budget == 0:
                    break
                self._take(step, seq, _left(seq) - step.sizes[seq], may_preempt=False)
            if passed_over:
                self._admit(step, 0, 0, passed_over)
        step.out.chunks = [ScheduledChunk(seq, n) for seq, n in step.sizes.items()]
        return step.out

    def _admit(
        self, step: _Step, threshold: int, num_long: int, only: list[Sequence] | None = None
    ) -> list[Sequence]:
        """Admits waiting sequences in order while budget, slots and pages last, and returns
        the long ones passed over because `max_long_prefills` long prompts already prefill
        (none when `threshold` is 0). `only`: admit from these alone."""
        passed_over: list[Sequence] = []
        for seq in list(self.waiting):
            if step.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if only is not None and seq not in only:
                continue
            is_long = threshold > 0 and _left(seq) > threshold
            # The reserve is headroom for running sequences' growth: with none running it
            # guards nothing, and would keep a prompt (or a preempted sequence, grown since)
            # that fits the pool only without it waiting for good.
            reserve = self.config.reserve_pages if self.running else 0
            num_new = self._admitted_chunk(
                seq, min(_left(seq), threshold if is_long else step.budget), reserve
            )
            if num_new == 0:
                break  # nothing behind it takes the memory it waits for
            if is_long and num_long >= self.config.max_long_prefills:
                passed_over.append(seq)
                continue
            admitted_tokens = (
                seq.num_computed_tokens + num_new
                if self.block_manager.releases(seq)
                else seq.num_tokens
            )
            if self.block_manager.allocate(seq, admitted_tokens, reserve) is None:
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.out.admitted.append(seq)
            self._take(step, seq, num_new)
            num_long += is_long
        return passed_over

    def _admitted_chunk(self, seq: Sequence, num_new: int, reserve: int) -> int:
        """How many of `num_new` tokens `seq` can be admitted with, `reserve` pages left
        free (0: it does not fit): all of them when the pages of its whole sequence fit.
        Where passed pages are released, when the pages of its window fit (what it holds
        computing a token at a time, so it is not admitted only to be preempted), as many
        as the free pages hold."""
        bm = self.block_manager
        window_pages = bm.max_held_pages(1)
        if window_pages is None or not bm.releases(seq):
            return num_new if bm.can_allocate(seq, seq.num_tokens, reserve) else 0
        needed = min(pages_for(seq.num_tokens, bm.page_size), window_pages)
        if needed + reserve > bm.num_free_pages:
            return 0
        return max(0, min(num_new, bm.num_fitting_tokens(seq, seq.num_computed_tokens, reserve)))

    def _take(self, step: _Step, seq: Sequence, num_more: int, may_preempt: bool = True) -> None:
        """Schedules up to `num_more` more tokens of `seq` within the budget: as many as the
        free pages hold, or else one, preempting the newest running sequences while its
        pages are short (perhaps `seq` itself; none unless `may_preempt`)."""
        num_more = min(num_more, step.budget)
        scheduled = step.sizes.get(seq, 0)
        # Only where passed pages are released does a prefill chunk find its pages short
        # (elsewhere admission took them all): it takes what is free before preempting.
        fitting = self.block_manager.num_fitting_tokens(seq, seq.num_computed_tokens + scheduled)
        if fitting < num_more:
            num_more = fitting if fitting > 0 or not may_preempt else min(num_more, 1)
        if num_more <= 0:
            return
        while (
            self.block_manager.allocate(seq, seq.num_computed_tokens + scheduled + num_more) is None
        ):
            victim = self.running[-1]
            self._preempt(victim)
            step.out.preempted.append(victim)
            step.budget += step.sizes.pop(victim, 0)
            if victim is seq:
                return
        step.sizes[seq] = scheduled + num_more
        step.budget -= num_more

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


def _left(seq: Sequence) -> int:
    """Tokens of `seq` whose KV is not computed yet."""
    return seq.num_tokens - seq.num_computed_tokens


@dataclass
class _Step:
    """One schedule being built: the budget left and the tokens given to each sequence,
    in batch order."""

    budget: int
    sizes: dict[Sequence, int] = field(default_factory=dict)
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
