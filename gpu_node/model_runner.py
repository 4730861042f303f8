"""Runs the model for one scheduled step: builds the flat inputs, checks page
ownership, returns logits and the sequences the kernels flagged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_node.attention import PagedAttention, StepMetadata
from gpu_node.kernels.paged_attention import check_page_ownership
from gpu_node.kv_cache import KVCache
from gpu_node.models.llama import LlamaModel
from scheduler.block_manager import sequence_tag
from scheduler.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [N, V], one row per chunk that completes its sequence
    violations: list[bool]  # per chunk: the kernels saw a page the sequence does not own


def repeated_pages(
    block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int
) -> torch.Tensor:
    """bool [B]: a sequence's used block-table entries name one page twice.

    Ownership tags cannot see this (the page is the sequence's own), yet two
    positions would then share one slot.
    """
    width = block_tables.shape[1]
    columns = torch.arange(width, device=block_tables.device)
    is_used = columns < ((context_lens.long() + page_size - 1) // page_size)[:, None]  # [B, M]
    pages = torch.where(is_used, block_tables.long(), -1 - columns)  # unused entries never collide
    ordered = pages.sort(dim=1).values
    return (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        page_owner: torch.Tensor,
        check_owner: bool = True,
    ):
        self.model = model
        self.check_owner = check_owner
        self.kv_cache = kv_cache
        self.page_owner = page_owner
        self.device = kv_cache.device
        self.scale = model.config.head_dim**-0.5

    def _tables(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        context_lens = [c.seq.num_computed_tokens + c.num_new_tokens for c in chunks]
        width = max(1, *(len(c.seq.block_table) for c in chunks))
        tables = torch.zeros((len(chunks), width), dtype=torch.int32)
        for i, c in enumerate(chunks):
            tables[i, : len(c.seq.block_table)] = torch.tensor(c.seq.block_table, dtype=torch.int32)
        seq_tags = torch.tensor([sequence_tag(c.seq) for c in chunks], dtype=torch.int64)
        return tables.to(self.device), context_lens, seq_tags.to(self.device)

    def find_violations(self, chunks: list[ScheduledChunk]) -> list[bool]:
        """Per chunk: does its sequence's block table reach a page it does not own?"""
        if not chunks:
            return []
        tables, context_lens, seq_tags = self._tables(chunks)
        lens = torch.tensor(context_lens, dtype=torch.int32, device=self.device)
        bad = check_page_ownership(tables, lens, self.kv_cache.page_size, self.page_owner, seq_tags)
        return (bad | repeated_pages(tables, lens, self.kv_cache.page_size)).tolist()

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
        tables, context_lens, seq_tags = self._tables(chunks)
        metadata = StepMetadata(
            query_lens=[c.num_new_tokens for c in chunks],
            context_lens=context_lens,
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            seq_tags=seq_tags,
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
