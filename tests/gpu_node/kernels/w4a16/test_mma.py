"""The tensor-core decode GEMV over Int4WeightMMA.

On CPU: the layout is lossless and as documented, and an emulation of the kernel's
arithmetic built from PTX's own fragment tables for mma.m16n8k16 (not from the
kernel's code) equals the reference, so the layout, the LOP3 dequantization and
the scale/offset algebra agree with what the tensor core does. On CUDA: the kernel
itself equals the reference (the interpreter cannot run its inline asm).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import gpu_node.kernels.w4a16.mma as mma_module
import gpu_node.kernels.w4a16.mma_dequant as dequant_module
import gpu_node.kernels.w4a16.mma_plan as plan_module
from gpu_node.kernels.w4a16.mma_asm import HALVES_PTX, HIGH_ROWS, PTX, group_step_constants
from gpu_node.kernels.w4a16.reference import dequantize_ref, w4a16_matmul_ref
from gpu_node.quant.int4 import (
    Int4WeightMMA,
    dequantize_int4,
    from_mma,
    quantize_int4,
    to_mma,
    unpack_int4,
)
from gpu_node.quant.linear import Int4Linear, model_bytes

dequantize_mma = dequant_module.dequantize_mma
mma_gemv_config = mma_module.mma_gemv_config
supports = mma_module.supports
w4a16_mma_gemv = mma_module.w4a16_mma_gemv
w4a16_mma_matmul = mma_module.w4a16_mma_matmul
D_ASM, D_CONSTRAINTS, S_ASM, S_CONSTRAINTS = PTX[1]  # one accumulator a chain
D2_ASM, D2_CONSTRAINTS, S2_ASM, S2_CONSTRAINTS = PTX[2]  # two

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA or os.environ.get("TRITON_INTERPRET") == "1",
    reason="the kernel's inline PTX runs on NVIDIA GPUs only, compiled (TRITON_INTERPRET=0)",
)
# Max |kernel - reference| over max |reference|: both sum in fp32; what is left is
# the summation order, the offset's cancellation and one rounding of the output.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 8e-3}


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def mma_weight(
    n: int, k: int, group_size: int, seed: int, device: str = "cpu", symmetric: bool = False
) -> Int4WeightMMA:
    gen = torch.Generator().manual_seed(seed)
    weight = quantize_int4(torch.randn(n, k, generator=gen), group_size, symmetric=symmetric)
    mma = to_mma(weight, symmetric=symmetric)
    return Int4WeightMMA(mma.tiles.to(device), mma.shape, group_size, symmetric)


def test_mma_layout_is_lossless_and_as_documented() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = quantize_int4(torch.randn(20, 128, generator=gen), 64)
    mma = to_mma(weight)
    assert mma.tiles.shape == (2, 2, 2 * 64 + 16) and mma.tiles.dtype == torch.int32
    assert mma.tiles.stride() == (144, 2 * 144, 1)  # stored group-major
    assert mma.words.shape == (2, 2, 32, 4) and mma.words.dtype == torch.int32
    assert mma.scale_mins.shape == (2, 2, 8, 4) and mma.scale_mins.dtype == torch.float16
    # 128 words and 16 int32 of scales and mins per (row block, group): 144 * 4 bytes
    # for 16 x 64 values (512 bytes of codes and 64 of scales and mins).
    assert mma.nbytes == 2 * 2 * 144 * 4
    back = from_mma(mma)
    assert torch.equal(back.packed, weight.packed)
    assert torch.equal(back.scales, weight.scales) and torch.equal(back.mins, weight.mins)
    codes = unpack_int4(weight.packed).reshape(20, 128)
    # Lane 4g + t = 4 * 3 + 2 (g = 3, t = 2) of row block 1, chunk 1, step s = 3:
    # kb = 64 + 32 + 12 = 108; rows 16 + 3 and 16 + 3 + 8 = 27 (a zero pad row).
    word = int(mma.words[1, 1, 14, 3]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * p)) & 15 for p in range(8)]
    assert nibbles == [
        int(codes[19, 108]),
        0,
        int(codes[19, 110]),
        0,
        int(codes[19, 109]),
        0,
        int(codes[19, 111]),
        0,
    ]
    assert torch.equal(mma.words[1, 1], mma.tiles[1, 1, :128].reshape(32, 4))
    # Scale and min of rows 16rb + g and 16rb + g + 8 (row block 0, group 1, g = 5).
    assert mma.scale_mins[0, 1, 5].tolist() == [
        float(weight.scales[5, 1]),
        float(weight.mins[5, 1]),
        float(weight.scales[13, 1]),
        float(weight.mins[13, 1]),
    ]
    assert mma.scale_mins[1, 1, 4, 2:].tolist() == [0.0, 0.0]  # row 28: padding


def test_group_32_tiles_hold_a_chunk_and_both_groups_scales() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = quantize_int4(torch.randn(16, 128, generator=gen), 32)
    mma = to_mma(weight)
    # A step of 64 k: 128 words, then 16 int32 of scales and mins for each of its 2 groups.
    assert mma.tiles.shape == (1, 2, 128 + 2 * 16)
    assert mma.words.shape == (1, 2, 32, 4) and mma.scale_mins.shape == (1, 4, 8, 4)
    # Step 1 holds groups 2 and 3: group 3's (g = 6) pair sits after group 2's.
    second = mma.tiles[0, 1, 128 + 16 :].contiguous().view(torch.float16).reshape(8, 4)
    assert second[6].tolist() == [
        float(weight.scales[6, 3]),
        float(weight.mins[6, 3]),
        float(weight.scales[14, 3]),
        float(weight.mins[14, 3]),
    ]
    back = from_mma(mma)
    assert torch.equal(back.packed, weight.packed)
    assert torch.equal(back.scales, weight.scales) and torch.equal(back.mins, weight.mins)


def test_symmetric_tiles_hold_the_scales_alone() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = quantize_int4(torch.randn(20, 256, generator=gen), 128, symmetric=True)
    mma = to_mma(weight, symmetric=True)
    # 256 words and 8 int32 of scales per (row block, group): 264 * 4 bytes for 16 x 128
    # values, against 272 * 4 with the mins.
    assert mma.symmetric and mma.tiles.shape == (2, 2, 2 * 128 + 8)
    assert mma.nbytes == 2 * 2 * 264 * 4
    assert to_mma(weight).nbytes == 2 * 2 * 272 * 4
    # fp16 (g, 2) a group: the scales of rows 16rb + g and 16rb + g + 8 (rb 0, group 1, g 5).
    scales = mma.tiles[0, 1, 256:].contiguous().view(torch.float16).reshape(8, 2)
    assert scales[5].tolist() == [float(weight.scales[5, 1]), float(weight.scales[13, 1])]
    assert mma.scale_mins[0, 1, 5].tolist() == [
        float(weight.scales[5, 1]),
        float(weight.mins[5, 1]),
        float(weight.scales[13, 1]),
        float(weight.mins[13, 1]),
    ]
    assert torch.equal(mma.words, to_mma(weight).words)  # the codes are laid out alike
    back = from_mma(mma)
    assert torch.equal(back.packed, weight.packed)
    assert torch.equal(back.scales, weight.scales) and torch.equal(back.mins, weight.mins)
    # Groups of 32: a step's two groups' scales one after the other (8 int32 each).
    g32 = quantize_int4(torch.randn(16, 128, generator=gen), 32, symmetric=True)
    tiles = to_mma(g32, symmetric=True).tiles
    assert tiles.shape == (1, 2, 128 + 2 * 8)
    second = tiles[0, 1, 128 + 8 :].contiguous().view(torch.float16).reshape(8, 2)
    assert second[6].tolist() == [float(g32.scales[6, 3]), float(g32.scales[14, 3])]
    assert torch.equal(dequantize_int4(from_mma(to_mma(g32, symmetric=True))), dequantize_int4(g32))


def test_symmetric_tiles_refuse_a_weight_with_its_own_mins() -> None:
    weight = quantize_int4(torch.randn(16, 128, generator=torch.Generator().manual_seed(6)), 64)
    with pytest.raises(ValueError, match=r"symmetric=True\) takes a weight whose mins are -8"):
        to_mma(weight, symmetric=True)
    with pytest.raises(ValueError, match=r"must be int32 \[1, 2, 136\]"):
        Int4WeightMMA(to_mma(weight).tiles, (16, 128), 64, symmetric=True)


def test_tiles_must_start_16_byte_aligned() -> None:
    # The kernels load 16 bytes a lane from every tile and step: a stride or offset that
    # is no multiple of 4 int32 is refused, not read misaligned.
    padded = torch.zeros(1, 2, 145, dtype=torch.int32)[:, :, :144]  # step stride 145
    with pytest.raises(
        ValueError,
        match=r"multiples of 4, got torch.int32 \[1, 2, 144\] "
        r"strides \(290, 145, 1\) offset 0",
    ):
        Int4WeightMMA(padded, (16, 128), 64)
    shifted = torch.zeros(2 * 144 + 1, dtype=torch.int32)[1:].reshape(1, 2, 144)
    with pytest.raises(ValueError, match="offset 1"):
        Int4WeightMMA(shifted, (16, 128), 64)
    Int4WeightMMA(torch.zeros(1, 2, 144, dtype=torch.int32), (16, 128), 64)  # aligned: taken


def test_to_mma_rejects_what_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="takes K a multiple of 64, got 96"):
        to_mma(quantize_int4(torch.randn(16, 96), 32))
    # Nor a hand-built layout whose K ends inside a step (the kernel would skip the rest).
    with pytest.raises(ValueError, match="Int4WeightMMA takes K a multiple of 64, got 96"):
        Int4WeightMMA(torch.zeros(1, 1, 160, dtype=torch.int32), (16, 96), 32)


def _halves(regs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 registers [...] -> their two 16-bit halves as floats [..., 2] (low, high)."""
    return regs.contiguous().view(torch.int16).view(dtype).float().reshape(*regs.shape, 2)


