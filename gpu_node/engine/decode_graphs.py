"""Decode steps replayed from CUDA graphs.

An eager decode step on a GPU launches a few hundred kernels, one after another from
Python: at SmolLM2's size the host takes far longer to launch them than the GPU to
run them. A CUDA graph records one step's launches once and replays them with one
call. A graph replays fixed shapes and addresses, so:

- the step's inputs live in static buffers, padded to a batch bucket (1, 2, 4, ...
  up to `max_batch`); a pad row writes nothing (slot -1), attends over one token of
  page 0 under a tag no page has (`PAD_TAG`), and its outputs are dropped;
- the block tables live in a buffer as wide as `max_model_len` allows; a step writes
  its own width, since the kernels never read a row past its context;
- the attention kernels' split grid is sized from a context bound (`context_bucket`:
  powers of two from `MIN_CONTEXT` to `max_model_len`), so there is a graph per
  (batch bucket, context bucket), captured the first time a step needs it. The graphs
  share one memory pool: a replay's outputs are read before the next replay.

Page ownership is checked as in an eager step: the host check before the step is
unchanged, and the captured kernels check every write and read against the device
copy of the ownership table, which the graph reads at replay.

Prefill steps, steps with a chunk of more than one token, and models that cannot be
captured (float MoE experts, whose reference path syncs with the host) run eagerly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_node.cache.kv_cache import KVCache
from gpu_node.engine.attention import PagedAttention, StepMetadata
from gpu_node.models.llama import LlamaModel

if TYPE_CHECKING:
    from gpu_node.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

PAD_TAG = -1  # owns no page: owner tags are > 0 and FREE is 0
MIN_CONTEXT = 256


class GraphCaptureError(RuntimeError):
    """A decode step could not be recorded; the graphs are off and steps run eagerly."""


def batch_bucket(batch: int, max_batch: int) -> int | None:
    """The smallest power of two >= `batch`, capped at `max_batch`; None past it."""
    if batch < 1 or batch > max_batch:
        return None
    return min(1 << (batch - 1).bit_length(), max_batch)


def context_bucket(max_context: int, max_model_len: int) -> int:
    """The context bound a step's graph is captured for: the smallest power of two
    >= `max_context` (and >= MIN_CONTEXT), capped at `max_model_len`."""
    bound = max(MIN_CONTEXT, 1 << max(0, max_context - 1).bit_length())
    return min(bound, max_model_len)


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step's inputs on the host, a row per sequence, padded to a bucket."""

    ids: np.ndarray  # int64 [b]
    positions: np.ndarray  # int64 [b]
    slots: np.ndarray  # int64 [b], -1 in pad rows
    tables: np.ndarray  # int32 [b, w] (w: the step's widest table), 0 past each table
    context_lens: np.ndarray  # int32 [b]
    seq_tags: np.ndarray  # int64 [b]

    @classmethod
    def padded(
        cls,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        context_lens: np.ndarray,
        seq_tags: np.ndarray,
        batch: int,
        width: int,
    ) -> DecodeInputs:
        """The first len(ids) rows are the step's own; the rest, up to `batch`, are pad
        rows: token 0 at position 0, no write, one token of page 0, tag PAD_TAG."""
        n, w = tables.shape
        if n > batch or w > width:
            raise ValueError(f"{n} rows of {w} pages do not fit a bucket of {batch} x {width}")
        # The step's own width only: the kernels read a row's first ceil(context / page)
        # entries, so the static table's columns past it are never read.
        padded_tables = np.zeros((batch, max(w, 1)), dtype=np.int32)
        padded_tables[:n, :w] = tables
        return cls(
            ids=_pad(ids, batch, 0, np.int64),
            positions=_pad(positions, batch, 0, np.int64),
            slots=_pad(slots, batch, -1, np.int64),
            tables=padded_tables,
            context_lens=_pad(context_lens, batch, 1, np.int32),
            seq_tags=_pad(seq_tags, batch, PAD_TAG, np.int64),
        )


def _pad(values: np.ndarray, size: int, fill: int, dtype: type) -> np.ndarray:
    out: np.ndarray = np.full(size, fill, dtype=dtype)
    out[: len(values)] = values
    return out


def capturable(model: LlamaModel) -> bool:
    """Whether a decode step of `model` can be recorded: nothing in its forward may wait
    for the host. Float MoE experts off CUDA run their reference loop, which does."""
    from gpu_node.models.moe import MoeExperts

    return not any(isinstance(m, MoeExperts) and m.waits_for_host for m in model.modules())


