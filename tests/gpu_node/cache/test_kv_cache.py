"""The KV pool (kv_cache.py): the pages a memory budget buys in each KV dtype, and the
pool's head-major layout, written in place."""

import torch

from gpu_node.cache.kv_cache import KVCache, bytes_per_page
from gpu_node.cache.kv_quant import pool_strides


def test_fp8_pool_holds_1_94x_the_tokens_of_bf16_at_one_budget(make_engine):
    budget = 64 * 1024 * 1024
    bf16 = make_engine(kv_dtype="bf16", num_pages=None, kv_memory_bytes=budget).stats()
    fp8 = make_engine(kv_dtype="fp8", num_pages=None, kv_memory_bytes=budget).stats()
    # SmolLM2: 30 layers, 3 kv heads, head dim 64, pages of 16 tokens.
    # bf16: 2 * 3 * 64 * 2 B = 768 B per token-layer -> 368,640 B a page -> 182 pages.
    # fp8:  2 * 3 * (64 + 2) B = 396 B per token-layer -> 190,080 B a page -> 353 pages.
    assert bytes_per_page("bf16", 30, 16, 3, 64) == 368_640
    assert bytes_per_page("fp8", 30, 16, 3, 64) == 190_080
    assert (bf16.num_pages, fp8.num_pages) == (182, 353)
    assert fp8.num_pages * 16 / (bf16.num_pages * 16) >= 1.9


def test_the_pool_is_head_major_and_written_in_place():
    """Each layer's pool is head-major (one kv head's page contiguous), and a write lands
    where a [P, S, H, D] index says: page 2, offset 5, head 1 -> element
    ((2 * 3 + 1) * 16 + 5) * 64 of the pool's memory."""
    cache = KVCache(2, 4, 16, 3, 64, "bf16")
    assert pool_strides(cache.k_cache[1]) == (64, 16 * 64)
    key = torch.arange(3 * 64, dtype=torch.float32).view(1, 3, 64) / 8
    owner = torch.tensor([7, 7, 7, 7])
    refused = cache.write(1, key, -key, torch.tensor([2 * 16 + 5]), owner, torch.tensor([7]))
    assert refused.tolist() == [False]
    memory = cache.k_cache[1].permute(0, 2, 1, 3)  # the storage itself, no copy
    assert memory.is_contiguous() and memory.data_ptr() == cache.k_cache[1].data_ptr()
    at = ((2 * 3 + 1) * 16 + 5) * 64
    assert torch.equal(memory.reshape(-1)[at : at + 64].float(), key[0, 1])  # exact in bf16
    assert int(memory.count_nonzero()) == 3 * 64 - 1  # the token's three rows (one 0.0)