def emulate_mma_gemv(x: torch.Tensor, weight: Int4WeightMMA) -> torch.Tensor:
    """What the kernel computes, from PTX's fragment tables for mma.m16n8k16 (fp32 sums).

    A (16 x 16): lane 4g + t, register r holds A[g + 8 (r % 2)][2t + 8 (r // 2) + {0, 1}];
    B (16 x 8): register h holds B[2t + 8h + {0, 1}][g]; C (16 x 8): c_j = C[g + 8 (j // 2)][2t + j % 2].
    """
    magic, offset = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}[
        x.dtype
    ]
    n, k = weight.shape
    m = x.shape[0]
    rbs = weight.words.shape[0]
    pairs = x.contiguous().view(torch.int32)  # [M, K/2]
    y = torch.zeros(m, rbs * 16)
    g_of = torch.arange(32) // 4
    t_of = torch.arange(32) % 4
    size = weight.group_size
    d = torch.zeros(k // size, rbs, 16, 8)  # C[row][col], per group and row block
    s = torch.zeros(k // size, 16, 8)
    for c in range(k // 64):
        for step in range(4):
            # Lane t's k for (step, h): Int4WeightMMA's docstring, independently of the kernel.
            if size == 32:
                group = 2 * c + step // 2

                def k_of(t: int, h: int, c=c, step=step) -> int:
                    return 64 * c + 32 * (step // 2) + 8 * t + 4 * (step % 2) + 2 * h
            else:
                group = 64 * c // size

                def k_of(t: int, h: int, c=c, step=step) -> int:
                    return 64 * c + 16 * t + 4 * step + 2 * h

            a = torch.zeros(rbs, 16, 16)
            words = weight.words[:, c, :, step]  # [rbs, 32 lanes]
            for r in range(4):
                if x.dtype == torch.float16:  # odd registers keep their nibbles in place
                    reg = ((words >> (8 * (r // 2))) & (0x000F000F << (4 * (r % 2)))) | magic
                else:
                    reg = ((words >> (4 * r)) & 0x000F000F) | magic
                vals = _halves(reg, x.dtype)  # [rbs, 32, 2]
                for lane in range(32):
                    row = g_of[lane] + 8 * (r % 2)
                    col = 2 * t_of[lane] + 8 * (r // 2)
                    a[:, row, col : col + 2] = vals[:, lane]
            b = torch.zeros(16, 8)
            for lane in range(32):
                g, t = int(g_of[lane]), int(t_of[lane])
                x_row = g if g < m else 0
                for h in range(2):
                    pair = pairs[x_row, k_of(t, h) // 2]
                    b[2 * t + 8 * h : 2 * t + 8 * h + 2, g] = _halves(pair.reshape(1), x.dtype)[0]
            d[group] += a @ b
            s[group] += torch.ones(16, 16) @ b
    for group in range(k // size):
        sm = weight.scale_mins[:, group].float()  # [rbs, 8, 4]
        high = HIGH_ROWS[x.dtype]  # rows g + 8 came out this many times too large
        scale = torch.cat([sm[:, :, 0], sm[:, :, 2] / high], dim=1)  # [rbs, 16] by row g + 8h
        min_ = torch.cat([sm[:, :, 1], sm[:, :, 3]], dim=1)
        corr = min_ - offset * scale
        out = scale[..., None] * d[group] + corr[..., None] * s[group][0][None, None, :]
        y += out[..., :m].reshape(rbs * 16, m).T
    return y[:, :n]


@pytest.mark.parametrize(
    "m, n, k, group_size, dtype",
    [
        (1, 16, 64, 64, torch.bfloat16),
        (3, 40, 256, 128, torch.bfloat16),
        (8, 32, 128, 64, torch.float16),
        (2, 24, 192, 32, torch.bfloat16),  # three chunks, each two groups of 32
        (1, 16, 128, 32, torch.float16),
    ],
)
def test_fragment_emulation_equals_reference(m, n, k, group_size, dtype) -> None:
    weight = mma_weight(n, k, group_size, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.float() @ dequantize_ref(weight).T
    got = emulate_mma_gemv(x, weight)
    assert got.shape == (m, n)
    # fp32 on both sides: what differs is the order and the offset's cancellation,
    # sum x (offset + q) - offset sum x, which costs log2(offset) bits of fp32's 24.
    assert relative_error(got, ref) < {torch.bfloat16: 1e-5, torch.float16: 1e-4}[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_asm_operands_match_their_constraints(dtype) -> None:
    # Every $i the PTX uses exists, and every operand is used: outputs, then inputs.
    import re

    for asm, constraints, outputs in (
        (D_ASM[dtype], D_CONSTRAINTS, 4),
        (S_ASM[dtype], S_CONSTRAINTS, 4),
        (D2_ASM[dtype], D2_CONSTRAINTS, 8),
        (S2_ASM[dtype], S2_CONSTRAINTS, 8),
        (HALVES_PTX[0][dtype], HALVES_PTX[1], 8),
        (HALVES_PTX[2][dtype], HALVES_PTX[3], 8),
    ):
        used = {int(v) for v in re.findall(r"\$(\d+)", asm)}
        kinds = constraints.split(",")
        assert used == set(range(len(kinds)))
        assert kinds[:outputs] == ["=f"] * outputs and "=f" not in kinds[outputs:]
        assert asm.count("mma.sync.aligned.m16n8k16.row.col.f32.") == 4  # one per k16 step
    assert ("bf16.bf16" in D_ASM[dtype]) == (dtype == torch.bfloat16)


def _run_scales_ptx(asm: str, words: list[int], pick: int) -> list[float]:
    """Execute scales_asm's PTX (its few instructions) on one lane's inputs: $8..$11 the
    four words it loads, $12 g % 4. Returns $0..$7 as fp32. numpy does each step in the
    instruction's own precision (fp32, exact fp16 -> fp32)."""
    import re

    import numpy as np

    regs: dict[str, object] = {f"${8 + i}": np.uint32(w) for i, w in enumerate(words)}
    regs["$12"] = np.uint32(pick)

    def val(token: str) -> object:
        token = token.strip()
        if token.startswith("0f"):
            return np.frombuffer(bytes.fromhex(token[2:]), dtype=">f4")[0].astype(np.float32)
        if token in regs:
            return regs[token]
        return np.uint32(int(token, 0))

    def f32(v: object) -> np.float32:
        if isinstance(v, np.float32):
            return v
        return np.array([v], dtype=np.uint32).view(np.float32)[0]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*\})", rest)]
        if op == "mov.b32" and args[0].startswith("{"):
            lo, hi = (a.strip() for a in args[0].strip("{}").split(","))
            w = int(val(args[1]))
            regs[lo], regs[hi] = np.uint16(w & 0xFFFF), np.uint16(w >> 16)
        elif op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "and.b32":
            regs[args[0]] = np.uint32(int(val(args[1])) & int(val(args[2])))
        elif op == "setp.ne.b32":
            regs[args[0]] = int(val(args[1])) != int(val(args[2]))
        elif op == "selp.b32":
            regs[args[0]] = val(args[1]) if regs[args[3]] else val(args[2])
        elif op == "cvt.f32.f16":
            regs[args[0]] = (
                np.array([regs[args[1]]], dtype=np.uint16).view(np.float16)[0].astype(np.float32)
            )
        elif op == "mul.f32":
            regs[args[0]] = np.float32(f32(val(args[1])) * f32(val(args[2])))
        elif op == "fma.rn.f32":  # every product here is exact in fp32: one rounding
            a, b, c = (np.float64(f32(val(x))) for x in args[1:])
            regs[args[0]] = np.float32(a * b + c)
        else:
            raise AssertionError(f"scales_asm uses {op}, which this emulator does not know")
    return [float(f32(regs[f"${i}"])) for i in range(8)]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scales_ptx_picks_each_lanes_own_scales(symmetric, dtype) -> None:
    """scales_asm run on the 16 bytes each lane of a real tile loads ((g // 2) * 4 + j, or
    (g // 4) * 4 + j for symmetric tiles) gives every C element its own row's scale (over
    HIGH_ROWS for rows g + 8) and min - OFFSET * scale, exactly."""
    from gpu_node.kernels.w4a16.mma_asm import MAGIC, scales_asm

    gen = torch.Generator().manual_seed(7)
    weight = quantize_int4(torch.randn(16, 128, generator=gen), 128, symmetric=symmetric)
    tile = to_mma(weight, symmetric=symmetric).tiles[0, 0]
    scales_at = tile[256:].tolist()  # the group's scale (and min) words
    asm = scales_asm(dtype, symmetric)
    offset, high = MAGIC[dtype][1], HIGH_ROWS[dtype]
    for g in range(8):
        first = (g // 4) * 4 if symmetric else (g // 2) * 4
        words = [scales_at[first + j] & 0xFFFFFFFF for j in range(4)]
        got = _run_scales_ptx(asm, words, g % 4)
        rows = (g, g, g + 8, g + 8)
        scales = [float(weight.scales[r, 0]) / (high if r >= 8 else 1.0) for r in rows]
        corrections = [
            float(weight.mins[r, 0]) - offset * scale for r, scale in zip(rows, scales, strict=True)
        ]
        assert got == scales + corrections, g


def _chains_of(asm: str, operands: int) -> list[tuple[str, str]]:
    """(D, C) register groups of each mma of the PTX, in order."""
    import re

    chain_a, chain_b = "{$0, $1, $2, $3}", "{$4, $5, $6, $7}"
    in_a = "{" + ", ".join(f"${operands - 8 + i}" for i in range(4)) + "}"
    in_b = "{" + ", ".join(f"${operands - 4 + i}" for i in range(4)) + "}"
    names = {chain_a: "a", chain_b: "b", in_a: "in a", in_b: "in b"}
    mmas = [line for line in asm.splitlines() if line.startswith("mma.sync")]
    parts = [re.findall(r"\{[^}]*\}", line) for line in mmas]
    return [(names[p[0]], names[p[3]]) for p in parts]


@pytest.mark.parametrize(
    "asm, operands", [(D2_ASM[torch.bfloat16], 28), (S2_ASM[torch.bfloat16], 24)]
)
def test_two_chains_alternate_and_start_from_their_inputs(asm, operands) -> None:
    # k16 steps 0 and 2 accumulate into $0-$3, steps 1 and 3 into $4-$7; each chain's
    # first mma reads its own input registers (the last eight operands), then itself.
    assert _chains_of(asm, operands) == [("a", "in a"), ("b", "in b"), ("a", "a"), ("b", "b")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_group_32_chains_take_one_group_each(dtype) -> None:
    # Steps 0-1 (the chunk's first group of 32) into $0-$3, steps 2-3 (the second) into $4-$7.
    d_asm, d_constraints, s_asm, s_constraints = HALVES_PTX
    for asm, constraints in ((d_asm[dtype], d_constraints), (s_asm[dtype], s_constraints)):
        operands = len(constraints.split(","))
        assert _chains_of(asm, operands) == [("a", "in a"), ("a", "a"), ("b", "in b"), ("b", "b")]
    assert d_constraints == D2_CONSTRAINTS and s_constraints == S2_CONSTRAINTS
    assert group_step_constants(dtype, 2, 32)["D_ASM"] == d_asm[dtype]
    with pytest.raises(ValueError, match="groups of 32 take CHAINS 2"):
        group_step_constants(dtype, 1, 32)


def test_supports_and_errors_on_cpu() -> None:
    weight = mma_weight(16, 128, 128, seed=1)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    assert not supports(x, weight)  # CPU tensors: the kernel is CUDA-only
    with pytest.raises(ValueError, match="on CUDA"):
        w4a16_mma_gemv(x, weight)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        w4a16_mma_gemv(torch.randn(1, 64, dtype=torch.bfloat16), weight)


@pytest.mark.parametrize(
    "n, k, group_size, symmetric",
    [
        (16, 64, 64, False),
        (40, 256, 128, False),
        (33, 384, 64, False),
        (24, 192, 32, False),
        (40, 256, 128, True),
        (24, 192, 32, True),
    ],
)
def test_dequantize_kernel_equals_reference(n, k, group_size, symmetric) -> None:
    device = "cuda" if CUDA else "cpu"
    weight = mma_weight(n, k, group_size, seed=n, device=device, symmetric=symmetric)
    expected = dequantize_ref(weight).T  # fp32 [K, N]
    assert torch.equal(dequantize_mma(weight, torch.float32), expected)  # exact: same fp32 math
    assert torch.equal(dequantize_mma(weight, torch.bfloat16), expected.to(torch.bfloat16))
    # The kernels take the tiles' strides: row-block-major storage reads the same.
    rb_major = Int4WeightMMA(weight.tiles.contiguous(), weight.shape, group_size, symmetric)
    assert torch.equal(dequantize_mma(rb_major, torch.float32), expected)


def test_matmul_takes_every_shape() -> None:
    # On CPU (and for fp32 or more than 8 rows on CUDA): dequantize, then torch.matmul.
    device = "cuda" if CUDA else "cpu"
    weight = mma_weight(24, 128, 64, seed=2, device=device)
    x = torch.randn(2, 10, 128, device=device)
    y = w4a16_mma_matmul(x, weight)
    assert y.shape == (2, 10, 24) and y.dtype == torch.float32
    ref = x.reshape(20, 128) @ dequantize_ref(weight).T
    assert relative_error(y.reshape(20, 24), ref) < 1e-5
    assert w4a16_mma_matmul(torch.empty(0, 128, device=device), weight).shape == (0, 24)
    with pytest.raises(ValueError, match="x has 64 features, weight expects 128"):
        w4a16_mma_matmul(torch.randn(1, 64, device=device), weight)


def test_int4_linear_relays_out_to_mma_without_loss() -> None:
    gen = torch.Generator().manual_seed(4)
    linear = Int4Linear(quantize_int4(torch.randn(48, 128, generator=gen), 64))
    x = torch.randn(3, 128, generator=gen)
    before = linear(x)
    dense, size = dequantize_int4(linear.weight_int4), model_bytes(linear)
    linear.use_mma_layout()
    assert linear.layout == "mma" and linear.packed.shape == (3, 2, 144)
    assert linear.scales.numel() == 0 and linear.mins.numel() == 0  # inside the tiles
    assert torch.equal(dequantize_int4(linear.weight_int4), dense)
    assert model_bytes(linear).total == size.total  # 48 rows: no pad rows
    assert torch.equal(linear(x), before)  # the CPU path reads the re-laid weight
    with pytest.raises(ValueError, match="takes K a multiple of 64, got 96"):
        Int4Linear(quantize_int4(torch.randn(16, 96), 32)).use_mma_layout()


def test_int4_linear_gives_a_symmetric_weight_symmetric_tiles() -> None:
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(48, 256, generator=gen)
    x = torch.randn(2, 256, generator=gen)
    symmetric = Int4Linear(quantize_int4(dense, 128, symmetric=True))
    before, codes = symmetric(x), dequantize_int4(symmetric.weight_int4)
    symmetric.use_mma_layout()
    # 3 row blocks, 2 steps; 256 int32 of words + 8 of scales (asymmetric: + 16)
    assert symmetric.packed.shape == (3, 2, 264) and symmetric.weight_mma.symmetric
    assert torch.equal(dequantize_int4(symmetric.weight_int4), codes)
    assert model_bytes(symmetric).total == 3 * 2 * 264 * 4
    assert torch.equal(symmetric(x), before)
    asymmetric = Int4Linear(quantize_int4(dense, 128))
    asymmetric.use_mma_layout()
    assert asymmetric.packed.shape == (3, 2, 272) and not asymmetric.weight_mma.symmetric


def test_int4_linear_keeps_one_mma_wrapper_while_its_tiles_stay() -> None:
    linear = Int4Linear(quantize_int4(torch.randn(48, 128), 64))
    linear.use_mma_layout()
    first = linear.weight_mma
    assert linear.weight_mma is first and first.tiles is linear.packed
    linear.packed = linear.packed.clone()  # what a move to another device does
    second = linear.weight_mma
    assert second is not first and second.tiles is linear.packed
    assert torch.equal(second.tiles, first.tiles) and second.shape == (48, 128)


def test_calls_without_a_config_reuse_their_shapes_plan() -> None:
    cpu = torch.device("cpu")  # 4 multiprocessors for the heuristic
    plan = plan_module.default_plan(4096, 4096, 128, torch.bfloat16, cpu, False)
    assert plan_module.default_plan(4096, 4096, 128, torch.bfloat16, cpu, False) is plan
    config = mma_gemv_config(4096, 4096, 128, 4)
    assert plan.splits == 32 // config["GROUPS_PER_SPLIT"]
    assert plan.programs == 256 // (config["WARPS"] * config["R"])
    assert plan.constexprs["SPLIT_K"] == plan.splits and plan.constexprs["EARLY"] == 0
    # a config of its own is planned apart and leaves the shape's plan as it was
    assert (
        plan_module.plan_launch(4096, 4096, 128, torch.bfloat16, cpu, False, {"SPLITS": 3}).splits
        == 3
    )
    assert plan_module.default_plan(4096, 4096, 128, torch.bfloat16, cpu, False) is plan


@pytest.fixture
def tuning_table(tmp_path, monkeypatch):
    """A tuning table of one GPU ("Test GPU", which the CPU plays) with one entry, KWARPS at
    4096 x 4096; the cached table and plans are dropped before and after."""
    table = {"devices": {"Test GPU": {"configs": {"4096x4096/g128/asym": {"config": {
        "KWARPS": 1, "WARPS": 8, "R": 1, "CHAINS": 2, "GROUPS_PER_SPLIT": 4, "PIPE": 2}}}}}}  # fmt: skip
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(plan_module, "TUNED_PATH", path)
    for cached in (plan_module.tuned_table, plan_module.default_plan):
        cached.cache_clear()
    yield monkeypatch
    for cached in (plan_module.tuned_table, plan_module.default_plan):
        cached.cache_clear()


def test_the_serving_plan_takes_the_tuned_config_of_its_gpu_and_shape(tuning_table) -> None:
    cpu = torch.device("cpu")
    heuristic = plan_module.plan_launch(4096, 4096, 128, torch.bfloat16, cpu, False, None)
    # Off CUDA the GPU has no name: the heuristic.
    assert plan_module.default_plan(4096, 4096, 128, torch.bfloat16, cpu, False) == heuristic
    plan_module.default_plan.cache_clear()
    tuning_table.setattr(plan_module, "device_name", lambda device: "Test GPU")
    plan = plan_module.default_plan(4096, 4096, 128, torch.bfloat16, cpu, False)
    # 32 steps, 8 warps of 4 steps each: one split; 256 row blocks, one a program
    assert (plan.programs, plan.splits, plan.tile) == (256, 1, (1, 128))
    assert (plan.constexprs["KWARPS"], plan.constexprs["PIPE"], plan.constexprs["WARPS"]) == (
        True, 2, 8)  # fmt: skip
    # Another shape, group size or layout on the same GPU: the heuristic.
    assert plan_module.default_plan(4096, 8192, 128, torch.bfloat16, cpu, False) == (
        plan_module.plan_launch(4096, 8192, 128, torch.bfloat16, cpu, False, None)
    )
    assert plan_module.tuned_config(4096, 4096, 64, cpu, False) is None
    assert plan_module.tuned_config(4096, 4096, 128, cpu, True) is None
    tuning_table.setattr(plan_module, "device_name", lambda device: "Other GPU")
    assert plan_module.tuned_config(4096, 4096, 128, cpu, False) is None


def test_the_checked_in_tuning_table_plans_every_entry() -> None:
    """Every config of gpu_node/kernels/w4a16/mma_tuned.json is a launch the plan takes at
    its own shape (a bad entry would fail at serve time), and it sets every key of the
    heuristic's config, so the GPU's multiprocessor count does not change it."""
    table = plan_module.tuned_table()
    assert table.get("NVIDIA H200")
    cpu = torch.device("cpu")
    for configs in table.values():
        for key, config in configs.items():
            n, k, group_size, symmetric = plan_module.parse_tuned_key(key)
            assert plan_module.tuned_key(n, k, group_size, symmetric) == key
            assert set(mma_gemv_config(n, k, group_size, 132)) <= set(config), key
            plan = plan_module.plan_launch(n, k, group_size, torch.bfloat16, cpu, symmetric, config)
            for name in ("WARPS", "R", "CHAINS"):
                assert plan.constexprs[name] == config[name], key
            assert plan.constexprs["KWARPS"] == bool(config.get("KWARPS")), key
            assert plan.constexprs["PIPE"] == config.get("PIPE", 2 if symmetric else 0), key


def test_config_fills_the_gpu() -> None:
    one = {"WARPS": 4, "R": 1, "CHAINS": 2}  # one-row-block warps split their mma chains
    two = {"WARPS": 4, "R": 2, "CHAINS": 1}
    # One wave is 24 x 132 = 3168 warps. 28672 rows (8192 in, 64 groups): 896 warps of
    # 2 row blocks x 4 splits of 16 groups = 3584.
    assert mma_gemv_config(28672, 8192, 128, 132) == {**two, "GROUPS_PER_SPLIT": 16}
    # 8192 rows: 2-row-block warps reach 2048 at most (8 groups a split); 512 warps of one
    # row block x 8 splits of 8 groups = 4096 (16 groups: 2048).
    assert mma_gemv_config(8192, 8192, 128, 132) == {**one, "GROUPS_PER_SPLIT": 8}
    # 224 groups (28672 in) is long K: 512 one-row-block warps x 7 splits of 32 = 3584.
    assert mma_gemv_config(8192, 28672, 128, 132) == {**one, "GROUPS_PER_SPLIT": 32}
    # 4096 rows, 112 groups: 256 one-row-block warps x 14 splits of 8 groups = 3584.
    assert mma_gemv_config(4096, 14336, 128, 132) == {**one, "GROUPS_PER_SPLIT": 8}
    # 4096 x 4096 never reaches a wave (2048 at 4 groups a split) but passes 12 x 132 = 1584
    # there; at 8 groups it launches 1024.
    assert mma_gemv_config(4096, 4096, 128, 132) == {**one, "GROUPS_PER_SPLIT": 4}
    # A short second wave is passed over at groups of 128 (7 two-row-block programs a
    # multiprocessor, 8 one-row-block ones: 924 and 1056 on 132). DeepSeek-V3's 18432 out of
    # 7168 in (56 groups): 2 row blocks on 7 splits of 8 launch 1008 programs (1.09 waves),
    # 1 row block on 4 splits of 16 1152 (1.09); 7 splits of 8 launch 2016 (1.91).
    assert mma_gemv_config(18432, 7168, 128, 132) == {**one, "GROUPS_PER_SPLIT": 8}
    # 7168 out of 18432 in (144 groups, long K): 32-group splits and 16-group splits of two
    # row blocks launch too few warps, 8-group ones 1008 programs; 9 splits of 16 groups of
    # one row block 1008 of 1056 (0.95 waves).
    assert mma_gemv_config(7168, 18432, 128, 132) == {**one, "GROUPS_PER_SPLIT": 16}
    # 10240 out of 8192 in: 8 splits of 8 groups launch 1280 programs (1.21), 16 of 4 2560.
    assert mma_gemv_config(10240, 8192, 128, 132) == {**one, "GROUPS_PER_SPLIT": 4}
    assert (plan_module.resident_programs(1), plan_module.resident_programs(2)) == (8, 7)
    # A small layer never fills the GPU: splits of 2 groups (or 1 when there is 1).
    assert mma_gemv_config(64, 512, 128, 132) == {**one, "GROUPS_PER_SPLIT": 2}
    assert mma_gemv_config(64, 128, 128, 132)["GROUPS_PER_SPLIT"] == 1
    # Groups of 32 count in steps of two (64 k) and always split their chains. 8192 in is
    # 128 steps (long K): 512 one-row-block warps x 4 splits of 32 = 2048, 256 two-row-block
    # warps x 8 splits of 16 = 2048, x 16 splits of 8 = 4096.
    assert mma_gemv_config(8192, 8192, 32, 132) == {**two, "CHAINS": 2, "GROUPS_PER_SPLIT": 8}
    assert mma_gemv_config(4096, 14336, 32, 132) == {**two, "CHAINS": 2, "GROUPS_PER_SPLIT": 8}
    assert mma_gemv_config(576, 1536, 32, 132) == {**one, "GROUPS_PER_SPLIT": 2}


def test_symmetric_tiles_from_fp16_in_two_row_blocks_are_capped_at_128_registers() -> None:
    cpu = torch.device("cpu")

    def maxnreg(dtype, symmetric, config=None):
        plan = plan_module.plan_launch(8192, 8192, 128, dtype, cpu, symmetric, config)
        return plan.constexprs.get("maxnreg")

    two_rows = {"WARPS": 4, "R": 2, "GROUPS_PER_SPLIT": 8, "CHAINS": 1}
    assert maxnreg(torch.float16, True, two_rows) == 128
    assert maxnreg(torch.float16, True, {**two_rows, "MAXNREG": 96}) == 96  # a cap given wins
    assert maxnreg(torch.bfloat16, True, two_rows) is None
    assert maxnreg(torch.float16, False, two_rows) is None  # asymmetric: 72 registers
    assert maxnreg(torch.float16, True, {**two_rows, "R": 1, "CHAINS": 2}) is None


def test_symmetric_tiles_take_the_two_buffer_loop() -> None:
    cpu = torch.device("cpu")
    assert (
        plan_module.plan_launch(4096, 4096, 128, torch.bfloat16, cpu, False, None).constexprs[
            "PIPE"
        ]
        == 0
    )
    assert (
        plan_module.plan_launch(4096, 4096, 128, torch.bfloat16, cpu, True, None).constexprs["PIPE"]
        == 2
    )
    with pytest.raises(ValueError, match=r"PIPE must be 0 or 2 \(2 for symmetric tiles\), got 0"):
        plan_module.plan_launch(4096, 4096, 128, torch.bfloat16, cpu, True, {"PIPE": 0})
    with pytest.raises(ValueError, match=r"PIPE must be 0 or 2 .*, got 1"):
        plan_module.plan_launch(4096, 4096, 128, torch.bfloat16, cpu, False, {"PIPE": 1})
    two = {"WARPS": 4, "R": 2, "CHAINS": 1}
    # 64 steps of K or fewer: splits of 8 (28672 rows: 896 x 8 = 7168 warps); more: 16.
    assert mma_gemv_config(28672, 8192, 128, 132, True) == {**two, "GROUPS_PER_SPLIT": 8}
    assert mma_gemv_config(8192, 28672, 128, 132, True) == {**two, "GROUPS_PER_SPLIT": 16}
    # 4096 x 4096: 128 warps x 4 splits of 8 = 512 < 12 x 132: the asymmetric choice stands.
    assert mma_gemv_config(4096, 4096, 128, 132, True) == mma_gemv_config(4096, 4096, 128, 132)


def test_config_rejects_other_chains() -> None:
    weight = mma_weight(16, 128, 64, seed=1)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CHAINS must be 1 or 2, got 3"):
        mma_module._launch(x, weight, {"CHAINS": 3})
    with pytest.raises(ValueError, match="groups of 32 take CHAINS 2"):
        mma_module._launch(x, mma_weight(16, 128, 32, seed=1), {"CHAINS": 1})
    with pytest.raises(ValueError, match=r"SPLITS must be 1\.\.2 \(steps of K\), got 3"):
        mma_module._launch(x, weight, {"SPLITS": 3})  # 128 in: two steps of 64
    with pytest.raises(ValueError, match=r"R must be 1, 2, 4 or 8, got 3"):
        mma_module._launch(x, weight, {"R": 3})


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, n, k, group_size",
    [
        (1, 16, 64, 64),
        (1, 4096, 4096, 128),
        (3, 200, 1024, 64),
        (8, 1000, 2048, 128),
        (5, 96, 8192, 128),
        (1, 576, 1536, 32),  # SmolLM2's down projection, as its GGUF stores it (Q4_1)
        (4, 1000, 4096, 32),
    ],
)
def test_kernel_equals_reference(m, n, k, group_size, dtype) -> None:
    weight = mma_weight(n, k, group_size, seed=k + n, device="cuda")
    x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
    ref = w4a16_matmul_ref(x, weight)
    for _ in range(2):  # the split-K counters are left at zero for the next call
        got = w4a16_mma_gemv(x, weight)
        assert got.shape == (m, n) and got.dtype == dtype
        assert relative_error(got, ref) < TOLERANCE[dtype]


@needs_cuda
@pytest.mark.parametrize(
    "warps, rows_per_warp, groups_per_split, chains",
    [
        (1, 1, 1, 1),
        (2, 4, 3, 1),
        (8, 2, 64, 1),
        (4, 1, 5, 1),
        (4, 2, 32, 1),
        (4, 2, 8, 2),
        (1, 1, 3, 2),
    ],
)
def test_kernel_configs_agree(warps, rows_per_warp, groups_per_split, chains) -> None:
    weight = mma_weight(1040, 4096, 128, seed=7, device="cuda")
    gen = torch.Generator("cuda").manual_seed(11)
    x = torch.randn(2, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    ref = w4a16_matmul_ref(x, weight)
    config = {
        "WARPS": warps,
        "R": rows_per_warp,
        "GROUPS_PER_SPLIT": groups_per_split,
        "CHAINS": chains,
    }
    got = w4a16_mma_gemv(x, weight, config=config)
    assert relative_error(got, ref) < TOLERANCE[torch.bfloat16]
    rb_major = Int4WeightMMA(weight.tiles.contiguous(), weight.shape, 128)
    assert torch.equal(w4a16_mma_gemv(x, rb_major, config=config), got)


@needs_cuda
@pytest.mark.parametrize("splits", [3, 7, 31, 32])
def test_split_counts_that_do_not_divide_k_give_the_reference(splits) -> None:
    """32 steps in 3, 7 or 31 splits (the kernel shares them evenly), or one step each."""
    weight = mma_weight(1040, 4096, 128, seed=9, device="cuda")
    gen = torch.Generator("cuda").manual_seed(17)
    x = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    ref = w4a16_matmul_ref(x, weight)
    for chains in (1, 2):
        config = {"WARPS": 4, "R": 1, "CHAINS": chains, "SPLITS": splits}
        for _ in range(2):  # the counters are back at zero for the next call
            got = w4a16_mma_gemv(x, weight, config=config)
            assert relative_error(got, ref) < TOLERANCE[torch.bfloat16]


@needs_cuda
def test_group_32_configs_agree() -> None:
    """Groups of 32 (two a chunk, one accumulator each) under warps x row blocks x steps a
    split, including a split ending inside K and the row-major storage."""
    weight = mma_weight(1040, 4096, 32, seed=8, device="cuda")
    gen = torch.Generator("cuda").manual_seed(13)
    x = torch.randn(3, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    ref = w4a16_matmul_ref(x, weight)
    rb_major = Int4WeightMMA(weight.tiles.contiguous(), weight.shape, 32)
    for warps, rows, per_split in ((4, 2, 8), (2, 1, 3), (8, 2, 64), (1, 4, 5)):
        config = {"WARPS": warps, "R": rows, "GROUPS_PER_SPLIT": per_split, "CHAINS": 2}
        got = w4a16_mma_gemv(x, weight, config=config)
        assert relative_error(got, ref) < TOLERANCE[torch.bfloat16]
        assert torch.equal(w4a16_mma_gemv(x, rb_major, config=config), got)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, n, k, group_size", [(1, 4096, 4096, 128), (3, 200, 1024, 64), (4, 1000, 4096, 32)]
)
def test_symmetric_tiles_give_the_asymmetric_kernels_bits(m, n, k, group_size, dtype) -> None:
    """A symmetric weight through its scales-only tiles equals the same weight through
    tiles that store its mins (-8 * scale): the correction comes out the same in fp32."""
    sym = mma_weight(n, k, group_size, seed=n + k, device="cuda", symmetric=True)
    both = to_mma(from_mma(sym))  # the mins written out
    assert both.nbytes > sym.nbytes
    gen = torch.Generator("cuda").manual_seed(m + 1)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    got = w4a16_mma_gemv(x, sym)
    assert torch.equal(got, w4a16_mma_gemv(x, Int4WeightMMA(both.tiles.cuda(), (n, k), group_size)))
    assert relative_error(got, w4a16_matmul_ref(x, sym)) < TOLERANCE[dtype]
    for config in ({"R": 2, "CHAINS": 2 if group_size == 32 else 1}, {"R": 1, "CHAINS": 2}):
        assert (
            relative_error(w4a16_mma_gemv(x, sym, config), w4a16_matmul_ref(x, sym))
            < TOLERANCE[dtype]
        )
    if dtype == torch.float16:  # its cap of 128 registers on two row blocks (MAXNREG 0: none)
        two_rows = {"R": 2, "CHAINS": 2 if group_size == 32 else 1}
        assert torch.equal(
            w4a16_mma_gemv(x, sym, two_rows), w4a16_mma_gemv(x, sym, {**two_rows, "MAXNREG": 0})
        )


@needs_cuda
@pytest.mark.parametrize("rows_per_warp", [1, 2])
def test_both_loops_give_the_same_bits(rows_per_warp) -> None:
    """The one-buffer loop with fp16 scales unpacked in Triton (PIPE 0) and the two-buffer
    loop with int32 scales unpacked in PTX (PIPE 2): the same arithmetic in the same order,
    so the same bits, for even and odd step counts a split (5 and 4 groups of 128 or 64,
    10 and 8 steps of 32) and one-step splits."""
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    for group_size in (128, 64, 32):
        weight = mma_weight(1040, 4096, group_size, seed=21, device="cuda")
        chains = 2 if group_size == 32 or rows_per_warp == 1 else 1
        for per_split in (5, 4, 1):
            base = {"R": rows_per_warp, "CHAINS": chains, "WARPS": 4, "GROUPS_PER_SPLIT": per_split}
            one = w4a16_mma_gemv(x, weight, {**base, "PIPE": 0})
            assert relative_error(one, w4a16_matmul_ref(x, weight)) < TOLERANCE[torch.bfloat16]
            two = w4a16_mma_gemv(x, weight, {**base, "PIPE": 2})
            assert torch.equal(two, one), (group_size, per_split)


def test_k_split_warps_take_equal_shares() -> None:
    """KWARPS: a program's warps split its steps, so a split must be WARPS equal shares:
    64 steps (8192 in) of 8 warps at 8 a warp is one split; 224 steps (28672 in) at 8 a
    warp would be 3 splits of 8 warps, which do not divide, so 2; a split count given
    outright is taken as it is, or refused when its shares do not divide; 4160 in at groups
    of 64 (65 steps, no multiple of 8 warps) is refused; symmetric tiles are refused (wrong
    sums on the GPU: plan_launch's comment says why); the two-buffer loop over asymmetric
    tiles takes it."""
    cpu = torch.device("cpu")
    config = {"KWARPS": True, "WARPS": 8, "R": 1, "CHAINS": 2, "GROUPS_PER_SPLIT": 8}
    plan = plan_module.plan_launch(8192, 8192, 128, torch.bfloat16, cpu, False, config)
    assert (plan.programs, plan.splits, plan.tile) == (512, 1, (1, 128))
    plan = plan_module.plan_launch(8192, 28672, 128, torch.bfloat16, cpu, False, config)
    assert (plan.programs, plan.splits) == (512, 2)
    plan = plan_module.plan_launch(
        8192, 8192, 128, torch.bfloat16, cpu, False, {**config, "SPLITS": 2}
    )
    assert plan.splits == 2
    with pytest.raises(ValueError, match=r"equal shares: 3 splits of 8 warps do not divide 64"):
        plan_module.plan_launch(
            8192, 8192, 128, torch.bfloat16, cpu, False, {**config, "SPLITS": 3}
        )
    with pytest.raises(ValueError, match=r"KWARPS takes splits of equal shares: 1 splits of 8"):
        plan_module.plan_launch(64, 4160, 64, torch.bfloat16, cpu, False, config)
    with pytest.raises(ValueError, match=r"KWARPS takes asymmetric tiles, not symmetric ones"):
        plan_module.plan_launch(8192, 8192, 128, torch.bfloat16, cpu, True, config)
    # Asymmetric tiles take it in the two-buffer loop too, when asked.
    plan = plan_module.plan_launch(
        8192, 8192, 128, torch.bfloat16, cpu, False, {**config, "PIPE": 2}
    )
    assert (plan.programs, plan.splits, plan.tile) == (512, 1, (1, 128))
    assert (plan.constexprs["PIPE"], plan.constexprs["KWARPS"]) == (2, True)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("early", [0, 2])
@pytest.mark.parametrize("group_size", [128, 64, 32])
@pytest.mark.parametrize("m", [1, 3])
def test_k_split_warps_equal_the_reference(dtype, early, group_size, m) -> None:
    """KWARPS (the warps of a program split K, summed through shared memory) against the
    fp32 reference, with and without split K across programs, one and two row blocks, 4
    and 8 warps, with and without early launch; and 6 splits of two row blocks at 6144 in,
    whose last program sums the partials 4 and then 2."""
    for k, launches in (
        (4096, ((8, 1, 8, None), (4, 1, 2, None), (4, 2, 4, None), (8, 2, 1, None))),
        (6144, ((4, 2, 1, 6),) if group_size == 128 else ()),
    ):
        weight = mma_weight(1040, k, group_size, seed=23, device="cuda")
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", dtype)
        ref = w4a16_matmul_ref(x, weight)
        for warps, rows, per_warp, splits in launches:
            chains = 2 if group_size == 32 or rows == 1 else 1
            config = {"KWARPS": True, "WARPS": warps, "R": rows, "CHAINS": chains,
                      "GROUPS_PER_SPLIT": per_warp, "EARLY": early}  # fmt: skip
            if splits:
                config["SPLITS"] = splits
            got = w4a16_mma_gemv(x, weight, config)
            assert got.shape == (m, 1040)
            err = relative_error(got, ref)
            assert err < TOLERANCE[dtype], (k, config, err)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, 64, 32])
def test_k_split_warps_in_the_two_buffer_loop_give_its_bits(dtype, group_size) -> None:
    """KWARPS in the two-buffer loop (PIPE 2, asked for over asymmetric tiles) equals the
    one-buffer loop's KWARPS over the same weight bit for bit (the same arithmetic in the
    same order), and the reference: one and two row blocks, 4 and 8 warps, 5 steps a warp
    (5120 in), one split and split K across programs."""
    k = 5120
    weight = mma_weight(1040, k, group_size, seed=29, device="cuda")
    for m in (1, 3):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", dtype)
        ref = w4a16_matmul_ref(x, weight)
        for warps, rows, per_warp, splits in ((4, 2, 5, None), (4, 1, 5, None), (8, 2, 5, 1)):
            chains = 2 if group_size == 32 or rows == 1 else 1
            config = {"KWARPS": True, "WARPS": warps, "R": rows, "CHAINS": chains,
                      "GROUPS_PER_SPLIT": per_warp, "PIPE": 2}  # fmt: skip
            if splits:
                config["SPLITS"] = splits
            got = w4a16_mma_gemv(x, weight, config)
            err = relative_error(got, ref)
            assert err < TOLERANCE[dtype], (m, config, err)
            assert torch.equal(got, w4a16_mma_gemv(x, weight, {**config, "PIPE": 0})), (m, config)


@needs_cuda
def test_the_tuned_configs_of_this_gpu_give_the_reference() -> None:
    """Each launch the tuning table holds for this GPU is what a call without a config runs
    at that shape, and it gives the fp32 reference (M = 1 and 3)."""
    device = torch.device("cuda")
    configs = plan_module.tuned_table().get(plan_module.device_name(device), {})
    if not configs:
        pytest.skip(f"the tuning table has no entry for {plan_module.device_name(device)}")
    gen = torch.Generator("cuda").manual_seed(31)
    for key, config in configs.items():
        n, k, group_size, symmetric = plan_module.parse_tuned_key(key)
        dense = torch.randn(n, k, device=device, generator=gen) / k**0.5
        weight = to_mma(quantize_int4(dense, group_size, symmetric), symmetric=symmetric)
        plan = plan_module.default_plan(n, k, group_size, torch.bfloat16, device, symmetric)
        assert plan == plan_module.plan_launch(
            n, k, group_size, torch.bfloat16, device, symmetric, config
        ), key
        for m in (1, 3):
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            err = relative_error(w4a16_mma_gemv(x, weight), w4a16_matmul_ref(x, weight))
            assert err < TOLERANCE[torch.bfloat16], (key, m, err)


@needs_cuda
def test_early_launch_chains_give_the_same_result() -> None:
    """Each call launched early behind the last (PDL) starts its weight loads before the
    previous call is done; x, the partials and the split-K counters are touched only after
    it is: a chain whose inputs are the previous outputs equals the same chain unlaunched."""
    first = mma_weight(4096, 4096, 128, seed=12, device="cuda")
    second = mma_weight(4096, 4096, 128, seed=13, device="cuda")
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)

    def chain(early: int) -> torch.Tensor:
        y = x
        for _ in range(3):
            for weight in (first, second):
                y = w4a16_mma_gemv(y, weight, config={"EARLY": early})
                y = y / y.float().abs().max().to(y.dtype)  # keep it in range, and a kernel between
                y = w4a16_mma_gemv(y, weight, config={"EARLY": early})  # back to back
        return y

    late = chain(0)
    assert torch.equal(chain(1), late)  # the next call may launch from the start
    assert torch.equal(chain(2), late)  # from the tail (the default)


@needs_cuda
def test_kernel_takes_any_rows_and_views() -> None:
    gen = torch.Generator("cuda").manual_seed(12)
    weight = mma_weight(10, 256, 64, seed=10, device="cuda")  # N < 16: one padded row block
    x = torch.randn(3, 257, device="cuda", generator=gen).to(torch.bfloat16)[:, 1:]
    assert x.storage_offset() % 2 == 1  # a row view at an odd element
    got = w4a16_mma_matmul(x, weight)
    assert got.shape == (3, 10)
    assert relative_error(got, w4a16_matmul_ref(x.contiguous(), weight)) < TOLERANCE[torch.bfloat16]
    three_d = w4a16_mma_matmul(x.contiguous().reshape(3, 1, 256), weight)
    assert torch.equal(three_d.reshape(3, 10), got)
    # One row of an odd stride at an even element: contiguous() and clone() keep the
    # stride, so the kernel's int32 pairs come from a copy.
    row = torch.randn(4, 257, device="cuda", generator=gen).to(torch.bfloat16)[1:2, 1:]
    assert row.is_contiguous() and row.stride(0) == 257 and row.storage_offset() % 2 == 0
    assert torch.equal(
        w4a16_mma_matmul(row, weight),
        w4a16_mma_matmul(row.clone(memory_format=torch.contiguous_format), weight),
    )


@needs_cuda
def test_int4_linear_picks_its_gpu_layout_from_the_first_call() -> None:
    gen = torch.Generator().manual_seed(9)
    weight = quantize_int4(torch.randn(200, 512, generator=gen), 128)
    tensor_cores = Int4Linear(weight).cuda()
    x = torch.randn(3, 512, generator=gen).cuda()
    more = torch.randn(20, 512, generator=gen).cuda()
    for rows in (x[:1], x, more):  # GEMV, GEMV, dequantize + matmul
        y = tensor_cores(rows.to(torch.bfloat16))
        assert tensor_cores.layout == "mma"
        ref = tensor_cores.forward_ref(rows.float())
        assert relative_error(y, ref) < TOLERANCE[torch.bfloat16]
    cuda_cores = Int4Linear(weight).cuda()
    cuda_cores(x)  # fp32 activations: the CUDA-core GEMV's layout
    assert cuda_cores.layout == "kn"
    group_32 = Int4Linear(quantize_int4(torch.randn(64, 128, generator=gen), 32)).cuda()
    y = group_32(x[:, :128].to(torch.bfloat16))  # group 32, K a multiple of 64: tensor cores
    assert group_32.layout == "mma"
    assert relative_error(y, group_32.forward_ref(x[:, :128])) < TOLERANCE[torch.bfloat16]
    symmetric = Int4Linear(quantize_int4(torch.randn(200, 512, generator=gen), 128, True)).cuda()
    y = symmetric(x.to(torch.bfloat16))  # symmetric tiles, the symmetric launch
    assert symmetric.weight_mma.symmetric
    assert relative_error(y, symmetric.forward_ref(x)) < TOLERANCE[torch.bfloat16]
    odd_k = Int4Linear(quantize_int4(torch.randn(64, 96, generator=gen), 32)).cuda()
    odd_k(x[:, :96].to(torch.bfloat16))  # K = 96: no tensor-core layout
    assert odd_k.layout == "kn"


def test_a_plan_refuses_config_keys_it_does_not_know() -> None:
    """No served plan, the table's or the heuristic's, carries a split-sum or loads-only
    switch; a config key the plan does not know is refused by name."""
    cpu = torch.device("cpu")
    served = plan_module.plan_launch(8192, 8192, 128, torch.bfloat16, cpu, False, None)
    assert "NO_SUM" not in served.constexprs and "MODE" not in served.constexprs
    with pytest.raises(ValueError, match=r"unknown config keys \['NO_SUM'\]"):
        plan_module.plan_launch(8192, 8192, 128, torch.bfloat16, cpu, False, {"NO_SUM": 1})
    with pytest.raises(ValueError, match=r"unknown config keys \['MODE'\]"):
        plan_module.plan_launch(8192, 8192, 128, torch.bfloat16, cpu, False, {"MODE": 1})
