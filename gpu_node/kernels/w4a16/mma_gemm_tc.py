"""The `tc` W4A16 GEMM over Int4WeightMMA (w4a16/mma_gemm.py picks it for up to TC_MAX_M
rows on the GPU; w4a16_mma_matmul sends it 9 or more, the GEMV takes fewer): y = x @ W^T with the decode GEMV's arithmetic and token tiles.

Letters: M tokens, N out features, K in features, G group size (32, 64 or 128),
T = max(G, 64) k values a tile step, S split-K ways.

The words are the mma's A fragments (int4.py); each is dequantized once by LOP3 into
128 + q (bf16) or 1024 + q (fp16) and multiplied by MT tiles of 8 activation rows, one
mma.m16n8k16 a tile and k16 step, the activations' sums by mma with A = 1 once a tile; the
group's scale and min - OFFSET * scale are applied once a step:

    y[m, n] += scale[n] * D[n, m] + (min[n] - OFFSET * scale[n]) * x_sum[m]

Tensors are the GEMV's [R, E] with the token tiles in front ([MT, R, E]: four consecutive
e a lane, the tiles and row-block slots in registers); the weights, scales and activations
of a step are loaded a step ahead into one of two register buffers, so that each load lands
in registers already used and is issued ahead of the mma. Inline PTX
(mma_asm.GEMM_PTX): GPU only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_node.kernels.launch import int32_pairs
from gpu_node.kernels.w4a16.mma_asm import GEMM_PTX, HIGH_ROWS, MAGIC
from gpu_node.kernels.w4a16.mma_step import fragment, x_sum_chunk, x_sum_chunk2
from gpu_node.quant.int4 import Int4WeightMMA

__all__ = ["TcConfig", "launch_tc", "tc_config"]

# Register tensors are powers of two: 1, 2 or 4 token tiles a program and row blocks a warp.
TILE_COUNTS = (1, 2, 4)


@dataclass(frozen=True, kw_only=True)
class TcConfig:
    """A launch of the tc kernel: `mt` token tiles (8 rows) a program, `r` row blocks (16
    rows) a warp, `warps` warps a program, K split `split_k` ways."""

    mt: int = 2
    r: int = 1
    warps: int = 4
    split_k: int = 1

    def __post_init__(self) -> None:
        for name in ("mt", "r"):
            if getattr(self, name) not in TILE_COUNTS:
                raise ValueError(
                    f"{name} must be 1, 2 or 4 (register tensors), got {getattr(self, name)}"
                )
        if self.warps < 1 or self.warps & (self.warps - 1):
            raise ValueError(f"warps must be a power of two, got {self.warps}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be 1 or more, got {self.split_k}")


@functools.lru_cache(maxsize=1024)
def tc_config(m: int, n: int, k: int, group_size: int, sms: int) -> TcConfig:
    """The heuristic launch for M rows of an [N, K] weight on `sms` multiprocessors."""
    # Two token tiles a program; two row blocks a warp on long or wide weights (the
    # activations' sums, one mma a tile, shared by more row blocks); K split until about
    # 6 warps a multiprocessor (fewer left the loads' latency in the open).
    r = 2 if max(n, k) >= 8192 else 1
    row_blocks = -(-n // 16)
    programs = -(-row_blocks // (4 * r)) * -(-m // 16)
    steps = k // max(64, group_size)
    split = 1
    while programs * split * 4 < 6 * sms and steps // (2 * split) >= 2:
        split *= 2
    return TcConfig(mt=2, r=r, warps=4, split_k=split)


@triton.jit
def _dequant(words, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [words], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _tile_mma(a, x_lo, x_hi, d, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    a0, a1, a2, a3 = a
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [a0, a1, a2, a3, x_lo, x_hi, d], dtype=tl.float32, is_pure=True,
        pack=4,
    )  # fmt: skip


@triton.jit
def _tile_mma2(a, x_lo, x_hi, d_a, d_b, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    a0, a1, a2, a3 = a
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [a0, a1, a2, a3, x_lo, x_hi, d_a, d_b], dtype=(tl.float32, tl.float32),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _load_x(x_at, step, x_ok, CPG: tl.constexpr, X_HI: tl.constexpr):
    xc = x_at + step * (32 * CPG)
    x0_lo = tl.load(xc, mask=x_ok, other=0)
    x0_hi = tl.load(xc + X_HI, mask=x_ok, other=0)
    if CPG == 2:
        x1_lo = tl.load(xc + 32, mask=x_ok, other=0)
        x1_hi = tl.load(xc + 32 + X_HI, mask=x_ok, other=0)
    else:
        x1_lo, x1_hi = x0_lo, x0_hi  # unused
    return x0_lo, x0_hi, x1_lo, x1_hi


@triton.jit
def _load_step(words_at, sm_at, x_at, step, stride_tg, mask, x_ok, CPG: tl.constexpr,
               SUBS: tl.constexpr, SYMMETRIC: tl.constexpr, PER_GROUP: tl.constexpr,
               X_HI: tl.constexpr):  # fmt: skip
    """A step's words [1, R, E] (a second chunk's with groups of 128), its groups' scales
    and mins as fp16 [1, R, E] (a lane's C elements: rows g and g + 8), and the token
    tiles' activation pairs [MT, 1, E] (x_lo, x_hi a chunk), loaded a step ahead of their
    use so that they are in flight behind the tensor cores."""
    at = step * stride_tg
    w0 = tl.load(words_at + at, mask=mask, other=0)
    sc0 = tl.load(sm_at + 2 * at, mask=mask, other=0.0)
    mn0 = sc0 if SYMMETRIC else tl.load(sm_at + 2 * at + 1, mask=mask, other=0.0)
    w1 = tl.load(words_at + at + 128, mask=mask, other=0) if CPG == 2 else w0
    x0_lo, x0_hi, x1_lo, x1_hi = _load_x(x_at, step, x_ok, CPG, X_HI)
    if SUBS == 2:
        at2 = 2 * (at + PER_GROUP)
        sc1 = tl.load(sm_at + at2, mask=mask, other=0.0)
        mn1 = sc1 if SYMMETRIC else tl.load(sm_at + at2 + 1, mask=mask, other=0.0)
    else:
        sc1, mn1 = sc0, mn0  # unused
    # A warp barrier after the loads, as the GEMV's (w4a16/mma_step.py). Alone it did not
    # keep them ahead of the mma here (H200 SASS, one buffer); the two buffers did.
    tl.inline_asm_elementwise(
        "bar.warp.sync -1;\nmov.b32 $0, 0;", "=r,r", [tl.full([1], 0, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
    return w0, w1, sc0, mn0, sc1, mn1, x0_lo, x0_hi, x1_lo, x1_hi


@triton.jit
def _corrected(acc, d, s, sc, mn, sm_mul, SYMMETRIC: tl.constexpr, OFFSET: tl.constexpr,
               HIGH: tl.constexpr):  # fmt: skip
    """acc + scale * d + (min - OFFSET * scale) * s for one group: rows g + 8 divided by
    HIGH where the mma saw them HIGH times too large (fp16 reads their nibbles in place)."""
    scale = sc.to(tl.float32)
    min_ = scale * -8.0 if SYMMETRIC else mn.to(tl.float32)
    if HIGH != 1.0:
        scale = scale * sm_mul
    acc = tl.fma(d, scale, acc)
    return tl.fma(s, min_ - OFFSET * scale, acc)


@triton.jit
def _step(acc, loaded, sm_mul, MT: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
          CPG: tl.constexpr, SUBS: tl.constexpr, SYMMETRIC: tl.constexpr, OFFSET: tl.constexpr,
          HIGH: tl.constexpr, DQ_ASM: tl.constexpr, DQ_CONSTRAINTS: tl.constexpr,
          MMA_ASM: tl.constexpr, MMA_CONSTRAINTS: tl.constexpr, S_ASM: tl.constexpr,
          S_CONSTRAINTS: tl.constexpr):  # fmt: skip
    """acc [MT, R, E] + one step of K: each word dequantized once, then one mma a token tile
    and k16 step; the activations' sums by mma with A = 1 (one a token tile, not a row
    block); the groups' scales and corrections applied once a step."""
    w0, w1, sc0, mn0, sc1, mn1, x0_lo, x0_hi, x1_lo, x1_hi = loaded
    d_a = tl.full((MT, R, E), 0.0, tl.float32)
    d_b = d_a
    s_a = tl.full((MT, 1, E), 0.0, tl.float32)
    s_b = s_a
    for c in tl.static_range(CPG):
        w = w0 if c == 0 else w1
        x_lo = x0_lo if c == 0 else x1_lo
        x_hi = x0_hi if c == 0 else x1_hi
        a = _dequant(w, DQ_ASM, DQ_CONSTRAINTS)
        if SUBS == 2:
            d_a, d_b = _tile_mma2(a, x_lo, x_hi, d_a, d_b, MMA_ASM, MMA_CONSTRAINTS)
            s_a, s_b = x_sum_chunk2(x_lo, x_hi, s_a, s_b, S_ASM, S_CONSTRAINTS)
        else:
            d_a = _tile_mma(a, x_lo, x_hi, d_a, MMA_ASM, MMA_CONSTRAINTS)
            s_a = x_sum_chunk(x_lo, x_hi, s_a, S_ASM, S_CONSTRAINTS)
    acc = _corrected(acc, d_a, s_a, sc0, mn0, sm_mul, SYMMETRIC, OFFSET, HIGH)
    if SUBS == 2:
        acc = _corrected(acc, d_b, s_b, sc1, mn1, sm_mul, SYMMETRIC, OFFSET, HIGH)
    return acc


