"""fp8 paged decode attention in registers: mma.sync on the pages as loaded, one warp a split.

Same contract as `paged_decode_attention` (paged_attention/dot.py), for fp8 pages with
head dim 64 or 128 and at most 8 query heads per kv head, on sm_89 or newer. Letters
as there: B sequences, Q query heads, H kv heads, G = Q / H, D head dim, S page size.

Why another kernel: the tl.dot kernel moves every fp8 tile global -> registers ->
(convert) -> shared memory -> registers, with barriers, and its softmax reductions
cross warps (~39 instructions a token where the bandwidth needs ~19). Here a program is one warp that never touches shared memory:
each lane loads exactly the bytes its mma fragments hold, so the loads feed the
tensor cores directly, and the softmax state of query head g lives in lanes 4g..4g+3.

Lane 4g + t (g = 0..7, t = 0..3: the mma fragments' group and thread) works on query
head g. Per 32-token step, in two 16-token halves (a half never straddles a page,
S % 16 == 0), all mma.sync.m16n8k16 with fp32 sums:

    S = q K^T        A = q in fp16, rotated into the keys' basis (kv_quant; head g in
                     row g; rows 8-15 hold -q, their scores dropped; q times a power of
                     two per head that puts max |q| in (8192, 16384]); B = K as stored,
                     int8 codes converted to fp16 in registers (exactly, by byte
                     permutes and one f16x2 subtract): the k slots of lane t are its
                     own D / 4 contiguous dims, and column n of the two n-tiles is token
                     pi(n) and pi(n) + 2 of the half, pi(n) = 4 (n // 2) + n % 2, so a
                     lane loads D / 4 bytes of two tokens (16-byte loads), and the scores
                     it gets back are those of tokens 4t .. 4t + 3.
    O^T += V^T P^T   A = V^T as stored (int8 codes of the rotated rows, kv_quant): rows
                     are the lane's D / 8 dims, k its tokens 4t .. 4t + 3 (paired two
                     tokens a register by PRMT, converted in registers as K is);
                     B = P exactly as the QK^T product left it (no shuffle), so O^T's
                     columns are heads and every accumulator register is used. O stays
                     in the rotated basis; the merge rotates each output row back.

Element j of a lane is register j of a [128] tensor (element e = 32 j + lane, the
layout Triton gives a one-warp [128] tensor): in scores and probabilities, token 4t + j
of the half; in the accumulator tensor of m-tile i, head 2t + j % 2 and dim
g D / 8 + 2i + j // 2. The K/V/scale loads are inline asm (16-byte vectors with the
half's address added once), so no tl.load asks Triton for another layout.

Softmax: scores are in log2 units. Each token's V scale is folded into P: by default
(V_LINEAR) P = p v_scale / n with p = exp2(s - m) and n the running max of p v_scale
(one exp2 a token), else P = exp2(s + log2 v_scale - m2) with m2 the running max of
s + log2 v_scale; either way P is in [0, 1] whatever the scales, and the sum l uses p
alone. A split stores (m, l, O n) or (m, l, O exp2(m2 - m)) for the merge kernel of
paged_attention/dot.py. Each step's data is loaded a step ahead, its page ids two; steps
wholly inside the context (all but the last one or two of a split) run unguarded loads
and unmasked scores (FULL_STEPS, per batch class). q's mma fragments are built once,
with -q in the rows the mma pads (distinct registers, so the fragments stay put; their
scores are dropped).

Integrity: every page id the loop loads is range-checked (out of range: flagged, page
0 read); a context longer than the block table is flagged; and, with the check on,
the owners of all the split's block-table columns are compared with the sequence's
tag by vector loads outside the loop (the first 128 columns' loads go out before it;
for some batch classes they are compared after it, DEFER_OWNERS), so the attention loop is the
same with the check on or off. kv head 0's programs report.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from gpu_node.cache.kv_quant import FP8_DTYPE, pool_strides, rotate
from gpu_node.kernels.combine import maximum_tl
from gpu_node.kernels.launch import launches_early
from gpu_node.kernels.paged_attention import mma_asm as asm
from gpu_node.kernels.paged_attention.reference import validate_decode_inputs
from gpu_node.kernels.paged_attention.split_merge import merge_splits, split_partials

STEP = 32  # tokens per loop step: two 16-token halves
MAX_GROUP = 8  # query heads per kv head: the mma's rows 0-7


class BatchClass(NamedTuple):
    """Launch defaults for calls of at most `max_pairs` (sequence, kv head) pairs (None:
    any number)."""

    max_pairs: int | None
    max_registers: int  # register cap per thread
    waves: float  # one-warp programs aimed at, in multiples of what fits at the cap
    max_splits: int  # splits per sequence at most
    full_steps: bool  # the kernel's FULL_STEPS
    defer_owners: bool  # the kernel's DEFER_OWNERS


# Per head dim: the batch classes in order. A wave is as
# many programs as the multiprocessors hold at once at the cap (resident_warps). From
# sweeps at 32K context on an H200:
# head dim 64 at batch 1 (3 pairs) best at 144 registers and 256 splits (13.9-14.0 µs;
# 512 splits 14.8, 128 registers 15.6); at B = 8 at 128 registers, one wave of 16 warps,
# every step guarded (41.6 µs; with the unguarded full steps, which spill at that cap,
# 43.8; at 144 registers 47.4); at B = 64 at 144 and 32 warps (253 µs; 128: 281-296).
# Head dim 128 at 216 registers (9 warps), 16 warps a multiprocessor for small batches
# (B = 8: 146 µs against 167 at two whole waves) and one wave for large ones (B = 64:
# 1042 µs, 1052-1103 at two to four), at most 128 splits (B = 1: 32.0 µs; 64 splits
# 34.1, 256 39.3: the merge kernel's share grows with the splits).
MIN_SPLIT = 64  # tokens per split at least
DEFAULTS = {
    64: (
        BatchClass(8, 144, 1.0, 256, full_steps=True, defer_owners=True),
        BatchClass(127, 128, 1.0, 512, full_steps=False, defer_owners=False),
        BatchClass(None, 144, 32 / 14, 512, full_steps=True, defer_owners=True),
    ),
    128: (
        BatchClass(127, 216, 16 / 9, 128, full_steps=True, defer_owners=False),
        BatchClass(None, 216, 1.0, 128, full_steps=True, defer_owners=False),
    ),
}
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 32  # one-warp blocks: Hopper holds at most 32 blocks a multiprocessor
# P's V scale as p * v_scale / max (True) or through log2 and a second running max. The
# other variants (steps wholly inside the context with unguarded loads and unmasked
# scores, or every step guarded; the owners of a split's first 128 columns compared
# after the loop, or before it) are per batch class (BatchClass).
V_LINEAR = True


@dataclass(frozen=True)
class MmaTuning:
    """Launch options of this kernel, for tests and sweeps; passing one to
    `paged_decode_attention` picks this kernel. None takes the call's batch class
    (DEFAULTS), MIN_SPLIT and V_LINEAR.

    The split count aims at `warps_per_sm` one-warp programs a multiprocessor (or `waves`
    times as many as it holds at the register cap: split_plan), each split at least
    `min_split` tokens (rounded up to a multiple of 32) and at most `max_splits` splits a
    sequence; `max_registers` caps the registers per thread (0: none). `linear_v`,
    `defer_owners` and `full_steps` pick the kernel's variants. `early_merge`: the merge
    kernel as a programmatic dependent launch (None: where the GPU has it, `launches_early`).
    """

    warps_per_sm: int | None = None
    min_split: int | None = None
    max_splits: int | None = None
    max_registers: int | None = None
    waves: float | None = None
    linear_v: bool | None = None
    defer_owners: bool | None = None
    full_steps: bool | None = None
    early_merge: bool | None = None


@triton.jit
def _quad(x, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _run_max(a, b, running, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [a, b, running], dtype=tl.float32, is_pure=True, pack=4
    )


@triton.jit
def _unary(x, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _pair(lo, hi, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [lo, hi], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _pair2(a, b, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    # A two-input, four-wide asm block (EXP2_DIFF, SPREAD_EXP2_DIFF).
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [a, b], dtype=tl.float32, is_pure=True, pack=4
    )


@triton.jit
def _q_quads(pairs, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, CONSTRAINTS, [pairs], dtype=(tl.int32, tl.int32), is_pure=True, pack=4
    )


@triton.jit
def _step_pages(table_row, step_start, end, num_pages, max_pages, PAGE_SIZE: tl.constexpr):
    """Page ids of a step's two halves (page 0 where out of range) and whether a live
    half's id was out of range. A column past the block table reads page 0: the
    context-longer-than-table check flags that sequence. The ids are loaded whether or
    not the halves are live (any column inside the table may be read), so the first
    step's loads do not wait for the context length; a half that is not live loads no
    K/V bytes (its load blocks are guarded by the context)."""
    column_a = step_start // PAGE_SIZE
    column_b = (step_start + 16) // PAGE_SIZE
    live_a = step_start < end
    live_b = step_start + 16 < end
    page_a = tl.load(table_row + column_a, mask=column_a < max_pages, other=0)
    page_b = tl.load(table_row + column_b, mask=column_b < max_pages, other=0)
    ok_a = (page_a >= 0) & (page_a < num_pages)
    ok_b = (page_b >= 0) & (page_b < num_pages)
    is_bad = (live_a & (ok_a == 0)) | (live_b & (ok_b == 0))
    return tl.where(ok_a, page_a, 0).to(tl.int64), tl.where(ok_b, page_b, 0).to(tl.int64), is_bad


@triton.jit
def _half_data(
    k_addr, v_addr, ks_addr, vs_addr, page, half_start, end, kv_head,
    k_lane, k_token, v_lane, v_token, s_lane,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr, HEAD_STRIDE: tl.constexpr,
    LOAD_K: tl.constexpr, LOAD_K_CONSTRAINTS: tl.constexpr,
    LOAD_V: tl.constexpr, LOAD_V_CONSTRAINTS: tl.constexpr,
    LOAD_SCALES: tl.constexpr, LOAD_SCALES_CONSTRAINTS: tl.constexpr,
):  # fmt: skip
    """One half's K (tokens pi(g), pi(g) + 2), V and packed scales (tokens 4t .. 4t + 3),
    through the given load blocks: guarded ones load nothing for tokens past `end`,
    unguarded ones (a half wholly inside the context) load every token."""
    left = tl.full((128,), 0, tl.int32) + (end - half_start)
    PAGE_BYTES: tl.constexpr = PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM
    base = page * PAGE_BYTES + (half_start % PAGE_SIZE) * TOKEN_STRIDE + kv_head * HEAD_STRIDE
    k_base = tl.full((128,), 0, tl.int64) + (k_addr + base)
    v_base = tl.full((128,), 0, tl.int64) + (v_addr + base)
    if HEAD_DIM == 128:
        ka0, ka1, kb0, kb1 = tl.inline_asm_elementwise(
            LOAD_K, LOAD_K_CONSTRAINTS, [k_base, k_lane, k_token, left],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4,
        )  # fmt: skip
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            LOAD_V, LOAD_V_CONSTRAINTS, [v_base, v_lane, v_token, left],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        ka0, kb0 = tl.inline_asm_elementwise(
            LOAD_K, LOAD_K_CONSTRAINTS, [k_base, k_lane, k_token, left],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=4,
        )  # fmt: skip
        ka1 = ka0
        kb1 = kb0
        v0, v1 = tl.inline_asm_elementwise(
            LOAD_V, LOAD_V_CONSTRAINTS, [v_base, v_lane, v_token, left],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=4,
        )  # fmt: skip
        v2 = v0
        v3 = v1
    # scales of tokens 4t + j: [P, H, S] bf16, four consecutive, K's and V's packed
    scale_base = ((page * NUM_KV_HEADS + kv_head) * PAGE_SIZE + half_start % PAGE_SIZE) * 2
    scales = tl.inline_asm_elementwise(
        LOAD_SCALES, LOAD_SCALES_CONSTRAINTS,
        [tl.full((128,), 0, tl.int64) + (ks_addr + scale_base),
         tl.full((128,), 0, tl.int64) + (vs_addr + scale_base), s_lane, v_token, left],
        dtype=tl.int32, is_pure=True, pack=4,
    )  # fmt: skip
    return ka0, ka1, kb0, kb1, v0, v1, v2, v3, scales


@triton.jit
def _column_owners(
    table_row, page_owner_ptr, tag, first_column, end_column, num_pages, max_pages, e
):
    """The owners of the page ids in block-table columns [first_column, first_column + 128)
    below `end_column`, `tag` for unused columns, columns past the table and out-of-range
    ids (those are the loop's or the length check's to flag). One page id and owner per
    element: two vector loads, masked by the table's width alone so that they do not
    wait for the context length."""
    columns = first_column + e
    in_table = columns < max_pages
    pages = tl.load(table_row + columns, mask=in_table, other=0)
    in_range = (pages >= 0) & (pages < num_pages)
    owners = tl.load(
        page_owner_ptr + tl.where(in_range, pages, 0).to(tl.int64), mask=in_table & in_range,
        other=tag,
    )  # fmt: skip
    return tl.where(columns < end_column, owners, tag)


@triton.jit
def _foreign(owners, tag):
    """1 if any of the owners is not `tag`, else 0 (a reduction over the warp)."""
    return tl.reduce((owners != tag).to(tl.int32), 0, maximum_tl)


@triton.jit
def _pv(o, p, v0, v1, v2, v3, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, VW: tl.constexpr):
    if VW == 4:
        out = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS, [p, v0, v1, v2, v3, o], dtype=tl.float32, is_pure=True, pack=4
        )
    else:
        out = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS, [p, v0, v1, o], dtype=tl.float32, is_pure=True, pack=4
        )
    return out


@triton.jit
def _pv_step(
    o,
    alpha,
    pa,
    pb,
    va0,
    va1,
    va2,
    va3,
    vb0,
    vb1,
    vb2,
    vb3,
    ASM: tl.constexpr,
    CONSTRAINTS: tl.constexpr,
    VW: tl.constexpr,
):
    # One m-tile's accumulator over a step: rescaled, then both halves' P.V.
    o = _pv(o * alpha, pa, va0, va1, va2, va3, ASM, CONSTRAINTS, VW)
    return _pv(o, pb, vb0, vb1, vb2, vb3, ASM, CONSTRAINTS, VW)


@triton.jit
def _qk(
    f0, f1, f2, f3, f4, f5, f6, f7, ka0, ka1, kb0, kb1,
    ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, KW: tl.constexpr,
):  # fmt: skip
    if KW == 8:
        out = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS, [f0, f1, f2, f3, f4, f5, f6, f7, ka0, ka1, kb0, kb1],
            dtype=tl.float32, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        out = tl.inline_asm_elementwise(
            ASM, CONSTRAINTS, [f0, f1, f2, f3, ka0, kb0], dtype=tl.float32, is_pure=True, pack=4
        )
    return out


@triton.jit
def _scores(
    raw, scales, left, v_token, j, score_scale, V_LINEAR: tl.constexpr, FULL: tl.constexpr,
    LOG2: tl.constexpr, UNARY_CONSTRAINTS: tl.constexpr,
):  # fmt: skip
    """s = q.k in log2 units, -inf for tokens past the context (their bytes and scales
    may be anything), and the V scale's term: u = s + log2(v_scale) (-inf past the
    context), or with V_LINEAR the V scale itself (0 past the context). scales: K's bf16
    << 16 | V's bf16. FULL: every token is in the context (nothing masked)."""
    k_scale = (scales & -65536).to(tl.float32, bitcast=True)
    v_scale = (scales << 16).to(tl.float32, bitcast=True)
    s = raw * k_scale * score_scale
    if V_LINEAR:  # noqa: SIM108 (a static branch on a constexpr)
        u = v_scale
    else:
        u = s + _unary(v_scale, LOG2, UNARY_CONSTRAINTS)
    if not FULL:
        is_valid = v_token + j < left
        s = tl.where(is_valid, s, float("-inf"))
        u = tl.where(is_valid, u, 0.0 if V_LINEAR else float("-inf"))
    return s, u


