"""Prefix caching by copy: the KV of finished prompts' full pages, kept beside the pool
and copied into a new request's own pages, so its prefill starts past them.

Every page of the pool keeps exactly one owner (the integrity checks and kernels are
unchanged): cached blocks live in a store of their own, never in a block table.
When a request ends (finished, cancelled or handed off, never after an integrity
fault), the pages wholly inside its computed prompt are copied into the store. When
a request is admitted, the longest run of its prompt's leading blocks found in the
store is copied into its first pages and counted as cached tokens; at least one
prompt token is always computed, for the logits of the first output token.

A block is named by a chained BLAKE2b digest of the account's salt and every token
from the prompt's start to the block's end, so two accounts never share a block and
a block is only reused behind the same whole prefix. The KV of a position depends on
the tokens up to it only (a prefix's rows come out bit for bit the same in any
longer prompt, tested), so a cached prefix gives exactly the tokens a cold one does.

The store holds `num_blocks` blocks in the pool's own storage (fp8 bytes and scales
for fp8 pools); when it is full the least recently used block makes room. A prompt's
blocks are used last to first, so of one prompt the block nearest its end goes first:
a block is reachable only behind all of its prompt's earlier ones, and evicting the
first had left the rest in the store, taking room, never to be read again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch

from gpu_node.cache.kv_cache import KVCache, raw_storage


class PrefixCache:
    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._cache = cache
        self.page_size = cache.page_size
        self.num_blocks = num_blocks

        def like(pools: list[torch.Tensor]) -> list[torch.Tensor]:
            return [
                torch.empty((num_blocks, *p.shape[1:]), dtype=p.dtype, device=p.device)
                for p in (raw_storage(pool) for pool in pools)
            ]

        self._k, self._v = like(cache.k_cache), like(cache.v_cache)
        scaled = [s for s in cache.k_scale + cache.v_scale if s is not None]
        self._scales = like(scaled)  # k scales of every layer, then v scales
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, oldest use first
        self._free = list(range(num_blocks - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slots)

    def digests(self, token_ids: list[int], salt: str) -> list[bytes]:
        """The chained digest of each full page of `token_ids`, under the account's salt."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        previous = hashlib.blake2b(salt.encode(), digest_size=16, person=b"edgeserve-kv").digest()
        out = []
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            h = hashlib.blake2b(previous, digest_size=16)
            h.update(tokens[start : start + self.page_size].tobytes())
            previous = h.digest()
            out.append(previous)
        return out

    def load(self, digests: list[bytes], pages: list[int]) -> int:
        """Copies the longest cached run of `digests` (from the first) into `pages`; the
        number of blocks copied."""
        slots = []
        for digest in digests:
            slot = self._slots.get(digest)
            if slot is None:
                break
            slots.append(slot)
        self._use_last_to_first(digests[: len(slots)])
        if slots:
            self._copy(slots, pages[: len(slots)], into_pool=True)
        return len(slots)

    def store(self, digests: list[bytes], pages: list[int]) -> None:
        """Keeps the blocks in `pages` under `digests` (the ones not kept already)."""
        slots, sources = [], []
        # At most a cache's worth. The blocks kept already are used first, so that none of
        # this prompt's is the least recently used when a new one takes a slot: room is
        # made from other prompts' blocks alone, and nothing stored here is copied twice.
        blocks = list(zip(digests, pages, strict=True))[: self.num_blocks]
        for digest, _ in blocks:
            if digest in self._slots:
                self._slots.move_to_end(digest)
        for digest, page in blocks:
            if digest in self._slots:
                continue
            if self._free:
                slot = self._free.pop()
            else:
                _, slot = self._slots.popitem(last=False)  # the least recently used
            self._slots[digest] = slot
            slots.append(slot)
            sources.append(page)
        self._use_last_to_first([digest for digest, _ in blocks])
        if slots:
            self._copy(slots, sources, into_pool=False)

    def _use_last_to_first(self, digests: list[bytes]) -> None:
        """Marks a prompt's blocks used, its first block last (the most recently used)."""
        for digest in reversed(digests):
            self._slots.move_to_end(digest)

    def _copy(self, slots: list[int], pages: list[int], into_pool: bool) -> None:
        cache = self._cache
        device = cache.device
        slot_ids = torch.tensor(slots, dtype=torch.long, device=device)
        page_ids = torch.tensor(pages, dtype=torch.long, device=device)
        pools = [raw_storage(p) for p in cache.k_cache + cache.v_cache]
        pools += [s for s in cache.k_scale + cache.v_scale if s is not None]
        for pool, store in zip(pools, self._k + self._v + self._scales, strict=True):
            if into_pool:
                pool[page_ids] = store[slot_ids]
            else:
                store[slot_ids] = pool[page_ids]
