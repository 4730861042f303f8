"""Int4WeightMMA -> dense W^T, for the matmuls the tensor-core GEMV does not take.

Letters: N out features, K in features, G group size (32, 64 or 128), T = max(G, 64)
k values a tile.

One program per (row block, step) tile: its 16 x T values, computed in fp32 as
scale * q + min (a symmetric weight's min being -8 * scale) and stored into W^T [K, N].
Plain tl operations only, so the interpreter runs it too (the CPU tests, and
torch.matmul past 8 rows on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_node.kernels.w4a16 import is_interpreted
from gpu_node.quant.int4 import Int4WeightMMA


@triton.jit
def _dequant_mma_kernel(
    tiles_ptr,  # int32 [N16 / 16, K / T, 2T + 16 T / G] (symmetric: 8 T / G), T = max(G, 64)
    stride_tr,  # along row blocks and steps, in int32; the last stride is 1
    stride_tg,
    out_ptr,  # [K, N]: W^T, dense
    N,
    GROUP_SIZE: tl.constexpr,
    SYMMETRIC: tl.constexpr,  # the tiles hold scales alone (every min -8 * scale)
):
    tl.static_assert(GROUP_SIZE == 32 or GROUP_SIZE == 64 or GROUP_SIZE == 128)
    STEP: tl.constexpr = 64 if GROUP_SIZE < 64 else GROUP_SIZE
    rb = tl.program_id(0)
    step = tl.program_id(1)
    tile = tiles_ptr + rb * stride_tr + step * stride_tg
    # The tile's words taken in the order (chunk, t, s, g), g fastest, so neighbouring
    # lanes store neighbouring output rows n = 16rb + g (+ 8): eight n per k.
    v = tl.arange(0, 2 * STEP)
    chunk = v // 128
    t = (v // 32) % 4
    s = (v // 8) % 4
    g = v % 8
    words = tl.load(tile + chunk * 128 + (4 * g + t) * 4 + s)  # lane 4g + t, step s
    # Groups of 32: steps 0-1 of every lane in the first group, 2-3 in the second.
    if GROUP_SIZE == 32:  # noqa: SIM108 (a constexpr branch of the kernel)
        k_in = (s // 2) * 32 + t * 8 + (s % 2) * 4
    else:
        k_in = chunk * 64 + t * 16 + s * 4  # within the step
    kb = step * STEP + k_in
    group_in = k_in // GROUP_SIZE  # 0, or 1 for the second g32 group of a chunk
    PER_GROUP: tl.constexpr = 8 if SYMMETRIC else 16  # int32 of scales (and mins) a group
    PER_ROW: tl.constexpr = 1 if SYMMETRIC else 2  # fp16 a row and group
    sm = (tile + 2 * STEP + PER_GROUP * group_in).to(tl.pointer_type(tl.float16))
    sm += g * 2 * PER_ROW
    for hr in tl.static_range(2):  # rows g, g + 8
        scale = tl.load(sm + PER_ROW * hr).to(tl.float32)
        if SYMMETRIC:  # noqa: SIM108 (a constexpr branch of the kernel)
            min_ = scale * -8.0
        else:
            min_ = tl.load(sm + 2 * hr + 1).to(tl.float32)
        n = rb * 16 + g + 8 * hr
        for h in tl.static_range(2):
            for e in tl.static_range(2):  # nibble hr + 2h + 4e holds W[n, kb + 2h + e]
                q = (words >> (4 * (hr + 2 * h + 4 * e))) & 15
                value = q.to(tl.float32) * scale + min_
                at = out_ptr + (kb + 2 * h + e) * N + n
                tl.store(at, value.to(out_ptr.dtype.element_ty), mask=n < N)


def dequantize_mma(weight: Int4WeightMMA, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] dense in `dtype` (computed in fp32: scale * q + min), by one kernel."""
    n, k = weight.shape
    tiles = weight.tiles  # checked by Int4WeightMMA itself
    # The interpreter's fp32 -> bf16 store truncates: keep fp32 there and round in torch.
    interpreted = is_interpreted(tiles)
    out = torch.empty(k, n, device=tiles.device, dtype=torch.float32 if interpreted else dtype)
    row_blocks, num_steps = tiles.shape[:2]
    _dequant_mma_kernel[(row_blocks, num_steps)](
        tiles,
        tiles.stride(0),
        tiles.stride(1),
        out,
        n,
        GROUP_SIZE=weight.group_size,
        SYMMETRIC=weight.symmetric,
    )
    return out.to(dtype)