@triton.jit
def _attend_step(
    m, m2, l_sum, o0, o1, o2, o3, o4, o5, o6, o7, f0, f1, f2, f3, f4, f5, f6, f7, score_scale, v_token, j,
    ka0, ka1, kb0, kb1, va0, va1, va2, va3, sca, lefta,
    kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb, leftb,
    KW: tl.constexpr, VW: tl.constexpr, QK_ASM: tl.constexpr, QK_CONSTRAINTS: tl.constexpr,
    PV0: tl.constexpr, PV1: tl.constexpr, PV2: tl.constexpr, PV3: tl.constexpr,
    PV4: tl.constexpr, PV5: tl.constexpr, PV6: tl.constexpr, PV7: tl.constexpr,
    PV_CONSTRAINTS: tl.constexpr, RUN_MAX: tl.constexpr, RUN_MAX_CONSTRAINTS: tl.constexpr,
    EXP2_DIFF: tl.constexpr, SPREAD_EXP2_DIFF: tl.constexpr, DIFF_CONSTRAINTS: tl.constexpr,
    EXP2: tl.constexpr, LOG2: tl.constexpr, UNARY_CONSTRAINTS: tl.constexpr,
    P_F16: tl.constexpr, P_CONSTRAINTS: tl.constexpr, V_LINEAR: tl.constexpr,
    RCP: tl.constexpr, SPREAD: tl.constexpr, SPREAD_CONSTRAINTS: tl.constexpr,
    FULL: tl.constexpr,
):  # fmt: skip
    """Online softmax over one 32-token step (halves a and b) for head g of the lane.

    m2 is the V scale's state: with V_LINEAR, n, the running max of p * v_scale (p =
    exp2(s - m)), and P = p * v_scale / n; otherwise the running max of s + log2(v_scale)
    and P = exp2(s + log2(v_scale) - m2). Both put P in [0, 1] whatever the scales;
    the linear form needs one exp2 a token instead of two and a log2."""
    sa, ua = _scores(
        _qk(f0, f1, f2, f3, f4, f5, f6, f7, ka0, ka1, kb0, kb1, QK_ASM, QK_CONSTRAINTS, KW),
        sca, lefta, v_token, j, score_scale, V_LINEAR, FULL, LOG2, UNARY_CONSTRAINTS,
    )  # fmt: skip
    sb, ub = _scores(
        _qk(f0, f1, f2, f3, f4, f5, f6, f7, kc0, kc1, kd0, kd1, QK_ASM, QK_CONSTRAINTS, KW),
        scb, leftb, v_token, j, score_scale, V_LINEAR, FULL, LOG2, UNARY_CONSTRAINTS,
    )  # fmt: skip
    m_new = _run_max(sa, sb, m, RUN_MAX, RUN_MAX_CONSTRAINTS)
    decay = _pair2(m, m_new, EXP2_DIFF, DIFF_CONSTRAINTS)  # exp2(m - m_new), 0 at first
    if V_LINEAR:
        p_a = _unary(sa - m_new, EXP2, UNARY_CONSTRAINTS)
        p_b = _unary(sb - m_new, EXP2, UNARY_CONSTRAINTS)
        l_sum = l_sum * decay + p_a + p_b
        za = p_a * ua  # 0 past the context: exp2(-inf) * 0
        zb = p_b * ub
        n_old = m2 * decay
        m2_new = _run_max(za, zb, n_old, RUN_MAX, RUN_MAX_CONSTRAINTS)
        inv = tl.where(m2_new > 0.0, _unary(m2_new, RCP, UNARY_CONSTRAINTS), 0.0)
        alpha = tl.inline_asm_elementwise(
            SPREAD, SPREAD_CONSTRAINTS, [n_old * inv], dtype=tl.float32, is_pure=True, pack=4
        )  # heads 2t, 2t + 1
        pa = tl.inline_asm_elementwise(
            P_F16, P_CONSTRAINTS, [za * inv], dtype=tl.int32, is_pure=True, pack=4
        )
        pb = tl.inline_asm_elementwise(
            P_F16, P_CONSTRAINTS, [zb * inv], dtype=tl.int32, is_pure=True, pack=4
        )
    else:
        l_sum = (
            l_sum * decay
            + _unary(sa - m_new, EXP2, UNARY_CONSTRAINTS)
            + _unary(sb - m_new, EXP2, UNARY_CONSTRAINTS)
        )
        m2_new = _run_max(ua, ub, m2, RUN_MAX, RUN_MAX_CONSTRAINTS)
        alpha = _pair2(m2, m2_new, SPREAD_EXP2_DIFF, DIFF_CONSTRAINTS)  # heads 2t, 2t + 1
        pa = tl.inline_asm_elementwise(
            P_F16, P_CONSTRAINTS, [_unary(ua - m2_new, EXP2, UNARY_CONSTRAINTS)],
            dtype=tl.int32, is_pure=True, pack=4,
        )  # fmt: skip
        pb = tl.inline_asm_elementwise(
            P_F16, P_CONSTRAINTS, [_unary(ub - m2_new, EXP2, UNARY_CONSTRAINTS)],
            dtype=tl.int32, is_pure=True, pack=4,
        )  # fmt: skip
    o0 = _pv_step(
        o0, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV0, PV_CONSTRAINTS, VW
    )
    o1 = _pv_step(
        o1, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV1, PV_CONSTRAINTS, VW
    )
    o2 = _pv_step(
        o2, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV2, PV_CONSTRAINTS, VW
    )
    o3 = _pv_step(
        o3, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV3, PV_CONSTRAINTS, VW
    )
    if VW == 4:
        o4 = _pv_step(
            o4, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV4, PV_CONSTRAINTS, VW
        )
        o5 = _pv_step(
            o5, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV5, PV_CONSTRAINTS, VW
        )
        o6 = _pv_step(
            o6, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV6, PV_CONSTRAINTS, VW
        )
        o7 = _pv_step(
            o7, alpha, pa, pb, va0, va1, va2, va3, vb0, vb1, vb2, vb3, PV7, PV_CONSTRAINTS, VW
        )
    return m_new, m2_new, l_sum, o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _steps(
    lo, hi, end, FULL: tl.constexpr,
    m, m2, l_sum, o0, o1, o2, o3, o4, o5, o6, o7, f0, f1, f2, f3, f4, f5, f6, f7, score_scale,
    ka0, ka1, kb0, kb1, va0, va1, va2, va3, sca,
    kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb, pa, pb, bad,
    k_addr, v_addr, ks_addr, vs_addr, table_row, kv_head, num_pages, max_pages,
    k_lane, k_token, v_lane, v_token, s_lane, j,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr, HEAD_STRIDE: tl.constexpr,
    KW: tl.constexpr, VW: tl.constexpr, QK_ASM: tl.constexpr, QK_CONSTRAINTS: tl.constexpr,
    PV0: tl.constexpr, PV1: tl.constexpr, PV2: tl.constexpr, PV3: tl.constexpr,
    PV4: tl.constexpr, PV5: tl.constexpr, PV6: tl.constexpr, PV7: tl.constexpr,
    PV_CONSTRAINTS: tl.constexpr, RUN_MAX: tl.constexpr, RUN_MAX_CONSTRAINTS: tl.constexpr,
    EXP2_DIFF: tl.constexpr, SPREAD_EXP2_DIFF: tl.constexpr, DIFF_CONSTRAINTS: tl.constexpr,
    EXP2: tl.constexpr, LOG2: tl.constexpr, RCP: tl.constexpr,
    UNARY_CONSTRAINTS: tl.constexpr, P_F16: tl.constexpr, P_CONSTRAINTS: tl.constexpr,
    SPREAD: tl.constexpr, SPREAD_CONSTRAINTS: tl.constexpr, V_LINEAR: tl.constexpr,
    LOAD_K: tl.constexpr, LOAD_K_CONSTRAINTS: tl.constexpr,
    LOAD_V: tl.constexpr, LOAD_V_CONSTRAINTS: tl.constexpr,
    LOAD_SCALES: tl.constexpr, LOAD_SCALES_CONSTRAINTS: tl.constexpr,
):  # fmt: skip
    """The attention loop over steps [lo, hi) of a split ending at `end`: each iteration
    loads the next step's data (its page ids loaded an iteration before) and the page ids
    of the step after it, then attends over the current step, whose data arrived while
    the previous one was computed. FULL: the current and the next step lie wholly inside
    the context (the loads are unguarded, the scores unmasked)."""
    for step in range(lo, hi, 32):
        n_ka0, n_ka1, n_kb0, n_kb1, n_va0, n_va1, n_va2, n_va3, n_sca = _half_data(
            k_addr, v_addr, ks_addr, vs_addr, pa, step + 32, end, kv_head, k_lane, k_token,
            v_lane, v_token, s_lane, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, TOKEN_STRIDE,
            HEAD_STRIDE, LOAD_K, LOAD_K_CONSTRAINTS, LOAD_V, LOAD_V_CONSTRAINTS, LOAD_SCALES,
            LOAD_SCALES_CONSTRAINTS,
        )  # fmt: skip
        n_kc0, n_kc1, n_kd0, n_kd1, n_vb0, n_vb1, n_vb2, n_vb3, n_scb = _half_data(
            k_addr, v_addr, ks_addr, vs_addr, pb, step + 48, end, kv_head, k_lane, k_token,
            v_lane, v_token, s_lane, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, TOKEN_STRIDE,
            HEAD_STRIDE, LOAD_K, LOAD_K_CONSTRAINTS, LOAD_V, LOAD_V_CONSTRAINTS, LOAD_SCALES,
            LOAD_SCALES_CONSTRAINTS,
        )  # fmt: skip
        pa, pb, range_bad = _step_pages(table_row, step + 64, end, num_pages, max_pages, PAGE_SIZE)
        m, m2, l_sum, o0, o1, o2, o3, o4, o5, o6, o7 = _attend_step(
            m, m2, l_sum, o0, o1, o2, o3, o4, o5, o6, o7, f0, f1, f2, f3, f4, f5, f6, f7, score_scale, v_token, j,
            ka0, ka1, kb0, kb1, va0, va1, va2, va3, sca, end - step,
            kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb, end - step - 16,
            KW, VW, QK_ASM, QK_CONSTRAINTS, PV0, PV1, PV2, PV3, PV4, PV5, PV6, PV7,
            PV_CONSTRAINTS, RUN_MAX, RUN_MAX_CONSTRAINTS, EXP2_DIFF, SPREAD_EXP2_DIFF,
            DIFF_CONSTRAINTS, EXP2, LOG2, UNARY_CONSTRAINTS, P_F16, P_CONSTRAINTS, V_LINEAR,
            RCP, SPREAD, SPREAD_CONSTRAINTS, FULL,
        )  # fmt: skip
        bad = bad | range_bad
        ka0, ka1, kb0, kb1, va0, va1, va2, va3, sca = (
            n_ka0, n_ka1, n_kb0, n_kb1, n_va0, n_va1, n_va2, n_va3, n_sca
        )  # fmt: skip
        kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb = (
            n_kc0, n_kc1, n_kd0, n_kd1, n_vb0, n_vb1, n_vb2, n_vb3, n_scb
        )  # fmt: skip
    return (
        m, m2, l_sum, o0, o1, o2, o3, o4, o5, o6, o7, ka0, ka1, kb0, kb1, va0, va1, va2, va3,
        sca, kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb, pa, pb, bad,
    )  # fmt: skip


