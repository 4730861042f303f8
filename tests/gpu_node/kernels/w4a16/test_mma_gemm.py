"""The W4A16 GEMMs over Int4WeightMMA (more rows than the decode GEMV takes).

On CPU the interpreter runs the dot kernel (products in fp32); on CUDA both kernels run
compiled, in bf16 and fp16 (the tc kernel's inline PTX is GPU-only; its PTX has CPU
tests here). Every path must equal x @ W^T over the dequantized weights: the dot kernel
rounds them to x's dtype as the dense copy does, the tc kernel multiplies the exact codes
and applies the scales in fp32 as the GEMV does.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import pytest
import torch

import gpu_node.kernels.w4a16.mma as mma_module
import gpu_node.kernels.w4a16.mma_dequant as dequant_module
import gpu_node.kernels.w4a16.mma_gemm as gemm_module
from gpu_node.kernels.w4a16.mma_asm import GEMM_PTX, MAGIC
from gpu_node.kernels.w4a16.reference import dequantize_ref
from gpu_node.quant.int4 import Int4WeightMMA, from_mma, quantize_int4, to_mma

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32]
KERNELS = ["tc", "dot"] if CUDA else ["dot"]
needs_cuda = pytest.mark.skipif(not CUDA, reason="the tc kernel's inline PTX runs on GPUs only")
# Max |gemm - reference| over max |reference|: fp32 sums of the same products in another
# order, and (bf16/fp16) one rounding of the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


def mma_weight(n: int, k: int, group_size: int, seed: int, symmetric: bool) -> Int4WeightMMA:
    gen = torch.Generator().manual_seed(seed)
    weight = quantize_int4(torch.randn(n, k, generator=gen), group_size, symmetric=symmetric)
    mma = to_mma(weight, symmetric=symmetric)
    return Int4WeightMMA(mma.tiles.to(DEVICE), mma.shape, group_size, symmetric)


def activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(DEVICE, dtype)


def reference(x: torch.Tensor, weight: Int4WeightMMA, kernel: str) -> torch.Tensor:
    """fp32 x @ W^T over the weights each kernel multiplies: rounded to x's dtype (dot),
    exact (tc)."""
    w = dequantize_ref(weight)
    if kernel == "dot":
        w = w.to(x.dtype).float()
    return x.float() @ w.T


def config_for(
    kernel: str, x: torch.Tensor, weight: Int4WeightMMA, **changes: Any
) -> gemm_module.GemmConfig:
    """The heuristic launch of `kernel` for this call (the interpreter plans for 4
    multiprocessors, as w4a16_mma_gemm does), with `changes`."""
    n, k = weight.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if CUDA else 4
    config = gemm_module.gemm_config(kernel, x.shape[0], n, k, weight.group_size, sms)
    return dataclasses.replace(config, **changes)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, n, k, group_size, symmetric",
    [
        (9, 40, 128, 32, False),  # N not a multiple of 16: pad rows never stored
        (20, 64, 256, 64, False),
        (33, 48, 256, 128, True),
        (17, 72, 192, 32, True),  # three steps of 64: an odd step count
        (12, 24, 384, 128, False),  # three steps of 128
    ],
)
def test_gemm_equals_the_reference(m, n, k, group_size, symmetric, dtype, kernel) -> None:
    weight = mma_weight(n, k, group_size, seed=m, symmetric=symmetric)
    x = activations(m, k, dtype, seed=n)
    y = gemm_module.w4a16_mma_gemm(x, weight, config_for(kernel, x, weight))
    assert y.shape == (m, n) and y.dtype == dtype
    assert relative_error(y, reference(x, weight, kernel)) < TOLERANCE[dtype]


DOT_CONFIGS = [
    {"split_k": 3, "rb": 2},  # 2, 2 and 2 of 6 groups of 32
    {"split_k": 5, "rb": 1},  # uneven splits: 1 or 2 groups each
    {"block_m": 32, "rb": 1},  # two token blocks, the last one partial
    {"block_m": 64, "rb": 8},  # more row blocks a program than there are
]
TC_CONFIGS = [
    {"mt": 1, "r": 1, "split_k": 3},  # one step of 64 a split
    {"mt": 4, "r": 2, "split_k": 2},  # 2 and 1 steps: an odd split
    {"mt": 2, "r": 4, "warps": 8},  # 32 row blocks a program, 5 of them
]


@pytest.mark.parametrize(
    "kernel, changes",
    [("dot", c) for c in DOT_CONFIGS]
    + [pytest.param("tc", c, marks=needs_cuda) for c in TC_CONFIGS],
)
def test_every_config_gives_the_same_product(kernel, changes) -> None:
    dtype = DTYPES[0]
    weight = mma_weight(72, 192, 32, seed=1, symmetric=False)
    x = activations(60, 192, dtype, seed=2)
    config = config_for(kernel, x, weight, **changes)
    y = gemm_module.w4a16_mma_gemm(x, weight, config)
    assert relative_error(y, reference(x, weight, kernel)) < TOLERANCE[dtype]
    # Splits sum their fp32 partials in a fixed order: the same bits call after call.
    assert torch.equal(y, gemm_module.w4a16_mma_gemm(x, weight, config))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("group_size, symmetric", [(64, True), (128, False)])
def test_splits_of_whole_groups_give_the_same_product(kernel, group_size, symmetric) -> None:
    # K = 384: six groups of 64 (six tc steps) or three of 128 (three tc steps of two
    # chunks each), split unevenly three and two ways.
    dtype = DTYPES[0]
    weight = mma_weight(40, 384, group_size, seed=4, symmetric=symmetric)
    x = activations(24, 384, dtype, seed=5)
    ref = reference(x, weight, kernel)
    for split in (2, 3):
        y = gemm_module.w4a16_mma_gemm(x, weight, config_for(kernel, x, weight, split_k=split))
        assert relative_error(y, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("kernel", KERNELS)
def test_views_of_x_give_the_product_of_their_rows(kernel) -> None:
    # Rows starting at an odd element, every other row, and one row of an odd stride:
    # the tc kernel reads x as int32 pairs, so such views are copied first.
    dtype = DTYPES[0]
    weight = mma_weight(32, 128, 64, seed=6, symmetric=False)
    base = activations(41, 129, dtype, seed=7)
    for x in (base[1:18, 1:], base[::2, :128], base[3:4, 1:]):
        y = gemm_module.w4a16_mma_gemm(x, weight, config_for(kernel, x, weight))
        assert relative_error(y, reference(x, weight, kernel)) < TOLERANCE[dtype]


def test_gemm_refuses_what_it_cannot_take() -> None:
    weight = mma_weight(32, 128, 64, seed=0, symmetric=False)
    x = activations(16, 128, DTYPES[0], 0)
    with pytest.raises(ValueError, match=re.escape("x must be [M, 128], got (4, 64)")):
        gemm_module.w4a16_mma_gemm(activations(4, 64, DTYPES[0], 0), weight)
    too_many = activations(gemm_module.MAX_M + 1, 128, DTYPES[0], 0)
    with pytest.raises(ValueError, match=f"1..{gemm_module.MAX_M} rows"):
        gemm_module.w4a16_mma_gemm(too_many, weight)
    with pytest.raises(ValueError, match=re.escape("split_k must be 1..2, got 3")):
        gemm_module.w4a16_mma_gemm(x, weight, gemm_module.DotConfig(split_k=3))
    with pytest.raises(ValueError, match="kernel is tc or dot, got 'mma'"):
        gemm_module.gemm_config("mma", 16, 32, 128, 64, 4)
    with pytest.raises(TypeError, match="config is a TcConfig or a DotConfig, got dict"):
        gemm_module.w4a16_mma_gemm(x, weight, {"KERNEL": "dot"})  # type: ignore[arg-type]
    assert not gemm_module.supports(x.unsqueeze(0), weight)
    assert not gemm_module.supports(x, from_mma(weight))
    if not CUDA:
        with pytest.raises(ValueError, match="the tc kernel takes bf16/fp16 on CUDA sm_80"):
            gemm_module.w4a16_mma_gemm(x, weight, gemm_module.TcConfig())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: gemm_module.TcConfig(mt=3), "mt must be 1, 2 or 4 (register tensors), got 3"),
        (lambda: gemm_module.TcConfig(r=8), "r must be 1, 2 or 4 (register tensors), got 8"),
        (lambda: gemm_module.TcConfig(warps=3), "warps must be a power of two, got 3"),
        (lambda: gemm_module.TcConfig(split_k=0), "split_k must be 1 or more, got 0"),
        (lambda: gemm_module.DotConfig(rb=3), "rb must be a power of two, got 3"),
        (lambda: gemm_module.DotConfig(num_warps=6), "num_warps must be a power of two, got 6"),
        (lambda: gemm_module.DotConfig(block_m=8), "block_m must be 16 or more (tl.dot), got 8"),
        (lambda: gemm_module.DotConfig(split_k=0), "split_k must be 1 or more, got 0"),
        (lambda: gemm_module.DotConfig(num_stages=0), "num_stages must be 1 or more, got 0"),
    ],
)
def test_configs_refuse_launches_the_kernels_cannot_lay_out(make, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


@needs_cuda
def test_tc_refuses_more_splits_than_steps() -> None:
    weight = mma_weight(32, 128, 64, seed=0, symmetric=False)  # two steps of 64
    x = activations(16, 128, DTYPES[0], 0)
    with pytest.raises(ValueError, match=re.escape("split_k must be 1..2, got 3")):
        gemm_module.w4a16_mma_gemm(x, weight, gemm_module.TcConfig(split_k=3))


def test_the_heuristic_fills_the_gpu() -> None:
    # tc: two token tiles a program. 4096 x 4096 on 132 multiprocessors, 16 rows: 256 row
    # blocks in 64 programs of four one-row-block warps, K split four ways (1024 warps).
    assert gemm_module.gemm_config("tc", 16, 4096, 4096, 128, 132) == gemm_module.TcConfig(
        mt=2, r=1, warps=4, split_k=4
    )
    # 14336 k: two row blocks a warp, 32 programs, eight splits of 14 steps.
    assert gemm_module.gemm_config("tc", 16, 4096, 14336, 128, 132).split_k == 8
    # 16384 rows at 32 tokens: 128 x 2 programs already fill six warps a multiprocessor.
    assert gemm_module.gemm_config("tc", 32, 16384, 2048, 128, 132).split_k == 1
    # dot: 64 tokens in one block of four row blocks; 64 programs split K in four.
    assert gemm_module.gemm_config("dot", 64, 4096, 4096, 128, 132) == gemm_module.DotConfig(
        block_m=64, rb=4, split_k=4, num_warps=4, num_stages=3
    )
    # Never fewer than 8 groups a split: 8 programs, yet 16 groups split only in two.
    assert gemm_module.gemm_config("dot", 64, 512, 2048, 128, 132).split_k == 2


def test_matmul_takes_the_gemm_between_the_gemv_and_the_dense_copy(monkeypatch) -> None:
    """w4a16_mma_matmul (what Int4Linear runs) sends 9..MAX_M rows of a weight of
    MIN_WEIGHTS or more to the GEMMs (tc up to TC_MAX_M rows on a GPU), and more rows or a
    smaller weight to the dense copy and torch.matmul."""
    dtype = DTYPES[0]
    weight = mma_weight(48, 128, 64, seed=3, symmetric=False)
    copy = dequant_module.dequantize_mma(weight, dtype)

    def through_copy(x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, copy)

    x = activations(9, 128, dtype, seed=9)
    assert gemm_module.MIN_WEIGHTS > 48 * 128  # a small weight: the copy is the faster
    assert torch.equal(mma_module.w4a16_mma_matmul(x, weight), through_copy(x))
    monkeypatch.setattr(gemm_module, "MIN_WEIGHTS", 48 * 128)
    for m, kernel in ((9, KERNELS[0]), (gemm_module.TC_MAX_M + 1, "dot")):
        x = activations(m, 128, dtype, seed=m)
        y = mma_module.w4a16_mma_matmul(x, weight)
        assert torch.equal(y, gemm_module.w4a16_mma_gemm(x, weight, config_for(kernel, x, weight)))
    x = activations(gemm_module.MAX_M + 1, 128, dtype, seed=5)
    assert torch.equal(mma_module.w4a16_mma_matmul(x, weight), through_copy(x))


@pytest.mark.parametrize("dtype", list(MAGIC))
@pytest.mark.parametrize("halves", [False, True])
def test_gemm_ptx_operands_match_their_constraints(dtype, halves) -> None:
    # Every $i the PTX uses exists and every operand is used: outputs, then inputs.
    dq, dq_c, mma, mma_c, s_asm, s_c = GEMM_PTX[halves]
    outputs = 8 if halves else 4
    for asm, constraints, outs in ((dq[dtype], dq_c, 16), (mma[dtype], mma_c, outputs),
                                   (s_asm[dtype], s_c, outputs)):  # fmt: skip
        used = {int(v) for v in re.findall(r"\$(\d+)", asm)}
        kinds = constraints.split(",")
        assert used == set(range(len(kinds)))
        assert all(kind.startswith("=") for kind in kinds[:outs])
        assert not any(kind.startswith("=") for kind in kinds[outs:])
    # One mma a k16 step, its A registers the dequantized words' (4r + s: register r of
    # step s), its B the lane's pairs 2s and 2s + 1 of the tile.
    steps = re.findall(r"\{(\$\d+), (\$\d+), (\$\d+), (\$\d+)\}, \{(\$\d+), (\$\d+)\}", mma[dtype])
    assert len(steps) == 4
    for s, regs in enumerate(steps):
        a = [int(r[1:]) - outputs for r in regs[:4]]
        b = [int(r[1:]) - outputs - 16 for r in regs[4:]]
        assert a == [4 * r + s for r in range(4)] and b == [2 * s, 2 * s + 1]
    # The dequantization writes output 4r + s (register r) from word s ($16 + s), each
    # word's four registers moved out before the next word is read: one LOP3 a register.
    assert dq[dtype].count("lop3.b32") == 16
    word, moved = -1, []
    for line in dq[dtype].splitlines():
        read = re.search(r"\$(1[6-9])\b", line)
        if read:
            word = int(read.group(1)) - 16
        out = re.match(r"mov\.b32 \$(\d+), a(\d);", line)
        if out:
            moved.append((int(out.group(1)), 4 * int(out.group(2)) + word))
    assert len(moved) == 16 and all(got == want for got, want in moved)
