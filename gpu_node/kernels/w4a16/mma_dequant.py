"""Int4WeightMMA -> dense W, for the matmuls the tensor-core GEMV and GEMM do not take.

Letters: N out features, K in features, G group size (32, 64 or 128), T = max(G, 64)
k values a tile.

One program per BLOCKS row blocks and step: their 16 x T values each, computed in fp32 as
scale * q + min (a symmetric weight's min being -8 * scale) and stored into W [N, K].
Lane 4g + t of a chunk holds the words of rows g and g + 8 at k = 16t .. 16t + 15 of the
chunk (groups of 32: 8t .. 8t + 7 and 32 + 8t .. 32 + 8t + 7, int4.py), so each lane
stores runs of contiguous k of two rows and a warp's stores fill whole sectors. The
result is returned as the W^T view torch.matmul takes. Plain tl operations only, so the
interpreter runs it too (the CPU tests, and torch.matmul past the GEMM on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_node.kernels.w4a16.dot import is_interpreted
from gpu_node.quant.int4 import Int4WeightMMA

BLOCKS = 4  # row blocks a program, as many warps


@triton.jit
def _dequant_mma_kernel(
    tiles_ptr,  # int32 [N16 / 16, K / T, 2T + 16 T / G] (symmetric: 8 T / G), T = max(G, 64)
    stride_tr,  # along row blocks and steps, in int32; the last stride is 1
    stride_tg,
    out_ptr,  # [N, K]: W, dense
    N,
    K,
    num_row_blocks,
    GROUP_SIZE: tl.constexpr,
    SYMMETRIC: tl.constexpr,  # the tiles hold scales alone (every min -8 * scale)
    BLOCKS: tl.constexpr,
):
    tl.static_assert(GROUP_SIZE == 32 or GROUP_SIZE == 64 or GROUP_SIZE == 128)
    STEP: tl.constexpr = 64 if GROUP_SIZE < 64 else GROUP_SIZE
    CPG: tl.constexpr = STEP // 64  # chunks a step
    PER_GROUP: tl.constexpr = 8 if SYMMETRIC else 16  # int32 of scales (and mins) a group
    PER_ROW: tl.constexpr = 1 if SYMMETRIC else 2  # fp16 a row and group
    step = tl.program_id(1)
    # Rows (row block, chunk, lane 4g + t) of the program, each a lane's four words
    # (k16 steps s), unpacked into its 16 values c = 4s + 2h + e of one of its two rows
    # (word nibbles h and e).
    lane = tl.arange(0, BLOCKS * CPG * 32)[:, None]
    s = tl.arange(0, 4)[None, :]
    rb = tl.program_id(0) * BLOCKS + lane // (CPG * 32)
    rb_ok = rb < num_row_blocks
    chunk = (lane // 32) % CPG
    g = (lane // 4) % 8
    t = lane % 4
    tile = tiles_ptr + rb.to(tl.int64) * stride_tr + step.to(tl.int64) * stride_tg
    words = tl.load(tile + chunk * 128 + (lane % 32) * 4 + s, mask=rb_ok, other=0)  # [L, 4]
    c = tl.arange(0, 16)[None, :]
    if GROUP_SIZE == 32:  # steps 0-1 in the chunk's first group, 2-3 in its second
        k_in = (c // 8) * 32 + t * 8 + c % 8
        group_in = s // 2
    else:
        k_in = chunk * 64 + t * 16 + c
        group_in = 0 * lane  # [L, 1]: one group a step
    sm = (tile + 2 * STEP + PER_GROUP * group_in).to(tl.pointer_type(tl.float16))
    sm += g * 2 * PER_ROW  # [L, 4]
    he = tl.arange(0, 4)[None, None, :]  # 2h + e
    for hr in tl.static_range(2):  # rows g, g + 8
        scale = tl.load(sm + PER_ROW * hr, mask=rb_ok, other=0.0).to(tl.float32)
        if SYMMETRIC:
            min_ = scale * -8.0
        else:
            min_ = tl.load(sm + PER_ROW * hr + 1, mask=rb_ok, other=0.0).to(tl.float32)
        # nibble hr + 2h + 4e holds W[n, kb + 2h + e]: shift 4 hr + 8h + 16e
        q = (words[:, :, None] >> (4 * hr + 8 * (he // 2) + 16 * (he % 2))) & 15  # [L, 4, 4]
        value = q.to(tl.float32) * scale[:, :, None] + min_[:, :, None]
        value = tl.reshape(value, (BLOCKS * CPG * 32, 16))
        n = rb * 16 + g + 8 * hr
        at = out_ptr + n.to(tl.int64) * K + step * STEP + k_in
        tl.store(at, value.to(out_ptr.dtype.element_ty), mask=rb_ok & (n < N))


def dequantize_mma(weight: Int4WeightMMA, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in `dtype` (computed in fp32: scale * q + min), by one kernel: the
    transposed view of a dense W [N, K], which torch.matmul takes as it is."""
    n, k = weight.shape
    tiles = weight.tiles  # checked by Int4WeightMMA itself
    # The interpreter's fp32 -> bf16 store truncates: keep fp32 there and round in torch.
    interpreted = is_interpreted(tiles)
    out = torch.empty(n, k, device=tiles.device, dtype=torch.float32 if interpreted else dtype)
    row_blocks, num_steps = tiles.shape[:2]
    _dequant_mma_kernel[(triton.cdiv(row_blocks, BLOCKS), num_steps)](
        tiles,
        tiles.stride(0),
        tiles.stride(1),
        out,
        n,
        k,
        row_blocks,
        GROUP_SIZE=weight.group_size,
        SYMMETRIC=weight.symmetric,
        BLOCKS=BLOCKS,
        num_warps=BLOCKS,
    )
    return out.to(dtype).t()
