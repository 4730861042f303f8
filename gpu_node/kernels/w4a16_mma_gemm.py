"""W4A16 GEMMs over Int4WeightMMA: y = x @ W^T for more rows than the decode GEMV takes.

Letters: M tokens, N out features, K in features, G group size (32, 64 or 128),
T = max(G, 64) k values a tile step, S split-K ways.

Past 8 rows the tensor-core GEMV (w4a16_mma.py) stops. Dequantizing the weights into a
dense copy for cuBLAS (w4a16_mma_dequant.py) writes 2 bytes a weight and reads them
again, where these kernels read the 0.5 of the INT4 tiles. Two kernels, each the faster
over part of the range (H200, docs/bench/w4a16_gemm.md):

`tc` (up to TC_MAX_M rows): the GEMV's arithmetic with token tiles. The words are the
mma's A fragments (int4.py); each is dequantized once by LOP3 into 128 + q (bf16) or
1024 + q (fp16) and multiplied by MT tiles of 8 activation rows, one mma.m16n8k16 a
tile and k16 step, the activations' sums by mma with A = 1 once a tile; the group's
scale and min - OFFSET * scale are applied once a step:

    y[m, n] += scale[n] * D[n, m] + (min[n] - OFFSET * scale[n]) * x_sum[m]

Tensors are the GEMV's [R, E] with the token tiles in front ([MT, R, E]: four
consecutive e a lane, the tiles and row-block slots in registers); the weights, scales
and activations of a step are loaded a step ahead into one of two register buffers, so
that each load lands in registers already used and is issued ahead of the mma. Inline
PTX (w4a16_mma_asm.GEMM_PTX): GPU only.

`dot` (more rows, and the interpreter): each program dequantizes a group of its
RB * 16 rows in registers (w = scale * q + min in fp32, rounded to x's dtype: the bits
the dense copy has) and Triton's tl.dot multiplies them by a block of BLOCK_M tokens.
Taken in the order (g, hr) a row and (c, t, s) a column, a group's words come out in
natural k order (word column w covers k = 4w .. 4w + 3 of the group): a program loads
its rows' words as [RB * 16, G / 4] (each word twice, once a half hr: the second read
comes from L1), shifts each row's nibbles by 4 hr and joins the four (h, e) nibbles of
a word into k = 4w + 2h + e. Row r of a program is n = 16 (RB pid + r // 16) +
(r // 2) % 8 + 8 (r % 2), a permutation undone by the store. Plain tl operations, so
the interpreter runs it too (the CPU tests), its products in fp32 (its bf16 tl.dot is
wrong).

Split K (grid dim 2, for too few row blocks to fill the GPU): each split writes an fp32
partial [S, M, N] and the wrapper sums them in a fixed order, so the result does not
depend on timing (CUDA-graph replays give the bits of eager calls).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from gpu_node.kernels.launch import check_operands, has_mma_sync
from gpu_node.kernels.w4a16 import is_interpreted, num_sms
from gpu_node.kernels.w4a16_mma_asm import GEMM_PTX, HIGH_ROWS, MAGIC
from gpu_node.kernels.w4a16_mma_step import fragment, x_sum_chunk, x_sum_chunk2
from gpu_node.quant.int4 import MMA_GROUP_SIZES, Int4WeightMMA

__all__ = [
    "MAX_M",
    "MIN_WEIGHTS",
    "TC_MAX_M",
    "gemm_config",
    "serves",
    "supports",
    "w4a16_mma_gemm",
]

# Where the GEMMs beat the dense copy + cuBLAS (H200, docs/bench/w4a16_gemm.md): up to
# MAX_M rows (at 128 the copy was faster at five of eight layer shapes) and weights of
# MIN_WEIGHTS or more (smaller ones' copy is cheap: 2048 x 3072 took 10.6 us against the
# tc kernel's 10.9 at 16 rows). tc up to TC_MAX_M rows, dot above.
TC_MAX_M = 32
MAX_M = 64
MIN_WEIGHTS = 1 << 24


@triton.jit
def _gemm_mma_kernel(
    x_ptr,  # [M, K]
    tiles_ptr,  # int32 [N16 / 16, K / T, 2T + 16 T / G] (symmetric: 8 T / G)
    stride_tr,  # tiles' strides (int32) along row blocks and steps; the last is 1
    stride_tg,
    out_ptr,  # [M, N] in x's dtype, or fp32 [S, M, N] partials with SPLIT_K > 1
    M,
    N,
    num_row_blocks,
    num_groups,  # K / G
    stride_xm,
    stride_om,
    stride_os,  # between splits' partials
    split_k,  # the splits of K (grid dim 2)
    GROUP_SIZE: tl.constexpr,
    SYMMETRIC: tl.constexpr,  # the tiles hold scales alone (every min -8 * scale)
    BLOCK_M: tl.constexpr,
    RB: tl.constexpr,
    DOT_FP32: tl.constexpr,  # the interpreter: products in fp32
    NUM_STAGES: tl.constexpr,
):
    tl.static_assert(GROUP_SIZE == 32 or GROUP_SIZE == 64 or GROUP_SIZE == 128)
    STEP: tl.constexpr = 64 if GROUP_SIZE < 64 else GROUP_SIZE
    SUBS: tl.constexpr = STEP // GROUP_SIZE  # groups a tile step: 2 (g32) or 1
    WORDS: tl.constexpr = GROUP_SIZE // 4  # words a row and group
    PER_GROUP: tl.constexpr = 8 if SYMMETRIC else 16  # int32 of scales (and mins) a group
    PER_ROW: tl.constexpr = 1 if SYMMETRIC else 2  # fp16 a row and group
    ROWS: tl.constexpr = RB * 16
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)

    r = tl.arange(0, ROWS)  # the program's rows, as (row block, g, hr)
    rb = pid_n * RB + r // 16
    g = (r // 2) % 8
    hr = r % 2
    rb_ok = rb < num_row_blocks
    n = rb * 16 + g + 8 * hr
    w = tl.arange(0, WORDS)  # word column: k = 4w .. 4w + 3 of the group
    if GROUP_SIZE == 32:
        word_in = g[:, None] * 16 + (w // 2)[None, :] * 4 + (w % 2)[None, :]  # + 2 sub
    else:
        chunk, t, s = w // 16, (w // 4) % 4, w % 4
        word_in = (chunk * 128 + t * 4 + s)[None, :] + g[:, None] * 16
    shift = (4 * hr)[:, None]  # [ROWS, 1]
    row_at = tiles_ptr + rb.to(tl.int64)[:, None] * stride_tr  # [ROWS, 1]
    sm_row = g * 2 * PER_ROW + PER_ROW * hr  # fp16 offset of the row's scale in a group

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    kk = tl.arange(0, GROUP_SIZE)
    x_at = x_ptr + m.to(tl.int64)[:, None] * stride_xm + kk[None, :]  # [BM, G]; + G group

    # The splits share the groups evenly (their lengths differ by one at most).
    g_begin = pid_s * num_groups // split_k
    g_end = (pid_s + 1) * num_groups // split_k
    acc = tl.full((ROWS, BLOCK_M), 0.0, tl.float32)
    for grp in tl.range(g_begin, g_end, num_stages=NUM_STAGES):
        step = grp // SUBS
        sub = grp % SUBS
        tile = row_at + step.to(tl.int64) * stride_tg  # [ROWS, 1]
        # + 2 sub: the second g32 group of a chunk is on steps 2-3 (sub is 0 otherwise)
        words = tl.load(tile + word_in + 2 * sub, mask=rb_ok[:, None], other=0)
        words = words >> shift  # row hr's nibbles at 0, 8, 16, 24 (h = 0) and 4 up (h = 1)
        sm = (tile + 2 * STEP + PER_GROUP * sub).to(tl.pointer_type(tl.float16))
        sm = tl.reshape(sm, (ROWS,)) + sm_row
        scale = tl.load(sm, mask=rb_ok, other=0.0).to(tl.float32)
        if SYMMETRIC:  # noqa: SIM108 (a constexpr branch of the kernel)
            min_ = scale * -8.0
        else:
            min_ = tl.load(sm + 1, mask=rb_ok, other=0.0).to(tl.float32)
        q00 = words & 15  # nibble 2h + 4e of the shifted word: h, e = 0, 0
        q10 = (words >> 8) & 15
        q01 = (words >> 16) & 15
        q11 = (words >> 24) & 15
        q = tl.join(tl.join(q00, q10), tl.join(q01, q11))  # [ROWS, WORDS, h, e]
        q = tl.reshape(q, (ROWS, GROUP_SIZE))  # k = 4w + 2h + e
        wt = q.to(tl.float32) * scale[:, None] + min_[:, None]
        x = tl.load(x_at + grp * GROUP_SIZE, mask=m_ok[:, None], other=0.0)
        if DOT_FP32:
            acc = tl.dot(wt, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(wt.to(x.dtype), tl.trans(x), acc)

    out_at = out_ptr + pid_s * stride_os + m[None, :] * stride_om + n[:, None]
    mask = (rb_ok & (n < N))[:, None] & m_ok[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
    # A warp barrier after the loads, as the GEMV's (w4a16_mma_step.py). Alone it did not
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
    # Tensors are [MT, R, E] as the GEMV's [R, E] (w4a16_mma.py): element e of a slot in
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
    # Two buffers, two steps an iteration (the GEMV's two-buffer loop, w4a16_mma.py): b is
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


def supports(x: torch.Tensor, weight: object) -> bool:
    """Whether w4a16_mma_gemm takes this call: 2-D bf16/fp16 (or fp32 interpreted) x of
    1..MAX_M rows on CUDA or under TRITON_INTERPRET=1, over Int4WeightMMA tiles whose
    offsets (fp16 ones twice the int32) stay within int32."""
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if interpreter else ())
    return (
        isinstance(weight, Int4WeightMMA)
        and (x.is_cuda or interpreter)
        and x.dtype in dtypes
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and weight.group_size in MMA_GROUP_SIZES
        and 2 * weight.tiles.numel() < 2**31
    )


def serves(x: torch.Tensor, weight: object) -> bool:
    """Whether w4a16_mma_matmul sends this call here: what `supports`, on a weight of at
    least MIN_WEIGHTS (read at call time, so tests and benchmarks can move it)."""
    if not supports(x, weight):
        return False
    n, k = weight.shape  # type: ignore[attr-defined]
    return n * k >= MIN_WEIGHTS


def _tensor_cores(x: torch.Tensor) -> bool:
    return x.is_cuda and not is_interpreted(x) and has_mma_sync(x.device) and x.dtype in MAGIC


@functools.lru_cache(maxsize=1024)
def _cached_config(
    kernel: str, m: int, n: int, k: int, group_size: int, sms: int
) -> tuple[tuple[str, object], ...]:
    row_blocks = -(-n // 16)
    if kernel == "tc":
        # Two token tiles a program; two row blocks a warp on long or wide weights (the
        # activations' sums, one mma a tile, shared by more row blocks); K split until
        # about 6 warps a multiprocessor (fewer left the loads' latency in the open).
        r = 2 if max(n, k) >= 8192 else 1
        programs = -(-row_blocks // (4 * r)) * -(-m // 16)
        steps = k // max(64, group_size)
        split = 1
        while programs * split * 4 < 6 * sms and steps // (2 * split) >= 2:
            split *= 2
        return (("KERNEL", "tc"), ("MT", 2), ("R", r), ("WARPS", 4), ("SPLIT_K", split))
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    rb = 4
    programs = -(-row_blocks // rb) * -(-m // block_m)
    groups = k // group_size
    split = 1
    while programs * split < sms and groups // (2 * split) >= 8:
        split *= 2
    warps = 8 if block_m == 64 else 4
    return (
        ("KERNEL", "dot"), ("BLOCK_M", block_m), ("RB", rb), ("SPLIT_K", split),
        ("num_warps", warps), ("num_stages", 3),
    )  # fmt: skip


def gemm_config(
    kernel: str, m: int, n: int, k: int, group_size: int, sms: int
) -> dict[str, object]:
    """The launch of `kernel` for M rows of an [N, K] weight on a GPU of `sms`
    multiprocessors: for "tc", MT token tiles a program, R row blocks a warp, WARPS and
    SPLIT_K ways; for "dot", BLOCK_M tokens and RB row blocks a program, SPLIT_K ways,
    num_warps and num_stages."""
    if kernel not in ("tc", "dot"):
        raise ValueError(f"KERNEL is tc or dot, got {kernel!r}")
    return dict(_cached_config(kernel, m, n, k, group_size, sms))


def default_kernel(x: torch.Tensor) -> str:
    """tc up to TC_MAX_M rows where the GPU runs it, else dot."""
    return "tc" if _tensor_cores(x) and x.shape[0] <= TC_MAX_M else "dot"


def w4a16_mma_gemm(
    x: torch.Tensor, weight: Int4WeightMMA, config: Mapping[str, object] | None = None
) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_M) @ W^T -> [M, N] in x's dtype, the weights dequantized in
    registers. `config` (gemm_config's keys; KERNEL picks the kernel) overrides the
    heuristic's; benchmarks sweep it."""
    n, k = weight.shape
    check_operands(x, k, weight.tiles.device)
    if not supports(x, weight):
        raise ValueError(
            f"w4a16_mma_gemm takes bf16/fp16 x (fp32 interpreted) of 1..{MAX_M} rows on CUDA "
            f"or under TRITON_INTERPRET=1, a group size in {MMA_GROUP_SIZES} and tiles of "
            f"under 2^30 int32; got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}, group {weight.group_size}"
        )
    kernel = str((config or {}).get("KERNEL", default_kernel(x)))
    if kernel == "tc" and not _tensor_cores(x):
        raise ValueError(
            f"the tc kernel takes bf16/fp16 on CUDA sm_80+, got {x.dtype} on {x.device}"
        )
    sms = 4 if is_interpreted(x) else num_sms(x.device)
    plan = gemm_config(kernel, x.shape[0], n, k, weight.group_size, sms)
    plan.update(config or {})
    x = x.contiguous()
    if kernel == "tc":
        return _launch_tc(x, weight, plan)
    return _launch_dot(x, weight, plan)


