"""The model's small per-token operations in one launch each, for GPU decode steps.

A decode step's work per layer is a few matrix products; around them, RMSNorm (nine
torch operations), RoPE (about nine per tensor) and SwiGLU's silu-and-multiply (two)
are each a string of kernels over a few KB. In a CUDA graph the launches are cheap but
not free (about 2 µs a kernel on an H200), and these strings were two thirds of a
step's ~55 kernels a layer. Each function here is one kernel with the torch
reference's arithmetic: fp32 inside, rounded once to the input's dtype at the end.

The model calls them on CUDA tensors (`use_kernels`); on CPU it keeps the torch code,
which is also the reference the interpreter tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_node.kernels.w4a16 import is_interpreted


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the model should call these kernels for `x`: compiled, on a GPU."""
    return x.is_cuda and not is_interpreted(x)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] * rsqrt(mean(x^2) + eps) * weight, in fp32, returned in x's dtype."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs x [T, D] with unit column stride and weight [D], "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")  # fmt: skip
    out = torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.shape[1], x.stride(0), out.stride(0), eps, BLOCK=block,
            num_warps=4 if block >= 1024 else 1,
        )  # fmt: skip
    return out


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, N, stride_t, stride_n, stride_cs,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_N)[:, None]  # [BN, 1]
    pairs = tl.arange(0, HALF)[None, :]  # [1, E/2]
    mask = (heads < N) & (pairs < HALF)
    if INTERLEAVED:  # pairs (2i, 2i + 1)
        first, second = 2 * pairs, 2 * pairs + 1
    else:  # pairs (i, i + E/2)
        first, second = pairs, pairs + HALF
    base = t * stride_t + heads * stride_n
    x1 = tl.load(x_ptr + base + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + second, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_cs + pairs)
    sin = tl.load(sin_ptr + t * stride_cs + pairs)
    out_base = out_ptr + (t * N + heads) * (2 * HALF)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_base + first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_base + second, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, N, E] rotated by angles whose cos and sin are [T, 1, E/2] (fp32): adjacent pairs
    when `interleaved`, else the two halves; returned contiguous in x's dtype."""
    t, n, e = x.shape
    if x.stride(2) != 1 or e % 2 or cos.shape != (t, 1, e // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope needs x [T, N, E] with unit last stride and cos, sin [T, 1, E/2], "
                         f"got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")  # fmt: skip
    if triton.next_power_of_2(e // 2) != e // 2:
        raise ValueError(f"rope's head dim must be twice a power of two, got {e}")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty((t, n, e), dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t,)](
            x, cos, sin, out, n, x.stride(0), x.stride(1), cos.stride(0),
            HALF=e // 2, BLOCK_N=triton.next_power_of_2(n), INTERLEAVED=interleaved, num_warps=1,
        )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, F, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the dtype before the product, as torch's two operations do
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * F + cols, (s * u).to(dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [T, F] of one dtype: SwiGLU's activation."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul needs gate and up [T, F] of one dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")  # fmt: skip
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("silu_mul needs unit column strides")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    t, f = gate.shape
    if t:
        block = min(1024, triton.next_power_of_2(f))
        _silu_mul_kernel[(t, triton.cdiv(f, block))](
            gate, up, out, f, gate.stride(0), up.stride(0), BLOCK=block, num_warps=4
        )
    return out
