"""What the launch wrappers share: operand checks and activations as int32 pairs."""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch

from gpu_node.kernels.launch import check_operands, int32_pairs


def test_check_operands_names_the_shape_and_devices() -> None:
    check_operands(torch.zeros(3, 64), 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=re.escape("x must be [M, 64], got (3, 32)")):
        check_operands(torch.zeros(3, 32), 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=re.escape("x must be [M, 64], got (64,)")):
        check_operands(torch.zeros(64), 64, torch.device("cpu"))


@pytest.mark.parametrize(
    "rows, copied",
    [
        (slice(0, 4), False),  # whole rows of an even stride: viewed in place
        (slice(2, 3), False),
        (slice(3, 4), True),  # one row at element 388 of a stride of 129 (clone kept it)
        (slice(0, 4, 2), True),  # rows 258 apart, starting at element 1
    ],
)
def test_int32_pairs_holds_each_row_and_copies_only_odd_views(rows, copied) -> None:
    base = torch.arange(8 * 130, dtype=torch.float32).reshape(8, 130).to(torch.bfloat16)
    odd = base.reshape(-1)[1 : 1 + 8 * 129].reshape(8, 129)  # rows 129 apart from element 1
    x = (odd if copied else base)[rows, :128]
    pairs = int32_pairs(x)
    assert pairs.shape == (x.shape[0], 64)
    assert (pairs.data_ptr() == x.data_ptr()) is not copied
    # Each int32 is a row's two bf16 in order: the low half the even k.
    assert torch.equal(pairs.view(torch.bfloat16), x)
    assert pairs.stride(1) == 1


def test_int32_pairs_copies_columns_that_are_not_adjacent() -> None:
    base = torch.arange(4 * 260, dtype=torch.float32).reshape(4, 260).to(torch.bfloat16)
    x = base[:, ::2][:, :128]  # strides (260, 2): each row's k apart by two elements
    pairs = int32_pairs(x)
    assert pairs.data_ptr() != x.data_ptr()
    assert torch.equal(pairs.view(torch.bfloat16), x)


def test_int32_pairs_keeps_nothing_between_calls() -> None:
    # Each call reads x as it is now, and holds no reference to it afterwards.
    base = torch.zeros(4, 129, dtype=torch.bfloat16)
    x = base[1:2, 1:]  # the copying path
    assert torch.equal(int32_pairs(x).view(torch.bfloat16), x)
    x.fill_(3.0)
    assert torch.equal(int32_pairs(x).view(torch.bfloat16), x)
    alive = weakref.ref(x)
    del x, base
    gc.collect()
    assert alive() is None
