"""W4A16 on the GPU over the transposed INT4 layout (Int4WeightKN): y = x @ W^T.

Letters: M tokens, N out features, K in features, G group size, S split-K ways,
R output rows per thread, U words per row per unrolled step.

Decode (M <= MAX_M): a GEMV on CUDA cores that streams the weights once.

    words int32 [K/8, N]: word (kw, n) holds W[n, 8kw .. 8kw+7], nibble p = k - 8kw

    program (pid_n, pid_s): rows pid_n*BLOCK_N .. (BLOCK_N = R * 32 * num_warps),
                            groups of split pid_s (a slice of K)
      lane: R neighbouring rows, so one word row is one R*4-byte vector load per
            lane and a warp reads 32*R*4 contiguous bytes (coalesced);
            the 8 activations of a word are the same for every lane (broadcast
            loads, no activation permute, no layout conversion)
      per group:   acc_g[m, n] += q[n, k] * x[m, k]      k in the group, q exact in fp32
      then:        acc[m, n]   += scale[n] * acc_g[m, n] + min[n] * sum_k x[m, k]
      end, S = 1:  y = acc
      end, S > 1:  partial [S, M, N] fp32; the last program of a row block to finish
                   (a per-row-block counter, atomically incremented) adds the S
                   partials (in rounds of CHUNK_S loads in flight, always in the
                   same order) and writes y: one kernel, and the result does not
                   depend on which program finished when.

The scale and min are applied once per group rather than per weight, so a weight
costs three instructions: the nibble is AND-ed into the bit pattern of 2^23 (one
LOP3; a nibble at bit s <= 12 gives the float 2^23 + q * 2^s), one exact FMA turns
that into q, one FMA accumulates q * x. No int-to-float conversion (a quarter-rate
instruction on NVIDIA GPUs).

More rows (M > MAX_M): `w4a16_kn_matmul` dequantizes W^T into a transient dense
buffer with one kernel and hands the product to torch.matmul (cuBLAS).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from gpu_node.kernels.w4a16.dot import is_interpreted, num_sms
from gpu_node.quant.int4 import Int4WeightKN

MAX_M = 8  # the largest batch the GEMV takes (its accumulators grow with M)
MAX_TILES = 1 << 16  # row blocks per call the split-K counters cover

# Only core builtins inside the kernels (tl.full, tl.reduce; no tl.sum / tl.zeros /
# tl.cdiv): the standard library's @jit helpers stay compiled-mode when Triton was
# imported before TRITON_INTERPRET was set, and the interpreter cannot call them.


@triton.jit
def _gemv_kn_kernel(
    x_ptr,  # [M, K], contiguous along K; bf16 is read as int32 pairs (X_PAIRS)
    words_ptr,  # int32 [K / 8, N]
    scales_ptr,  # fp16 [K / G, N]
    mins_ptr,  # fp16 [K / G, N]
    part_ptr,  # fp32 [S, BLOCK_M, N] partial sums (S > 1)
    count_ptr,  # int32 [row blocks]: programs of the row block done; 0 between calls
    out_ptr,  # [M, N]
    M,
    N,
    stride_xm,  # in elements of x_ptr's type
    stride_om,
    num_groups,
    groups_per_split,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,  # words per row loaded before any is used; divides G / 8
    SPLIT_K: tl.constexpr,
    CHUNK_S: tl.constexpr,  # partials the last program loads per round (a power of 2)
    X_PAIRS: tl.constexpr,  # x is bf16 viewed as int32: two activations per load
):
    MAGIC: tl.constexpr = 0x4B000000  # bit pattern of the float 2^23
    MAGIC_F: tl.constexpr = 8388608.0  # 2^23
    WORDS_PER_GROUP: tl.constexpr = GROUP_SIZE // 8
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    # Tiles are [BLOCK_M, 1, BLOCK_N] (or a broadcast side of one), so that the
    # activations, codes and accumulators share one register layout (no conversions).
    offs_m = tl.arange(0, BLOCK_M)[:, None, None]  # [BLOCK_M, 1, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :]  # [1, 1, BLOCK_N]
    mask_n = offs_n < N  # N % 4 == 0 (wrapper): whole vectors in or out
    # Activation rows past M read row 0; their results are never stored.
    x_rows = x_ptr + tl.where(offs_m < M, offs_m, 0) * stride_xm  # [BLOCK_M, 1, 1]
    g_begin = pid_s * groups_per_split
    g_end = tl.minimum(g_begin + groups_per_split, num_groups)
    acc = tl.full((BLOCK_M, 1, BLOCK_N), 0.0, tl.float32)
    for g in range(g_begin, g_end):
        acc_g = tl.full((BLOCK_M, 1, BLOCK_N), 0.0, tl.float32)
        x_sum = tl.full((BLOCK_M, 1, 1), 0.0, tl.float32)
        for u0 in range(0, WORDS_PER_GROUP, UNROLL):
            for u in tl.static_range(UNROLL):
                kw = g * WORDS_PER_GROUP + u0 + u
                words = tl.load(words_ptr + kw * N + offs_n, mask=mask_n, other=0)  # int32
                for half in tl.static_range(2):
                    # Nibbles 4*half.. at bits 0..15, under the exponent bits of 2^23.
                    src = ((words >> (16 * half)) & 0xFFFF) | MAGIC
                    if X_PAIRS:
                        # bf16 pairs (k, k+1) for k = 8kw + 4*half + 2i: two int32 loads
                        pair_ptr = x_rows + kw * 4 + 2 * half  # [BLOCK_M, 1, 1]
                        pair_0 = tl.load(pair_ptr)
                        pair_1 = tl.load(pair_ptr + 1)
                    for nib in tl.static_range(4):
                        p = 4 * half + nib  # k = 8 * kw + p
                        if X_PAIRS:
                            pair = pair_0 if nib < 2 else pair_1
                            # the low bf16 of the pair, or the high one (0xFFFF0000)
                            bits_x = pair << 16 if nib % 2 == 0 else pair & -65536
                            x_p = bits_x.to(tl.float32, bitcast=True)
                        else:
                            x_p = tl.load(x_rows + kw * 8 + p).to(tl.float32)
                        bits = src & ((15 << (4 * nib)) | MAGIC)  # 2^23 + q * 16^nib
                        unit = 1.0 / (1 << (4 * nib))
                        q = bits.to(tl.float32, bitcast=True) * unit - MAGIC_F * unit
                        acc_g += x_p * q
                        x_sum += x_p
        scale = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        min_ = tl.load(mins_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += acc_g * scale + x_sum * min_

    out_mask = (offs_m < M) & mask_n  # [BLOCK_M, 1, BLOCK_N]
    out_ptrs = out_ptr + offs_m * stride_om + offs_n
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_row = offs_m * N + offs_n  # [BLOCK_M, 1, BLOCK_N]
        tl.store(part_ptr + pid_s * BLOCK_M * N + part_row, acc, mask=out_mask)
        # Every thread's partial is written before the row block's counter moves
        # (barrier, then a release-acquire increment); the program that sees S - 1
        # came last, and it reads the partials from L2 (.cg), never a stale L1 line.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            # CHUNK_S partials per round, all loads of a round in flight at once.
            offs_s = tl.arange(0, CHUNK_S)[None, :, None]  # [1, CHUNK_S, 1]
            total = tl.full((BLOCK_M, 1, BLOCK_N), 0.0, tl.float32)
            for s0 in range(0, SPLIT_K, CHUNK_S):
                parts = tl.load(
                    part_ptr + (s0 + offs_s) * (BLOCK_M * N) + part_row,
                    mask=out_mask & (s0 + offs_s < SPLIT_K),
                    other=0.0,
                    cache_modifier=".cg",
                )  # [BLOCK_M, CHUNK_S, BLOCK_N]
                total += tl.reduce(parts, 1, tl.standard._sum_combine, keep_dims=True)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (CUDA graphs too)


@triton.jit
def _dequant_kn_kernel(
    words_ptr,  # int32 [K / 8, N]
    scales_ptr,  # fp16 [K / G, N]
    mins_ptr,
    out_ptr,  # [K, N]: W^T, dense
    N,
    num_word_rows,  # K / 8
    GROUP_SIZE: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    kw = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)[:, None]  # [BLOCK_KW, 1]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N]
    mask = (kw < num_word_rows) & (offs_n < N)
    words = tl.load(words_ptr + kw * N + offs_n, mask=mask, other=0)
    group_rows = (kw // (GROUP_SIZE // 8)) * N + offs_n
    scale = tl.load(scales_ptr + group_rows, mask=mask, other=0.0).to(tl.float32)
    min_ = tl.load(mins_ptr + group_rows, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(8):  # W^T row 8kw + p: nibble p of word row kw
        w = ((words >> (4 * p)) & 15).to(tl.float32) * scale + min_
        tl.store(out_ptr + (8 * kw + p) * N + offs_n, w.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _cached_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> tuple:
    return tuple(gemv_config(m, n, k, group_size, num_sms).items())


def gemv_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict[str, int]:
    """Tile, warps, unroll and split-K ways for one problem (a heuristic).

    From the H200 sweeps (docs/benchmarks.md): 4 rows per lane; a whole group's
    words (16 for group 128) loaded before any is used, up to 4 rows of x (above, the
    accumulators need the registers: 8 words); K cut into splits of 128 values; 4 warps
    per program, but 1 past 4096 values of K, whose many splits already fill the GPU
    and whose row blocks then finish sooner.
    """
    num_warps = 4 if k <= 4096 else 1
    while num_warps > 1 and n < 4 * 32 * num_warps * 2:  # small N: smaller programs
        num_warps //= 2
    return {
        "BLOCK_M": triton.next_power_of_2(m),
        "BLOCK_N": 4 * 32 * num_warps,
        "UNROLL": min(16 if m <= 4 else 8, group_size // 8),
        "GROUPS_PER_SPLIT": max(1, 128 // group_size),
        "num_warps": num_warps,
    }


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K counters: zero between calls (each call leaves them so).

    One buffer per device, so GEMV calls on one device must not run concurrently on
    two streams (the engine runs one stream). It is made on the first call, outside
    any CUDA-graph capture when callers warm up first, as they must for Triton anyway.
    """
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _check(x: torch.Tensor, weight: Int4WeightKN) -> tuple[int, int]:
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if n % 4:
        raise ValueError(f"N must be a multiple of 4, got {n}")
    if x.device != weight.words.device:
        raise ValueError(f"x on {x.device}, weight on {weight.words.device}")
    if weight.words.dtype != torch.int32 or tuple(weight.words.shape) != (k // 8, n):
        raise ValueError(f"words must be int32 [{k // 8}, {n}], got {tuple(weight.words.shape)}")
    return n, k


def w4a16_gemv(
    x: torch.Tensor, weight: Int4WeightKN, config: Mapping[str, int] | None = None
) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_M) @ W^T -> [M, N] in x's dtype, on CUDA cores.

    `config` (BLOCK_N, UNROLL, GROUPS_PER_SPLIT, num_warps) overrides the heuristic; tests
    sweep it.
    """
    n, k = _check(x, weight)
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"w4a16_gemv takes 1..{MAX_M} rows, got {m}")
    # Computed once per shape: a decode step calls this for every layer.
    cfg = dict(_cached_config(m, n, k, weight.group_size, num_sms(x.device)))
    cfg.update(config or {})
    if (weight.group_size // 8) % cfg["UNROLL"]:
        raise ValueError(f"UNROLL {cfg['UNROLL']} must divide {weight.group_size // 8}")
    num_groups = k // weight.group_size
    groups_per_split = cfg.pop("GROUPS_PER_SPLIT")
    splits = triton.cdiv(num_groups, groups_per_split)
    row_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    if row_blocks > MAX_TILES:
        raise ValueError(f"{row_blocks} row blocks exceed {MAX_TILES}")
    x = x.contiguous()
    pairs = x.dtype == torch.bfloat16
    if pairs and x.storage_offset() % 2:  # a view starting at an odd element: no int32 pairs
        x = x.clone()
    x_arg = x.view(torch.int32) if pairs else x
    # The interpreter's fp32 -> bf16 store truncates: keep fp32 there and round in torch.
    out_dtype = torch.float32 if is_interpreted(x) else x.dtype
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    # Partials only when K is split (the kernel never touches part_ptr otherwise).
    part = torch.empty(splits, cfg["BLOCK_M"], n, device=x.device) if splits > 1 else out
    _gemv_kn_kernel[(row_blocks, splits)](
        x_arg,
        weight.words,
        weight.scales,
        weight.mins,
        part,
        split_counters(x.device),
        out,
        m,
        n,
        x_arg.stride(0),
        out.stride(0),
        num_groups,
        groups_per_split,
        GROUP_SIZE=weight.group_size,
        SPLIT_K=splits,
        # <= 32 fp32 values of a round per lane and row of the tile
        CHUNK_S=min(triton.next_power_of_2(splits), max(1, 32 // cfg["BLOCK_M"])),
        X_PAIRS=pairs,
        **cfg,
    )
    return out.to(x.dtype)


def dequantize_kn(weight: Int4WeightKN, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] dense in `dtype` (computed in fp32: scale * q + min), by one kernel."""
    n, k = weight.shape
    # The interpreter's fp32 -> bf16 store truncates: keep fp32 there and round in torch.
    interpreted = is_interpreted(weight.words)
    out = torch.empty(
        k, n, device=weight.words.device, dtype=torch.float32 if interpreted else dtype
    )
    block_kw, block_n = 8, 128
    grid = (triton.cdiv(k // 8, block_kw), triton.cdiv(n, block_n))
    _dequant_kn_kernel[grid](
        weight.words,
        weight.scales,
        weight.mins,
        out,
        n,
        k // 8,
        GROUP_SIZE=weight.group_size,
        BLOCK_KW=block_kw,
        BLOCK_N=block_n,
    )
    return out.to(dtype)


def w4a16_kn_matmul(x: torch.Tensor, weight: Int4WeightKN) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T -> [..., N] in x's dtype.

    Up to MAX_M rows take the GEMV. More rows dequantize W^T into a transient
    dense buffer (x's dtype) and run the vendor matmul: at those sizes the product
    is what costs, and cuBLAS does it better than an INT4 tensor-core kernel of ours
    over this layout did (docs/benchmarks.md). The buffer lives for the call.
    """
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    if m <= MAX_M:
        return w4a16_gemv(x2, weight).reshape(*lead, n)
    _check(x2, weight)
    return torch.matmul(x2, dequantize_kn(weight, x2.dtype)).reshape(*lead, n)
