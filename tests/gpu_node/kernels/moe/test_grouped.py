"""The fused INT4 MoE kernel equals its torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import pytest
import torch

import gpu_node.kernels.moe.grouped as moe_module
from gpu_node.kernels.moe.reference import moe_experts_ref
from gpu_node.models.moe_routing import route
from gpu_node.quant.int4 import Int4Weight
from tests.gpu_node.kernels.moe.weights import random_experts, routing_weight_cases

fused_moe_int4 = moe_module.fused_moe_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max |kernel - reference| over max |reference|. The kernel rounds the SwiGLU
# activation to the input dtype between the two GEMMs; the reference stays fp32.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _experts(
    num_experts: int, hidden: int, inner: int, group_size: int, seed: int
) -> tuple[Int4Weight, Int4Weight]:
    return random_experts(num_experts, hidden, inner, group_size, seed, DEVICE)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "group_size"),
    [
        (1, 8, 2, 32),  # one token: 6 of 8 experts get nothing
        (5, 8, 2, 64),
        (20, 4, 3, 32),  # several blocks per expert
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(
    tokens: int, num_experts: int, top_k: int, group_size: int, dtype: torch.dtype
) -> None:
    hidden, inner = 128, 64
    w13, w2 = _experts(num_experts, hidden, inner, group_size, seed=tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    routing = route(torch.randn(tokens, num_experts, generator=gen).to(DEVICE), top_k)
    y = fused_moe_int4(x, w13, w2, routing)
    ref = moe_experts_ref(x, w13, w2, routing)
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    err = (y.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert float(err) <= TOLERANCE[dtype]


def test_routing_weight_is_applied_in_the_kernel() -> None:
    w13, w2 = _experts(4, 128, 64, 32, seed=1)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids = torch.tensor([[1, 2], [1, 2]], device=DEVICE)
    base, doubled, only_first, alone = routing_weight_cases(
        lambda x, routing: fused_moe_int4(x, w13, w2, routing), x, ids
    )
    torch.testing.assert_close(doubled, 2 * base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(only_first, alone, rtol=1e-5, atol=1e-5)


def test_shapes_that_do_not_fit_are_refused() -> None:
    w13, w2 = _experts(4, 128, 64, 32, seed=2)
    routing = route(torch.zeros(3, 4, device=DEVICE), 2)
    with pytest.raises(ValueError, match="does not fit"):
        fused_moe_int4(torch.randn(3, 64, device=DEVICE), w13, w2, routing)
