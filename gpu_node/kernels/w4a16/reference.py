"""The torch reference of the W4A16 matmuls, which every kernel of this folder is compared with."""

from __future__ import annotations

import torch

from gpu_node.quant.int4 import (
    Int4Weight,
    Int4WeightKN,
    Int4WeightMMA,
    dequantize_int4,
    from_kn,
    from_mma,
)


def dequantize_ref(weight: Int4Weight | Int4WeightKN | Int4WeightMMA) -> torch.Tensor:
    """W [N, K] in fp32 (scale * q + min, exact) from any of the three INT4 layouts."""
    if isinstance(weight, Int4WeightKN):
        weight = from_kn(weight)
    elif isinstance(weight, Int4WeightMMA):
        weight = from_mma(weight)
    return dequantize_int4(weight)


def w4a16_matmul_ref(
    x: torch.Tensor, weight: Int4Weight | Int4WeightKN | Int4WeightMMA
) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype: W dequantized to fp32, multiplied in fp32."""
    return (x.float() @ dequantize_ref(weight).T).to(x.dtype)
