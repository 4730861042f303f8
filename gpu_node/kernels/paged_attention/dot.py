"""Paged decode attention over fp8 or 16/32-bit KV pages, with the page-ownership check fused.

Shape letters: B sequences, Q query heads, H kv heads, G = Q // H query heads per kv head,
D head dim, P pages, S page size, M max pages per sequence, L context length, N splits.
The cache layout is drawn in `gpu_node/cache/kv_cache.py`.

    q             [B, Q, D]   one new token per sequence
    block_tables  [B, M] int32   page ids; only the first ceil(L / S) are read
    context_lens  [B] int32      tokens in the cache, the ones just written included
    page_owner    [P] int64      tag of the sequence owning each page
    seq_tags      [B] int64      tag of each sequence (`scheduler.block_manager.owner_tag`)

Integrity: a sequence must own every page it reads. Each program compares
`page_owner[page]` with the sequence's tag for every page of its slice of the context,
vectorised over the block table (loaded before its attention loop, compared after it,
so the loop carries no owner loads), and treats a page id outside [0, P) or a
context longer than its block table as a violation too (those are never loaded: the
attention loop range-checks every page it loads). A flagged sequence's output is
undefined (an in-range page it does not own is still read, so the check adds no
latency to the loads); the others are exact.

The kernel is split-K ("flash decoding"): grid (B, H, N), each program runs online
softmax over one slice of the context for the G query heads of one kv head, then a
second kernel merges the N partial results, so one long sequence still fills the GPU.
fp8 tiles (K and V as int8 codes of the rotated rows, kv_quant) are multiplied in fp16
(converted in registers, exactly) with the per-row scales applied to scores and
probabilities; q is rotated into the stored basis before the kernel and each output row
rotated back out of it by the merge. Measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TypeVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from gpu_node.cache.kv_quant import FP8_DTYPE, pool_strides, rotate
from gpu_node.kernels.combine import add_tl, maximum_tl
from gpu_node.kernels.kv_write.kernel import scale_offset_tl
from gpu_node.kernels.launch import launches_early
from gpu_node.kernels.paged_attention.mma import MmaTuning, paged_decode_attention_mma
from gpu_node.kernels.paged_attention.mma import supports as supports_mma
from gpu_node.kernels.paged_attention.reference import validate_decode_inputs
from gpu_node.kernels.paged_attention.split_merge import merge_splits, split_partials


@triton.jit
def _to_dot_tl(x, DOT_KIND: tl.constexpr):
    # The dtype is passed as a code: a tl.dtype argument trips the interpreter.
    if DOT_KIND == 1:
        y = x.to(tl.bfloat16)
    elif DOT_KIND == 2:
        y = x.to(tl.float16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _tile_to_dot_tl(x, IS_FP8: tl.constexpr, DOT_KIND: tl.constexpr):
    # A K or V tile as an MMA operand: fp8 pools hold int8 codes (kv_quant), which every
    # dot dtype holds exactly. To fp16, a plain cast is moved past the tile's shared-memory
    # load into the operand layout, where Triton then reads the tile one byte at a time;
    # as opaque PTX it stays in the load's own layout: per four codes a xor, two byte
    # permutes under the exponent of 1024 (c + 128 -> the fp16 1152 + c) and two f16x2
    # subtracts of 1152, as the mma kernel converts them (mma_asm).
    if IS_FP8 and DOT_KIND == 2:
        y = tl.inline_asm_elementwise(
            "{ .reg .b32 u, bias; xor.b32 u, $2, 0x80808080; mov.b32 bias, 0x64806480;"
            " prmt.b32 $0, u, 0x64646464, 0x4140; prmt.b32 $1, u, 0x64646464, 0x4342;"
            " sub.rn.f16x2 $0, $0, bias; sub.rn.f16x2 $1, $1, bias; }",
            "=r,=r,r",
            [x.to(tl.uint8, bitcast=True)],
            dtype=tl.float16,
            is_pure=False,  # a pure op would be moved like the cast
            pack=4,
        )
    elif IS_FP8:
        y = _to_dot_tl(x.to(tl.int8, bitcast=True), DOT_KIND)
    else:
        y = _to_dot_tl(x, DOT_KIND)
    return y


@triton.jit
def _attend_block_tl(
    block_start,
    end,
    running_max,  # [BLOCK_G] fp32
    running_sum,  # [BLOCK_G] fp32
    acc,  # [BLOCK_G, BLOCK_D] fp32
    num_bad,  # [BLOCK_N] int32
    full_pages,  # [BLOCK_N] int32 a full block's page ids, loaded by the caller
    full_k_scale,  # [BLOCK_N] bf16 a full block's K scales, if SCALES_GIVEN
    full_v_scale,  # [BLOCK_N] bf16 its V scales
    q,
    q_t,
    qk_scale,
    seq,
    kv_head,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    num_pages,
    max_pages,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,  # the pool's memory order (kv_quant.pool_strides)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_KIND: tl.constexpr,
    TOKENS_M: tl.constexpr,
    IS_PARTIAL: tl.constexpr,
    SCALES_GIVEN: tl.constexpr,  # full blocks: the caller loaded the scales (a block ahead)
):
    # One block of BLOCK_N tokens of online softmax. IS_PARTIAL: the block may run past
    # `end` or past the block table, so everything is masked; else all its tokens are
    # valid and nothing is (masks were about a fifth of the fp8 loop's instructions).
    tokens = block_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    dims = tl.arange(0, BLOCK_D)
    columns = tokens // PAGE_SIZE
    if IS_PARTIAL:
        is_valid = tokens < end
        has_column = is_valid & (columns < max_pages)
        pages = tl.load(block_tables_ptr + seq * stride_bt + columns, mask=has_column, other=-1)
        # The range check guards the K/V loads (memory safety) and flags; ownership
        # is checked per page for the whole split, outside this loop.
        is_loadable = has_column & (pages >= 0) & (pages < num_pages)
    else:
        is_valid = tokens >= 0  # all true
        pages = full_pages
        is_loadable = (pages >= 0) & (pages < num_pages)
        pages = tl.where(is_loadable, pages, 0)
    pages = pages.to(tl.int64)
    num_bad += (is_valid & (is_loadable == 0)).to(tl.int32)

    offsets = tokens % PAGE_SIZE
    # [BLOCK_N] each token's row in either memory order (the pointers are the kv head's)
    rows = pages * (PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM) + offsets * TOKEN_STRIDE
    kv_offsets = rows[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]
    scale_offsets = scale_offset_tl(pages, offsets, kv_head, NUM_KV_HEADS, PAGE_SIZE)
    if IS_PARTIAL or BLOCK_D != HEAD_DIM:
        kv_mask = is_loadable[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_offsets)
        v = tl.load(v_cache_ptr + kv_offsets)
    # fp8 codes convert exactly to every dot dtype; the row scales are applied to the
    # score columns and to the probabilities instead of to every K/V element.
    k = _tile_to_dot_tl(k, IS_FP8, DOT_KIND)
    v = _tile_to_dot_tl(v, IS_FP8, DOT_KIND)
    if TOKENS_M:  # noqa: SIM108 (a Triton constexpr branch)
        scores = tl.trans(tl.dot(k, q_t)) * qk_scale
    else:
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [G, BLOCK_N]
    if IS_FP8:
        if IS_PARTIAL:
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=is_loadable, other=0.0)
        elif SCALES_GIVEN:
            k_scale = full_k_scale
        else:
            k_scale = tl.load(k_scale_ptr + scale_offsets)
        scores = scores * k_scale.to(tl.float32)[None, :]
    if IS_PARTIAL:
        scores = tl.where(is_valid[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.reduce(scores, 1, maximum_tl))
    correction = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * correction + tl.reduce(probs, 1, add_tl)
    if IS_FP8:
        # The row scales go into the probabilities, relative to the block's largest
        # (so a 16-bit p * scale stays in [0, 1], never deep in fp16's subnormals);
        # the largest multiplies the block's product instead.
        if IS_PARTIAL:
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=is_loadable, other=0.0)
        elif SCALES_GIVEN:
            v_scale = full_v_scale
        else:
            v_scale = tl.load(v_scale_ptr + scale_offsets)
        v_scale = v_scale.to(tl.float32)
        v_max = tl.reduce(v_scale, 0, maximum_tl)
        v_max = tl.where(v_max > 0.0, v_max, 1.0)
        pv = tl.dot(_to_dot_tl(probs * (v_scale * (1.0 / v_max))[None, :], DOT_KIND), v)
        pv = pv * v_max
    else:
        pv = tl.dot(_to_dot_tl(probs, DOT_KIND), v)
    acc = acc * correction[:, None] + pv  # [G, D]
    return new_max, running_sum, acc, num_bad


@triton.jit
def _block_pages_tl(
    table_row, block_start, max_pages, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    # A full block's page ids, per token; columns past the table read as page 0 (the
    # prefetches run one or two blocks past the last full block).
    columns = (block_start + tl.arange(0, BLOCK_N)) // PAGE_SIZE
    return tl.load(table_row + columns, mask=columns < max_pages, other=0)


@triton.jit
def _block_scales_tl(
    k_scale_ptr,
    v_scale_ptr,
    pages,  # [BLOCK_N] the block's page ids
    block_start,
    kv_head,
    num_pages,
    NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A full block's K and V scales ([P, H, S] layout); an out-of-range page id reads
    # page 0's (the block flags it when it loads K/V).
    pages = tl.where((pages >= 0) & (pages < num_pages), pages, 0).to(tl.int64)
    offsets = (block_start + tl.arange(0, BLOCK_N)) % PAGE_SIZE
    scale_offsets = scale_offset_tl(pages, offsets, kv_head, NUM_KV_HEADS, PAGE_SIZE)
    return tl.load(k_scale_ptr + scale_offsets), tl.load(v_scale_ptr + scale_offsets)


@triton.jit
def _owners_tl(table_row, page_owner_ptr, tag, column, last, num_pages, CHECK_BLOCK: tl.constexpr):
    # Block-table columns [column, column + CHECK_BLOCK) below `last`: their page ids'
    # owners, and which columns are used and which ids in range.
    columns = column + tl.arange(0, CHECK_BLOCK)
    is_used = columns < last
    pages = tl.load(table_row + columns, mask=is_used, other=0)
    is_in_range = (pages >= 0) & (pages < num_pages)
    owners = tl.load(
        page_owner_ptr + tl.where(is_in_range, pages, 0).to(tl.int64), mask=is_used, other=tag
    )
    return is_used, is_in_range, owners


@triton.jit
def _violations_tl(is_used, is_in_range, owners, tag):
    # 1 if a used column's page is out of range or owned by another tag, else 0.
    is_bad = is_used & ((is_in_range & (owners == tag)) == 0)
    return tl.reduce(is_bad.to(tl.int32), 0, maximum_tl)


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    page_owner_ptr,
    seq_tags_ptr,
    part_max_ptr,  # [B, Q, N] fp32 running max (log2 domain)
    part_sum_ptr,  # [B, Q, N] fp32 softmax denominator
    part_acc_ptr,  # [B, Q, N, D] fp32 unnormalised output
    part_bad_ptr,  # [B, N] int8 ownership violation in this split
    qk_scale,  # sm_scale * log2(e)
    split_size,  # tokens per split, a multiple of BLOCK_N
    num_pages,
    max_pages,
    stride_qb,
    stride_qh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,
    HEAD_STRIDE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    CHECK_OWNER: tl.constexpr,
    DOT_KIND: tl.constexpr,
    TOKENS_M: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,  # fp8 full blocks: page ids one block ahead
    PREFETCH_SCALES: tl.constexpr,  # fp8 full blocks: page ids two ahead, scales one ahead
    HELD_BLOCK: tl.constexpr,  # block-table columns checked across the attention loop
    CHECK_BLOCK: tl.constexpr,  # block-table columns per step of the check after it
    LAUNCH_MERGE: tl.constexpr,  # let the merge grid launch now (merge_splits, early)
):
    if LAUNCH_MERGE:
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * split_size
    end = tl.minimum(start + split_size, context_len)

    # The ownership check covers the split's block-table columns [first, last). The
    # first HELD_BLOCK columns' loads are issued here and compared after the attention
    # loop, so their latency hides behind it (HELD_BLOCK is small: the owners stay in
    # registers through the loop); the rest, if any, are checked after the loop in
    # chunks of CHECK_BLOCK. The loop itself carries no owner loads.
    table_row = block_tables_ptr + seq * stride_bt
    first = start // PAGE_SIZE
    last = tl.minimum((end + PAGE_SIZE - 1) // PAGE_SIZE, max_pages)
    tag = tl.load(seq_tags_ptr + seq)
    if CHECK_OWNER:
        check_is_used, check_in_range, check_owners = _owners_tl(
            table_row, page_owner_ptr, tag, first, last, num_pages, HELD_BLOCK
        )

    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + groups  # [BLOCK_G] query heads of this kv head
    q_mask = (groups < GROUP)[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0
    )
    q = _to_dot_tl(q, DOT_KIND)  # [BLOCK_G, BLOCK_D]
    q_t = tl.trans(q)  # [BLOCK_D, BLOCK_G], for TOKENS_M

    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    num_bad = tl.full([BLOCK_N], 0, tl.int32)
    tail_start = start
    # this kv head's rows: its offset in a page, once (in the block loop it cost registers)
    k_head_ptr = k_cache_ptr + kv_head * HEAD_STRIDE
    v_head_ptr = v_cache_ptr + kv_head * HEAD_STRIDE
    if IS_FP8:
        # Full blocks first, with no masks: a page id out of range is clamped to page 0
        # for the load (and flagged), so every load is in bounds. Then the last, partial
        # block. (16-bit pages keep one masked loop: split, they measured up to 15%
        # slower with the ownership check on, docs/benchmarks.md.)
        num_full = tl.maximum(tl.minimum(end, max_pages * PAGE_SIZE) - start, 0) // BLOCK_N
        tail_start = start + num_full * BLOCK_N
        # PREFETCH_PAGES: each block's page ids are loaded during the block before, so
        # that its K/V copies never wait on the block-table load (on an H200 that wait,
        # not the bytes, set the fp8 loop's pace; the last load reads one block past
        # the full ones, masked to the table). Page ids are per token: a block need not
        # start on a page boundary (page 48, block 64).
        # PREFETCH_SCALES: page ids two blocks ahead and each block's scales one block
        # ahead, so that neither the scale loads nor their addresses are waited for.
        next_pages = tl.arange(0, BLOCK_N)  # unused without a prefetch
        if PREFETCH_PAGES or PREFETCH_SCALES:
            next_pages = _block_pages_tl(table_row, start, max_pages, PAGE_SIZE, BLOCK_N)
        after_pages = next_pages  # unused without the scale prefetch
        k_scales = tl.full([BLOCK_N], 0.0, k_scale_ptr.dtype.element_ty)  # likewise
        v_scales = k_scales
        if PREFETCH_SCALES:
            after_pages = _block_pages_tl(table_row, start + BLOCK_N, max_pages, PAGE_SIZE, BLOCK_N)
            k_scales, v_scales = _block_scales_tl(
                k_scale_ptr, v_scale_ptr, next_pages, start, kv_head, num_pages,
                NUM_KV_HEADS, PAGE_SIZE, BLOCK_N,
            )  # fmt: skip
        for block_start in range(start, tail_start, BLOCK_N):
            k_block_scales = k_scales
            v_block_scales = v_scales
            if PREFETCH_SCALES:
                pages = next_pages
                next_pages = after_pages
                after_pages = _block_pages_tl(
                    table_row, block_start + 2 * BLOCK_N, max_pages, PAGE_SIZE, BLOCK_N
                )
                k_scales, v_scales = _block_scales_tl(
                    k_scale_ptr, v_scale_ptr, next_pages, block_start + BLOCK_N, kv_head,
                    num_pages, NUM_KV_HEADS, PAGE_SIZE, BLOCK_N,
                )  # fmt: skip
            elif PREFETCH_PAGES:
                pages = next_pages
                next_pages = _block_pages_tl(
                    table_row, block_start + BLOCK_N, max_pages, PAGE_SIZE, BLOCK_N
                )
            else:
                pages = _block_pages_tl(table_row, block_start, max_pages, PAGE_SIZE, BLOCK_N)
            running_max, running_sum, acc, num_bad = _attend_block_tl(
                block_start=block_start, end=end, running_max=running_max,
                running_sum=running_sum, acc=acc, num_bad=num_bad, full_pages=pages,
                full_k_scale=k_block_scales, full_v_scale=v_block_scales, q=q,
                q_t=q_t, qk_scale=qk_scale, seq=seq, kv_head=kv_head,
                k_cache_ptr=k_head_ptr, v_cache_ptr=v_head_ptr, k_scale_ptr=k_scale_ptr,
                v_scale_ptr=v_scale_ptr,
                block_tables_ptr=block_tables_ptr, num_pages=num_pages,
                max_pages=max_pages, stride_bt=stride_bt, NUM_KV_HEADS=NUM_KV_HEADS,
                HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, TOKEN_STRIDE=TOKEN_STRIDE,
                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IS_FP8=IS_FP8, DOT_KIND=DOT_KIND,
                TOKENS_M=TOKENS_M, IS_PARTIAL=False, SCALES_GIVEN=PREFETCH_SCALES,
            )  # fmt: skip
    for block_start in range(tail_start, end, BLOCK_N):
        running_max, running_sum, acc, num_bad = _attend_block_tl(
            block_start=block_start, end=end, running_max=running_max, running_sum=running_sum,
            acc=acc, num_bad=num_bad, full_pages=num_bad, full_k_scale=num_bad,  # unused
            full_v_scale=num_bad, q=q, q_t=q_t, qk_scale=qk_scale,
            seq=seq, kv_head=kv_head, k_cache_ptr=k_head_ptr, v_cache_ptr=v_head_ptr,
            k_scale_ptr=k_scale_ptr, v_scale_ptr=v_scale_ptr,
            block_tables_ptr=block_tables_ptr, num_pages=num_pages, max_pages=max_pages,
            stride_bt=stride_bt, NUM_KV_HEADS=NUM_KV_HEADS, HEAD_DIM=HEAD_DIM,
            PAGE_SIZE=PAGE_SIZE, TOKEN_STRIDE=TOKEN_STRIDE, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            IS_FP8=IS_FP8, DOT_KIND=DOT_KIND, TOKENS_M=TOKENS_M, IS_PARTIAL=True,
            SCALES_GIVEN=False,
        )  # fmt: skip

    head_mask = groups < GROUP
    part = (seq * NUM_KV_HEADS * GROUP + heads) * NUM_SPLITS + split  # [BLOCK_G]
    tl.store(part_max_ptr + part, running_max, mask=head_mask)
    tl.store(part_sum_ptr + part, running_sum, mask=head_mask)
    tl.store(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        acc,
        mask=head_mask[:, None] & dim_mask[None, :],
    )
    # Every kv head checks the same pages; kv head 0 reports.
    is_bad = (tl.reduce(num_bad, 0, maximum_tl) > 0) | (context_len > max_pages * PAGE_SIZE)
    if CHECK_OWNER:
        split_bad = _violations_tl(check_is_used, check_in_range, check_owners, tag)
        for column in range(first + HELD_BLOCK, last, CHECK_BLOCK):
            is_used, is_in_range, owners = _owners_tl(
                table_row, page_owner_ptr, tag, column, last, num_pages, CHECK_BLOCK
            )
            split_bad = tl.maximum(split_bad, _violations_tl(is_used, is_in_range, owners, tag))
        is_bad = is_bad | (split_bad > 0)
    tl.store(part_bad_ptr + seq * NUM_SPLITS + split, is_bad.to(tl.int8), mask=kv_head == 0)


@dataclass(frozen=True)
class DecodeTile:
    """Tile defaults of the decode kernel (`decode_tile_config`)."""

    block_n: int  # tokens per step
    programs_per_sm: int  # the split count aims at this many programs per multiprocessor
    tokens_m: bool  # QK^T as K q^T, the tokens the MMA's M side
    max_registers: int  # per-thread register cap, 0 for none
    num_stages: int = 2  # software pipeline depth of the K/V loads
    prefetch_pages: bool = False  # fp8 full blocks: each block's page ids a block ahead
    prefetch_scales: bool = False  # fp8 full blocks: page ids two blocks ahead, scales one


def decode_tile_config(is_fp8: bool, head_dim: int) -> DecodeTile:
    """The decode kernel's tile defaults, measured on an H200 (docs/benchmarks.md).

    16-bit pages: 64-token blocks, 4 programs per multiprocessor. fp8 pages move half
    the bytes per token: head dim 64, 128-token blocks, 8 programs per multiprocessor,
    each block's page ids loaded a block ahead and three pipeline stages (1.06-1.08x
    over two stages without the prefetch at 32K context); wider heads, 64-token blocks
    with the tokens as the MMA's M side, 16 programs per multiprocessor and at most 128
    registers, so that 4 programs fit on a multiprocessor instead of 3, page ids two
    blocks ahead and scales one (1-2% over no prefetch; the page-id prefetch alone
    gained nothing there and a third stage lost 16-20%).
    """
    if not is_fp8:
        return DecodeTile(block_n=64, programs_per_sm=4, tokens_m=False, max_registers=0)
    if head_dim <= 64:
        return DecodeTile(
            block_n=128, programs_per_sm=8, tokens_m=False, max_registers=0, num_stages=3,
            prefetch_pages=True,
        )  # fmt: skip
    return DecodeTile(
        block_n=64, programs_per_sm=16, tokens_m=True, max_registers=128, prefetch_scales=True
    )


@dataclass(frozen=True)
class DotTuning:
    """Launch options of the tl.dot kernel, for tests and sweeps; passing one to
    `paged_decode_attention` picks this kernel. None takes the measured default
    (`decode_tile_config`, `default_dot_dtype`).

    `dot_dtype`: the operand dtype of the two matrix products. `block_n`: tokens a step.
    `target_programs`: the split count aims at this many programs (default: the tile's
    programs per multiprocessor times the multiprocessors). `tokens_m`: QK^T computed as
    K q^T with the tokens as the MMA's M side. `max_registers`: a per-thread register cap,
    0 for none. `prefetch_pages`: fp8 full blocks load their page ids a block ahead;
    `prefetch_scales`: page ids two blocks ahead and the scales one, overriding
    `prefetch_pages`.
    """

    dot_dtype: torch.dtype | None = None
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int | None = None
    target_programs: int | None = None
    tokens_m: bool | None = None
    max_registers: int | None = None
    prefetch_pages: bool | None = None
    prefetch_scales: bool | None = None


def paged_decode_attention(
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
    tuning: DotTuning | MmaTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over the paged cache: (out [B, Q, D] in q's dtype, violations [B]).

    `max_context_len` (the scheduler knows it) sizes the split grid without reading
    `context_lens` back from the device; it must be >= every context length.
    `check_owner=False` skips the ownership comparison.

    The kernel: without `tuning`, the register-resident fp8 kernel of
    paged_attention/mma.py wherever it takes the call (`paged_attention_mma.supports`;
    1.57-1.76x faster than bf16 pages at 32K context and batch 8-64 on an H200, where the
    tl.dot kernel is slower than bf16 pages), else this module's tl.dot kernel, each with
    its measured launch. A `DotTuning` runs the tl.dot kernel, an `MmaTuning` the mma
    kernel, with the options it gives.
    """
    if tuning is not None and not isinstance(tuning, DotTuning | MmaTuning):
        raise ValueError(f"tuning must be a DotTuning, an MmaTuning or None, got {tuning!r}")
    if isinstance(tuning, MmaTuning) or (
        tuning is None and supports_mma(q, k_cache, v_cache, k_scale, v_scale)
    ):
        return paged_decode_attention_mma(
            q, k_cache, v_cache, block_tables, context_lens, page_owner, seq_tags, sm_scale,
            k_scale, v_scale, max_context_len=max_context_len, check_owner=check_owner,
            tuning=tuning,
        )  # fmt: skip
    tuning = DotTuning() if tuning is None else tuning
    num_pages, page_size, num_kv_heads, head_dim = validate_decode_inputs(
        q, k_cache, v_cache, block_tables, context_lens, page_owner, seq_tags, k_scale, v_scale
    )
    batch, num_heads, _ = q.shape
    out = torch.empty_like(q)
    violations = torch.empty(batch, dtype=torch.bool, device=q.device)  # merge_splits sets all
    if batch == 0:
        return out, violations
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    is_fp8 = k_cache.dtype == FP8_DTYPE
    if is_fp8:
        q = rotate(q)  # into the basis fp8 pools keep rows in (kv_quant); merge_splits rotates back
    tile = decode_tile_config(is_fp8, head_dim)
    block_n = _given(tuning.block_n, tile.block_n)
    target_programs = tuning.target_programs
    if target_programs is None:
        target_programs = tile.programs_per_sm * _num_multiprocessors(q.device)
    max_registers = _given(tuning.max_registers, tile.max_registers)
    # Enough splits to fill the GPU, each at least one BLOCK_N and a multiple of it.
    num_blocks = max(1, math.ceil(max_context_len / block_n))
    num_splits = min(num_blocks, max(1, math.ceil(target_programs / (batch * num_kv_heads))))
    split_size = math.ceil(num_blocks / num_splits) * block_n
    num_splits = max(1, math.ceil(max_context_len / split_size))

    part_max, part_sum, part_acc, part_bad = split_partials(
        batch, num_heads, num_splits, head_dim, q.device
    )
    dot_dtype = _given(tuning.dot_dtype, default_dot_dtype(q, k_cache))
    early = launches_early(q.device)
    token_stride, head_stride = pool_strides(k_cache)  # validated: one of the two orders
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    group = num_heads // num_kv_heads
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale if is_fp8 else k_cache,  # never read unless fp8
        v_scale if is_fp8 else v_cache,
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
        BLOCK_N=block_n,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IS_FP8=is_fp8,
        CHECK_OWNER=check_owner,
        DOT_KIND=_DOT_KINDS[dot_dtype],
        TOKENS_M=_given(tuning.tokens_m, tile.tokens_m),
        PREFETCH_PAGES=_given(tuning.prefetch_pages, tile.prefetch_pages),
        PREFETCH_SCALES=_given(tuning.prefetch_scales, tile.prefetch_scales),
        HELD_BLOCK=_HELD_BLOCK,
        CHECK_BLOCK=_CHECK_BLOCK,
        LAUNCH_MERGE=early,
        num_warps=tuning.num_warps,
        num_stages=_given(tuning.num_stages, tile.num_stages),
        **({"maxnreg": max_registers} if max_registers else {}),
    )
    merge_splits(part_max, part_sum, part_acc, part_bad, out, violations, early, rotate=is_fp8)
    return out, violations


_T = TypeVar("_T")
_DOT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # see _to_dot_tl
# Ownership check: columns whose owners are loaded before the attention loop and held
# through it (64: 1024 tokens at S = 16; with 256, bf16 pages at head dim 128 lost up to
# 18% to the registers held), then chunks of the rest after the loop.
_HELD_BLOCK = 64
_CHECK_BLOCK = 256


def default_dot_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The operand dtype of the two matrix products when the caller names none.

    fp8 pages: fp16 on the GPU (fp16 holds every int8 code exactly, and q's bf16
    values of ordinary range; it measured 1.2x faster than bf16 operands on an H200,
    docs/benchmarks.md).
    16-bit pages: q's dtype when the pages have it. Else, and always off the GPU
    (the Triton interpreter's 16-bit dot is wrong), fp32. Probabilities are rounded
    to it too, as flash attention does.
    """
    if q.device.type != "cuda" or q.dtype == torch.float32:
        return torch.float32
    if k_cache.dtype == FP8_DTYPE:
        return torch.float16
    return q.dtype if k_cache.dtype == q.dtype else torch.float32


def _given(option: _T | None, default: _T) -> _T:
    return default if option is None else option


@functools.cache
def _num_multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: fewer splits, faster tests
