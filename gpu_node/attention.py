"""Paged attention for one engine step (the torch path; kernels plug in on a GPU).

Each step's tokens are flattened across sequences; `StepMetadata` says which
rows belong to which sequence and where their K/V go. Attention is computed
per sequence over exactly its own context, so a sequence's numbers do not
depend on what else is in the batch (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_node.kv_cache import KVCache


@dataclass(frozen=True)
class StepMetadata:
    query_lens: list[int]  # new tokens per sequence, in row order
    context_lens: list[int]  # tokens in cache per sequence after this step's writes
    block_tables: list[torch.Tensor]  # int64 page ids per sequence (covering its context)
    slot_mapping: torch.Tensor  # int64 [T]


class PagedAttention:
    """The `AttentionBackend` the model calls: write this step's K/V, then attend."""

    def __init__(self, kv_cache: KVCache, metadata: StepMetadata, scale: float):
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.scale = scale

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q [T, H, E], k/v [T, K, E]
        md = self.metadata
        self.kv_cache.write(layer, k, v, md.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for query_len, context_len, pages in zip(
            md.query_lens, md.context_lens, md.block_tables, strict=True
        ):
            end = start + query_len
            keys, values = self.kv_cache.gather(layer, pages, context_len, q.dtype)  # [L, K, E]
            out[start:end] = attend_ref(q[start:end], keys, values, self.scale)
            start = end
        return out


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last `n` positions of a context over all of it.

    q [n, H, E] are the queries of context positions L-n .. L-1; k, v [L, K, E].
    """
    n, length = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H|K, n|L, E]
    mask = None
    if n > 1:
        # query i sits at position L-n+i and sees keys 0 .. L-n+i
        rows = torch.arange(n, device=q.device)[:, None] + (length - n)
        mask = torch.arange(length, device=q.device)[None, :] <= rows  # [n, L]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [n, H, E]
