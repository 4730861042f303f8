"""The tensor-core MoE kernel over expert slots equals the torch reference (GPU only).

Its inline PTX cannot run in the interpreter; the slots and the stacked layout have CPU
tests in tests/gpu_node/models/test_moe.py, and the per-lane arithmetic is the dense kernel's
(tests/gpu_node/kernels/w4a16/test_mma.py emulates it on CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_node.kernels.moe.reference import moe_experts_ref
from gpu_node.models.moe import Int4MoeExperts
from gpu_node.models.moe_routing import Routing, route
from gpu_node.quant.int4 import (
    Int4ExpertsMMA,
    Int4Weight,
    dequantize_int4,
    experts_to_mma,
)
from tests.gpu_node.kernels.moe.weights import random_experts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="the kernel's inline PTX runs on NVIDIA GPUs only, compiled (TRITON_INTERPRET=0)",
)

# Max |kernel - reference| over max |reference|: the kernel rounds x, the SwiGLU
# activation and the output to 16 bits; the reference stays fp32.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _experts(
    num_experts: int, hidden: int, inner: int, group_size: int, seed: int
) -> tuple[Int4Weight, Int4Weight]:
    return random_experts(num_experts, hidden, inner, group_size, seed, "cuda")


def _mma(w13: Int4Weight, w2: Int4Weight) -> tuple[Int4ExpertsMMA, Int4ExpertsMMA]:
    return experts_to_mma(w13, gated=True), experts_to_mma(w2)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def _counters_dirty(device: torch.device) -> bool:
    """Whether a split-K counter was left non-zero (the next call would read it)."""
    from gpu_node.kernels.w4a16.gemv import split_counters

    return bool(split_counters(device).any())


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "group_size", "hidden", "inner"),
    [
        (1, 8, 2, 64, 128, 64),  # one token: 6 of 8 experts idle, split K
        (5, 8, 2, 128, 256, 128),
        (20, 4, 3, 64, 128, 64),  # 15 assignments an expert: two slots each
        (64, 64, 8, 64, 256, 128),  # 512 slots: whole K, no split
        (1, 8, 2, 32, 128, 64),  # groups of 32 (the engine's moe-small)
        (6, 8, 3, 32, 256, 128),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_reference(
    tokens: int,
    num_experts: int,
    top_k: int,
    group_size: int,
    hidden: int,
    inner: int,
    dtype: torch.dtype,
) -> None:
    from gpu_node.kernels.moe.mma import fused_moe_mma

    w13, w2 = _experts(num_experts, hidden, inner, group_size, seed=tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    routing = route(torch.randn(tokens, num_experts, generator=gen).to("cuda"), top_k)
    y = fused_moe_mma(x, *_mma(w13, w2), routing)
    ref = moe_experts_ref(x.float(), w13, w2, routing)
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    assert _relative_error(y, ref) <= TOLERANCE[dtype]


def test_routing_weight_is_applied_in_the_kernel() -> None:
    from gpu_node.kernels.moe.mma import fused_moe_mma

    w13, w2 = _mma(*_experts(4, 128, 64, 64, seed=1))
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    ids = torch.tensor([[1, 2], [1, 2]], device="cuda")
    half = fused_moe_mma(x, w13, w2, Routing(ids, torch.full((2, 2), 0.5, device="cuda")))
    ones = fused_moe_mma(x, w13, w2, Routing(ids, torch.ones(2, 2, device="cuda")))
    assert torch.equal(ones, 2 * half)  # a power of two: exact through every rounding
    only_first = fused_moe_mma(
        x, w13, w2, Routing(ids, torch.tensor([[1.0, 0.0]] * 2, device="cuda"))
    )
    alone = fused_moe_mma(
        x, w13, w2, Routing(ids[:, :1].contiguous(), torch.ones(2, 1, device="cuda"))
    )
    assert torch.equal(only_first, alone)


def test_module_takes_the_mma_layout_on_cuda_and_keeps_its_output() -> None:
    w13, w2 = _experts(8, 128, 128, 128, seed=3)
    module = Int4MoeExperts(w13, w2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 128, generator=gen).to("cuda", torch.bfloat16)
    routing = route(torch.randn(3, 8, generator=gen).to("cuda"), 2)
    y = module(x, routing)
    assert module.layout == "mma"
    back13, back2 = module.weights()
    assert torch.equal(back13.packed, w13.packed) and torch.equal(back2.scales, w2.scales)
    ref = moe_experts_ref(x.float(), w13, w2, routing)
    assert _relative_error(y, ref) <= TOLERANCE[torch.bfloat16]
    # fp32 activations fall back to the CUDA-core kernel over the same weights.
    y32 = module(x.float(), routing)
    assert _relative_error(y32, ref) <= 1e-5


def test_replays_in_a_cuda_graph_with_new_routing() -> None:
    from gpu_node.kernels.moe.mma import fused_moe_mma

    w13, w2 = _mma(*_experts(8, 128, 64, 64, seed=6))
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 128, generator=gen).to("cuda", torch.bfloat16)
    first = route(torch.randn(4, 8, generator=gen).to("cuda"), 2)
    second = route(torch.randn(4, 8, generator=gen).to("cuda"), 2)
    ids, weights = first.topk_ids.clone(), first.topk_weights.clone()
    fused_moe_mma(x, w13, w2, Routing(ids, weights))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_mma(x, w13, w2, Routing(ids, weights))
    for routing in (second, first):
        ids.copy_(routing.topk_ids)
        weights.copy_(routing.topk_weights)
        graph.replay()
        assert torch.equal(out, fused_moe_mma(x, w13, w2, routing))


def test_calls_that_do_not_fit_are_refused() -> None:
    from gpu_node.kernels.moe.mma import fused_moe_mma

    w13, w2 = _mma(*_experts(4, 128, 64, 64, seed=2))
    routing = route(torch.zeros(3, 4, device="cuda"), 2)
    with pytest.raises(ValueError, match="does not fit"):
        fused_moe_mma(torch.randn(3, 64, device="cuda", dtype=torch.bfloat16), w13, w2, routing)
    with pytest.raises(ValueError, match="bf16/fp16"):
        fused_moe_mma(torch.randn(3, 128, device="cuda"), w13, w2, routing)
    with pytest.raises(ValueError, match="gated"):
        fused_moe_mma(
            torch.randn(3, 128, device="cuda", dtype=torch.bfloat16),
            experts_to_mma(_experts(4, 128, 64, 64, seed=2)[0]),
            w2,
            routing,
        )


@pytest.mark.parametrize("tokens", [1, 24])  # split K (one slot an assignment); 3 slots an expert
def test_grouped_gemv_plain_and_gated(tokens: int) -> None:
    """One expert GEMM: plain rows give x @ W^T per assignment; gated rows give
    silu(gate) * up of the same product, applied in the epilogue."""
    from gpu_node.kernels.moe.mma import _grouped_gemv
    from gpu_node.kernels.moe.slots import expert_slots

    w13, _ = _experts(4, 256, 128, 128, seed=9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, 256, generator=gen).to("cuda", torch.bfloat16)
    ids = route(torch.randn(tokens, 4, generator=gen).to("cuda"), 2).topk_ids
    slots = expert_slots(ids, 4)
    dense = dequantize_int4(w13)  # [E, 2I, H] fp32
    h_ref = torch.einsum("ah,anh->an", x.float().repeat_interleave(2, 0), dense[ids.reshape(-1)])
    h = _grouped_gemv(x, experts_to_mma(w13), slots, None, 2)  # [A, 2I]
    assert h.shape == (tokens * 2, 256)
    assert _relative_error(h, h_ref) <= 8e-3
    gate, up = h_ref.chunk(2, dim=-1)
    act = _grouped_gemv(x, experts_to_mma(w13, gated=True), slots, None, 2)  # [A, I]
    assert act.shape == (tokens * 2, 128)
    assert _relative_error(act, torch.nn.functional.silu(gate) * up) <= 1e-2


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_one_token_path_equals_the_slot_path(group_size: int) -> None:
    """T = 1 without slot tables, GEMM 2 summing the experts: the same result as the slots
    and a separate sum, up to where bf16 rounds (the slot path rounds each expert's rows
    before summing; the one-token path sums fp32 partials and rounds once)."""
    from gpu_node.kernels.moe.mma import fused_moe_mma

    w13, w2 = _experts(16, 256, 128, group_size, seed=11)
    mma13, mma2 = _mma(w13, w2)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        x = torch.randn(1, 256, generator=gen).to("cuda", torch.bfloat16)
        routing = route(torch.randn(1, 16, generator=gen).to("cuda"), 6)
        direct = fused_moe_mma(x, mma13, mma2, routing)
        slotted = fused_moe_mma(x, mma13, mma2, routing, one_token=False)
        ref = moe_experts_ref(x.float(), w13, w2, routing)
        assert _relative_error(direct, ref) <= TOLERANCE[torch.bfloat16]
        assert _relative_error(direct, slotted) <= TOLERANCE[torch.bfloat16]
        assert torch.equal(direct, fused_moe_mma(x, mma13, mma2, routing))  # deterministic


def test_one_token_with_an_id_out_of_range_leaves_the_counters_clean() -> None:
    """An expert id out of range in the one-token path contributes zero rows and still
    reaches its columns' counters, so the split-K counters are clean for the next call."""
    from gpu_node.kernels.moe.mma import fused_moe_mma
    from gpu_node.kernels.w4a16.gemv import split_counters

    w13, w2 = _experts(8, 128, 512, 64, seed=12)  # GEMM 2 over 8 groups: split K
    mma13, mma2 = _mma(w13, w2)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(12)).to("cuda", torch.bfloat16)
    good = Routing(torch.tensor([[3, 5]], device="cuda"), torch.tensor([[0.5, 0.5]], device="cuda"))
    bad = Routing(torch.tensor([[3, 8]], device="cuda"), good.topk_weights)  # 8 == E
    expected = fused_moe_mma(x, mma13, mma2, good)
    only_three = fused_moe_mma(
        x, mma13, mma2, Routing(good.topk_ids[:, :1].contiguous(), good.topk_weights[:, :1])
    )
    # Equal up to the split-K sums' order (the two routings may split K differently).
    assert _relative_error(fused_moe_mma(x, mma13, mma2, bad), only_three) <= 1e-2
    assert not split_counters(x.device).any()
    assert torch.equal(fused_moe_mma(x, mma13, mma2, good), expected)