def _split_out(x: torch.Tensor, m: int, n: int, split: int, splits_max: int) -> torch.Tensor:
    if not 1 <= split <= splits_max:
        raise ValueError(f"SPLIT_K must be 1..{splits_max}, got {split}")
    # Partials in fp32; the interpreter's fp32 -> bf16 store truncates, so it keeps fp32
    # and rounds in torch.
    fp32 = split > 1 or is_interpreted(x)
    return torch.empty(split, m, n, device=x.device, dtype=torch.float32 if fp32 else x.dtype)


def _summed(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The splits' partials added in a fixed order: the same bits every call."""
    return (out.sum(0) if out.shape[0] > 1 else out[0]).to(dtype)


def _launch_dot(x: torch.Tensor, weight: Int4WeightMMA, plan: Mapping[str, object]) -> torch.Tensor:
    n, k = weight.shape
    m = x.shape[0]
    block_m, rb, split, warps, stages = (
        int(str(plan[key])) for key in ("BLOCK_M", "RB", "SPLIT_K", "num_warps", "num_stages")
    )
    groups = k // weight.group_size
    out = _split_out(x, m, n, split, groups)
    row_blocks = weight.tiles.shape[0]
    grid = (triton.cdiv(m, block_m), triton.cdiv(row_blocks, rb), split)
    _gemm_mma_kernel[grid](
        x,
        weight.tiles,
        weight.tiles.stride(0),
        weight.tiles.stride(1),
        out,
        m,
        n,
        row_blocks,
        groups,
        x.stride(0),
        out.stride(1),
        out.stride(0),
        split,
        GROUP_SIZE=weight.group_size,
        SYMMETRIC=weight.symmetric,
        BLOCK_M=block_m,
        RB=rb,
        DOT_FP32=is_interpreted(x),  # fp32 x comes interpreted only
        NUM_STAGES=stages,
        num_warps=warps,
    )
    return _summed(out, x.dtype)


def _launch_tc(x: torch.Tensor, weight: Int4WeightMMA, plan: Mapping[str, object]) -> torch.Tensor:
    n = weight.shape[0]
    m = x.shape[0]
    mt, r, warps, split = (int(str(plan[key])) for key in ("MT", "R", "WARPS", "SPLIT_K"))
    if mt not in (1, 2, 4) or r not in (1, 2, 4):
        raise ValueError(f"MT and R are 1, 2 or 4 (register tensors), got MT {mt}, R {r}")
    steps = weight.tiles.shape[1]
    out = _split_out(x, m, n, split, steps)
    if x.storage_offset() % 2 or x.stride(0) % 2:  # no int32 pairs in an odd view
        x = x.clone()
    pairs = x.view(torch.int32)
    row_blocks = weight.tiles.shape[0]
    grid = (triton.cdiv(m, 8 * mt), triton.cdiv(row_blocks, r * warps), split)
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
        steps,
        pairs.stride(0),
        out.stride(1),
        out.stride(0),
        split,
        GROUP_SIZE=weight.group_size,
        SYMMETRIC=weight.symmetric,
        WARPS=warps,
        R=r,
        MT=mt,
        OFFSET=MAGIC[x.dtype][1],
        HIGH=HIGH_ROWS[x.dtype],
        DQ_ASM=dq[x.dtype],
        DQ_CONSTRAINTS=dq_c,
        MMA_ASM=mma[x.dtype],
        MMA_CONSTRAINTS=mma_c,
        S_ASM=s_asm[x.dtype],
        S_CONSTRAINTS=s_c,
        num_warps=warps,
    )
    return _summed(out, x.dtype)
