"""The paged KV pool: one preallocated tensor per layer, pages handed out by the block manager.

Layout (one layer; the same for K and V):

    k_cache[layer] : [num_pages, page_size, num_kv_heads, head_dim]
                      │          │          │             └ contiguous: one head's vector
                      │          │          └ grouped-query heads of one token
                      │          └ token offset inside the page
                      └ page id (what block tables hold)

    slot = page * page_size + offset          (what slot_mapping holds, one per new token)
    sequence s, token i  ->  page block_table[s][i // page_size], offset i % page_size

A 16-bit or fp32 pool stores values as they are; `fp8` stores
`float8_e4m3fn` values with scales (see `gpu_node.kv_quant`).
"""

from __future__ import annotations

import torch

TORCH_KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bytes_per_page(
    kv_dtype: str, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int
) -> int:
    """Bytes one page costs across all layers, K and V, scales included."""
    if kv_dtype == "fp8":
        from gpu_node.kv_quant import bytes_per_token

        per_token = bytes_per_token("fp8", num_kv_heads, head_dim, page_size)
        return num_layers * page_size * per_token
    element = torch.tensor([], dtype=TORCH_KV_DTYPES[kv_dtype]).element_size()
    return num_layers * 2 * page_size * num_kv_heads * head_dim * element


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
        if kv_dtype not in TORCH_KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} is not supported by this pool")
        self.kv_dtype = kv_dtype
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        dtype = TORCH_KV_DTYPES[kv_dtype]
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """k, v [T, K, E] into slots [T]."""
        kf = self.k_cache[layer].view(-1, *self.k_cache[layer].shape[2:])  # [slots, K, E]
        vf = self.v_cache[layer].view(-1, *self.v_cache[layer].shape[2:])
        kf.index_copy_(0, slot_mapping, k.to(kf.dtype))
        vf.index_copy_(0, slot_mapping, v.to(vf.dtype))

    def gather(
        self, layer: int, pages: torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens of the sequence whose pages are `pages` -> k, v [L, K, E]."""
        k = self.k_cache[layer].index_select(0, pages).flatten(0, 1)[:length]
        v = self.v_cache[layer].index_select(0, pages).flatten(0, 1)[:length]
        return k.to(dtype), v.to(dtype)
