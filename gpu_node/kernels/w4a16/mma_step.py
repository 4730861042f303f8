"""The group step of the tensor-core W4A16 kernels: one step of K (a group, or two groups of
32) of a row block's INT4 tiles against the activations, on mma.sync, and the loads that
bring a step in. The dense GEMV (w4a16/mma.py, whose docstring has the arithmetic and the
layout) and the MoE kernel (moe/mma.py) both run their loops over it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _d_chunk(words, x_lo, x_hi, d, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [words, x_lo, x_hi, d], dtype=tl.float32, is_pure=True, pack=4
    )


@triton.jit
def x_sum_chunk(x_lo, x_hi, s, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    """s + a chunk's activation sums (mma with A = 1); the GEMM takes it too."""
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [x_lo, x_hi, s], dtype=tl.float32, is_pure=True, pack=4
    )


@triton.jit
def _d_chunk2(words, x_lo, x_hi, d_a, d_b, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [words, x_lo, x_hi, d_a, d_b], dtype=(tl.float32, tl.float32),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def x_sum_chunk2(x_lo, x_hi, s_a, s_b, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [x_lo, x_hi, s_a, s_b], dtype=(tl.float32, tl.float32),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def fragment(e):
    """Where element e of a row-block slot sits in the mma fragments of its lane (e // 4) %
    32: j (the k16 step of its word, the C element of its result), g = lane // 4 and
    t = lane % 4."""
    lane = (e // 4) % 32
    return e % 4, lane // 4, lane % 4


@triton.jit
def load_step_int32(words_at, sm_at, step, stride_tg, mask, CPG: tl.constexpr, SUBS: tl.constexpr,
               SM2: tl.constexpr):  # fmt: skip
    """The two-buffer loop's (PIPE 2) loads of a step: words (two chunks with groups of 128)
    and the 16 bytes of scales (and mins) a lane reads, [R, E] each.

    A warp barrier follows them, which ptxas does not move loads across, so they are issued
    here rather than sunk towards their first use (ptxas's choice, for fewer live
    registers), and a step's math hides their latency (faster than without, H200)."""
    at = step * stride_tg
    w0 = tl.load(words_at + at, mask=mask)
    w1 = tl.load(words_at + at + 128, mask=mask & (CPG == 2))
    sm = tl.load(sm_at + at, mask=mask)
    sm2 = tl.load(sm_at + at + SM2, mask=mask & (SUBS == 2))
    tl.inline_asm_elementwise(
        "bar.warp.sync -1;\nmov.b32 $0, 0;", "=r,r", [tl.full([1], 0, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
    return w0, w1, sm, sm2


@triton.jit
def load_step_fp16(words_at, sm_at, step, stride_tg, mask, CPG: tl.constexpr,
                    SUBS: tl.constexpr, SM2: tl.constexpr):  # fmt: skip
    """The one-buffer loop's (PIPE 0) loads of a step: words, and the scales and mins as
    fp16 (sm_at an fp16 pointer, so offsets twice the int32 ones), [R, E] each."""
    at = step * stride_tg
    w0 = tl.load(words_at + at, mask=mask, other=0)
    w1 = tl.load(words_at + at + 128, mask=mask & (CPG == 2), other=0)
    sm = tl.load(sm_at + 2 * at, mask=mask, other=0.0)
    sm2 = tl.load(sm_at + 2 * at + 2 * SM2, mask=mask & (SUBS == 2), other=0.0)
    return w0, w1, sm, sm2


@triton.jit
def _scales_asm(sm, pick, ASM: tl.constexpr):
    """sm [R, E] int32 (the 16 bytes of a group's scales and mins a lane loads) and pick
    [1, E] (g % 4: where its own words sit) -> (scale, correction) fp32 per C element, in
    inline PTX (w4a16_mma_asm.scales_asm)."""
    pick = pick + tl.zeros_like(sm)
    return tl.inline_asm_elementwise(
        ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r", [sm, pick],
        dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _scales_fp16(sm, sm_mul, OFFSET: tl.constexpr, HIGH: tl.constexpr):
    """The one-buffer loop's (PIPE 0, and the MoE kernel's) scales: sm [R, E] fp16, (scale,
    min) of rows g and g + 8 per lane -> scale and min - OFFSET * scale per C element, in
    Triton. With HIGH > 1 the rows g + 8 came out of the mma HIGH times too large:
    sm_mul [1, E] divides their scale (1 / HIGH at the lane's element 2, exact)."""
    sm = sm.to(tl.float32)
    if HIGH != 1.0:
        sm = sm * sm_mul
    scale, min_ = tl.split(tl.reshape(sm, (sm.shape[0], sm.shape[1] // 2, 2)))  # rows g, g + 8
    corr = min_ - OFFSET * scale
    scale = tl.reshape(tl.join(scale, scale), sm.shape)
    corr = tl.reshape(tl.join(corr, corr), sm.shape)
    return scale, corr


@triton.jit
def _scales(sm, sm_pick, sm_mul, SM_ASM: tl.constexpr, FP16_SCALES: tl.constexpr,
            OFFSET: tl.constexpr, HIGH: tl.constexpr):  # fmt: skip
    """A step's (scale, correction) per C element, from whichever form its loop loaded."""
    if FP16_SCALES:
        scale, corr = _scales_fp16(sm, sm_mul, OFFSET, HIGH)
    else:
        scale, corr = _scales_asm(sm, sm_pick, SM_ASM)
    return scale, corr


@triton.jit
def mma_group_step(
    acc,
    step,  # (w0, w1, sm, sm2) as the step's loop loaded them
    sm_pick,
    x_at,
    c0,
    CPG: tl.constexpr,
    CHAINS: tl.constexpr,
    SUBS: tl.constexpr,
    D_ASM: tl.constexpr,
    D_CONSTRAINTS: tl.constexpr,
    S_ASM: tl.constexpr,
    S_CONSTRAINTS: tl.constexpr,
    SM_ASM: tl.constexpr,
    sm_mul=None,  # with FP16_SCALES: sm is fp16, scaled in Triton (_scales_fp16)
    FP16_SCALES: tl.constexpr = False,
    OFFSET: tl.constexpr = 128.0,
    HIGH: tl.constexpr = 1.0,
):
    """acc [R, E] + one step's share of y: scale * D + (min - OFFSET * scale) * x_sum.

    CHAINS = 2 splits each mma chain (D and x_sum) into two accumulators of half the
    length; the scale multiplies both halves in the same fused multiply-adds. SUBS = 2
    (groups of 32, CHAINS 2 with HALVES_PTX): the step's chunk holds two groups, the
    first accumulator is the first group's (scales and mins `sm`), the second the
    second's (`sm2`)."""
    w0, w1, sm, sm2 = step
    zero_d = tl.full(w0.shape, 0.0, tl.float32)
    zero_s = tl.full((1, w0.shape[1]), 0.0, tl.float32)
    X_HI: tl.constexpr = 4 + 12 * (SUBS - 1)  # 4, or 16 with groups of 32
    for c in tl.static_range(CPG):
        # [1, E]: pairs 8t .. 8t + 3 of the chunk and 8t + 4 .. 8t + 7 (x_at is at 8t), or
        # with groups of 32 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 (x_at at 4t)
        x_lo = tl.load(x_at + (c0 + c) * 32)
        x_hi = tl.load(x_at + (c0 + c) * 32 + X_HI)
        w = w0 if c == 0 else w1
        if c == 0:  # the chains start from zero
            d_a, d_b, s_a, s_b = zero_d, zero_d, zero_s, zero_s
        if CHAINS == 2:
            d_a, d_b = _d_chunk2(w, x_lo, x_hi, d_a, d_b, D_ASM, D_CONSTRAINTS)
            s_a, s_b = x_sum_chunk2(x_lo, x_hi, s_a, s_b, S_ASM, S_CONSTRAINTS)
        else:
            d_a = _d_chunk(w, x_lo, x_hi, d_a, D_ASM, D_CONSTRAINTS)
            s_a = x_sum_chunk(x_lo, x_hi, s_a, S_ASM, S_CONSTRAINTS)
    scale, corr = _scales(sm, sm_pick, sm_mul, SM_ASM, FP16_SCALES, OFFSET, HIGH)
    if SUBS == 2:
        scale2, corr2 = _scales(sm2, sm_pick, sm_mul, SM_ASM, FP16_SCALES, OFFSET, HIGH)
        acc = tl.fma(d_a, scale, acc)
        acc = tl.fma(d_b, scale2, acc)
        acc = tl.fma(s_a, corr, acc)
        return tl.fma(s_b, corr2, acc)
    acc = tl.fma(d_a, scale, acc)
    if CHAINS == 2:
        acc = tl.fma(d_b, scale, acc)
        s_a += s_b
    return tl.fma(s_a, corr, acc)
