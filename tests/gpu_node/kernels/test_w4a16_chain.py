"""The persistent chain of square W4A16 GEMVs (gpu_node/kernels/w4a16_mma_chain.py).

The stacking, the plan and the errors run on the CPU; the kernel (inline PTX) on a GPU only,
where each layer of a chain must give the same bits as the GEMV launched one layer at a time
with the same launch (rows a warp, chains, splits)."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_node.kernels import w4a16_mma_chain as chain_module
from gpu_node.kernels.w4a16_mma import w4a16_mma_gemv, w4a16_mma_ref
from gpu_node.kernels.w4a16_mma_chain import (
    MMAChain,
    chain_plan,
    launch_splits,
    supports,
    w4a16_mma_chain,
)
from gpu_node.quant.int4 import Int4WeightMMA, quantize_int4, to_mma

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA or os.environ.get("TRITON_INTERPRET") == "1",
    reason="the kernel's inline PTX runs on NVIDIA GPUs only, compiled (TRITON_INTERPRET=0)",
)


def layer(n: int, k: int, group_size: int, seed: int, symmetric: bool = False) -> Int4WeightMMA:
    gen = torch.Generator().manual_seed(seed)
    # Scaled so that a chain's activations keep their size layer after layer.
    weight = torch.randn(n, k, generator=gen) / k**0.5
    return to_mma(quantize_int4(weight, group_size, symmetric=symmetric), symmetric=symmetric)


def on(weight: Int4WeightMMA, device: str) -> Int4WeightMMA:
    return Int4WeightMMA(weight.tiles.to(device), weight.shape, weight.group_size, weight.symmetric)


def test_a_chain_holds_square_layers_each_as_it_was() -> None:
    weights = [layer(256, 256, 64, seed) for seed in range(3)]
    chain = MMAChain.from_weights(weights)
    # [L, K / T, N16 / 16, width]: 4 steps of 64, 16 row blocks, 128 words + 16 of scales
    assert tuple(chain.storage.shape) == (3, 4, 16, 144)
    assert chain.storage.is_contiguous()
    assert (chain.layers, chain.shape, chain.group_size) == (3, (256, 256), 64)
    assert chain.nbytes == sum(w.nbytes for w in weights)
    for index, weight in enumerate(weights):
        got = chain.layer(index)
        assert torch.equal(got.tiles, weight.tiles)
        assert (got.shape, got.group_size, got.symmetric) == (weight.shape, 64, False)
        assert got.tiles.stride() == weight.tiles.stride()


def test_a_chain_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        MMAChain.from_weights([])
    with pytest.raises(ValueError, match="square layers"):
        MMAChain.from_weights([layer(128, 256, 64, 0)])
    with pytest.raises(ValueError, match="one shape and group size"):
        MMAChain.from_weights([layer(256, 256, 64, 0), layer(256, 256, 128, 1)])
    with pytest.raises(ValueError, match="asymmetric layers"):
        MMAChain.from_weights([layer(256, 256, 64, 0), layer(256, 256, 64, 1, symmetric=True)])


def test_the_plan_is_the_gemvs_with_splits_fitted_to_what_is_resident() -> None:
    # 8192 x 8192 on 132 multiprocessors: the GEMV's heuristic, one row block a warp, 8
    # steps a split (w4a16_mma_plan): 128 programs along N, 8 splits.
    plan = chain_plan(8192, 8192, 128, 132)
    assert (plan.programs, plan.splits, plan.rows_per_warp, plan.warps, plan.chains) == (
        128, 8, 1, 4, 2,
    )  # fmt: skip
    assert plan.num_groups == 64
    # 6 programs a multiprocessor resident: 792 in all, so 6 splits of the 128 columns.
    assert chain_plan(8192, 8192, 128, 132, resident=6 * 132).splits == 6
    assert chain_plan(8192, 8192, 128, 132, resident=10_000).splits == 8
    assert chain_plan(8192, 8192, 128, 132, resident=128).splits == 1
    assert chain_plan(4096, 4096, 128, 132, config={"SPLITS": 3, "R": 2}).splits == 3
    with pytest.raises(ValueError, match="128 programs along N exceed the 100 resident"):
        chain_plan(8192, 8192, 128, 132, resident=100)


def test_a_call_off_the_gpu_is_refused_in_words() -> None:
    chain = MMAChain.from_weights([layer(256, 256, 64, 0)])
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not supports(x, chain)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\], got \(1, 128\)"):
        w4a16_mma_chain(x[:, :128], chain)
    with pytest.raises(ValueError, match=r"takes bf16/fp16 x of 1\.\.8 rows on CUDA"):
        w4a16_mma_chain(x, chain)


def one_at_a_time(x: torch.Tensor, chain: MMAChain, config: dict) -> list[torch.Tensor]:
    """The GEMV launched layer by layer, each reading the last's y."""
    ys = []
    for index in range(chain.layers):
        x = w4a16_mma_gemv(x, chain.layer(index), config={"WARPS": 4, **config})
        ys.append(x)
    return ys