def test_a_split_override_past_the_counters_is_refused() -> None:
    from gpu_node.kernels.moe.mma import _grouped_gemv
    from gpu_node.kernels.moe.slots import expert_slots

    w13, _ = _experts(2, 128, 64, 64, seed=13)
    # 128 rows: 2 programs a slot; 32800 slots: 65600 split-K columns
    ids = torch.zeros(16400, 2, dtype=torch.int64, device="cuda")
    ids[:, 1] = 1
    x = torch.randn(16400, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exceed the 65536 counters"):
        _grouped_gemv(x, experts_to_mma(w13, gated=True), expert_slots(ids, 2), None, 2, 1)


def test_gemm2_split_k_at_several_tokens_equals_the_whole_k() -> None:
    """T > 1 through the slots with GEMM 2's K (the expert hidden size) split: the same
    result as one pass over K up to the order of the fp32 sums, and the reference's."""
    from gpu_node.kernels.moe.mma import _grouped_gemv, fused_moe_mma, moe_mma_config
    from gpu_node.kernels.moe.slots import expert_slots
    from gpu_node.kernels.w4a16.dot import num_sms

    w13, w2 = _experts(8, 128, 1024, 64, seed=14)  # GEMM 2: K = 1024, 16 groups
    mma13, mma2 = _mma(w13, w2)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(3, 128, generator=gen).to("cuda", torch.bfloat16)
    routing = route(torch.randn(3, 8, generator=gen).to("cuda"), 2)
    slots = expert_slots(routing.topk_ids, 8)
    num_slots = slots.slot_experts.numel()
    assert moe_mma_config(num_slots, 128, 1024, 64, num_sms(x.device)) < 16  # the heuristic splits
    y = fused_moe_mma(x, mma13, mma2, routing)
    assert _relative_error(y, moe_experts_ref(x.float(), w13, w2, routing)) <= 2e-2
    act = _grouped_gemv(x, mma13, slots, None, 2)
    weights = routing.topk_weights.reshape(-1).float().contiguous()
    whole = _grouped_gemv(act, mma2, slots, weights, 1, per_split=16)
    for per_split in (1, 2, 4, 8):
        split = _grouped_gemv(act, mma2, slots, weights, 1, per_split=per_split)
        assert _relative_error(split, whole) <= 8e-3  # each assignment's row rounds to bf16
        assert not _counters_dirty(x.device)


def test_one_token_path_replays_in_a_cuda_graph_with_new_routing() -> None:
    """T = 1 (no slot tables, GEMM 2 summing the experts) captured once: each replay reads
    the routing buffers' new ids and weights and gives the eager call's exact result."""
    from gpu_node.kernels.moe.mma import fused_moe_mma

    w13, w2 = _mma(*_experts(16, 128, 512, 64, seed=15))  # GEMM 2 over 8 groups: split K
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(1, 128, generator=gen).to("cuda", torch.bfloat16)
    routings = [route(torch.randn(1, 16, generator=gen).to("cuda"), 4) for _ in range(3)]
    ids, weights = routings[0].topk_ids.clone(), routings[0].topk_weights.clone()
    fused_moe_mma(x, w13, w2, Routing(ids, weights))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_mma(x, w13, w2, Routing(ids, weights))
    for routing in (routings[1], routings[2], routings[0]):
        ids.copy_(routing.topk_ids)
        weights.copy_(routing.topk_weights)
        graph.replay()
        assert torch.equal(out, fused_moe_mma(x, w13, w2, routing))
    assert not _counters_dirty(x.device)


@pytest.mark.parametrize("tokens", [1, 5])
def test_folded_int4_moe_mlp_on_tensor_cores_equals_the_unfolded_fp32_path(tokens: int) -> None:
    """A whole MoE MLP (router, routed experts, one shared expert) quantized to INT4 g64:
    with its shared expert folded and bf16 activations it runs the fused router and the
    tensor-core kernel; unfolded with fp32 activations, the CUDA-core kernels. Same
    routing, outputs within bf16's rounding of each other."""
    from gpu_node.models.moe import MoeConfig, MoeMLP
    from gpu_node.quant.linear import quantize_model

    config = MoeConfig(
        hidden_size=256, num_experts=8, top_k=2, expert_hidden_size=128, num_shared_experts=1
    )
    mlp = MoeMLP.dummy(config, seed=16, dtype=torch.bfloat16, device="cuda")
    mlp = quantize_model(mlp, group_size=64, skip=("router",))
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(16)).to("cuda")
    x = x.to(torch.bfloat16)
    unfolded_routing = mlp.router(x.float())
    ref = mlp(x.float())  # fp32 activations: CUDA-core kernels, shared expert apart
    assert mlp.fold_shared_experts()
    folded_routing = mlp.router(x, mlp.num_always_on)
    assert torch.equal(folded_routing.topk_ids[:, :2], unfolded_routing.topk_ids)
    assert torch.equal(folded_routing.topk_ids[:, 2], torch.full((tokens,), 8, device="cuda"))
    y = mlp(x)
    assert isinstance(mlp.experts, Int4MoeExperts) and mlp.experts.layout == "mma"
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, 256)
    assert _relative_error(y, ref) <= TOLERANCE[torch.bfloat16]
