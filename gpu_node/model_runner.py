"""Runs the model for one scheduled step: builds the flat inputs, returns logits."""

from __future__ import annotations

import torch

from gpu_node.attention import PagedAttention, StepMetadata
from gpu_node.kv_cache import KVCache
from gpu_node.models.llama import LlamaModel
from scheduler.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device | str = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.scale = model.config.head_dim**-0.5

    def prepare(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        page_size = self.kv_cache.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, block_tables = [], [], []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(
                table[i // page_size] * page_size + i % page_size for i in range(start, end)
            )
            query_lens.append(chunk.num_new_tokens)
            context_lens.append(end)
            num_pages = -(-end // page_size)
            block_tables.append(
                torch.tensor(table[:num_pages], dtype=torch.long, device=self.device)
            )
        metadata = StepMetadata(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, metadata

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Computes the chunks' KV; returns logits [N, V] for the chunks that complete a sequence."""
        ids, pos, metadata = self.prepare(chunks)
        ends = torch.tensor(metadata.query_lens, device=self.device).cumsum(0) - 1
        completing = [i for i, c in enumerate(chunks) if c.completes_sequence]
        attention = PagedAttention(self.kv_cache, metadata, self.scale)
        return self.model(ids, pos, attention, logits_indices=ends[completing])