class DecodeGraphs:
    """Runs all-decode steps of up to `max_batch` sequences from captured graphs.

    `capture=False` runs the same padded, static-buffer step eagerly (any device): the
    tests use it on CPU to check the padding and the row selection against the
    engine's own step.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        page_owner: torch.Tensor,
        scale: float,
        check_owner: bool,
        max_batch: int,
        max_model_len: int,
        capture: bool = True,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.kv_cache = kv_cache
        self.page_owner = page_owner
        self.scale = scale
        self.check_owner = check_owner
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.capture = capture
        self.width = math.ceil(max_model_len / kv_cache.page_size)
        device = kv_cache.device
        self._ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self._tables = torch.zeros(max_batch, self.width, dtype=torch.int32, device=device)
        self._context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self._seq_tags = torch.full((max_batch,), PAD_TAG, dtype=torch.long, device=device)
        self._rows = torch.arange(max_batch, dtype=torch.long, device=device)
        # (batch bucket, context bucket) -> (graph, logits [b, V], violations [b])
        self._graphs: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        self._pool = None
        self.disabled = False  # set when a capture failed: every step runs eagerly then

    @classmethod
    def for_runner(
        cls, runner: ModelRunner, max_batch: int, max_model_len: int, capture: bool = True
    ) -> DecodeGraphs:
        """Graphs over `runner`'s model, pool, ownership table and settings."""
        return cls(
            runner.model, runner.kv_cache, runner.page_owner, runner.scale, runner.check_owner,
            max_batch, max_model_len, capture,
        )  # fmt: skip

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch bucket, context bucket) of each graph captured so far, sorted."""
        return sorted(self._graphs)

    def replay_last(self) -> None:
        """Replays the graph captured last, on whatever the static buffers hold (benchmarks:
        the GPU's share of a step without the host's)."""
        graph, _, _ = next(reversed(self._graphs.values()))
        graph.replay()

    def takes(self, query_lens: list[int], positions: np.ndarray, table_lens: np.ndarray) -> bool:
        """Whether a step of chunks of `query_lens` tokens, the first at `positions`, over
        block tables of `table_lens` pages, is an all-decode step a graph can run: each
        token's page within its table, each table within the padded width."""
        return (
            not self.disabled
            and batch_bucket(len(query_lens), self.max_batch) is not None
            and all(n == 1 for n in query_lens)
            and bool((table_lens <= self.width).all())
            and bool((positions < table_lens * self.kv_cache.page_size).all())
        )

    def run(self, inputs: DecodeInputs, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, V] float32, violations int32 [b]) of a padded step; rows past
        `num_rows` are pads. The tensors are the graph's own outputs: read them before the
        next step."""
        b = len(inputs.ids)
        bound = context_bucket(int(inputs.context_lens[:num_rows].max()), self.max_model_len)
        self._stage(inputs)
        if not self.capture:
            return self._forward(b, inputs.context_lens.tolist(), bound)
        key = (b, bound)
        if key not in self._graphs:
            self._graphs[key] = self._record(b, inputs.context_lens.tolist(), bound)
        graph, logits, violations = self._graphs[key]
        graph.replay()
        return logits, violations

    def _stage(self, inputs: DecodeInputs) -> None:
        b, w = inputs.tables.shape
        for static, values in (
            (self._ids, inputs.ids), (self._positions, inputs.positions),
            (self._slots, inputs.slots), (self._context_lens, inputs.context_lens),
            (self._seq_tags, inputs.seq_tags),
        ):  # fmt: skip
            static[:b].copy_(torch.from_numpy(values))
        self._tables[:b, :w].copy_(torch.from_numpy(inputs.tables))

    def _forward(
        self, b: int, context_lens: list[int], bound: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over the static buffers' first `b` rows. `context_lens` (host) serves
        the CPU attention only; the kernels read the device copy, their grid sized by
        `bound`, so a replay whatever the lengths runs what was captured."""
        metadata = StepMetadata(
            query_lens=[1] * b,
            context_lens=context_lens,
            block_tables=self._tables[:b],
            slot_mapping=self._slots[:b],
            seq_tags=self._seq_tags[:b],
            token_seq=self._rows[:b],
            page_owner=self.page_owner,
            context_lens_device=self._context_lens[:b],
            max_context_len=bound,
        )
        attention = PagedAttention(self.kv_cache, metadata, self.scale, self.check_owner)
        logits = self.model(self._ids[:b], self._positions[:b], attention)
        return logits, attention.violations

    def _record(
        self, b: int, context_lens: list[int], bound: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """Captures the step of `b` rows whose contexts are at most `bound` tokens. The
        staged inputs are the step about to run; warming up on them is harmless, since a
        decode step's writes are its own tokens' K/V, rewritten by the replay."""

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            return self._forward(b, context_lens, bound)

        side = torch.cuda.Stream(self.kv_cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits, violations = step()
        except RuntimeError as exc:  # the step did something a graph cannot record
            self.disabled = True
            log.exception("decode graph capture failed; decode steps run eagerly from now on")
            raise GraphCaptureError(str(exc)) from exc
        log.info("captured the decode graph for %d rows, contexts up to %d", b, bound)
        return graph, logits, violations