def all_zero_after(device: torch.device) -> bool:
    torch.cuda.synchronize()
    return not any(state.any() for state in chain_module._state(device, 1))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, n, group_size, config",
    [
        (1, 4096, 128, {"R": 1, "CHAINS": 2, "SPLITS": 8}),
        (3, 4096, 128, {"R": 2, "CHAINS": 1, "SPLITS": 5}),
        (8, 2048, 64, {"R": 1, "CHAINS": 2, "SPLITS": 1}),
        (2, 1024, 32, {"R": 1, "CHAINS": 2, "SPLITS": 4}),
        (1, 1088, 64, {"R": 2, "CHAINS": 1, "SPLITS": 3, "EARLY": 0}),  # a part program
        (1, 4096, 128, {"R": 1, "CHAINS": 2, "SPLITS": 8, "NEXT_FIRST": 0}),
    ],
)
def test_each_layer_gives_the_bits_of_the_gemv_one_layer_at_a_time(
    m, n, group_size, config, dtype
) -> None:
    weights = [on(layer(n, n, group_size, seed), "cuda") for seed in range(4)]
    chain = MMAChain.from_weights(weights)
    gen = torch.Generator("cuda").manual_seed(m + n)
    x = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    gemv_config = {key: config[key] for key in ("R", "CHAINS", "SPLITS")}
    expected = one_at_a_time(x, chain, gemv_config)
    for _ in range(2):  # the barriers and counters are back at zero for the next call
        ys = w4a16_mma_chain(x, chain, config=config, check=True)
        assert ys.shape == (4, m, n) and ys.dtype == dtype
        assert launch_splits(x, chain, config) == config["SPLITS"]
        for index in range(4):
            assert torch.equal(ys[index], expected[index]), index
        assert all_zero_after(x.device)
    # and the chain computes the products themselves (the reference from its layer's input)
    ref = w4a16_mma_ref(ys[2], weights[3]).float()
    assert float((ys[3].float() - ref).abs().max() / ref.abs().max()) < 8e-3


@needs_cuda
def test_more_splits_than_the_gpu_holds_are_fitted_down_and_stay_exact() -> None:
    """8192 x 8192 asked for 64 splits (8192 programs, past any H200 wave): the launch
    lowers them to what is resident, and the layers match the GEMV at that count."""
    weights = [on(layer(8192, 8192, 128, seed), "cuda") for seed in range(2)]
    chain = MMAChain.from_weights(weights)
    x = torch.randn(1, 8192, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    x = x.to(torch.bfloat16)
    config = {"R": 1, "CHAINS": 2, "SPLITS": 64}
    ys = w4a16_mma_chain(x, chain, config=config, check=True)
    splits = launch_splits(x, chain, config)
    assert 1 <= splits < 64
    expected = one_at_a_time(x, chain, {"R": 1, "CHAINS": 2, "SPLITS": splits})
    assert torch.equal(ys[0], expected[0]) and torch.equal(ys[1], expected[1])
    assert all_zero_after(x.device)


@needs_cuda
def test_a_chain_replays_in_a_cuda_graph() -> None:
    weights = [on(layer(4096, 4096, 128, seed), "cuda") for seed in range(3)]
    chain = MMAChain.from_weights(weights)
    x = torch.randn(1, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    x = x.to(torch.bfloat16)
    expected = w4a16_mma_chain(x, chain, check=True).clone()  # compiles, fits the splits
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = w4a16_mma_chain(x, chain)
    for _ in range(3):
        ys.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ys, expected)
    assert all_zero_after(x.device)
