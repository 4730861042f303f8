"""The float MoE experts' GEMV kernel equals the reference loop (interpreter on CPU, native
on CUDA), and on CUDA a call records into a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import gpu_node.kernels.moe.dense as dense_module
from gpu_node.kernels.moe.reference import moe_experts_ref
from gpu_node.models.moe_routing import Routing, route
from tests.gpu_node.kernels.moe.weights import float_experts, routing_weight_cases

moe_experts_dense = dense_module.moe_experts_dense

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max |kernel - reference| over max |reference|. Both round where bf16 matmuls round (the
# first product, the activation, the second product); the sums' orders differ.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _experts(
    num_experts: int, hidden: int, inner: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    w13, w2 = float_experts(num_experts, hidden, inner, seed)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "hidden", "inner"),
    [
        (1, 8, 2, 128, 64),  # one token: 6 of 8 experts get nothing
        (5, 8, 3, 200, 40),  # rows and columns past the blocks (200 in, 80 and 200 out)
        (4, 2, 2, 256, 96),  # every token on both experts
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(tokens, num_experts, top_k, hidden, inner, dtype) -> None:
    w13, w2 = _experts(num_experts, hidden, inner, dtype, seed=tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    routing = route(torch.randn(tokens, num_experts, generator=gen).to(DEVICE), top_k)
    y = moe_experts_dense(x, w13, w2, routing)
    ref = moe_experts_ref(x, w13, w2, routing)
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    err = (y.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert float(err) <= TOLERANCE[dtype], float(err)


def test_routing_weight_is_applied_in_the_kernel() -> None:
    w13, w2 = _experts(4, 128, 64, torch.float32, seed=1)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids = torch.tensor([[1, 2], [3, 1]], device=DEVICE)
    base, doubled, only_first, alone = routing_weight_cases(
        lambda x, routing: moe_experts_dense(x, w13, w2, routing), x, ids
    )
    torch.testing.assert_close(doubled, 2 * base, rtol=1e-5, atol=1e-5)
    assert torch.equal(only_first, alone)  # a zero weight adds exactly zero


def test_shapes_that_do_not_fit_are_refused() -> None:
    w13, w2 = _experts(4, 128, 64, torch.float32, seed=2)
    x = torch.zeros(1, 128, device=DEVICE)
    routing = Routing(torch.zeros(1, 1, dtype=torch.int64, device=DEVICE), torch.ones(1, 1))
    message = (
        r"experts must be w13 \[E, 2I, 128\] and w2 \[E, 128, I\], got \(4, 128, 128\) "
        r"and \(4, 128, 63\)"
    )
    with pytest.raises(ValueError, match=message):
        moe_experts_dense(x, w13, w2[:, :, :63], routing)
    with pytest.raises(ValueError, match=r"got \(4, 128, 128\) and \(3, 128, 64\)"):
        moe_experts_dense(x, w13, w2[:3], routing)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_call_records_into_a_cuda_graph() -> None:
    """Nothing waits for the host: a graph recorded around the call replays it, routing
    changed in place between replays."""
    w13, w2 = _experts(8, 256, 128, torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 256, generator=gen).to(DEVICE, torch.bfloat16)
    routing = route(torch.randn(2, 8, generator=gen).to(DEVICE), 2)
    moe_experts_dense(x, w13, w2, routing)  # compiled before recording
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_experts_dense(x, w13, w2, routing)
    other = route(torch.randn(2, 8, generator=gen).to(DEVICE), 2)
    routing.topk_ids.copy_(other.topk_ids)
    routing.topk_weights.copy_(other.topk_weights)
    graph.replay()
    assert torch.equal(y, moe_experts_dense(x, w13, w2, other))
