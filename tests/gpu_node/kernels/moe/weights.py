"""Seeded expert stacks for the MoE kernel tests, and the routing-weight cases they share."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_node.models.moe_routing import Routing
from gpu_node.quant.int4 import Int4Weight, quantize_int4


def float_experts(
    num_experts: int, hidden: int, inner: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] in fp32 on the CPU, std 1 / sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inner, generator=gen) / inner**0.5
    return w13, w2


def random_experts(
    num_experts: int, hidden: int, inner: int, group_size: int, seed: int, device: str
) -> tuple[Int4Weight, Int4Weight]:
    """float_experts quantized with `group_size`."""
    w13, w2 = float_experts(num_experts, hidden, inner, seed)
    return quantize_int4(w13, group_size).to(device), quantize_int4(w2, group_size).to(device)


def routing_weight_cases(
    experts: Callable[[torch.Tensor, Routing], torch.Tensor], x: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts of x [T, H] through ids [T, 2] at weights 0.5 and 1 (so the second
    should be twice the first), at (1, 0) and at the first id alone (which should agree)."""
    tokens, device = ids.shape[0], ids.device
    base = experts(x, Routing(ids, torch.full((tokens, 2), 0.5, device=device)))
    doubled = experts(x, Routing(ids, torch.ones(tokens, 2, device=device)))
    only_first = experts(x, Routing(ids, torch.tensor([[1.0, 0.0]] * tokens, device=device)))
    alone = experts(x, Routing(ids[:, :1].contiguous(), torch.ones(tokens, 1, device=device)))
    return base, doubled, only_first, alone
