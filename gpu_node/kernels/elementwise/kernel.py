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
from triton.language.extra.cuda import gdc_launch_dependents

from gpu_node.kernels.launch import releases_next
from gpu_node.kernels.w4a16.dot import is_interpreted


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the model should call these kernels for `x`: compiled, on a GPU."""
    return x.is_cuda and not is_interpreted(x)


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, D, stride_x, stride_r, stride_out, stride_sum, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RELEASE_NEXT: tl.constexpr,
):  # fmt: skip
    if RELEASE_NEXT:  # the next kernel may launch now (launch.py: SMALL_KERNELS_RELEASE_NEXT)
        gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the sum rounded to the dtype, as torch's add leaves it, then normed
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs x [T, D] with unit column stride and weight [D], "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")  # fmt: skip


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
    summed: torch.Tensor, eps: float,
) -> None:  # fmt: skip
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, summed, x.shape[1], x.stride(0), residual.stride(0),
            out.stride(0), summed.stride(0), eps, BLOCK=block, HAS_RESIDUAL=residual is not x,
            RELEASE_NEXT=releases_next(x.device), num_warps=4 if block >= 1024 else 1,
        )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] * rsqrt(mean(x^2) + eps) * weight, in fp32, returned in x's dtype."""
    _check_norm(x, weight)
    out = torch.empty_like(x)
    _launch_norm(x, x, weight, out, out, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one launch, the sum rounded to x's dtype
    first, as torch's add leaves it."""
    _check_norm(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(f"rms_norm's residual must be x's shape and dtype, got "
                         f"{tuple(residual.shape)} {residual.dtype} for {tuple(x.shape)} {x.dtype}")  # fmt: skip
    out, summed = torch.empty_like(x), torch.empty_like(x)
    _launch_norm(x, residual, weight, out, summed, eps)
    return out, summed


@triton.jit
def _rotate(x_ptr, out_ptr, t, h0, N, stride_t, stride_n, cos, sin, pairs,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    """Heads h0 .. h0 + BLOCK_H - 1 (those < N) of token t of x rotated into out
    (contiguous [T, N, 2 HALF])."""
    heads = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    mask = (heads < N) & (pairs < HALF)
    if INTERLEAVED:  # pairs (2i, 2i + 1)
        first, second = 2 * pairs, 2 * pairs + 1
    else:  # pairs (i, i + E/2)
        first, second = pairs, pairs + HALF
    base = t * stride_t + heads * stride_n
    x1 = tl.load(x_ptr + base + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + second, mask=mask, other=0.0).to(tl.float32)
    out_base = out_ptr + (t * N + heads) * (2 * HALF)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_base + first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_base + second, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, NQ, NK,
    stride_qt, stride_qn, stride_kt, stride_kn, stride_cs,
    HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Grid (T, q head blocks + k head blocks): a program rotates BLOCK_H heads of one
    token, of q or, past q's blocks, of k. BLOCK_P: E/2 rounded up to a power of two."""
    t = tl.program_id(0)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(NQ, BLOCK_H)
    pairs = tl.arange(0, BLOCK_P)[None, :]  # [1, BP], the first E/2 real
    cos = tl.load(cos_ptr + t * stride_cs + pairs, mask=pairs < HALF, other=0.0)
    sin = tl.load(sin_ptr + t * stride_cs + pairs, mask=pairs < HALF, other=0.0)
    if block < q_blocks:
        _rotate(q_ptr, q_out_ptr, t, block * BLOCK_H, NQ, stride_qt, stride_qn, cos, sin, pairs,
                HALF, BLOCK_H, INTERLEAVED)  # fmt: skip
    else:
        _rotate(k_ptr, k_out_ptr, t, (block - q_blocks) * BLOCK_H, NK, stride_kt, stride_kn,
                cos, sin, pairs, HALF, BLOCK_H, INTERLEAVED)  # fmt: skip


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    t, _, e = x.shape
    if x.stride(2) != 1 or e % 2 or cos.shape != (t, 1, e // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope needs x [T, N, E] with unit last stride and cos, sin [T, 1, E/2], "
                         f"got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")  # fmt: skip


def _launch_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
    k_out: torch.Tensor, interleaved: bool,
) -> None:  # fmt: skip
    t, n, e = q.shape
    if t:
        block_h = 4  # heads a program: 4 x 32 pairs is one warp's 4 values a lane at E = 64
        blocks = triton.cdiv(n, block_h) + (0 if k is q else triton.cdiv(k.shape[1], block_h))
        _rope_kernel[(t, blocks)](
            q, k, cos, sin, q_out, k_out, n, k.shape[1], q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), cos.stride(0), HALF=e // 2,
            BLOCK_P=triton.next_power_of_2(e // 2), BLOCK_H=block_h, INTERLEAVED=interleaved,
            num_warps=1,
        )  # fmt: skip


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, N, E] rotated by angles whose cos and sin are [T, 1, E/2] (fp32): adjacent pairs
    when `interleaved`, else the two halves; returned contiguous in x's dtype."""
    _check_rope(x, cos, sin)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rope(x, x, cos, sin, out, out, interleaved)
    return out


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's queries [T, H, E] and keys [T, K, E] rotated as `rope` does, in one launch."""
    _check_rope(q, cos, sin)
    _check_rope(k, cos, sin)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_rope(q, k, cos, sin, q_out, k_out, interleaved)
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, F, stride_g, stride_u, BLOCK: tl.constexpr, RELEASE_NEXT: tl.constexpr
):  # fmt: skip
    if RELEASE_NEXT:  # the next kernel may launch now (launch.py: SMALL_KERNELS_RELEASE_NEXT)
        gdc_launch_dependents()
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
            gate, up, out, f, gate.stride(0), up.stride(0), BLOCK=block,
            RELEASE_NEXT=releases_next(gate.device), num_warps=4,
        )  # fmt: skip
    return out
