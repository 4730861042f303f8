import pytest
import torch

from scheduler.block_manager import FREE, BlockManager, owner_tag, pages_for
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
