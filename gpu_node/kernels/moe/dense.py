"""Float MoE experts on the GPU without waiting for the host: one GEMV per assignment.

Letters: T tokens, H hidden, E experts, K top-k, A = T * K assignments (a = t * K + k), I
expert hidden.

    GEMM 1: h[a] = x[a // K] @ W13[e(a)]^T                 [A, 2I]
    act = silu(h[:, :I]) * h[:, I:]                        [A, I]
    GEMM 2: y[a] = w[a] * (act[a] @ W2[e(a)]^T)            [A, H]
    out[t] = sum over k of y[t * K + k]                    [T, H]

Each program computes BLOCK_N outputs of one assignment: it reads its expert id on the GPU,
walks that expert's rows in fp32 and stores in the activations' dtype (where the reference's
bf16 matmuls round). Nothing is sorted or counted on the host, so a decode step that uses it
can be recorded in a CUDA graph; the reference loop (moe_experts_ref) asks the host which
experts received tokens. Two assignments of one expert read its weight twice, so this is
for decode batches: at one token and top-8 it reads exactly the eight experts' weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_node.models.moe_routing import Routing

BLOCK_N = 32
BLOCK_K = 128


@triton.jit
def _expert_gemv_kernel(
    x_ptr,  # [rows, K_IN]: tokens (GEMM 1) or assignments (GEMM 2)
    w_ptr,  # [E, N, K_IN]
    ids_ptr,  # int64 [A]: the expert of each assignment
    scale_ptr,  # fp32 [A]: routing weights (GEMM 2), unread without SCALED
    y_ptr,  # [A, N]
    N,
    K_IN,
    stride_xr,
    stride_we,
    stride_wn,
    stride_ya,
    ROWS_PER_X: tl.constexpr,  # assignments per x row: K (GEMM 1) or 1 (GEMM 2)
    SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    a = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    expert = tl.load(ids_ptr + a)
    w_rows = w_ptr + expert * stride_we + n[:, None] * stride_wn  # [BLOCK_N, 1]
    x_row = x_ptr + (a // ROWS_PER_X) * stride_xr
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K_IN
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xv = tl.load(x_row + k, mask=k_ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    if SCALED:
        # The reference rounds the product to the activations' dtype before weighting it.
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32) * tl.load(scale_ptr + a)
    tl.store(y_ptr + a * stride_ya + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def _expert_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    rows_per_x: int,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y[a] = x[a // rows_per_x] @ w[ids[a]]^T (times scale[a]) -> [A, N]."""
    n, k = w.shape[1:]
    if w.stride(2) != 1:
        w = w.contiguous()
    x = x.contiguous()
    y = torch.empty(ids.numel(), n, device=x.device, dtype=out_dtype or x.dtype)
    if ids.numel() == 0:
        return y
    _expert_gemv_kernel[(ids.numel(), triton.cdiv(n, BLOCK_N))](
        x, w, ids, scale if scale is not None else ids, y,
        n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        ROWS_PER_X=rows_per_x, SCALED=scale is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return y


def moe_experts_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """The routed experts with float weights: x [T, H] -> [T, H] in x's dtype.

    w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], both in x's dtype or fp32."""
    tokens, hidden = x.shape
    shapes_ok = w13.dim() == w2.dim() == 3 and w13.shape[2] == w2.shape[1] == hidden
    if not shapes_ok or w2.shape[2] * 2 != w13.shape[1] or w13.shape[0] != w2.shape[0]:
        raise ValueError(
            f"experts must be w13 [E, 2I, {hidden}] and w2 [E, {hidden}, I], got "
            f"{tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    top_k = routing.topk_ids.shape[1]
    ids = routing.topk_ids.reshape(-1).contiguous()
    gate_up = _expert_gemv(x, w13, ids, rows_per_x=top_k)  # [A, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # [A, I]
    weights = routing.topk_weights.reshape(-1).float().contiguous()
    y = _expert_gemv(act, w2, ids, rows_per_x=1, scale=weights, out_dtype=torch.float32)
    return y.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