@triton.jit
def _decode_mma_kernel(
    q_ptr,
    k_addr,  # int64 addresses: fp8 pages [P, S, H, D], bf16 scales [P, H, S]
    v_addr,
    ks_addr,
    vs_addr,
    block_tables_ptr,
    context_lens_ptr,
    page_owner_ptr,
    seq_tags_ptr,
    part_max_ptr,  # fp32 [B, Q, N]
    part_sum_ptr,
    part_acc_ptr,  # fp32 [B, Q, N, D]
    part_bad_ptr,  # int8 [B, N]
    qk_scale,  # sm_scale * log2(e)
    split_size,  # tokens per split, a multiple of 32
    num_pages,
    max_pages,
    stride_qb,
    stride_qh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,  # bytes between a page's tokens (kv_quant.pool_strides)
    HEAD_STRIDE: tl.constexpr,  # bytes between a token's kv heads
    NUM_SPLITS: tl.constexpr,
    CHECK_OWNER: tl.constexpr,
    DEFER_OWNERS: tl.constexpr,
    FULL_STEPS: tl.constexpr,
    V_LINEAR: tl.constexpr,
    QK_ASM: tl.constexpr,
    QK_CONSTRAINTS: tl.constexpr,
    Q_QUADS: tl.constexpr,
    Q_QUADS_CONSTRAINTS: tl.constexpr,
    PV0: tl.constexpr,
    PV1: tl.constexpr,
    PV2: tl.constexpr,
    PV3: tl.constexpr,
    PV4: tl.constexpr,
    PV5: tl.constexpr,
    PV6: tl.constexpr,
    PV7: tl.constexpr,
    PV_CONSTRAINTS: tl.constexpr,
    QUAD_MAX: tl.constexpr,
    QUAD_SUM: tl.constexpr,
    QUAD_CONSTRAINTS: tl.constexpr,
    RUN_MAX: tl.constexpr,
    RUN_MAX_CONSTRAINTS: tl.constexpr,
    SPREAD: tl.constexpr,
    SPREAD_CONSTRAINTS: tl.constexpr,
    EXP2_DIFF: tl.constexpr,
    SPREAD_EXP2_DIFF: tl.constexpr,
    DIFF_CONSTRAINTS: tl.constexpr,
    PAIR: tl.constexpr,
    PAIR_CONSTRAINTS: tl.constexpr,
    EXP2: tl.constexpr,
    LOG2: tl.constexpr,
    RCP: tl.constexpr,
    UNARY_CONSTRAINTS: tl.constexpr,
    P_F16: tl.constexpr,
    P_CONSTRAINTS: tl.constexpr,
    LOAD_K: tl.constexpr,
    LOAD_K_CONSTRAINTS: tl.constexpr,
    LOAD_V: tl.constexpr,
    LOAD_V_CONSTRAINTS: tl.constexpr,
    LOAD_SCALES: tl.constexpr,
    LOAD_SCALES_CONSTRAINTS: tl.constexpr,
    LOAD_K_FULL: tl.constexpr,
    LOAD_V_FULL: tl.constexpr,
    LOAD_SCALES_FULL: tl.constexpr,
    LAUNCH_MERGE: tl.constexpr,
):
    KW: tl.constexpr = HEAD_DIM // 16  # K words per lane and token (dims t D/4 ..)
    VW: tl.constexpr = HEAD_DIM // 32  # V words per lane and token (dims g D/8 ..)
    if LAUNCH_MERGE:
        gdc_launch_dependents()  # the merge grid may launch now (merge_splits, early)
    seq_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = seq_head // NUM_KV_HEADS
    kv_head = seq_head % NUM_KV_HEADS
    # Element e is in lane e % 32, register j = e // 32: the layout Triton gives a [128]
    # tensor in one warp when no load asks for another (the K/V loads are inline asm).
    e = tl.arange(0, 128)
    lane = e % 32
    j = e // 32
    g = lane // 4
    t = lane % 4
    context_len = tl.load(context_lens_ptr + seq)
    tag = tl.load(seq_tags_ptr + seq)
    start = split * split_size
    end = tl.minimum(start + split_size, context_len)
    table_row = block_tables_ptr + seq * stride_bt

    # q of head g, lane t's dims as fp16 pairs times a power of two that puts max |q| in
    # (8192, 16384]: pair tensor c, element j = dims t D/4 + 8c + 2j, + 1.
    head_ok = g < GROUP
    q_at = q_ptr + seq * stride_qb + (kv_head * GROUP + g) * stride_qh + t * (HEAD_DIM // 4) + 2 * j
    lo0 = tl.load(q_at, mask=head_ok, other=0.0).to(tl.float32)
    hi0 = tl.load(q_at + 1, mask=head_ok, other=0.0).to(tl.float32)
    lo1 = tl.load(q_at + 8, mask=head_ok, other=0.0).to(tl.float32)
    hi1 = tl.load(q_at + 9, mask=head_ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.abs(lo0), tl.abs(hi0)), tl.maximum(tl.abs(lo1), tl.abs(hi1)))
    if KW == 8:
        lo2 = tl.load(q_at + 16, mask=head_ok, other=0.0).to(tl.float32)
        hi2 = tl.load(q_at + 17, mask=head_ok, other=0.0).to(tl.float32)
        lo3 = tl.load(q_at + 24, mask=head_ok, other=0.0).to(tl.float32)
        hi3 = tl.load(q_at + 25, mask=head_ok, other=0.0).to(tl.float32)
        amax = tl.maximum(
            amax,
            tl.maximum(tl.maximum(tl.abs(lo2), tl.abs(hi2)), tl.maximum(tl.abs(lo3), tl.abs(hi3))),
        )
    amax = _quad(amax, QUAD_MAX, QUAD_CONSTRAINTS)
    q_scale = tl.where(amax > 0.0, tl.exp2(tl.floor(tl.log2(16384.0 / amax))), 1.0)
    q0 = _pair(lo0 * q_scale, hi0 * q_scale, PAIR, PAIR_CONSTRAINTS)
    q1 = _pair(lo1 * q_scale, hi1 * q_scale, PAIR, PAIR_CONSTRAINTS)
    # the mma's A fragments of q, one a k step (f_s: pairs 2s, 2s + 1 of the lane)
    f0, f1 = _q_quads(q0, Q_QUADS, Q_QUADS_CONSTRAINTS)
    f2, f3 = _q_quads(q1, Q_QUADS, Q_QUADS_CONSTRAINTS)
    if KW == 8:
        q2 = _pair(lo2 * q_scale, hi2 * q_scale, PAIR, PAIR_CONSTRAINTS)
        q3 = _pair(lo3 * q_scale, hi3 * q_scale, PAIR, PAIR_CONSTRAINTS)
        f4, f5 = _q_quads(q2, Q_QUADS, Q_QUADS_CONSTRAINTS)
        f6, f7 = _q_quads(q3, Q_QUADS, Q_QUADS_CONSTRAINTS)
    else:
        f4, f5, f6, f7 = f0, f1, f2, f3
    score_scale = qk_scale / q_scale

    # Loop-invariant parts of the lane's load addresses (bytes within a half's page)
    k_token = 4 * (g // 2) + g % 2  # pi(g); the second K token is pi(g) + 2
    k_lane = k_token * TOKEN_STRIDE + t * (HEAD_DIM // 4)
    v_token = 4 * t
    v_lane = v_token * TOKEN_STRIDE + g * (HEAD_DIM // 8)
    s_lane = v_token * 2

    m = tl.full((128,), float("-inf"), tl.float32)  # head g's running max of s
    # the V scale's state (see _attend_step): n = 0, or max of s + log2(v_scale) = -inf
    if V_LINEAR:
        m2 = tl.full((128,), 0.0, tl.float32)
    else:
        m2 = tl.full((128,), float("-inf"), tl.float32)
    l_sum = tl.full((128,), 0.0, tl.float32)  # per element; summed over the quad at the end
    o0 = tl.full((128,), 0.0, tl.float32)
    o1 = tl.full((128,), 0.0, tl.float32)
    o2 = tl.full((128,), 0.0, tl.float32)
    o3 = tl.full((128,), 0.0, tl.float32)
    o4 = tl.full((128,), 0.0, tl.float32)
    o5 = tl.full((128,), 0.0, tl.float32)
    o6 = tl.full((128,), 0.0, tl.float32)
    o7 = tl.full((128,), 0.0, tl.float32)
    bad = context_len > max_pages * PAGE_SIZE

    # Pipeline: each iteration loads the next step's data (its page ids loaded an
    # iteration before) and the page ids of the step after it, then attends over the
    # current step, whose data arrived while the previous one was computed.
    pa, pb, range_bad = _step_pages(table_row, start, end, num_pages, max_pages, PAGE_SIZE)
    bad = bad | range_bad
    ka0, ka1, kb0, kb1, va0, va1, va2, va3, sca = _half_data(
        k_addr, v_addr, ks_addr, vs_addr, pa, start, end, kv_head, k_lane, k_token, v_lane,
        v_token, s_lane, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, TOKEN_STRIDE, HEAD_STRIDE, LOAD_K,
        LOAD_K_CONSTRAINTS, LOAD_V, LOAD_V_CONSTRAINTS, LOAD_SCALES, LOAD_SCALES_CONSTRAINTS,
    )  # fmt: skip
    kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb = _half_data(
        k_addr, v_addr, ks_addr, vs_addr, pb, start + 16, end, kv_head, k_lane, k_token,
        v_lane, v_token, s_lane, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, TOKEN_STRIDE, HEAD_STRIDE,
        LOAD_K, LOAD_K_CONSTRAINTS, LOAD_V, LOAD_V_CONSTRAINTS, LOAD_SCALES,
        LOAD_SCALES_CONSTRAINTS,
    )  # fmt: skip
    # Ownership of the split's pages, 128 block-table columns a round: the first round's
    # loads go out now and are compared after the attention loop (their latency hides
    # behind it; the loop itself is the same with the check on or off), the rest after.
    first_column = start // PAGE_SIZE
    end_column = (end + PAGE_SIZE - 1) // PAGE_SIZE
    if CHECK_OWNER:
        owners = _column_owners(
            table_row, page_owner_ptr, tag, first_column, end_column, num_pages, max_pages, e
        )
        if not DEFER_OWNERS:
            foreign = _foreign(owners, tag)
    pa, pb, range_bad = _step_pages(table_row, start + 32, end, num_pages, max_pages, PAGE_SIZE)
    bad = bad | range_bad
    # Steps wholly inside the context whose next step is too run with unguarded loads and
    # unmasked scores (phase 0, FULL_STEPS); the last one or two with guards (phase 1).
    full_end = start + (end - start) // 32 * 32
    tail_start = tl.maximum(start, full_end - 32) if FULL_STEPS else start
    for phase in tl.static_range(0 if FULL_STEPS else 1, 2):
        (m, m2, l_sum, o0, o1, o2, o3, o4, o5, o6, o7, ka0, ka1, kb0, kb1, va0, va1, va2,
         va3, sca, kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb, pa, pb, bad) = _steps(
            start if phase == 0 else tail_start, tail_start if phase == 0 else end, end,
            phase == 0,
            m, m2, l_sum, o0, o1, o2, o3, o4, o5, o6, o7, f0, f1, f2, f3, f4, f5, f6, f7, score_scale,
            ka0, ka1, kb0, kb1, va0, va1, va2, va3, sca,
            kc0, kc1, kd0, kd1, vb0, vb1, vb2, vb3, scb, pa, pb, bad,
            k_addr, v_addr, ks_addr, vs_addr, table_row, kv_head, num_pages, max_pages,
            k_lane, k_token, v_lane, v_token, s_lane, j,
            NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, TOKEN_STRIDE, HEAD_STRIDE, KW, VW, QK_ASM,
            QK_CONSTRAINTS,
            PV0, PV1, PV2, PV3, PV4, PV5, PV6, PV7, PV_CONSTRAINTS, RUN_MAX, RUN_MAX_CONSTRAINTS,
            EXP2_DIFF, SPREAD_EXP2_DIFF, DIFF_CONSTRAINTS, EXP2, LOG2, RCP, UNARY_CONSTRAINTS,
            P_F16, P_CONSTRAINTS, SPREAD, SPREAD_CONSTRAINTS, V_LINEAR,
            LOAD_K_FULL if phase == 0 else LOAD_K, LOAD_K_CONSTRAINTS,
            LOAD_V_FULL if phase == 0 else LOAD_V, LOAD_V_CONSTRAINTS,
            LOAD_SCALES_FULL if phase == 0 else LOAD_SCALES, LOAD_SCALES_CONSTRAINTS,
        )  # fmt: skip

    # Partials: head g's (m, l) from lane 4g, register 0; O of heads 2t, 2t + 1 times
    # exp2(m2 - m) of its head (0 for an empty split: m = -inf, O = 0).
    l_sum = _quad(l_sum, QUAD_SUM, QUAD_CONSTRAINTS)
    part = (seq * NUM_KV_HEADS * GROUP + kv_head * GROUP + g) * NUM_SPLITS + split
    first = (t == 0) & (j == 0) & head_ok
    tl.store(part_max_ptr + part, m, mask=first)
    tl.store(part_sum_ptr + part, l_sum, mask=first)
    if V_LINEAR:
        factor = tl.where(m == float("-inf"), 0.0, m2)
    else:
        factor = tl.where(m == float("-inf"), 0.0, tl.exp2(m2 - m))
    factor = tl.inline_asm_elementwise(
        SPREAD, SPREAD_CONSTRAINTS, [factor], dtype=tl.float32, is_pure=True, pack=4
    )
    o_head = 2 * t + j % 2
    o_part = (seq * NUM_KV_HEADS * GROUP + kv_head * GROUP + o_head) * NUM_SPLITS + split
    o_at = part_acc_ptr + o_part * HEAD_DIM + g * (HEAD_DIM // 8) + j // 2  # + 2i: m-tile i
    o_ok = o_head < GROUP
    tl.store(o_at, o0 * factor, mask=o_ok)
    tl.store(o_at + 2, o1 * factor, mask=o_ok)
    tl.store(o_at + 4, o2 * factor, mask=o_ok)
    tl.store(o_at + 6, o3 * factor, mask=o_ok)
    if VW == 4:
        tl.store(o_at + 8, o4 * factor, mask=o_ok)
        tl.store(o_at + 10, o5 * factor, mask=o_ok)
        tl.store(o_at + 12, o6 * factor, mask=o_ok)
        tl.store(o_at + 14, o7 * factor, mask=o_ok)
    if CHECK_OWNER:
        if DEFER_OWNERS:
            foreign = _foreign(owners, tag)
        for column in range(first_column + 128, end_column, 128):
            foreign = tl.maximum(
                foreign,
                _foreign(
                    _column_owners(
                        table_row,
                        page_owner_ptr,
                        tag,
                        column,
                        end_column,
                        num_pages,
                        max_pages,
                        e,
                    ),
                    tag,
                ),
            )
        bad = bad | (foreign > 0)
    is_bad = tl.full((128,), 0, tl.int8) + bad.to(tl.int8)
    tl.store(
        part_bad_ptr + seq * NUM_SPLITS + split + e * 0, is_bad, mask=(e == 0) & (kv_head == 0)
    )


def supports(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Whether this kernel takes the call: fp8 pages with head dim 64 or 128, G <= 8, on an
    sm_89+ GPU, pages 16-byte aligned and scales 8-byte aligned (its vector loads)."""
    if k_cache.dtype != FP8_DTYPE or q.device.type != "cuda" or q.dim() != 3:
        return False
    if k_cache.dim() != 4 or k_cache.shape[-1] not in asm.HEAD_DIMS:
        return False
    if q.shape[1] // k_cache.shape[2] > MAX_GROUP:
        return False
    aligned = all(
        t is None or t.data_ptr() % align == 0
        for t, align in ((k_cache, 16), (v_cache, 16), (k_scale, 8), (v_scale, 8))
    )
    return aligned and _has_fp8_mma(q.device)


@functools.cache
def _has_fp8_mma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def resident_warps(max_registers: int) -> int:
    """One-warp programs a multiprocessor holds at once when each thread may use
    `max_registers` (0: no cap, taken as 255), allocated 8 at a time."""
    regs = -(-(max_registers or 255) // 8) * 8
    return max(1, min(MAX_WARPS_PER_SM, REGISTERS_PER_SM // (32 * regs)))


def batch_class(batch: int, num_kv_heads: int, head_dim: int) -> BatchClass:
    """The DEFAULTS class of a call of `batch` sequences: the first whose max_pairs
    holds batch x kv heads."""
    pairs = batch * num_kv_heads
    return next(c for c in DEFAULTS[head_dim] if c.max_pairs is None or pairs <= c.max_pairs)


def split_plan(
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    max_context_len: int,
    num_sms: int,
    tuning: MmaTuning = MmaTuning(),
) -> tuple[int, int, int]:
    """(splits per sequence, tokens per split, register cap) of a call; the tuning's None
    fields take the call's batch class (DEFAULTS) and MIN_SPLIT. Programs are aimed at
    `warps_per_sm` a multiprocessor, or else `waves` times what it holds at the register
    cap. Splits are whole 32-token steps; none is empty for the longest sequence."""
    defaults = batch_class(batch, num_kv_heads, head_dim)
    pairs = batch * num_kv_heads
    cap = defaults.max_registers if tuning.max_registers is None else tuning.max_registers
    warps_per_sm = tuning.warps_per_sm
    if warps_per_sm is None:
        waves = defaults.waves if tuning.waves is None else tuning.waves
        warps_per_sm = max(1, round(waves * resident_warps(cap)))
    min_split = MIN_SPLIT if tuning.min_split is None else tuning.min_split
    max_splits = defaults.max_splits if tuning.max_splits is None else tuning.max_splits
    num_steps = max(1, math.ceil(max_context_len / STEP))
    target = warps_per_sm * num_sms
    # at most `target` programs: one more split a sequence would start a partial wave
    num_splits = max(1, min(num_steps, max_splits, target // pairs))
    steps_per_split = max(math.ceil(num_steps / num_splits), math.ceil(min_split / STEP))
    split_size = steps_per_split * STEP
    num_splits = max(1, math.ceil(max_context_len / split_size))
    return num_splits, split_size, cap


def paged_decode_attention_mma(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    page_owner: torch.Tensor,
    seq_tags: torch.Tensor,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_context_len: int | None = None,
    check_owner: bool = True,
    tuning: MmaTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over fp8 pages: (out [B, Q, D] in q's dtype, violations [B]).

    `tuning` overrides the measured launch (MmaTuning); the service passes none.
    """
    tuning = MmaTuning() if tuning is None else tuning
    num_pages, page_size, num_kv_heads, head_dim = validate_decode_inputs(
        q, k_cache, v_cache, block_tables, context_lens, page_owner, seq_tags, k_scale, v_scale
    )
    if not supports(q, k_cache, v_cache, k_scale, v_scale):
        raise ValueError(
            "paged_decode_attention_mma needs fp8 pages with head dim 64 or 128, at most "
            f"{MAX_GROUP} query heads per kv head, on an sm_89+ GPU, pages 16-byte aligned"
        )
    if k_scale is None or v_scale is None:  # validate_decode_inputs refused this already
        raise ValueError("fp8 pages need k_scale and v_scale")
    q = rotate(q)  # into the basis the pages keep rows in (kv_quant); the merge rotates back
    batch, num_heads, _ = q.shape
    out = torch.empty_like(q)
    violations = torch.empty(batch, dtype=torch.bool, device=q.device)  # merge_splits sets all
    if batch == 0:
        return out, violations
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    group = num_heads // num_kv_heads
    num_splits, split_size, max_registers = split_plan(
        batch, num_kv_heads, head_dim, max_context_len, _num_sms(q.device), tuning
    )
    variant = batch_class(batch, num_kv_heads, head_dim)
    early = launches_early(q.device) if tuning.early_merge is None else tuning.early_merge
    if early and not launches_early(q.device):
        raise ValueError("early_merge needs compiled kernels on an sm_90+ GPU")
    part_max, part_sum, part_acc, part_bad = split_partials(
        batch, num_heads, num_splits, head_dim, q.device
    )
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    pv = asm.PV[head_dim] + asm.PV[head_dim][:1] * (8 - len(asm.PV[head_dim]))  # 8 slots
    token_stride, head_stride = pool_strides(k_cache)  # fp8: bytes
    load_k = asm.load_k(head_dim, token_stride)
    load_v = asm.load_v(head_dim, token_stride)
    _decode_mma_kernel[(batch * num_kv_heads, num_splits)](
        q,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_scale.data_ptr(),
        v_scale.data_ptr(),
        block_tables,
        context_lens,
        page_owner,
        seq_tags,
        part_max,
        part_sum,
        part_acc,
        part_bad,
        scale * math.log2(math.e),
        split_size,
        num_pages,
        block_tables.shape[1],
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        TOKEN_STRIDE=token_stride,
        HEAD_STRIDE=head_stride,
        NUM_SPLITS=num_splits,
        CHECK_OWNER=check_owner,
        DEFER_OWNERS=_given(tuning.defer_owners, variant.defer_owners),
        V_LINEAR=_given(tuning.linear_v, V_LINEAR),
        FULL_STEPS=_given(tuning.full_steps, variant.full_steps),
        QK_ASM=asm.QK[head_dim],
        QK_CONSTRAINTS=asm.QK_CONSTRAINTS[head_dim],
        Q_QUADS=asm.Q_QUADS,
        Q_QUADS_CONSTRAINTS=asm.Q_QUADS_CONSTRAINTS,
        PV0=pv[0],
        PV1=pv[1],
        PV2=pv[2],
        PV3=pv[3],
        PV4=pv[4],
        PV5=pv[5],
        PV6=pv[6],
        PV7=pv[7],
        PV_CONSTRAINTS=asm.PV_CONSTRAINTS[head_dim],
        QUAD_MAX=asm.QUAD_MAX,
        EXP2_DIFF=asm.EXP2_DIFF,
        SPREAD_EXP2_DIFF=asm.SPREAD_EXP2_DIFF,
        DIFF_CONSTRAINTS=asm.EXP2_DIFF_CONSTRAINTS,
        QUAD_SUM=asm.QUAD_SUM,
        QUAD_CONSTRAINTS=asm.QUAD_CONSTRAINTS,
        RUN_MAX=asm.RUN_MAX,
        RUN_MAX_CONSTRAINTS=asm.RUN_MAX_CONSTRAINTS,
        SPREAD=asm.SPREAD,
        SPREAD_CONSTRAINTS=asm.SPREAD_CONSTRAINTS,
        PAIR=asm.PAIR_F16,
        PAIR_CONSTRAINTS=asm.PAIR_CONSTRAINTS,
        EXP2=asm.EXP2,
        LOG2=asm.LOG2,
        RCP=asm.RCP,
        UNARY_CONSTRAINTS=asm.UNARY_CONSTRAINTS,
        P_F16=asm.P_F16,
        P_CONSTRAINTS=asm.P_CONSTRAINTS,
        LOAD_K=load_k[0],
        LOAD_K_CONSTRAINTS=load_k[1],
        LOAD_V=load_v[0],
        LOAD_V_CONSTRAINTS=load_v[1],
        LOAD_SCALES=asm.LOAD_SCALES,
        LOAD_SCALES_CONSTRAINTS=asm.LOAD_SCALES_CONSTRAINTS,
        LOAD_K_FULL=asm.load_k(head_dim, token_stride, guarded=False)[0],
        LOAD_V_FULL=asm.load_v(head_dim, token_stride, guarded=False)[0],
        LOAD_SCALES_FULL=asm.LOAD_SCALES_FULL,
        LAUNCH_MERGE=early,
        num_warps=1,
        num_stages=1,
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    merge_splits(part_max, part_sum, part_acc, part_bad, out, violations, early, rotate=True)
    return out, violations


def _given(option: bool | None, default: bool) -> bool:
    return default if option is None else option


__all__ = [
    "DEFAULTS",
    "BatchClass",
    "MmaTuning",
    "batch_class",
    "paged_decode_attention_mma",
    "resident_warps",
    "split_plan",
    "supports",
]
