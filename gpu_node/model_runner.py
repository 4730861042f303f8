"""Runs the model for one scheduled step: builds the flat inputs, checks page
ownership, returns logits and the sequences the kernels flagged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_node.attention import PagedAttention, StepMetadata
from gpu_node.kv_cache import KVCache
from gpu_node.models.llama import LlamaModel
from scheduler.block_manager import sequence_tag
from scheduler.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [N, V], one row per chunk that completes its sequence
    violations: list[bool]  # per chunk: the kernels saw a page the sequence does not own


def find_violations_host(
    tables: np.ndarray, table_lens: np.ndarray, context_lens: np.ndarray, page_size: int,
    page_owner: np.ndarray, seq_tags: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """bool [B]: sequence b's block table (tables[b, :table_lens[b]]) reaches a page outside
    the pool, a page another tag owns, or one page twice, within its first
    ceil(context_lens[b] / page_size) entries, or is too short to cover them.

    Tags cannot see a page named twice (it is the sequence's own), yet two positions
    would then share one slot, hence the third rule.
    """
    num_pages = len(page_owner)
    columns = np.arange(tables.shape[1])
    needed = -(-context_lens // page_size)  # [B]
    is_used = columns[None, :] < needed[:, None]  # [B, M]
    in_range = (tables >= 0) & (tables < num_pages)
    owners = page_owner[np.clip(tables, 0, num_pages - 1)]
    is_foreign = is_used & (~in_range | (owners != seq_tags[:, None]))
    marked = np.where(is_used, tables, -1 - columns[None, :])  # unused entries never collide
    ordered = np.sort(marked, axis=1)
    is_repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    return is_foreign.any(axis=1) | is_repeated | (needed > table_lens)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        page_owner: torch.Tensor,
        page_owner_host: np.ndarray,
        check_owner: bool = True,
    ):
        self.model = model
        self.check_owner = check_owner
        self.kv_cache = kv_cache
        self.page_owner = page_owner
        self.page_owner_host = page_owner_host
        self.device = kv_cache.device
        self.scale = model.config.head_dim**-0.5

    def _host_tables(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tables int64 [B, M] padded with 0, table lengths [B], context lengths [B], tags [B])."""
        table_lens = np.array([len(c.seq.block_table) for c in chunks], dtype=np.int64)
        tables = np.zeros((len(chunks), max(1, int(table_lens.max(initial=0)))), dtype=np.int64)
        for i, c in enumerate(chunks):
            tables[i, : table_lens[i]] = c.seq.block_table
        context_lens = np.array(
            [c.seq.num_computed_tokens + c.num_new_tokens for c in chunks], dtype=np.int64
        )
        seq_tags = np.array([sequence_tag(c.seq) for c in chunks], dtype=np.int64)
        return tables, table_lens, context_lens, seq_tags

    def find_violations(self, chunks: list[ScheduledChunk]) -> list[bool]:
        """Per chunk: does its block table break the ownership rules (`find_violations_host`)?

        Runs on the host mirror of the ownership table, so it never waits for the
        device; the kernels check the device copy again as they read and write.
        """
        if not chunks:
            return []
        tables, table_lens, context_lens, seq_tags = self._host_tables(chunks)
        bad = find_violations_host(
            tables,
            table_lens,
            context_lens,
            self.kv_cache.page_size,
            self.page_owner_host,
            seq_tags,
        )
        return bad.tolist()

    def prepare(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        page_size = self.kv_cache.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_seq: list[int] = []
        for i, chunk in enumerate(chunks):
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(
                table[p // page_size] * page_size + p % page_size for p in range(start, end)
            )
            token_seq.extend([i] * chunk.num_new_tokens)
        tables, _, context_lens, seq_tags = self._host_tables(chunks)
        metadata = StepMetadata(
            query_lens=[c.num_new_tokens for c in chunks],
            context_lens=context_lens.tolist(),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            seq_tags=torch.from_numpy(seq_tags).to(self.device),
            token_seq=torch.tensor(token_seq, dtype=torch.long, device=self.device),
            page_owner=self.page_owner,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, metadata

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepResult:
        """Computes the chunks' KV; returns logits for the chunks that complete a sequence."""
        ids, pos, metadata = self.prepare(chunks)
        ends = torch.tensor(metadata.query_lens, device=self.device).cumsum(0) - 1
        completing = [i for i, c in enumerate(chunks) if c.completes_sequence]
        attention = PagedAttention(self.kv_cache, metadata, self.scale, self.check_owner)
        logits = self.model(ids, pos, attention, logits_indices=ends[completing])
        return StepResult(logits, (attention.violations > 0).tolist())
