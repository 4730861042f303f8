"""Paged attention for one engine step.

Each step's tokens are flattened across sequences; `StepMetadata` says which
rows belong to which sequence, where their K/V go and which owner tag each
sequence carries. On a GPU, every decode row (one query) runs the Triton paged
decode kernel (ownership check fused), in one launch for all of them, in a
decode-only step as in a step that also prefills; a prefill chunk's attention
is computed per sequence over exactly its own context. Either way a sequence's
numbers do not depend on what else is in the batch (batch invariance), and a
mixed step's decode rows cost one launch a layer, not a few per sequence. On a
GPU a prefill chunk takes SDPA's fused kernels (`attend_fused`); on the CPU the
reference (`attend_ref`), whose numbers the CPU tests pin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from gpu_node.cache.kv_cache import KVCache
from gpu_node.kernels import cpu as cpu_kernels
from gpu_node.kernels.paged_attention.dot import paged_decode_attention


@dataclass(frozen=True)
class StepMetadata:
    query_lens: list[int]  # new tokens per sequence, in row order
    context_lens: list[int]  # tokens in cache per sequence after this step's writes
    block_tables: torch.Tensor  # int32 [B, M] page ids, padded with 0 past each sequence's pages
    slot_mapping: torch.Tensor  # int64 [T]
    seq_tags: torch.Tensor  # int64 [B] owner tag of each sequence
    token_seq: torch.Tensor  # int64 [T] row -> sequence index
    page_owner: torch.Tensor  # int64 [num_pages], the block manager's ownership table
    # Set by steps replayed from a CUDA graph (decode_graphs.py): the context lengths
    # already on the device, and the bound the graph was captured for, which sizes the
    # decode kernels' split grid instead of max(context_lens).
    context_lens_device: torch.Tensor | None = None  # int32 [B]
    max_context_len: int | None = None
    # Where the gathering chunks' context lies in the pool, built on the host by the runner;
    # None: PagedAttention builds it from block_tables (one copy to the host a step).
    context_index: ContextIndex | None = None

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def token_tags(self) -> torch.Tensor:
        return self.seq_tags[self.token_seq]


def gathering_chunks(query_lens: Sequence[int], uses_kernels: bool) -> list[int]:
    """The chunks whose attention reads their context out of the pool (`KVCache.gather`):
    every chunk, or with `uses_kernels` (a decode kernel reads the pages of one-query
    chunks itself: the GPU's, or the C loop on a CPU) the chunks of more than one token."""
    return [i for i, n in enumerate(query_lens) if n > 1 or not uses_kernels]


@dataclass(frozen=True)
class ContextIndex:
    """The page and the offset in it of every context token of a step's gathering chunks,
    built once a step on the host, not once a layer: int64 [2, N], chunk after chunk."""

    index: torch.Tensor  # int64 [2, N]: rows page, offset
    starts: dict[int, int]  # chunk -> its first column

    @classmethod
    def on_host(
        cls,
        tables: np.ndarray,
        context_lens: Sequence[int] | np.ndarray,
        chunks: Sequence[int],
        page_size: int,
        num_pages: int,
        device: torch.device,
    ) -> ContextIndex:
        """From the step's block tables on the host ([B, M], a row per chunk). ValueError if a
        chunk's table is too short for its context or names a page outside the pool."""
        starts, parts, start = {}, [], 0
        for i in chunks:
            length = int(context_lens[i])
            positions = np.arange(length, dtype=np.int64)
            columns = positions // page_size
            if length > page_size * tables.shape[1]:
                raise ValueError(f"chunk {i}: {length} tokens do not fit its block table")
            pages = tables[i, columns].astype(np.int64)
            if length and not ((pages >= 0) & (pages < num_pages)).all():
                raise ValueError(f"block_table holds a page id outside [0, {num_pages})")
            parts.append(np.stack((pages, positions % page_size)))
            starts[i] = start
            start += length
        index = np.concatenate(parts, axis=1) if parts else np.zeros((2, 0), dtype=np.int64)
        return cls(torch.from_numpy(index).to(device), starts)

    def of(self, chunk: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, offsets) int64 [length] of `chunk`'s context."""
        start = self.starts[chunk]
        return self.index[0, start : start + length], self.index[1, start : start + length]


class PagedAttention:
    """The `AttentionBackend` the model calls: write this step's K/V, then attend.

    `violations` counts, per sequence, refused writes and foreign pages seen by the
    kernels during the step (the engine aborts any sequence with a count > 0).
    """

    def __init__(
        self,
        kv_cache: KVCache,
        metadata: StepMetadata,
        scale: float,
        check_owner: bool = True,
        windows: Sequence[int | None] = (),
    ):
        """`windows`: per layer, how many tokens back a query sees, itself included (None or
        no entry: the whole context; ModelConfig.layer_windows)."""
        self.kv_cache = kv_cache
        self.check_owner = check_owner
        self.metadata = metadata
        self.scale = scale
        # What each layer's kernels flagged, summed once after the last layer (a few
        # kernels a step rather than four a layer).
        self._refused: list[torch.Tensor] = []  # bool [T] a layer
        self._foreign: list[torch.Tensor] = []  # bool [B] a layer
        self._token_tags = metadata.token_tags
        self._context_lens = (
            metadata.context_lens_device
            if metadata.context_lens_device is not None
            else torch.tensor(metadata.context_lens, dtype=torch.int32, device=kv_cache.device)
        )
        # A mixed step's decode rows, where a kernel reads their pages (built on first use).
        self._decode_rows: _DecodeRows | None = None
        self._attend_chunk = attend_fused if kv_cache.uses_kernels else attend_ref
        # Per gathering chunk, once a step (on first use): its query rows, its context's
        # pages and offsets.
        self._gathers: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None
        # The layers whose window cuts some sequence's context: there every chunk is
        # gathered (the decode kernel reads a context whole), built on first use.
        longest = max(metadata.context_lens, default=0)
        self._windows = {
            layer: w for layer, w in enumerate(windows) if w is not None and w < longest
        }
        self._windowed_gathers: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None

    def _gathers_of(
        self, chunks: list[int], index: ContextIndex | None
    ) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        md, kv = self.metadata, self.kv_cache
        index = index or ContextIndex.on_host(
            md.block_tables.cpu().numpy(), md.context_lens, chunks,
            kv.page_size, kv.num_pages, kv.device,
        )  # fmt: skip
        row_starts = np.cumsum([0, *md.query_lens]).tolist()
        return [
            (row_starts[i], row_starts[i + 1], *index.of(i, md.context_lens[i])) for i in chunks
        ]

    @property
    def violations(self) -> torch.Tensor:
        """int32 [B]: refused writes and foreign pages of each sequence over the layers run."""
        md = self.metadata
        counts = torch.zeros(len(md.query_lens), dtype=torch.int32, device=self.kv_cache.device)
        if self._refused:
            per_token = torch.stack(self._refused).sum(0, dtype=torch.int32)  # [T]
            counts.index_add_(0, md.token_seq, per_token)
        if self._foreign:
            foreign = torch.stack(self._foreign).sum(0, dtype=torch.int32)
            if self._decode_rows is None:
                counts += foreign
            else:  # a mixed step: the kernel saw its decode rows' sequences only
                counts.index_add_(0, self._decode_rows.seqs, foreign)
        return counts

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, E], k/v [T, K, E] -> [T, H, E], into `out` where given."""
        md, kv = self.metadata, self.kv_cache
        in_c = cpu_kernels.use_kernels(q) and kv.k_cache[layer].dtype == torch.float32
        if in_c:  # the C loops of kernels/cpu: same effect, one call each
            refused = cpu_kernels.kv_write(
                k, v, kv.k_cache[layer], kv.v_cache[layer], md.slot_mapping, md.page_owner,
                self._token_tags, self.check_owner,
            )  # fmt: skip
        else:
            refused = kv.write(
                layer, k, v, md.slot_mapping, md.page_owner, self._token_tags, self.check_owner
            )  # [T]
        self._refused.append(refused)
        window = self._windows.get(layer)
        if window is not None:
            return self._attend_window(layer, q, window, out)
        # One-query rows read their pages in place: the GPU's kernels, or the C loop on a
        # CPU (so a row's answer is the same in a decode step and in a mixed one).
        reads_pages = kv.uses_kernels or in_c
        if reads_pages and md.is_decode:
            max_len = md.max_context_len or max(md.context_lens)
            decoded, foreign = self._decode(
                layer, q, md.block_tables, self._context_lens, md.seq_tags, max_len, in_c
            )
            self._foreign.append(foreign)
            return decoded if out is None else out.copy_(decoded)
        out = torch.empty_like(q) if out is None else out
        if reads_pages and self._decode_rows is None:
            self._decode_rows = _DecodeRows.of(md, self._context_lens)
        if reads_pages and (rows := self._decode_rows) is not None:
            decoded, foreign = self._decode(
                layer, q.index_select(0, rows.rows), rows.tables, rows.context_lens, rows.tags,
                rows.max_context_len, in_c,
            )  # fmt: skip
            out.index_copy_(0, rows.rows, decoded)
            self._foreign.append(foreign)
        if self._gathers is None:
            chunks = gathering_chunks(md.query_lens, reads_pages)
            self._gathers = self._gathers_of(chunks, md.context_index) if chunks else []
        for start, end, pages, offsets in self._gathers:  # the rest: gathered chunks
            keys, values = kv.gather(layer, pages, offsets, q.dtype)  # [L, K, E]
            out[start:end] = self._attend_chunk(q[start:end], keys, values, self.scale)
        return out

    def _decode(
        self,
        layer: int,
        q: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
        tags: torch.Tensor,
        max_context_len: int,
        in_c: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query a sequence over its pages, read in place: (out, foreign pages)."""
        kv = self.kv_cache
        if in_c:
            return cpu_kernels.paged_decode_attention(
                q, kv.k_cache[layer], kv.v_cache[layer], tables, context_lens,
                self.metadata.page_owner, tags, self.scale, self.check_owner,
            )  # fmt: skip
        return paged_decode_attention(
            q, kv.k_cache[layer], kv.v_cache[layer], tables, context_lens,
            self.metadata.page_owner, tags, self.scale, kv.k_scale[layer], kv.v_scale[layer],
            max_context_len=max_context_len, check_owner=self.check_owner,
        )  # fmt: skip

    def decode_in_c(
        self,
        plan: cpu_kernels.LlamaDecodePlan,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> bool:
        """Runs every layer of a decode step through `plan` (one C call, kernels/cpu), x [B, D]
        updated in place, where this step allows it: one query a sequence, fp32 pages on
        the CPU, no window cutting a context. False (nothing done) otherwise."""
        md, kv = self.metadata, self.kv_cache
        if not md.is_decode or kv.uses_kernels or self._windows or self._refused:
            return False
        if kv.k_cache[0].dtype != torch.float32 or len(md.query_lens) > cpu_kernels.MAX_ROWS:
            return False
        counts = plan.run(
            x, cos, sin, kv.k_cache, kv.v_cache, md.slot_mapping, self._token_tags,
            md.block_tables, self._context_lens, md.page_owner, md.seq_tags, self.scale,
            self.check_owner,
        )  # fmt: skip
        self._refused.append(counts)  # per token, which is per sequence in a decode step
        return True

    def _attend_window(
        self, layer: int, q: torch.Tensor, window: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        """A sliding layer's attention: every chunk over the last `window` tokens up to each
        query, from its gathered context."""
        if self._windowed_gathers is None:
            chunks = list(range(len(self.metadata.query_lens)))
            self._windowed_gathers = self._gathers_of(chunks, None)
        out = torch.empty_like(q) if out is None else out
        for start, end, pages, offsets in self._windowed_gathers:
            n, length = end - start, pages.shape[0]
            # The first key any query here sees; a sequence's released pages
            # (BlockManager.release_passed) lie wholly before it, so are never gathered.
            first = max(0, length - n - window + 1)
            keys, values = self.kv_cache.gather(
                layer, pages[first:], offsets[first:], q.dtype
            )  # [L', K, E]
            out[start:end] = attend_ref(q[start:end], keys, values, self.scale, window)
        return out


@dataclass(frozen=True)
class _DecodeRows:
    """A mixed step's decode rows (sequences with one query), for one kernel launch a layer."""

    seqs: torch.Tensor  # int64 [D] their sequence indices
    rows: torch.Tensor  # int64 [D] their query rows
    tables: torch.Tensor  # int32 [D, M]
    context_lens: torch.Tensor  # int32 [D]
    tags: torch.Tensor  # int64 [D]
    max_context_len: int

    @classmethod
    def of(cls, md: StepMetadata, context_lens: torch.Tensor) -> _DecodeRows | None:
        seqs, rows, start = [], [], 0
        for i, query_len in enumerate(md.query_lens):
            if query_len == 1:
                seqs.append(i)
                rows.append(start)
            start += query_len
        if not seqs:
            return None
        device = md.block_tables.device
        index = torch.tensor(seqs, dtype=torch.long, device=device)
        return cls(
            seqs=index,
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            tables=md.block_tables.index_select(0, index),
            context_lens=context_lens.index_select(0, index),
            tags=md.seq_tags.index_select(0, index),
            max_context_len=max(md.context_lens[i] for i in seqs),
        )


def attend_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal attention of the last `n` positions of a context over all of it.

    q [n, H, E] are the queries of context positions L-n .. L-1; k, v [L, K, E]. With a
    `window`, a query sees only the `window` latest keys, its own included.
    """
    n, length = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H|K, n|L, E]
    mask = None
    if n > 1 or (window is not None and length > window):
        # query i sits at position L-n+i and sees keys 0 .. L-n+i (the last `window` of them)
        rows = torch.arange(n, device=q.device)[:, None] + (length - n)
        keys = torch.arange(length, device=q.device)[None, :]
        mask = keys <= rows  # [n, L]
        if window is not None:
            mask &= keys > rows - window
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [n, H, E]


def attend_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend_ref`'s attention through SDPA's fused kernels (flash attention on a GPU): the
    causal mask, aligned to the last query (lower right), is never materialised, where
    `attend_ref` builds it as an [n, L] tensor and takes SDPA's unfused path, which holds
    every head's [n, L] scores at once (gigabytes for a long prompt's chunk). K/V heads are
    repeated to the query heads, as the fused kernels take them.
    """
    n, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, E]
    kh = k.repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)  # [1, H, L, E]
    vh = v.repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
    mask = causal_lower_right(n, length) if n > 1 else None
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [n, H, E]
