"""Runs the model for one scheduled step: builds the flat inputs, checks page
ownership, returns logits and the sequences the kernels flagged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from gpu_node.cache.kv_cache import KVCache
from gpu_node.engine.attention import ContextIndex, PagedAttention, StepMetadata, gathering_chunks
from gpu_node.engine.decode_graphs import (
    DecodeGraphs,
    DecodeInputs,
    GraphCaptureError,
    batch_bucket,
)
from gpu_node.engine.step_graphs import StepGraphs
from gpu_node.models.llama import LlamaModel
from scheduler.block_manager import sequence_tag
from scheduler.scheduler import ScheduledChunk


class StepBroadcast(Protocol):
    """Sends a step's inputs to the other ranks of a tensor-parallel group, which run the
    same forward on their shards (gpu_node/parallel/step.py StepSender)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
        logits_indices: torch.Tensor,
    ) -> None: ...


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [N, V], one row per chunk that completes its sequence
    violations: list[bool]  # per chunk: the kernels saw a page the sequence does not own


def find_violations_host(
    tables: np.ndarray, table_lens: np.ndarray, context_lens: np.ndarray, page_size: int,
    page_owner: np.ndarray, page_column: np.ndarray, seq_tags: np.ndarray,
    first_columns: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """bool [B]: within the first ceil(context_lens[b] / page_size) entries of sequence
    b's block table (tables[b, :table_lens[b]]), an entry names a page outside the
    pool, a page another tag owns, or one of its own pages at a column other than
    the one it was handed out for (`page_column`); or the table is too short.
    Columns before `first_columns[b]` (released pages, past every later window) are
    not the sequence's any more and never read, so not checked.

    Tags cannot see a page named twice (it is the sequence's own), yet two positions
    would then share one slot: the column rule catches that, with one more gather
    instead of a per-row sort (docs/benchmarks.md, `bench_paged_attention.py integrity-host`).
    """
    num_pages = len(page_owner)
    tables = np.asarray(tables, dtype=np.int64)
    columns = np.arange(tables.shape[1])
    needed = -(-context_lens // page_size)  # [B]
    # One pass per rule, in place, over [B, M] (at batch 64 x 32K tokens the table
    # has 131K entries, and each temporary costs about as much as a gather).
    # Out-of-range ids are clipped for the gathers and flagged by the range rule.
    is_bad = np.take(page_owner, tables, mode="clip") != seq_tags[:, None]
    is_bad |= np.take(page_column, tables, mode="clip") != columns
    is_bad |= tables.view(np.uint64) >= num_pages  # a negative id reads as a huge one
    if (needed < tables.shape[1]).any():  # entries past a sequence's context are not read
        is_bad &= columns[None, :] < needed[:, None]
    if first_columns is not None and first_columns.any():
        is_bad &= columns[None, :] >= first_columns[:, None]
    return is_bad.any(axis=1) | (needed > table_lens)


@dataclass(frozen=True)
class HostTables:
    """One step's block tables on the host, a row per chunk."""

    tables: np.ndarray  # int64 [B, M], padded with 0 past each table's length
    table_lens: np.ndarray  # int64 [B]
    context_lens: np.ndarray  # int64 [B] tokens in cache after this step's writes
    seq_tags: np.ndarray  # int64 [B] owner tags
    first_columns: np.ndarray  # int64 [B] leading columns released: never read nor checked

    def select(self, keep: list[bool]) -> HostTables:
        rows = np.asarray(keep, dtype=bool)
        return HostTables(
            self.tables[rows], self.table_lens[rows], self.context_lens[rows],
            self.seq_tags[rows], self.first_columns[rows],
        )  # fmt: skip


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        page_owner: torch.Tensor,
        page_owner_host: np.ndarray,
        page_column_host: np.ndarray,
        check_owner: bool = True,
    ):
        self.model = model
        # All-decode steps it takes replay CUDA graphs, steps that prefill piecewise ones
        # (set by the engine on a GPU).
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        # Under tensor parallelism (rank 0), what sends each step to the other ranks; such
        # steps run eagerly, never from the graphs (set by the engine).
        self.broadcast: StepBroadcast | None = None
        self.check_owner = check_owner
        self.kv_cache = kv_cache
        self.page_owner = page_owner
        self.page_owner_host = page_owner_host
        self.page_column_host = page_column_host
        self.device = kv_cache.device
        self.scale = model.config.attention_scale
        self.windows = model.config.layer_windows
        # Contexts longer than this are cut by a sliding layer's window: their steps attend
        # from gathered context (PagedAttention), never from the decode graphs. So do the
        # steps of sequences with released pages (longer than every window): the decode
        # kernels and graphs read and check a context from column 0, and released columns
        # name pages that are no longer the sequence's.
        self.window_from = min((w for w in self.windows if w is not None), default=None)

    def host_tables(self, chunks: list[ScheduledChunk]) -> HostTables:
        """The step's block tables on the host, built once for the check and the inputs."""
        table_lens = np.array([len(c.seq.block_table) for c in chunks], dtype=np.int64)
        tables = np.zeros((len(chunks), max(1, int(table_lens.max(initial=0)))), dtype=np.int64)
        for i, c in enumerate(chunks):
            tables[i, : table_lens[i]] = c.seq.block_table
        context_lens = np.array(
            [c.seq.num_computed_tokens + c.num_new_tokens for c in chunks], dtype=np.int64
        )
        seq_tags = np.array([sequence_tag(c.seq) for c in chunks], dtype=np.int64)
        first_columns = np.array([c.seq.num_released_pages for c in chunks], dtype=np.int64)
        return HostTables(tables, table_lens, context_lens, seq_tags, first_columns)

    def find_violations(
        self, chunks: list[ScheduledChunk], tables: HostTables | None = None
    ) -> list[bool]:
        """Per chunk: does its block table break the ownership rules (`find_violations_host`)?

        Runs on the host mirror of the ownership table, so it never waits for the
        device; the kernels check the device copy again as they read and write.
        """
        if not chunks:
            return []
        t = tables if tables is not None else self.host_tables(chunks)
        bad = find_violations_host(
            t.tables, t.table_lens, t.context_lens, self.kv_cache.page_size,
            self.page_owner_host, self.page_column_host, t.seq_tags, t.first_columns,
        )  # fmt: skip
        return bad.tolist()

    def prepare(
        self, chunks: list[ScheduledChunk], tables: HostTables | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """The step's flat inputs on the device: token ids [T], positions [T] and the
        attention's metadata, built on the host with one copy of the per-token rows."""
        page_size = self.kv_cache.page_size
        t = tables if tables is not None else self.host_tables(chunks)
        query_lens = [c.num_new_tokens for c in chunks]
        starts = np.array([c.seq.num_computed_tokens for c in chunks], dtype=np.int64)
        token_seq = np.repeat(np.arange(len(chunks)), query_lens)
        positions = np.arange(len(token_seq)) - np.repeat(
            np.cumsum(query_lens) - query_lens - starts, query_lens
        )
        columns = positions // page_size
        if (columns >= t.table_lens[token_seq]).any():
            raise ValueError("a chunk's tokens reach past its block table")
        rows = np.empty((4, len(token_seq)), dtype=np.int64)  # ids, positions, slots, seq
        rows[0] = [
            i
            for c, s in zip(chunks, starts, strict=True)
            for i in c.seq.token_ids[s : s + c.num_new_tokens]
        ]
        rows[1] = positions
        rows[2] = t.tables[token_seq, columns] * page_size + positions % page_size
        rows[3] = token_seq
        flat = torch.from_numpy(rows).to(self.device)
        gathers = gathering_chunks(query_lens, self.kv_cache.uses_kernels)
        metadata = StepMetadata(
            query_lens=query_lens,
            context_lens=t.context_lens.tolist(),
            block_tables=torch.from_numpy(t.tables.astype(np.int32)).to(self.device),
            slot_mapping=flat[2],
            seq_tags=torch.from_numpy(t.seq_tags).to(self.device),
            token_seq=flat[3],
            page_owner=self.page_owner,
            context_index=ContextIndex.on_host(
                t.tables, t.context_lens, gathers, page_size, self.kv_cache.num_pages, self.device
            )
            if gathers
            else None,
        )
        return flat[0], flat[1], metadata

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], tables: HostTables | None = None) -> StepResult:
        """Computes the chunks' KV; returns logits for the chunks that complete a sequence."""
        t = tables if tables is not None else self.host_tables(chunks)
        completing = [i for i, c in enumerate(chunks) if c.completes_sequence]
        windowed = (
            self.window_from is not None and int(t.context_lens.max()) > self.window_from
        ) or bool(t.first_columns.any())
        if self.graphs is not None and not windowed:
            positions = np.array([c.seq.num_computed_tokens for c in chunks], dtype=np.int64)
            if self.graphs.takes([c.num_new_tokens for c in chunks], positions, t.table_lens):
                try:
                    return self._run_decode_graph(self.graphs, chunks, positions, t, completing)
                except GraphCaptureError:
                    pass  # logged; this step and every later one run eagerly
        ids, pos, metadata = self.prepare(chunks, t)
        ends = np.cumsum(metadata.query_lens) - 1
        logits_indices = torch.from_numpy(ends[completing]).to(self.device)
        if self.broadcast is not None:  # the other ranks run this step on their shards too
            self.broadcast(ids, pos, metadata, logits_indices)
        attention = PagedAttention(
            self.kv_cache, metadata, self.scale, self.check_owner, self.windows
        )
        step_graphs = self.step_graphs
        if step_graphs is not None and step_graphs.takes(len(ids)):
            logits = step_graphs.run(ids, pos, attention, logits_indices)
        else:
            logits = self.model(ids, pos, attention, logits_indices=logits_indices)
        return StepResult(logits, (attention.violations > 0).tolist())

    def _run_decode_graph(
        self,
        graphs: DecodeGraphs,
        chunks: list[ScheduledChunk],
        positions: np.ndarray,
        t: HostTables,
        completing: list[int],
    ) -> StepResult:
        """One all-decode step through `graphs`: chunk i is the token at `positions[i]`;
        logits come back for the chunks at `completing`."""
        page_size = self.kv_cache.page_size
        ids = np.array([c.seq.token_ids[p] for c, p in zip(chunks, positions, strict=True)])
        slots = t.tables[np.arange(len(chunks)), positions // page_size] * page_size + (
            positions % page_size
        )
        bucket = batch_bucket(len(chunks), graphs.max_batch)
        assert bucket is not None  # graphs.takes checked it
        inputs = DecodeInputs.padded(
            ids, positions, slots, t.tables, t.context_lens, t.seq_tags, bucket, graphs.width
        )
        logits, violations = graphs.run(inputs, len(chunks))
        rows = torch.tensor(completing, dtype=torch.long, device=logits.device)
        return StepResult(logits.index_select(0, rows), (violations[: len(chunks)] > 0).tolist())
