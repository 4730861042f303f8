"""Fused INT4 MoE: grouped W4A16 GEMMs over experts, routing weight applied in the kernel.

Letters: T tokens, H hidden, E experts, K top-k, I expert hidden, BM rows per block.

    x [T, H] --router--> topk_ids, topk_weights [T, K]
      group_by_expert: assignments (token*K + slot) sorted by expert, padded to BM
      GEMM 1 (this kernel): h[a] = x[a // K] @ W13[e]^T           [T*K, 2I]
      act = silu(h[:, :I]) * h[:, I:]                              [T*K, I]
      GEMM 2 (this kernel): y[a] = w[a] * (act[a] @ W2[e]^T)       [T*K, H]
      out[t] = sum over slots of y[t*K + slot]                     [T, H]

One program computes a [BM, BLOCK_N] tile for one block of assignments, all of
one expert e: it gathers the block's activation rows, walks the expert's INT4
weight with the same per-group step as the dense W4A16 kernel, multiplies by
the assignment's routing weight (GEMM 2) and scatters rows back to their
assignments. Blocks past the used ones (expert id == E) exit at once, so the
launch grid never waits on the GPU for the real number of blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_node.kernels.w4a16.dot import int4_group_step, is_interpreted
from gpu_node.models.moe_routing import ExpertBlocks, Routing, group_by_expert
from gpu_node.quant.int4 import Int4Weight


@triton.jit
def _fused_moe_int4_kernel(
    a_ptr,
    packed_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    topk_weights_ptr,
    num_assignments,
    num_experts,
    N,
    K,
    stride_am,
    stride_ak,
    stride_pe,
    stride_pn,
    stride_pk,
    stride_se,
    stride_sn,
    stride_sg,
    stride_om,
    stride_on,
    A_ROW_DIV: tl.constexpr,  # K (top-k) when A is the token matrix, 1 when A is per assignment
    MUL_ROUTED_WEIGHT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_b)
    if expert < num_experts:
        offs_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m)  # assignments of the block; sentinel = padding
        valid = ids < num_assignments
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = valid[None, :]
        mask_n = (offs_n < N)[:, None]
        a_cols = a_ptr + (ids // A_ROW_DIV)[None, :].to(tl.int64) * stride_am
        w_rows = packed_ptr + expert.to(tl.int64) * stride_pe + offs_n[:, None] * stride_pn
        s_rows = expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)  # out^T
        for step in range(0, K // BLOCK_K):
            group = step // (GROUP_SIZE // BLOCK_K)
            scale = tl.load(scales_ptr + s_rows + group * stride_sg, mask=mask_n)
            min_ = tl.load(mins_ptr + s_rows + group * stride_sg, mask=mask_n)
            acc = int4_group_step(
                acc,
                a_cols,
                mask_m,
                stride_ak,
                w_rows,
                mask_n,
                stride_pk,
                scale.to(tl.float32),
                min_.to(tl.float32),
                step,
                BLOCK_K,
                DOT_FP32,
            )
        if MUL_ROUTED_WEIGHT:
            weight = tl.load(topk_weights_ptr + ids, mask=valid, other=0.0)
            acc = acc * weight[None, :]
        out = out_ptr + ids[None, :].to(tl.int64) * stride_om + offs_n[:, None] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m & mask_n)


def _grouped_gemm(
    a: torch.Tensor,
    w: Int4Weight,
    blocks: ExpertBlocks,
    topk_weights: torch.Tensor | None,
    a_row_div: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out[a] = (routing weight *) A[a // a_row_div] @ W[expert(a)]^T for every assignment a."""
    num_experts, n, k = w.shape
    out = torch.empty(blocks.num_assignments, n, device=a.device, dtype=out_dtype)
    block_n = 64
    grid = (blocks.block_experts.numel(), triton.cdiv(n, block_n))
    weights = topk_weights if topk_weights is not None else out  # unread when not multiplying
    _fused_moe_int4_kernel[grid](
        a,
        w.packed,
        w.scales,
        w.mins,
        out,
        blocks.sorted_ids,
        blocks.block_experts,
        weights,
        blocks.num_assignments,
        num_experts,
        n,
        k,
        a.stride(0),
        a.stride(1),
        w.packed.stride(0),
        w.packed.stride(1),
        w.packed.stride(2),
        w.scales.stride(0),
        w.scales.stride(1),
        w.scales.stride(2),
        out.stride(0),
        out.stride(1),
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        GROUP_SIZE=w.group_size,
        BLOCK_M=blocks.block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(w.group_size, 128),
        DOT_FP32=is_interpreted(a) or a.dtype == torch.float32,
        num_warps=4,
        num_stages=4,
    )
    return out


def fused_moe_int4(
    x: torch.Tensor, w13: Int4Weight, w2: Int4Weight, routing: Routing, block_m: int = 16
) -> torch.Tensor:
    """Routed experts with INT4 weights: x [T, H] -> [T, H] in x's dtype.

    w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I].
    """
    t, h = x.shape
    num_experts, two_i, h13 = w13.shape
    if h13 != h or w2.shape != (num_experts, h, two_i // 2):
        raise ValueError(f"x [{t}, {h}] does not fit w13 {w13.shape} and w2 {w2.shape}")
    if t == 0:
        return x.clone()
    top_k = routing.topk_ids.shape[1]
    blocks = group_by_expert(routing.topk_ids, num_experts, block_m)
    # The interpreter's bf16 stores truncate, so it keeps every intermediate in fp32.
    inner_dtype = torch.float32 if is_interpreted(x) else x.dtype
    x = x.contiguous()
    gate_up = _grouped_gemm(x, w13, blocks, None, top_k, inner_dtype)  # [T*K, 2I]
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(x.dtype)  # [T*K, I]
    weights = routing.topk_weights.reshape(-1).float().contiguous()  # [T*K]
    y = _grouped_gemm(act, w2, blocks, weights, 1, inner_dtype)  # [T*K, H]
    return y.view(t, top_k, h).float().sum(dim=1).to(x.dtype)
