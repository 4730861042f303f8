"""Seeded INT4 expert stacks for the MoE kernel tests."""

from __future__ import annotations

import torch

from gpu_node.quant.int4 import Int4Weight, quantize_int4


def random_experts(
    num_experts: int, hidden: int, inner: int, group_size: int, seed: int, device: str
) -> tuple[Int4Weight, Int4Weight]:
    """w13 [E, 2I, H] and w2 [E, H, I], std 1 / sqrt(fan_in), quantized with `group_size`."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inner, generator=gen) / inner**0.5
    return quantize_int4(w13, group_size).to(device), quantize_int4(w2, group_size).to(device)
