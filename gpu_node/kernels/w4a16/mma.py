"""W4A16 decode GEMV on tensor cores over Int4WeightMMA: y = x @ W^T for M <= 8.

Letters: M tokens, N out features, K in features, G group size (32, 64 or 128),
T = max(G, 64) k values a loop step, S split-K ways, W warps per program, R row
blocks (16 rows) per warp (per program with KWARPS, its warps sharing them).

The CUDA-core GEMV (w4a16/gemv.py) spends about five instructions a weight, so its
arithmetic takes as long as reading the weight. Here a weight costs about two: the
packed words are already each lane's A fragment of `mma.sync.m16n8k16` (int4.py,
Int4WeightMMA), so one LOP3 turns two nibbles into two bf16 (or fp16) values
without a conversion instruction,

    (word >> 4r) & 0x000F000F | 0x43004300   ->  bf16 pair (128 + q_lo, 128 + q_hi)

and the tensor core multiplies them by the activations and sums in fp32 (the step itself,
which the MoE kernel shares, is w4a16/mma_step.py). The offset and the group's scale and
min come out afterwards, once per group and row:

    D[n, m]     = sum_k x[m, k] (128 + q[n, k])    (mma over the group, fp32 sums)
    x_sum[m]    = sum_k x[m, k]                    (mma with A = 1: exact products, fp32 sums)
    y[m, n]    += scale[n] D[n, m] + (min[n] - 128 scale[n]) x_sum[m]

The B operand is the activations: column g of the mma is x row g (rows past M
repeat row 0 and are never stored), so M = 1..8 issue the same instructions. C
fragment element j of lane 4g + t is output row 16rb + g + 8 (j // 2), activation
row 2t + j % 2.

The mma is a warp instruction, so the kernel's register tensors must map onto
lanes exactly: every tensor in the loop is [R, 128 W] with four consecutive
elements per lane (the layout Triton gives a 16-byte-per-lane load of that shape),
and the inline asm (w4a16/mma_asm.py) takes a lane's four elements at once
(pack = 4). The GPU tests check the result against the torch reference; the
interpreter cannot run inline asm, so this kernel is GPU-only (the layout and its
arithmetic have CPU tests).

Each chunk's mma form a dependent chain (four k16 steps into one accumulator);
CHAINS = 2 alternates the steps between two accumulators, halving the chain, and the
group's scale multiplies both in the same fused multiply-adds.

Two loops (PIPE): 0, one register buffer with the scales and mins as fp16, the default
for asymmetric tiles; 2, two buffers with them as int32 words unpacked in PTX
(w4a16_mma_asm.scales_asm), which symmetric tiles (scales alone) always take. Both give
the same bits; docs/benchmarks.md has the H200 figures of each.

KWARPS (a config option the heuristic does not choose; docs/benchmarks.md has where
it was faster): a program's warps share its row blocks and each walks an equal share of its
split's steps, the shares summed across warps through shared memory.

Split K (grid dim 1): each program writes an fp32 partial; the last of a column of
programs (same row blocks) to finish (a release/acquire counter, as in
w4a16/gemv.py) adds the S partials in a fixed order and writes y, so the result
does not depend on timing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_node.kernels.launch import check_operands, has_mma_sync, int32_pairs
from gpu_node.kernels.w4a16 import mma_gemm, mma_plan
from gpu_node.kernels.w4a16.dot import is_interpreted
from gpu_node.kernels.w4a16.gemv import MAX_M, split_counters
from gpu_node.kernels.w4a16.mma_asm import MAGIC
from gpu_node.kernels.w4a16.mma_dequant import dequantize_mma
from gpu_node.kernels.w4a16.mma_plan import mma_gemv_config, plan_launch
from gpu_node.kernels.w4a16.mma_step import (
    fragment,
    load_step_fp16,
    load_step_int32,
    mma_group_step,
)
from gpu_node.quant.int4 import MMA_GROUP_SIZES, Int4WeightMMA

__all__ = ["mma_gemv_config", "supports", "w4a16_mma_gemv", "w4a16_mma_matmul"]


@triton.jit
def _gemv_mma_kernel(
    x_ptr,  # int32 [M, K / 2]: bf16/fp16 pairs
    tiles_ptr,  # int32 [N16 / 16, K / T, 2T + 16 T / G]: words, then scales and mins
    stride_tr,  # tiles' strides (int32) along row blocks and groups; the last is 1
    stride_tg,
    part_ptr,  # fp32 [S, programs along N, R, 128 W] ([S, programs, R, 128] with KWARPS)
    count_ptr,  # int32 [programs along N]: 0 between calls
    out_ptr,  # [M, N]
    M,
    N,
    num_row_blocks,
    stride_xm,  # in int32 pairs
    stride_om,
    num_groups,  # steps of T = max(G, 64) k: groups, or pairs of g32 groups
    GROUP_SIZE: tl.constexpr,
    WARPS: tl.constexpr,
    R: tl.constexpr,  # row blocks per warp
    SPLIT_K: tl.constexpr,
    OFFSET: tl.constexpr,  # 128.0 (bf16) or 1024.0 (fp16): the magic's integer part
    HIGH: tl.constexpr,  # 1.0 (bf16) or 16.0 (fp16): what rows g + 8 come out times
    D_ASM: tl.constexpr,
    D_CONSTRAINTS: tl.constexpr,
    S_ASM: tl.constexpr,
    S_CONSTRAINTS: tl.constexpr,
    SM_ASM: tl.constexpr,  # a step's scales (and mins) -> scale and correction (PTX)
    CHAINS: tl.constexpr = 1,  # accumulators per mma chain: 1 or 2
    EARLY: tl.constexpr = 0,  # PDL: 0 off; the next kernel may launch from 1 the start, 2 the tail
    SYMMETRIC: tl.constexpr = False,  # the tiles hold scales alone (min = -8 scale)
    PIPE: tl.constexpr = 0,  # the loop: 0 one buffer, fp16 scales; 2 two buffers, int32 scales
    KWARPS: tl.constexpr = False,  # a program's warps share its row blocks and split its K
):
    tl.static_assert(GROUP_SIZE == 32 or GROUP_SIZE == 64 or GROUP_SIZE == 128)
    tl.static_assert(GROUP_SIZE != 32 or CHAINS == 2)
    tl.static_assert(R <= 8)  # the epilogue sums 8 // R partials at a time
    CPG: tl.constexpr = (GROUP_SIZE + 63) // 64  # chunks per step: 1 or 2
    SUBS: tl.constexpr = 64 * CPG // GROUP_SIZE  # groups per step: 2 (g32) or 1
    E: tl.constexpr = 128 * WARPS  # elements of a row-block slot: 32 lanes x 4 per warp
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    # Tensors are [R, E]: element e of slot i lives in lane (e // 4) % 32 of warp e // 128,
    # four consecutive e per lane, the slots in registers. Written as one contiguous
    # axis, it is the layout Triton gives a 16-byte-per-lane load, so the loads, the
    # inline asm and the arithmetic share it and nothing moves between lanes.
    i = tl.arange(0, R)[:, None]  # [R, 1]: row-block slot of the warp
    e = tl.arange(0, E)[None, :]  # [1, E]
    j, g, t = fragment(e)
    if KWARPS:  # noqa: SIM108 (a constexpr branch, not a value)
        rb = pid_n * R + i + 0 * e  # [R, E]: every warp on the program's row blocks
    else:
        rb = (pid_n * R + i) * WARPS + e // 128  # [R, E]
    rb_ok = rb < num_row_blocks
    # The SPLIT_K splits share the steps evenly (their lengths differ by one at most), so
    # a split count chosen to fill one wave never leaves a short last split behind.
    g_begin = pid_s * num_groups // SPLIT_K
    g_end = (pid_s + 1) * num_groups // SPLIT_K
    # Every tile and step starts 16-byte aligned (Int4WeightMMA checks the strides), which
    # Triton cannot see when a stride is no multiple of 16 int32 (a symmetric tile is 264).
    stride_tg = tl.multiple_of(stride_tg, 4)
    # The [4, 4] hint needs rb as a 2-D tensor, which with KWARPS and one row block a program
    # folds to a scalar; the stride's hint alone would lose symmetric tiles' 16-byte loads
    # (Triton 3.6 offline SASS: 100 loads instead of 46), so each keeps its own form.
    if KWARPS:
        tile_at = tiles_ptr + rb * tl.multiple_of(stride_tr, 4)
    else:
        tile_at = tiles_ptr + tl.multiple_of(rb * stride_tr, [4, 4])  # [R, E]; + stride_tg * step
    x_at = x_ptr + tl.where(g < M, g, 0) * stride_xm + t * (8 // SUBS) + j  # [1, E]; + 32 c
    if KWARPS:
        # Warp w walks the w-th of WARPS equal shares of the split's steps (the plan checks
        # that they divide): its tiles and activations start that far in, and the loop
        # below runs over one share.
        per_warp = (g_end - g_begin) // WARPS
        warp_at = (e // 128) * per_warp  # [1, E]: steps
        tile_at += warp_at * stride_tg
        x_at += warp_at * (32 * CPG)
        g_end = g_begin + per_warp
    words_at = tile_at + e % 128  # + 128 * chunk of the group
    SM2: tl.constexpr = 8 if SYMMETRIC else 16  # the second g32 group's words, in int32
    acc = tl.full((R, E), 0.0, tl.float32)
    if EARLY == 1:
        gdc_launch_dependents()  # the next kernel may launch once every program has started
    # A step's words, scales and mins are loaded a step ahead, so they are in flight
    # behind the tensor cores. Splits are never empty. Masked-off loads (past the
    # split's last step, or a row block past N) are never used.
    if PIPE == 0:
        # One buffer (the next step's registers copied into this step's at the end of
        # each iteration), fp16 scales and mins, (g, 4) a group (a 64-bit load a lane),
        # unpacked in Triton. The copy waits for the next step's loads; yet on the H200
        # this loop is the faster at most asymmetric shapes measured (w4a16_gemv.md).
        sm_at = (tile_at + 128 * CPG).to(tl.pointer_type(tl.float16)) + g * 4 + j
        sm_mul = tl.where(j == 2, 1.0 / HIGH, 1.0)
        a = load_step_fp16(words_at, sm_at, g_begin, stride_tg, rb_ok, CPG, SUBS, SM2)
    else:
        # Whole int32 words (two fp16 each), each lane loading the aligned 16 bytes that
        # hold its own (_scales_asm picks them out by g): carried as fp16 halves, they
        # were split apart at the end of the previous iteration, right after their
        # loads, and the split waited for them.
        if SYMMETRIC:  # one word a g and group: the scales of rows g and g + 8
            sm_at = tile_at + 128 * CPG + (g // 4) * 4 + j
        else:  # two words a g and group: (scale, min) of row g, then of row g + 8
            sm_at = tile_at + 128 * CPG + (g // 2) * 4 + j
        sm_pick = g % 4  # [1, E]: where the lane's own words sit in the 16 bytes it loads
        a = load_step_int32(words_at, sm_at, g_begin, stride_tg, rb_ok, CPG, SUBS, SM2)
    if EARLY != 0:
        # The weights are nobody's output, so their first step is in flight before the
        # wait; x, the partials and the counters only after the previous kernel is done.
        gdc_wait()
    if PIPE == 0:
        for grp in range(g_begin, g_end):
            b_mask = rb_ok & (grp + 1 < g_end)
            b = load_step_fp16(words_at, sm_at, grp + 1, stride_tg, b_mask, CPG, SUBS, SM2)
            acc = mma_group_step(
                acc, a, None, x_at, grp * CPG, CPG, CHAINS, SUBS,
                D_ASM, D_CONSTRAINTS, S_ASM, S_CONSTRAINTS, SM_ASM, sm_mul, True, OFFSET, HIGH,
            )  # fmt: skip
            a = b
    else:
        # Two buffers, two steps an iteration: b is loaded while a is used, then a again
        # while b is used. Each load lands in the registers its step is used from, so
        # nothing at the loop's end waits for a load still in flight. Symmetric tiles take
        # this loop: their scales are one word a g, which as fp16 loads four 2-byte loads.
        pairs_end = g_begin + (g_end - g_begin) // 2 * 2
        for grp in range(g_begin, pairs_end, 2):
            b = load_step_int32(words_at, sm_at, grp + 1, stride_tg, rb_ok, CPG, SUBS, SM2)
            acc = mma_group_step(
                acc, a, sm_pick, x_at, grp * CPG, CPG, CHAINS, SUBS,
                D_ASM, D_CONSTRAINTS, S_ASM, S_CONSTRAINTS, SM_ASM,
            )  # fmt: skip
            a_mask = rb_ok & (grp + 2 < g_end)
            a = load_step_int32(words_at, sm_at, grp + 2, stride_tg, a_mask, CPG, SUBS, SM2)
            acc = mma_group_step(
                acc, b, sm_pick, x_at, (grp + 1) * CPG, CPG, CHAINS, SUBS,
                D_ASM, D_CONSTRAINTS, S_ASM, S_CONSTRAINTS, SM_ASM,
            )  # fmt: skip
        if pairs_end < g_end:  # an odd step count: the last step is in a
            acc = mma_group_step(
                acc, a, sm_pick, x_at, pairs_end * CPG, CPG, CHAINS, SUBS,
                D_ASM, D_CONSTRAINTS, S_ASM, S_CONSTRAINTS, SM_ASM,
            )  # fmt: skip

    if EARLY == 2:
        gdc_launch_dependents()  # the weights are read: the next kernel's may stream in now
    if KWARPS:
        # The warps' shares of K summed across warps (through shared memory, in a fixed
        # order): [R, 128], one warp's fragments.
        acc = tl.sum(tl.reshape(acc, (R, WARPS, 128)), axis=1)
        e = tl.arange(0, 128)[None, :]
        j, g, t = fragment(e)
        rb = pid_n * R + i + 0 * e
        rb_ok = rb < num_row_blocks
    EO: tl.constexpr = 128 if KWARPS else E  # elements of a row-block slot in the result
    n_of = rb * 16 + g + 8 * (j // 2)  # [R, EO]: output row of C element j
    m_of = 2 * t + (j % 2)  # [1, EO]: activation row of C element j
    out_mask = rb_ok & (n_of < N) & (m_of < M)
    out_at = out_ptr + m_of * stride_om + n_of
    if SPLIT_K == 1:
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials as [S, programs, R, EO] fp32, each lane's four contiguous (16-byte
        # loads and stores), written only by lanes that hold result columns: 2t < M
        # (for odd M, column 2t + 1 repeats activation row 0 and is never stored).
        tile = R * EO
        split_stride = tl.num_programs(0) * tile
        part_at = part_ptr + pid_n * tile + i * EO + e
        part_mask = rb_ok & (2 * t < M)
        tl.store(part_at + pid_s * split_stride, acc, mask=part_mask)
        # As in w4a16/gemv.py: every partial written before the counter moves; the
        # program that sees SPLIT_K - 1 came last and reads the partials from L2 (.cg).
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            # RED partials at a time (a loop ptxas does not unroll): with all SPLIT_K loads
            # hoisted at once, two-row-block warps on 14 or more splits took 128-144
            # registers for this epilogue alone, against 70-72 for the loop.
            total = tl.full((R, EO), 0.0, tl.float32)
            RED: tl.constexpr = 8 // R
            for p0 in tl.range(0, SPLIT_K, RED, loop_unroll_factor=1):
                for q in tl.static_range(RED):
                    total += tl.load(
                        part_at + (p0 + q) * split_stride, mask=part_mask & (p0 + q < SPLIT_K),
                        other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
            tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def supports(x: torch.Tensor, weight: object) -> bool:
    """Whether w4a16_mma_gemv takes this call (else callers dequantize, or use the GEMV)."""
    return (
        isinstance(weight, Int4WeightMMA)
        and x.is_cuda
        and not is_interpreted(x)
        and has_mma_sync(x.device)
        and x.dtype in MAGIC
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and weight.group_size in MMA_GROUP_SIZES
    )


def w4a16_mma_gemv(
    x: torch.Tensor, weight: Int4WeightMMA, config: Mapping[str, int] | None = None
) -> torch.Tensor:
    """x [M, K] bf16/fp16 (1 <= M <= 8, on CUDA) @ W^T -> [M, N] in x's dtype.

    `config` (keys in mma_plan.plan_launch) overrides the launch the serving path would
    take; the tuner and the tests sweep it.
    """
    check_operands(x, weight.shape[1], weight.tiles.device)
    if not supports(x, weight):
        raise ValueError(
            f"w4a16_mma_gemv takes bf16/fp16 x of 1..{MAX_M} rows on CUDA (sm_80+, compiled, "
            f"not interpreted) and a group size in {MMA_GROUP_SIZES}; got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}, group {weight.group_size}"
        )
    return _launch(x, weight, config)


def _launch(
    x: torch.Tensor, weight: Int4WeightMMA, config: Mapping[str, int] | None
) -> torch.Tensor:
    """w4a16_mma_gemv once its checks passed (w4a16_mma_matmul comes here directly)."""
    n, k = weight.shape
    m = x.shape[0]
    if config is None:  # looked up on the module, so benchmarks can swap the cache out
        plan = mma_plan.default_plan(n, k, weight.group_size, x.dtype, x.device, weight.symmetric)
    else:
        plan = plan_launch(n, k, weight.group_size, x.dtype, x.device, weight.symmetric, config)
    pairs = int32_pairs(x)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    splits = plan.splits
    part = torch.empty(splits, plan.programs, *plan.tile, device=x.device) if splits > 1 else out
    _gemv_mma_kernel[(plan.programs, splits)](
        pairs,
        weight.tiles,
        weight.tiles.stride(0),
        weight.tiles.stride(1),
        part,
        split_counters(x.device),
        out,
        m,
        n,
        weight.tiles.shape[0],
        pairs.stride(0),
        out.stride(0),
        plan.num_groups,
        **plan.constexprs,
    )
    return out


def w4a16_mma_matmul(x: torch.Tensor, weight: Int4WeightMMA) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, over Int4WeightMMA.

    Up to 8 rows of bf16/fp16 on CUDA take the tensor-core GEMV; up to
    mma_gemm.MAX_M rows of a weight of MIN_WEIGHTS or more the GEMMs that
    dequantize in registers (the interpreter runs their dot kernel too); anything else
    (more rows, fp32 on a GPU) dequantizes W into a transient dense buffer
    (w4a16/mma_dequant.py) and runs torch.matmul, as w4a16_kn_matmul does past its GEMV.
    Triton kernels all: CPU tensors need TRITON_INTERPRET=1 (Int4Linear runs torch's own
    int4 kernel on a CPU instead).
    """
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if x.device != weight.tiles.device:
        raise ValueError(f"x on {x.device}, weight on {weight.tiles.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, n)
    if supports(x2, weight):
        return _launch(x2, weight, None).reshape(*lead, n)
    if mma_gemm.serves(x2, weight):
        return mma_gemm.w4a16_mma_gemm(x2, weight).reshape(*lead, n)
    return torch.matmul(x2, dequantize_mma(weight, x2.dtype)).reshape(*lead, n)
