"""KV write: quantize new K/V and scatter them into the paged cache by slot, checking ownership.

Shape letters: T new tokens, P pages, S page size, H kv heads, D head dim.
The cache layout (and the fp8 scale layout) is drawn in `gpu_node/cache/kv_cache.py`.

    key, value    [T, H, D]   the step's new K/V in the compute dtype
    slot_mapping  [T] int64   page * S + offset of each token; < 0 = padding, skipped
    token_tags    [T] int64   the tag of the sequence each token belongs to
    page_owner    [P] int64   the tag of the sequence that owns each page

A token is written only if its slot is in range and `page_owner[slot // S]` equals its
tag; otherwise the write is skipped and the token flagged, so a bad block table can
never overwrite another sequence's KV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_node.cache.kv_quant import FP8_DTYPE, pool_strides
from gpu_node.kernels.combine import maximum_tl
from gpu_node.kernels.kv_write.reference import validate_write_inputs


@triton.jit
def round_to_bf16_tl(x):
    """Round fp32 to the nearest bf16 value (ties to even), kept in fp32.

    The interpreter's fp32 -> bf16 cast truncates; rounding the bits here makes the
    kernel agree with torch on every backend (the later cast is then exact).
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & -65536).to(tl.float32, bitcast=True)  # -65536 = ~0xFFFF


@triton.jit
def scale_offset_tl(page, offset, head, NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offset of the scale of (page, token offset, head) in a `[P, H, S]` scale
    tensor (the layout drawn in `gpu_node/cache/kv_cache.py`)."""
    return (page * NUM_KV_HEADS + head) * PAGE_SIZE + offset


@triton.jit
def hadamard_tl(x, ROWS: tl.constexpr, DIM: tl.constexpr):
    """Triton twin of `kv_quant.hadamard` on a [ROWS, DIM] fp32 tile: the same butterfly
    stages (a + b, a - b) in the same order, so the results agree bit for bit."""
    for stage in tl.static_range(0, DIM.bit_length() - 1):
        half: tl.constexpr = 1 << stage
        pairs = tl.reshape(x, [ROWS, DIM // (2 * half), 2, half])
        a, b = tl.split(tl.permute(pairs, [0, 1, 3, 2]))  # [ROWS, DIM / 2h, h] each
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, DIM])
    return x


@triton.jit
def _quantize_rows_tl(x):
    # x [BLOCK_H, BLOCK_D] fp32, rotated -> (int8 codes, fp32 scale [BLOCK_H]) as
    # kv_quant.quantize_rows; IEEE division, as torch does (`/` is an approximate divide
    # on NVIDIA GPUs); the add and subtract of 1.5 * 2**23 rounds to the nearest integer,
    # ties to even, as torch.round.
    amax = tl.reduce(tl.abs(x), 1, maximum_tl)
    scale = round_to_bf16_tl(tl.maximum(tl.math.div_rn(amax, 127.0), 1.1754943508222875e-38))
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -127.0), 127.0)
    codes = (scaled + 12582912.0) - 12582912.0
    return codes.to(tl.int8), scale


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    page_owner_ptr,
    token_tags_ptr,
    violation_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,  # elements between a page's tokens
    HEAD_STRIDE: tl.constexpr,  # elements between a token's heads
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    CHECK_OWNER: tl.constexpr,
):
    # One program per token: both K and V of all its kv heads.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    is_real = slot >= 0
    is_ok = is_real & (slot < num_slots)
    if CHECK_OWNER:
        page = slot // PAGE_SIZE
        owner = tl.load(page_owner_ptr + page, mask=is_ok, other=-1)
        tag = tl.load(token_tags_ptr + t)
        is_ok = is_ok & (owner == tag)
    tl.store(violation_ptr + t, is_real & (is_ok == 0))  # bool [T]

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A skipped token masks every head (a bool tensor, not tensor & scalar: the interpreter
    # turns that into an int mask).
    head_mask = heads < tl.where(is_ok, NUM_KV_HEADS, 0)
    mask = head_mask[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(
        key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0
    )
    v = tl.load(
        value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0
    )
    # [BLOCK_H] each head's row in the pool, in either memory order (kv_quant.kv_pool)
    row = (
        (slot // PAGE_SIZE) * (PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM)
        + (slot % PAGE_SIZE) * TOKEN_STRIDE
        + heads * HEAD_STRIDE
    )
    cache_offsets = row[:, None] + dims[None, :]
    if IS_FP8:
        # int8 codes of the rotated rows (kv_quant.quantize_rows), through int8 views
        k_codes, k_scale = _quantize_rows_tl(hadamard_tl(k.to(tl.float32), BLOCK_H, BLOCK_D))
        v_codes, v_scale = _quantize_rows_tl(hadamard_tl(v.to(tl.float32), BLOCK_H, BLOCK_D))
        k_codes_ptr = k_cache_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
        v_codes_ptr = v_cache_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
        tl.store(k_codes_ptr + cache_offsets, k_codes, mask=mask)
        tl.store(v_codes_ptr + cache_offsets, v_codes, mask=mask)
        scale_offsets = scale_offset_tl(
            slot // PAGE_SIZE, slot % PAGE_SIZE, heads, NUM_KV_HEADS, PAGE_SIZE
        )  # [BLOCK_H]
        tl.store(k_scale_ptr + scale_offsets, k_scale.to(tl.bfloat16), mask=head_mask)
        tl.store(v_scale_ptr + scale_offsets, v_scale.to(tl.bfloat16), mask=head_mask)
    else:
        tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_owner: torch.Tensor,
    token_tags: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check_owner: bool = True,
) -> torch.Tensor:
    """Write `key`/`value` [T, H, D] into the cache in place; return violations, bool [T].

    For an fp8 cache each (token, head) row of K and V is stored as the int8 codes of its
    Hadamard rotation with its own bf16 scale (written to `k_scale`/`v_scale`;
    `kv_quant`). A flagged token was not written.
    `check_owner=False` skips the ownership check (benchmarks only); range checks stay.
    """
    num_pages, page_size, num_kv_heads, head_dim = validate_write_inputs(
        key, value, k_cache, v_cache, slot_mapping, page_owner, token_tags, k_scale, v_scale
    )
    num_tokens = key.shape[0]
    violations = torch.empty(num_tokens, dtype=torch.bool, device=key.device)
    if num_tokens == 0:
        return violations
    is_fp8 = k_cache.dtype == FP8_DTYPE
    token_stride, head_stride = pool_strides(k_cache)  # validated: one of the two orders
    # Non-fp8 caches never read the scale pointers; any tensor fills the slot.
    k_scale_arg = k_scale if is_fp8 else k_cache
    v_scale_arg = v_scale if is_fp8 else v_cache
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scale_arg,
        v_scale_arg,
        slot_mapping,
        page_owner,
        token_tags,
        violations,
        num_pages * page_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        PAGE_SIZE=page_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        TOKEN_STRIDE=token_stride,
        HEAD_STRIDE=head_stride,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8,
        CHECK_OWNER=check_owner,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
    return violations
