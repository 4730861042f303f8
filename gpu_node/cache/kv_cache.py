"""The paged KV pool: one preallocated tensor per layer, pages handed out by the block manager.

The KV layout, drawn here once (the kernels and kv_quant.py point to it).
Letters: P pages, S page size (tokens per page), H kv heads, D head dim.

    k_cache[layer] : indexed [P, S, H, D]   fp32 | bf16 | fp16 | float8_e4m3fn
                              │  │  │  └ contiguous: one head's vector
                              │  │  └ grouped-query heads of one token
                              │  └ token offset inside the page
                              └ page id (what block tables hold)
                     fp8 pools: K and V rows as int8 codes (in the same bytes) of the
                     Hadamard-rotated row (kv_quant)
                     stored head-major, a contiguous [P, H, S, D] viewed as [P, S, H, D]
                     (kv_quant.kv_pool, pool_strides; token-major is a contiguous [P, S, H, D]):
                      ┌──────────────── page p ────────────────┐
                      │ head 0: token 0 .. S-1 (S * D contiguous) │ head 1: ... │ head H-1 │
                     so one kv head's share of a page is one run of S * D elements
                     (1 KiB for SmolLM2's fp8 pages), what a decode program reads
    k_scale[layer] : [P, H, S]   bf16, fp8 pools only: one scale per (token, head) row,
                     row = H_D (code * scale) / D, scale = bf16(max|H_D row| / 127), for
                     K and V alike; a head's S scales
                     of a page contiguous (32 bytes at S = 16: one read a page for a
                     decode program, where [P, S, H] would gather 2 bytes a token)

    slot = page * S + offset   ->   k_cache[page, offset]      one token's keys [H, D]
                                    k_scale[page, :, offset]   their H scales
    sequence s, token i  ->  page block_table[s][i // S], offset i % S

Writes go through `kv_write` (the Triton kernel on a GPU, its torch reference
elsewhere), which quantizes fp8 rows and refuses to write into a page the
writing sequence does not own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu_node.cache.kv_quant import (
    FP8_DTYPE,
    SCALE_DTYPE,
    bytes_per_token,
    kv_pool,
    kv_torch_dtype,
    scale_shape,
)
from gpu_node.kernels.kv_write.kernel import kv_write
from gpu_node.kernels.kv_write.reference import kv_write_ref
from gpu_node.kernels.paged_attention.reference import gather_kv

if TYPE_CHECKING:
    from gpu_node.config import EngineConfig
    from gpu_node.models.config import ModelConfig

HEAD_MAJOR = True  # the pools' memory order (layout above)


def raw_storage(pool: torch.Tensor) -> torch.Tensor:
    """A pool layer as its raw storage: fp8 viewed as uint8 (indexing fp8 is not
    implemented everywhere), other dtypes as they are. Copies between pools (a KV
    handoff, the prefix cache) move these bytes exactly."""
    return pool.view(torch.uint8) if pool.dtype == FP8_DTYPE else pool


def bytes_per_page(
    kv_dtype: str, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int
) -> int:
    """Bytes one page costs across all layers, K and V, scales included."""
    return int(
        num_layers * page_size * bytes_per_token(kv_dtype, num_kv_heads, head_dim, page_size)
    )


class KVCache:
    """Holds the pool; writes new K/V by slot and reads a sequence's context back."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str,
        device: torch.device | str = "cpu",
    ):
        self.kv_dtype = kv_dtype
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        dtype = kv_torch_dtype(kv_dtype)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = [
            kv_pool(*shape, dtype, device, head_major=HEAD_MAJOR) for _ in range(num_layers)
        ]
        self.v_cache = [
            kv_pool(*shape, dtype, device, head_major=HEAD_MAJOR) for _ in range(num_layers)
        ]
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers
        if dtype == FP8_DTYPE:
            sshape = scale_shape(num_pages, page_size, num_kv_heads)
            self.k_scale = [
                torch.ones(sshape, dtype=SCALE_DTYPE, device=device) for _ in range(num_layers)
            ]
            self.v_scale = [
                torch.ones(sshape, dtype=SCALE_DTYPE, device=device) for _ in range(num_layers)
            ]

    @property
    def uses_kernels(self) -> bool:
        return self.device.type == "cuda"

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        page_owner: torch.Tensor,
        token_tags: torch.Tensor,
        check_owner: bool = True,
    ) -> torch.Tensor:
        """k, v [T, K, E] into slots [T]; returns bool [T], True where the write was refused."""
        write = kv_write if self.uses_kernels else kv_write_ref
        return write(
            k, v, self.k_cache[layer], self.v_cache[layer], slot_mapping, page_owner, token_tags,
            self.k_scale[layer], self.v_scale[layer], check_owner,
        )  # fmt: skip

    def gather(
        self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens at (`pages`, `offsets`) (int64 [L], pages within the pool) -> k, v [L, K, E]."""
        return gather_kv(
            self.k_cache[layer],
            self.v_cache[layer],
            pages,
            offsets,
            dtype,
            self.k_scale[layer],
            self.v_scale[layer],
        )


def build_kv_cache(config: EngineConfig, mc: ModelConfig) -> KVCache:
    """The KV pool `config` asks for, for a model of `mc` (a tensor-parallel rank's config:
    its own KV heads, so every rank of a group gets the same number of pages)."""
    page_bytes = bytes_per_page(
        config.kv_dtype, mc.num_layers, config.page_size, mc.num_kv_heads, mc.head_dim
    )
    num_pages = config.num_pages or max(1, config.kv_memory_bytes // page_bytes)
    return KVCache(
        mc.num_layers,
        num_pages,
        config.page_size,
        mc.num_kv_heads,
        mc.head_dim,
        config.kv_dtype,
        config.device,
    )
