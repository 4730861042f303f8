"""W4A16 GEMM: y = x @ W^T with W in INT4 (gpu_node.quant.int4 layout), x in bf16/fp16.

Letters: M tokens, N out features, K in features, G group size, S split-K ways.

Each program owns a [BLOCK_N, BLOCK_M] tile of y^T (weights on the MMA's wide
side, so decode-sized M costs little) and walks K in steps of BLOCK_K (BLOCK_K
divides G, so one step lies inside one group). A step loads BLOCK_K / 2 packed
bytes per weight row along their contiguous axis, splits them into low- and
high-nibble codes (two runs of 16 consecutive k per 32-value chunk, see
int4.py), dequantizes in registers (w = scale * q + min in fp32, rounded to the
activation dtype) and feeds the tensor cores, accumulating in fp32.

For decode-sized M there are too few output tiles to fill the GPU, so the K
loop is split S ways (grid dim 2); each split writes an fp32 partial [S, M, N]
and the wrapper sums them (deterministic, no atomics).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from gpu_node.quant.int4 import Int4Weight

# Only core builtins inside the kernels (tl.full, not tl.zeros; no tl.cdiv / tl.sum):
# the standard library's @jit helpers stay compiled-mode when Triton was imported
# before TRITON_INTERPRET was set, and the interpreter cannot call them.


@triton.jit
def int4_group_step(
    acc,  # fp32 [BLOCK_N, BLOCK_M], y^T so far
    x_cols,  # pointers [1, BLOCK_M] at k = 0 of each activation row
    mask_m,  # [1, BLOCK_M]
    stride_xk,
    w_rows,  # pointers [BLOCK_N, 1] at byte 0 of each packed weight row
    mask_n,  # [BLOCK_N, 1]
    stride_pk,
    scale,  # fp32 [BLOCK_N, 1] of this step's group
    min_,  # fp32 [BLOCK_N, 1]
    step,  # K step index: values step*BLOCK_K.., bytes step*BLOCK_K/2..
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One K step, transposed: acc + dequant(W)[:, k0:k0+BLOCK_K] @ x^T -> fp32 [BLOCK_N, BLOCK_M].

    W is the dot's left operand so that decode-sized M sits on the MMA's narrow
    side, and each weight row's bytes are loaded along their contiguous axis.
    """
    HALF: tl.constexpr = BLOCK_K // 2
    # Offsets as step * constant keep their divisibility visible, so loads vectorize.
    k0 = step * BLOCK_K
    b0 = step * HALF
    offs_b = tl.arange(0, HALF)  # byte of the step
    offs_lo = (offs_b // 16) * 32 + (offs_b % 16)  # value k of each byte's low nibble
    x_lo = tl.load(x_cols + (k0 + offs_lo)[:, None] * stride_xk, mask=mask_m, other=0.0)
    x_hi = tl.load(x_cols + (k0 + offs_lo + 16)[:, None] * stride_xk, mask=mask_m, other=0.0)
    packed = tl.load(w_rows + (b0 + offs_b)[None, :] * stride_pk, mask=mask_n, other=0)
    w_lo = (packed & 0x0F).to(tl.float32) * scale + min_  # [BLOCK_N, HALF]
    w_hi = (packed >> 4).to(tl.float32) * scale + min_
    if DOT_FP32:
        # The interpreter's bf16 dot is wrong, and fp32 activations want ieee products.
        acc = tl.dot(w_lo, x_lo.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(w_hi, x_hi.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(w_lo.to(x_lo.dtype), x_lo, acc)
        acc = tl.dot(w_hi.to(x_hi.dtype), x_hi, acc)
    return acc


@triton.jit
def _w4a16_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_pn,
    stride_pk,
    stride_sn,
    stride_sg,
    stride_os,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = (offs_m < M)[None, :]
    mask_n = (offs_n < N)[:, None]
    x_cols = x_ptr + offs_m[None, :] * stride_xm
    w_rows = packed_ptr + offs_n[:, None] * stride_pn
    num_steps = K // BLOCK_K
    steps_per_split = (num_steps + SPLIT_K - 1) // SPLIT_K
    step_begin = pid_k * steps_per_split
    step_end = tl.minimum(step_begin + steps_per_split, num_steps)
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)  # y^T
    for step in range(step_begin, step_end):
        group = step // (GROUP_SIZE // BLOCK_K)
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + group * stride_sg, mask=mask_n)
        min_ = tl.load(mins_ptr + offs_n[:, None] * stride_sn + group * stride_sg, mask=mask_n)
        acc = int4_group_step(
            acc,
            x_cols,
            mask_m,
            stride_xk,
            w_rows,
            mask_n,
            stride_pk,
            scale.to(tl.float32),
            min_.to(tl.float32),
            step,
            BLOCK_K,
            DOT_FP32,
        )
    out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m & mask_n)


def is_interpreted(t: torch.Tensor) -> bool:
    """True when Triton runs in its CPU interpreter (tests), where dots go through fp32."""
    return os.environ.get("TRITON_INTERPRET") == "1" or t.device.type == "cpu"


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 for the interpreter (heuristics need a number)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def w4a16_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict[str, int]:
    """Tile sizes and split-K ways for one problem (a heuristic, not autotuned)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    block_k = min(group_size, 128)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    num_steps = k // block_k
    split_k = 1
    # Aim for two waves of programs; each split keeps at least 4 K steps to amortise its tile.
    while tiles * split_k < 2 * num_sms and split_k * 2 <= max(1, num_steps // 4):
        split_k *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k}


def w4a16_matmul(
    x: torch.Tensor,
    weight: Int4Weight,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T for W [N, K] INT4 -> [..., N] in x's dtype.

    `config` (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) overrides the
    heuristic; tests sweep it. This kernel reads Int4Weight's own
    layout and shares its K step with the fused MoE kernel; Int4Linear on CUDA runs
    the kernels of w4a16/gemv.py over Int4WeightKN instead (a GEMV for decode).
    """
    if len(weight.shape) != 2:
        raise ValueError(f"w4a16_matmul takes a 2-D weight, got shape {weight.shape}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    if x.device != weight.packed.device:
        raise ValueError(f"x on {x.device}, weight on {weight.packed.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    cfg = w4a16_config(m, n, k, weight.group_size, num_sms(x.device))
    launch = {"num_warps": 4, "num_stages": 4}
    for key, value in (config or {}).items():
        (launch if key in launch else cfg)[key] = value
    splits = cfg["SPLIT_K"]
    interpreted = is_interpreted(x)
    # Partials stay fp32; so does the interpreter's output, whose bf16 cast truncates.
    direct = splits == 1 and not interpreted
    out_dtype = x.dtype if direct else torch.float32
    out = torch.empty(splits, m, n, device=x.device, dtype=out_dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _w4a16_kernel[grid](
        x2,
        weight.packed,
        weight.scales,
        weight.mins,
        out,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        weight.packed.stride(0),
        weight.packed.stride(1),
        weight.scales.stride(0),
        weight.scales.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        GROUP_SIZE=weight.group_size,
        DOT_FP32=interpreted or x.dtype == torch.float32,
        **launch,
        **cfg,
    )
    y = out[0] if direct else out.sum(dim=0).to(x.dtype)
    return y.reshape(*lead, n)