@triton.jit
def _gemm_tc_kernel(
    x_ptr,  # int32 [M, K / 2]: bf16/fp16 pairs
    tiles_ptr,  # int32 [N16 / 16, K / T, 2T + 16 T / G] (symmetric: 8 T / G)
    stride_tr,
    stride_tg,
    out_ptr,  # [M, N] in x's dtype, or fp32 [S, M, N] partials with more than one split
    M,
    N,
    num_row_blocks,
    num_steps,  # K / T
    stride_xm,  # in int32 pairs
    stride_om,
    stride_os,
    split_k,
    GROUP_SIZE: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    WARPS: tl.constexpr,
    R: tl.constexpr,  # row blocks a warp
    MT: tl.constexpr,  # token tiles (8 rows) a program
    OFFSET: tl.constexpr,
    HIGH: tl.constexpr,
    DQ_ASM: tl.constexpr,
    DQ_CONSTRAINTS: tl.constexpr,
    MMA_ASM: tl.constexpr,
    MMA_CONSTRAINTS: tl.constexpr,
    S_ASM: tl.constexpr,
    S_CONSTRAINTS: tl.constexpr,
):
    tl.static_assert(GROUP_SIZE == 32 or GROUP_SIZE == 64 or GROUP_SIZE == 128)
    CPG: tl.constexpr = (GROUP_SIZE + 63) // 64  # chunks a step: 1 or 2
    SUBS: tl.constexpr = 64 * CPG // GROUP_SIZE  # groups a step: 2 (g32) or 1
    E: tl.constexpr = 128 * WARPS
    PER_GROUP: tl.constexpr = 8 if SYMMETRIC else 16  # int32 of scales (and mins) a group
    PER_ROW: tl.constexpr = 1 if SYMMETRIC else 2  # fp16 a row and group
    X_HI: tl.constexpr = 4 + 12 * (SUBS - 1)  # a lane's second activation pairs of a chunk
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    # Tensors are [MT, R, E] as the GEMV's [R, E] (w4a16/mma.py): element e of a slot in
    # lane (e // 4) % 32 of warp e // 128, four consecutive e a lane; the token tiles and
    # row-block slots in registers. Weights are [1, R, E], activations [MT, 1, E].
    mt = tl.arange(0, MT)[:, None, None]
    i = tl.arange(0, R)[None, :, None]
    e = tl.arange(0, E)[None, None, :]
    j, g, t = fragment(e)
    rb = (pid_n * R + i) * WARPS + e // 128  # [1, R, E]
    rb_ok = rb < num_row_blocks
    stride_tg = tl.multiple_of(stride_tg, 4)
    tile_at = tiles_ptr + tl.multiple_of(rb * stride_tr, [4, 4, 4])
    words_at = tile_at + e % 128
    sm_at = (tile_at + 128 * CPG).to(tl.pointer_type(tl.float16))
    sm_at += g * 2 * PER_ROW + PER_ROW * (j // 2)  # the scale of row g + 8 (j // 2)
    sm_mul = tl.where(j >= 2, 1.0 / HIGH, 1.0)
    row = tl.minimum(pid_m * 8 * MT + 8 * mt + g, M - 1)  # [MT, 1, E]: rows past M repeat
    x_at = x_ptr + row * stride_xm + t * (8 // SUBS) + j
    s_begin = pid_s * num_steps // split_k
    s_end = (pid_s + 1) * num_steps // split_k
    acc = tl.full((MT, R, E), 0.0, tl.float32)
    # Two buffers, two steps an iteration (the GEMV's two-buffer loop, w4a16/mma.py): b is
    # loaded while a is used, then a again while b is used, so each load lands in registers
    # whose last use is behind it and can be issued ahead of the mma (with one buffer,
    # ptxas put the next step's loads after this step's mma, H200 SASS).
    a = _load_step(
        words_at, sm_at, x_at, s_begin, stride_tg, rb_ok, s_begin < s_end, CPG, SUBS,
        SYMMETRIC, PER_GROUP, X_HI,
    )  # fmt: skip
    pairs_end = s_begin + (s_end - s_begin) // 2 * 2
    for step in range(s_begin, pairs_end, 2):
        b = _load_step(
            words_at, sm_at, x_at, step + 1, stride_tg, rb_ok, True, CPG, SUBS, SYMMETRIC,
            PER_GROUP, X_HI,
        )  # fmt: skip
        acc = _step(acc, a, sm_mul, MT, R, E, CPG, SUBS, SYMMETRIC, OFFSET, HIGH, DQ_ASM,
                    DQ_CONSTRAINTS, MMA_ASM, MMA_CONSTRAINTS, S_ASM, S_CONSTRAINTS)  # fmt: skip
        more = step + 2 < s_end
        a = _load_step(
            words_at, sm_at, x_at, step + 2, stride_tg, rb_ok & more, more, CPG, SUBS,
            SYMMETRIC, PER_GROUP, X_HI,
        )  # fmt: skip
        acc = _step(acc, b, sm_mul, MT, R, E, CPG, SUBS, SYMMETRIC, OFFSET, HIGH, DQ_ASM,
                    DQ_CONSTRAINTS, MMA_ASM, MMA_CONSTRAINTS, S_ASM, S_CONSTRAINTS)  # fmt: skip
    if pairs_end < s_end:  # an odd step count: the last step is in a
        acc = _step(acc, a, sm_mul, MT, R, E, CPG, SUBS, SYMMETRIC, OFFSET, HIGH, DQ_ASM,
                    DQ_CONSTRAINTS, MMA_ASM, MMA_CONSTRAINTS, S_ASM, S_CONSTRAINTS)  # fmt: skip
    n_of = rb * 16 + g + 8 * (j // 2)  # [1, R, E]
    m_of = pid_m * 8 * MT + 8 * mt + 2 * t + (j % 2)  # [MT, 1, E]
    mask = rb_ok & (n_of < N) & (m_of < M)
    out_at = out_ptr + pid_s * stride_os + m_of * stride_om + n_of
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_tc(x: torch.Tensor, weight: Int4WeightMMA, config: TcConfig, out: torch.Tensor) -> None:
    """Launch over contiguous bf16/fp16 CUDA x [M, K] into out [S, M, N] (S =
    config.split_k)."""
    n = weight.shape[0]
    m = x.shape[0]
    pairs = int32_pairs(x)
    row_blocks = weight.tiles.shape[0]
    grid = (
        triton.cdiv(m, 8 * config.mt),
        triton.cdiv(row_blocks, config.r * config.warps),
        config.split_k,
    )
    dq, dq_c, mma, mma_c, s_asm, s_c = GEMM_PTX[weight.group_size == 32]
    _gemm_tc_kernel[grid](
        pairs,
        weight.tiles,
        weight.tiles.stride(0),
        weight.tiles.stride(1),
        out,
        m,
        n,
        row_blocks,
        weight.tiles.shape[1],
        pairs.stride(0),
        out.stride(1),
        out.stride(0),
        config.split_k,
        GROUP_SIZE=weight.group_size,
        SYMMETRIC=weight.symmetric,
        WARPS=config.warps,
        R=config.r,
        MT=config.mt,
        OFFSET=MAGIC[x.dtype][1],
        HIGH=HIGH_ROWS[x.dtype],
        DQ_ASM=dq[x.dtype],
        DQ_CONSTRAINTS=dq_c,
        MMA_ASM=mma[x.dtype],
        MMA_CONSTRAINTS=mma_c,
        S_ASM=s_asm[x.dtype],
        S_CONSTRAINTS=s_c,
        num_warps=config.warps,
    )
