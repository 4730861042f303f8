"""Sharding in one process: what is refused, and the slices a shard is built from (the
collectives run in test_worker.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_smollm2_across_2_ranks_is_refused_and_left_whole(smollm2_parts):
    from gpu_node.parallel.sharding import shard_llama

    model, _ = smollm2_parts
    layer = model.layers[0]
    with pytest.raises(ValueError) as refused:
        shard_llama(model, 0, 2)
    assert str(refused.value) == (
        "cannot shard llama across 2 ranks: 9 query heads do not divide by 2 ranks; "
        "3 KV heads do not divide by 2 ranks"
    )
    assert model.layers[0] is layer and isinstance(layer.self_attn.o_proj, nn.Linear)
    assert (layer.self_attn.num_heads, model.config.num_heads) == (9, 9)


def test_int4_rows_and_columns_are_the_weights():
    from gpu_node.parallel.layers import take_columns, take_rows
    from gpu_node.quant.int4 import dequantize_int4
    from gpu_node.quant.linear import Int4Linear

    linear = nn.Linear(128, 48, bias=True)
    int4 = Int4Linear.from_linear(linear, group_size=32)
    whole = dequantize_int4(int4.weight_int4)  # [48, 128]
    rows = take_rows(int4, [(0, 8), (40, 48)])
    assert torch.equal(dequantize_int4(rows.weight_int4), torch.cat([whole[:8], whole[40:]]))
    assert torch.equal(rows.bias, torch.cat([linear.bias[:8], linear.bias[40:]]))
    columns = take_columns(int4, 64, 96)
    assert torch.equal(dequantize_int4(columns.weight_int4), whole[:, 64:96])
    assert columns.bias is None
    with pytest.raises(ValueError, match=r"columns \[16, 48\) cut the INT4 groups of 32"):
        take_columns(int4, 16, 48)
