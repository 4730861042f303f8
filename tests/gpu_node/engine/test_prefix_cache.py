"""Prefix caching on the real SmolLM2: cached prompt pages give exactly the cold tokens,
are counted as cached tokens, never cross accounts, and make room oldest first, the end of
a prompt before its start; on a GPU too, seeded weights in pools the Triton kernels read
and write."""

from __future__ import annotations

import pytest

from gpu_node.config import EngineConfig
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import default_seeded_engine, needs_cuda, run_to_end, seeded_model

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BASE = "Tell me about the sea, the moon and the stars, and how they move together."


def run(engine, request_id, ids, params=GREEDY, salt="acct-a"):
    return run_to_end(engine, request_id, ids, params, cache_salt=salt)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_a_shared_prefix_is_served_from_the_cache_with_the_cold_tokens(
    make_engine, chat_ids, kv_dtype
) -> None:
    first, second = chat_ids(BASE + " One."), chat_ids(BASE + " Two, please, in detail.")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    cold = make_engine(kv_dtype=kv_dtype)
    expected = [run(cold, "cold", second)[0]]
    warm = make_engine(kv_dtype=kv_dtype, prefix_cache_blocks=16)
    _, before = run(warm, "a", first)
    assert before.num_cached_tokens == 0
    assert len(warm.prefix_cache) == len(first) // 16
    tokens, after = run(warm, "b", second)
    assert [tokens] == expected
    assert after.num_cached_tokens == shared // 16 * 16 > 0
    assert after.num_prompt_tokens == len(second)
    # the same prompt again: every full page but the one holding the last prompt token
    again, final = run(warm, "c", second)
    assert again == expected[0]
    assert final.num_cached_tokens == (len(second) - 1) // 16 * 16
    stats = warm.stats()
    assert stats.num_free_pages == stats.num_pages  # cached blocks hold no pool pages


def test_another_account_never_reads_a_cached_block(make_engine, chat_ids) -> None:
    engine = make_engine(prefix_cache_blocks=16)
    ids = chat_ids(BASE)
    run(engine, "a", ids, salt="acct-a")
    _, other = run(engine, "b", ids, salt="acct-b")
    assert other.num_cached_tokens == 0
    _, same = run(engine, "c", ids, salt="acct-a")
    assert same.num_cached_tokens == (len(ids) - 1) // 16 * 16


def test_a_full_cache_makes_room_oldest_first(make_engine, chat_ids) -> None:
    engine = make_engine(prefix_cache_blocks=3)
    one, two = chat_ids(BASE), chat_ids("Name three colours and say which one you like best.")
    # 48 and 41 tokens: 3 and 2 full pages, the first (the chat template's) the same
    assert (len(one), len(two)) == (48, 41) and one[:16] == two[:16]
    run(engine, "one", one)  # keeps pages A1 A2 A3, used last to first: A3 is the oldest
    run(engine, "two", two)  # A1 is used again; its page B2 takes the oldest, A3's, slot
    _, two_again = run(engine, "two-again", two)
    assert two_again.num_cached_tokens == 32  # A1 B2
    _, one_again = run(engine, "one-again", one)
    # A1 A2, then A3 is gone. Had A2 made room (the oldest by first use), the chain would
    # stop at A1 and A3 would sit in the store, never reachable.
    assert one_again.num_cached_tokens == 32


def test_off_by_default_and_refuses_a_negative_size(make_engine, chat_ids) -> None:
    engine = make_engine()
    assert engine.prefix_cache is None
    ids = chat_ids(BASE)
    run(engine, "a", ids)
    assert run(engine, "b", ids)[1].num_cached_tokens == 0
    with pytest.raises(ValueError, match="prefix_cache_blocks must be >= 0, got -1"):
        EngineConfig(prefix_cache_blocks=-1)


def test_a_cancelled_request_leaves_its_computed_prompt_behind(make_engine, chat_ids) -> None:
    engine = make_engine(prefix_cache_blocks=16)
    ids = chat_ids(BASE)
    engine.add_request("a", ids, SamplingParams(max_tokens=50), cache_salt="acct-a")
    engine.step()  # the prompt is prefilled
    engine.abort("a")
    assert len(engine.prefix_cache) == len(ids) // 16
    _, final = run(engine, "b", ids)
    assert final.num_cached_tokens == (len(ids) - 1) // 16 * 16


def test_a_block_table_naming_another_requests_page_is_never_cached(make_engine, chat_ids) -> None:
    """The bug the integrity checks exist for, caught between steps: request a's table
    names a page of b's, then a is cancelled. Nothing of it may enter the cache, or b's
    rows would be served to a's account under a's prefix."""
    import random

    from gpu_node.faults import FaultInjector

    engine = make_engine(prefix_cache_blocks=16)
    params = SamplingParams(max_tokens=50)
    engine.add_request("a", chat_ids(BASE), params, cache_salt="acct-a")
    engine.add_request("b", chat_ids("Name three colours."), params, cache_salt="acct-b")
    engine.step()  # both prompts prefilled
    FaultInjector(engine, random.Random(3)).point_at_foreign_page("a", "b")
    engine.abort("a")
    assert len(engine.prefix_cache) == 0
    engine.abort("b")  # b's own table is sound: its page is kept
    assert len(engine.prefix_cache) == len(chat_ids("Name three colours.")) // 16


def test_storing_a_prompt_never_makes_room_with_its_own_blocks() -> None:
    """Stored last to first, a prompt's new second block had taken the slot of its own
    first block (the least recently used), which was then copied again into another."""
    from gpu_node.cache.kv_cache import KVCache
    from gpu_node.engine.prefix_cache import PrefixCache

    class Recording(PrefixCache):
        def _copy(self, slots, pages, into_pool):
            self.copies.append((list(slots), list(pages), into_pool))
            super()._copy(slots, pages, into_pool)

    store = Recording(KVCache(1, 8, 4, 1, 8, "fp32"), num_blocks=2)
    store.copies = []
    store.store([b"A1"], [0])  # slot 0
    store.store([b"B1"], [1])  # slot 1; A1 is now the least recently used
    store.store([b"A1", b"A2"], [2, 3])  # A1 kept: A2 takes B1's slot
    assert store.copies == [([0], [0], False), ([1], [1], False), ([1], [3], False)]
    assert store.load([b"A1", b"A2"], [4, 5]) == 2
    assert store.copies[-1] == ([0, 1], [4, 5], True)
    assert store.load([b"B1"], [6]) == 0


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_a_cached_prefix_on_the_gpu_gives_the_cold_tokens(kv_dtype):
    model = seeded_model("bf16", fuse=False)
    shared = [(5 * j) % 4000 + 1 for j in range(40)]
    first, second = [*shared, 7, 8, 9], [*shared, 11, 12, 13, 14, 15]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cold, _ = run_to_end(default_seeded_engine(model, kv_dtype), "c", second, params)
    warm = default_seeded_engine(model, kv_dtype, prefix_cache_blocks=8)
    run_to_end(warm, "a", first, params)
    tokens, final = run_to_end(warm, "b", second, params)
    assert tokens == cold
    assert final.num_cached_tokens == 32  # two full pages of the shared 40 tokens
