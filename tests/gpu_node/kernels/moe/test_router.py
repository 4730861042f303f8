"""The one-launch router equals `route` + `with_always_on` (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gpu_node.kernels.moe.router as router_module
from gpu_node.models.moe import MOE_CONFIGS, MoeConfig
from gpu_node.models.moe_routing import route, with_always_on

route_fused = router_module.route_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = MOE_CONFIGS["moe-small"]
WIDE = MoeConfig(hidden_size=1024, num_experts=64, top_k=8, expert_hidden_size=64)
SIGMOID_24 = MoeConfig(
    hidden_size=96,
    num_experts=24,
    top_k=6,
    expert_hidden_size=32,
    scoring="sigmoid",
    routed_scaling=2.5,
)


def _reference(x: torch.Tensor, weight: torch.Tensor, c: MoeConfig, always_on: int):
    logits = x.float() @ weight.float().T
    routing = route(logits, c.top_k, c.scoring, c.renormalize, c.routed_scaling)
    return with_always_on(routing, c.num_experts, always_on) if always_on else routing


@pytest.mark.parametrize(
    ("config", "tokens", "always_on", "dtype"),
    [
        (SMALL, 1, 0, torch.float32),  # one token, top-2 of 8
        (SMALL, 7, 1, torch.bfloat16),  # the shared expert folded: [T, 3]
        (dataclasses.replace(SMALL, renormalize=False), 5, 2, torch.float32),
        (SIGMOID_24, 9, 1, torch.float32),  # DeepSeek-V3's rule: sigmoid, scaled
        (WIDE, 3, 1, torch.bfloat16),  # decode: the logits split over H in 8 programs
        (WIDE, 65, 0, torch.float32),  # past SPLIT_TOKENS: one program a token
    ],
)
def test_route_fused_equals_route(
    config: MoeConfig, tokens: int, always_on: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(config.num_experts, config.hidden_size, generator=gen).to(DEVICE)
    ours = route_fused(x, weight, config, always_on)
    ref = _reference(x, weight, config, always_on)
    assert ours.topk_ids.shape == (tokens, config.top_k + always_on)
    assert ours.topk_ids.dtype == torch.int64 and ours.topk_weights.dtype == torch.float32
    assert torch.equal(ours.topk_ids, ref.topk_ids)
    # The logits sum H products in another order (~1e-7 relative); softmax scales that by
    # the logits' size (about 30 here: unnormalised random weights), so 1e-4 relative.
    torch.testing.assert_close(ours.topk_weights, ref.topk_weights, rtol=1e-4, atol=1e-5)


def test_ties_go_to_the_lower_expert_id() -> None:
    # Zero weights: every expert scores alike, so the top-k are experts 0 .. K-1 in order.
    x = torch.randn(3, SMALL.hidden_size).to(DEVICE)
    weight = torch.zeros(SMALL.num_experts, SMALL.hidden_size, device=DEVICE)
    ours = route_fused(x, weight, SMALL, 1)
    assert ours.topk_ids.tolist() == [[0, 1, 8]] * 3
    assert ours.topk_weights.tolist() == [[0.5, 0.5, 1.0]] * 3


def test_a_weight_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        route_fused(torch.randn(2, 64, device=DEVICE), torch.randn(8, 128, device=DEVICE), SMALL)


def test_nan_scores_still_pick_distinct_real_experts() -> None:
    x = torch.full((2, WIDE.hidden_size), float("nan"), device=DEVICE)
    weight = torch.randn(WIDE.num_experts, WIDE.hidden_size, device=DEVICE)
    ids = route_fused(x, weight, WIDE, 1).topk_ids
    assert ids.tolist() == [[*range(8), 64]] * 2  # the lowest ids, then the always-on one
