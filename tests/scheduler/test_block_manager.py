import pytest
import torch

from scheduler.block_manager import (
    FREE,
    RELEASED_PAGE,
    BlockManager,
    owner_tag,
    pages_for,
    release_window,
)
from scheduler.sequence import SamplingParams, Sequence


def seq(seq_id: int, n: int = 1) -> Sequence:
    return Sequence(
        seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=[1] * n, params=SamplingParams()
    )


def test_pages_for_rounds_up():
    assert [pages_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_allocate_hands_out_pages_in_order_and_tags_them():
    bm = BlockManager(num_pages=8, page_size=4)
    a, b = seq(1), seq(2)
    assert bm.allocate(a, 9) == [0, 1, 2]
    assert bm.allocate(b, 4) == [3]
    assert a.block_table == [0, 1, 2] and b.block_table == [3]
    assert bm.page_owner.tolist() == [owner_tag(1, 0)] * 3 + [owner_tag(2, 0)] + [FREE] * 4
    # growing within the last page needs nothing; crossing it takes the next free page
    assert bm.allocate(a, 12) == []
    assert bm.allocate(a, 13) == [4]
    assert bm.num_free_pages == 3


def test_exhaustion_returns_none_and_changes_nothing():
    bm = BlockManager(num_pages=4, page_size=4)
    a, b = seq(1), seq(2)
    assert bm.allocate(a, 12) == [0, 1, 2]
    assert bm.can_allocate(b, 8) is False
    assert bm.allocate(b, 8) is None
    assert b.block_table == [] and bm.num_free_pages == 1
    assert bm.allocate(b, 4, reserve=1) is None  # the reserve must stay free
    assert bm.allocate(b, 4) == [3]


def test_free_returns_pages_and_reuse_order_is_fifo():
    bm = BlockManager(num_pages=4, page_size=4)
    a, b, c = seq(1), seq(2), seq(3)
    bm.allocate(a, 8)
    bm.allocate(b, 8)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_pages == 2
    assert bm.page_owner.tolist() == [FREE, FREE, owner_tag(2, 0), owner_tag(2, 0)]
    assert bm.allocate(c, 8) == [0, 1]
    bm.free(b)
    bm.free(c)
    assert bm.num_free_pages == bm.num_pages


def test_reused_page_never_matches_a_stale_tag():
    bm = BlockManager(num_pages=1, page_size=4)
    a = seq(1)
    bm.allocate(a, 4)
    stale = int(bm.page_owner[0])
    bm.free(a)
    a.num_preemptions += 1  # re-admitted after preemption: a new generation
    bm.allocate(a, 4)
    assert int(bm.page_owner[0]) == owner_tag(1, 1) != stale


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(num_pages=0, page_size=16)


def test_owner_table_is_int64():
    assert BlockManager(3, 16).page_owner.dtype == torch.int64


def test_owner_tag_packs_id_and_generation_and_is_never_free():
    assert owner_tag(3, 5) == 3 * 2**16 + 5
    assert owner_tag(3, 2**16 + 5) == owner_tag(3, 5)  # the generation wraps at 2**16
    assert owner_tag(1, 0) == 2**16 != FREE  # the smallest tag
    with pytest.raises(ValueError, match=r"seq_id must be in \[1, "):
        owner_tag(0, 0)  # would equal FREE
    with pytest.raises(ValueError, match="generation must be >= 0"):
        owner_tag(1, -1)


def test_pages_record_the_column_they_were_handed_out_for():
    bm = BlockManager(num_pages=8, page_size=4)
    a, b = seq(1), seq(2)
    assert bm.allocate(a, 9) == [0, 1, 2]  # 9 tokens: columns 0..2
    assert bm.allocate(b, 4) == [3]
    assert bm.allocate(a, 13) == [4]  # a grows into column 3
    assert bm.page_column_host[[0, 1, 2, 3, 4]].tolist() == [0, 1, 2, 0, 3]
    bm.free(a)
    assert bm.allocate(b, 12) == [5, 6]  # b's columns 1 and 2 (free list order)
    assert bm.page_column_host[[5, 6]].tolist() == [1, 2]


def test_the_release_window_is_the_widest_layers_and_none_with_a_global_layer():
    assert release_window((16, 16, 16)) == 16
    assert release_window((4, 8, 4)) == 8  # the widest layer reads furthest back
    assert release_window((8, None, 8)) is None  # a global layer reads every page
    assert release_window(()) is None


def test_passed_pages_are_those_wholly_before_the_next_querys_window():
    """Window 16, pages of 8: the next query, at p = computed tokens, sees p - 15 .. p, so
    page j (positions 8j .. 8j + 7) is passed once 8j + 7 < p - 15."""
    bm = BlockManager(num_pages=8, page_size=8, window=16)
    computed = [0, 15, 22, 23, 30, 31, 38, 39, 100]
    assert [bm.num_passed_pages(c) for c in computed] == [0, 0, 0, 1, 1, 2, 2, 3, 10]
    assert [bm.max_held_pages(n) for n in (1, 2, 3, 16)] == [3, 3, 4, 5]
    kept = BlockManager(num_pages=8, page_size=8)
    assert kept.num_passed_pages(100) == 0 and kept.max_held_pages(1) is None


def test_release_frees_the_passed_pages_at_once_and_keeps_positions():
    bm = BlockManager(num_pages=6, page_size=8, window=16)
    a = seq(1, 24)
    assert bm.allocate(a, 24) == [0, 1, 2]
    a.num_computed_tokens = 22
    assert bm.release_passed(a) == []  # the query at 22 still sees position 7
    a.num_computed_tokens = 23
    assert bm.release_passed(a) == [0]
    assert a.block_table == [RELEASED_PAGE, 1, 2] and a.num_released_pages == 1
    assert a.num_held_pages == 2 and bm.num_free_pages == 4
    assert bm.page_owner.tolist() == [FREE] + [owner_tag(1, 0)] * 2 + [FREE] * 3
    assert bm.release_passed(a) == []  # nothing more until the window moves on
    assert bm.allocate(a, 32) == [3]  # column 3; the released page queues last
    a.num_computed_tokens = 40  # the query at 40 sees 25 .. 40: column 3 stays
    assert bm.release_passed(a) == [1, 2]
    assert a.block_table == [RELEASED_PAGE] * 3 + [3] and a.num_released_pages == 3
    assert bm.allocate(a, 48) == [4, 5]  # columns 4 and 5
    assert bm.page_column_host[[3, 4, 5]].tolist() == [3, 4, 5]
    assert bm.num_free_pages == 3 and a.num_held_pages == 3


def test_free_after_release_returns_the_held_pages_in_table_order():
    bm = BlockManager(num_pages=6, page_size=8, window=16)
    a, b = seq(1), seq(2)
    assert bm.allocate(a, 40) == [0, 1, 2, 3, 4]
    a.num_computed_tokens = 39
    assert bm.release_passed(a) == [0, 1, 2]
    assert bm.allocate(b, 16) == [5, 0]
    bm.free(a)
    assert a.block_table == [] and a.num_released_pages == 0
    assert bm.num_free_pages == 4
    assert bm.allocate(b, 48) == [1, 2, 3, 4]  # the free list: 1, 2 released, then 3, 4
    assert bm.page_owner.tolist() == [owner_tag(2, 0)] * 6


def test_release_never_frees_a_page_the_sequence_does_not_own():
    bm = BlockManager(num_pages=4, page_size=8, window=8)
    a, b = seq(1), seq(2)
    bm.allocate(a, 16)
    bm.allocate(b, 8)
    a.block_table[0] = b.block_table[0]  # a corrupt table naming b's page
    a.num_computed_tokens = 15
    assert bm.release_passed(a) == []  # page 2 is b's: left alone, not freed twice
    assert a.num_released_pages == 1 and bm.num_free_pages == 1
    assert bm.page_owner.tolist() == [owner_tag(1, 0), owner_tag(1, 0), owner_tag(2, 0), FREE]
    bm.free(a)  # page 0, lost from a's table, is still returned by ownership
    assert bm.num_free_pages == 3


def test_pages_are_kept_without_a_window():
    bm = BlockManager(num_pages=4, page_size=8)
    a = seq(1)
    bm.allocate(a, 32)
    a.num_computed_tokens = 32
    assert bm.release_passed(a) == [] and a.block_table == [0, 1, 2, 3]


def test_fitting_tokens_count_the_table_and_the_free_pages_beyond_the_reserve():
    bm = BlockManager(num_pages=4, page_size=8, window=8)
    a = seq(1)
    bm.allocate(a, 10)
    assert bm.num_fitting_tokens(a, 10) == 22  # 2 columns + 2 free pages = 32 tokens
    assert bm.num_fitting_tokens(a, 10, reserve=2) == 6
    assert bm.num_fitting_tokens(seq(2), 40) == -24


def test_rejects_a_bad_window():
    with pytest.raises(ValueError, match="window must be positive"):
        BlockManager(num_pages=4, page_size=8, window=0)


def test_a_sequence_that_keeps_its_pages_releases_none():
    bm = BlockManager(num_pages=4, page_size=8, window=8)
    a = seq(1)
    a.keeps_pages = True  # a prefill for a decode node exports its prompt whole
    bm.allocate(a, 32)
    a.num_computed_tokens = 32
    assert not bm.releases(a) and bm.releases(seq(2))
    assert bm.release_passed(a) == [] and a.block_table == [0, 1, 2, 3]
