"""The `dot` W4A16 GEMM over Int4WeightMMA (w4a16/mma_gemm.py picks it past TC_MAX_M rows,
and on the interpreter): y = x @ W^T, a program's weights dequantized in registers for
Triton's tl.dot.

Letters: M tokens, N out features, K in features, G group size (32, 64 or 128), S split-K
ways.

Each program dequantizes a group of its RB * 16 rows in registers (w = scale * q + min in
fp32, rounded to x's dtype: the bits the dense copy has) and tl.dot multiplies them by a
block of BLOCK_M tokens. Taken in the order (g, hr) a row and (c, t, s) a column, a group's
words come out in natural k order (word column w covers k = 4w .. 4w + 3 of the group): a
program loads its rows' words as [RB * 16, G / 4] (each word twice, once a half hr: the
second read comes from L1), shifts each row's nibbles by 4 hr and joins the four (h, e)
nibbles of a word into k = 4w + 2h + e. Row r of a program is n = 16 (RB pid + r // 16) +
(r // 2) % 8 + 8 (r % 2), a permutation undone by the store. Plain tl operations, so the
interpreter runs it too (the CPU tests), its products in fp32 (its bf16 tl.dot is wrong).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_node.kernels.w4a16.dot import is_interpreted
from gpu_node.quant.int4 import Int4WeightMMA

__all__ = ["DotConfig", "dot_config", "launch_dot"]


@dataclass(frozen=True, kw_only=True)
class DotConfig:
    """A launch of the dot kernel: `block_m` tokens and `rb` row blocks (16 rows) a
    program, K split `split_k` ways, Triton's `num_warps` and `num_stages`."""

    block_m: int = 16
    rb: int = 4
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "rb", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_m < 16:
            raise ValueError(f"block_m must be 16 or more (tl.dot), got {self.block_m}")
        for name in ("split_k", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be 1 or more, got {getattr(self, name)}")


@functools.lru_cache(maxsize=1024)
def dot_config(m: int, n: int, k: int, group_size: int, sms: int) -> DotConfig:
    """The heuristic launch for M rows of an [N, K] weight on `sms` multiprocessors: the
    smallest token block that holds M, four row blocks a program, K split (keeping 8 groups
    a split) while the programs do not fill the multiprocessors, four warps (at 64 tokens
    1-6% faster than eight at five layer shapes, H200: docs/benchmarks.md)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    rb = 4
    row_blocks = -(-n // 16)
    programs = -(-row_blocks // rb) * -(-m // block_m)
    groups = k // group_size
    split = 1
    while programs * split < sms and groups // (2 * split) >= 8:
        split *= 2
    return DotConfig(block_m=block_m, rb=rb, split_k=split, num_warps=4)


@triton.jit
def _gemm_dot_kernel(
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


def launch_dot(
    x: torch.Tensor, weight: Int4WeightMMA, config: DotConfig, out: torch.Tensor
) -> None:
    """Launch over contiguous x [M, K] into out [S, M, N] (S = config.split_k)."""
    n, k = weight.shape
    m = x.shape[0]
    row_blocks = weight.tiles.shape[0]
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(row_blocks, config.rb), config.split_k)
    _gemm_dot_kernel[grid](
        x,
        weight.tiles,
        weight.tiles.stride(0),
        weight.tiles.stride(1),
        out,
        m,
        n,
        row_blocks,
        k // weight.group_size,
        x.stride(0),
        out.stride(1),
        out.stride(0),
        config.split_k,
        GROUP_SIZE=weight.group_size,
        SYMMETRIC=weight.symmetric,
        BLOCK_M=config.block_m,
        RB=config.rb,
        DOT_FP32=is_interpreted(x),  # fp32 x comes interpreted only
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
