"""A step's model inputs, broadcast from rank 0 (where the scheduler and the runner build
them) to the ranks that run the same forward on their shards.

A step crosses in three broadcasts from rank 0, all int64:

    header  cpu group     [8]   kind, T, B, M, P, L, has context index, C
    host    cpu group     [2B]  query_lens, context_lens           (lists in StepMetadata)
    payload device group  [4T + BM + B + P + L + 2C]
            input_ids [T] | positions [T] | slot_mapping [T] | token_seq [T] |
            block_tables [B, M] | seq_tags [B] | page_owner [P] | logits_indices [L] |
            context index [2, C] (pages row, then offsets row)

Letters: T tokens, B sequences, M block-table width, P pool pages, L rows sampled from,
C context tokens of the gathering chunks. A header of kind STOP ends a worker's loop.

Every rank gets the same block tables, tags and ownership table, so every rank's
kernels flag the same sequences: rank 0's violations stand for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from gpu_node.engine.attention import ContextIndex, StepMetadata, gathering_chunks
from gpu_node.parallel.group import ParallelGroup

STOP, STEP = 0, 1
HEADER_SIZE = 8


@dataclass(frozen=True)
class StepInputs:
    """What a rank's forward takes for one step."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: StepMetadata
    logits_indices: torch.Tensor  # int64 [L]


class StepSender:
    """Rank 0's side: the runner calls it with each eager step's inputs before running it
    (ModelRunner.broadcast); `stop()` ends the other ranks' loops."""

    def __init__(self, group: ParallelGroup):
        if group.rank != 0:
            raise ValueError(f"steps are sent from rank 0, not rank {group.rank}")
        self.group = group

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
        logits_indices: torch.Tensor,
    ) -> None:
        md = metadata
        index = md.context_index
        b, m = md.block_tables.shape
        header = torch.tensor(
            [
                STEP, len(input_ids), b, m, len(md.page_owner), len(logits_indices),
                index is not None, 0 if index is None else index.index.shape[1],
            ],
            dtype=torch.int64,
        )  # fmt: skip
        dist.broadcast(header, 0, group=self.group.cpu_group)
        host = torch.tensor([*md.query_lens, *md.context_lens], dtype=torch.int64)
        dist.broadcast(host, 0, group=self.group.cpu_group)
        parts = [
            input_ids, positions, md.slot_mapping, md.token_seq,
            md.block_tables.flatten().long(), md.seq_tags, md.page_owner, logits_indices,
        ]  # fmt: skip
        if index is not None:
            parts.append(index.index.flatten())
        payload = torch.cat([p.to(self.group.device, torch.int64) for p in parts])
        dist.broadcast(payload, 0, group=self.group.device_group)

    def stop(self) -> None:
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        header[0] = STOP
        dist.broadcast(header, 0, group=self.group.cpu_group)


class StepReceiver:
    """A worker rank's side: each step's inputs as rank 0 built them."""

    def __init__(self, group: ParallelGroup, uses_kernels: bool):
        """`uses_kernels`: the rank's KV pool runs the GPU kernels (KVCache.uses_kernels),
        which decides the chunks that gather their context, as on rank 0."""
        self.group = group
        self.uses_kernels = uses_kernels

    def receive(self) -> StepInputs | None:
        """The next step's inputs; None once rank 0 has stopped."""
        header = torch.empty(HEADER_SIZE, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group.cpu_group)
        kind, t, b, m, p, n_logits, has_index, c = header.tolist()
        if kind == STOP:
            return None
        host = torch.empty(2 * b, dtype=torch.int64)
        dist.broadcast(host, 0, group=self.group.cpu_group)
        query_lens, context_lens = host[:b].tolist(), host[b:].tolist()
        payload = torch.empty(
            4 * t + b * m + b + p + n_logits + 2 * c, dtype=torch.int64, device=self.group.device
        )
        dist.broadcast(payload, 0, group=self.group.device_group)
        ids, positions, slots, token_seq, tables, tags, owner, logits_indices, index = (
            payload.split([t, t, t, t, b * m, b, p, n_logits, 2 * c])
        )
        context_index = None
        if has_index:
            chunks = gathering_chunks(query_lens, self.uses_kernels)
            starts = np.cumsum([0, *(context_lens[i] for i in chunks)])[:-1].tolist()
            context_index = ContextIndex(index.view(2, c), dict(zip(chunks, starts, strict=True)))
        metadata = StepMetadata(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables.view(b, m).to(torch.int32),
            slot_mapping=slots,
            seq_tags=tags,
            token_seq=token_seq,
            page_owner=owner,
            context_index=context_index,
        )
        return StepInputs(ids, positions, metadata, logits_indices)
