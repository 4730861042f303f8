"""W4A16 GEMV for decode-sized batches: y = x @ W^T on CUDA cores, M <= 8, W in INT4.

Letters: M tokens, N out features, K in features, G group size, C chunks (32
values, 16 bytes, 4 int32 words of a packed row), S split-K ways.

At M <= 8 a GEMM is a stream over the weights: every byte is read once and
takes part in M multiply-adds, far too few to pay for tensor-core tiles (the
MMA's narrow side is 16 rows, so M = 1 wastes 15/16 of it and as many loads go
to the activations as to the weights). Here each program owns BLOCK_N weight
rows and streams them along K (or along one of S slices of K):

    packed row n (uint8 [K/2]) viewed as int32 words [K/8]:

    word 4c+j of row n, bits 4p..4p+3 (p = 0..7) = code of value
        k = 32c + 16*(p % 2) + 4j + p // 2              (Q4_1's chunk order, int4.py)

    program (pid_n, pid_s) -> rows pid_n*BLOCK_N.., chunks of slice pid_s
      step: words  int32 [BLOCK_N, BLOCK_C, 4]   one 16-byte load per row and chunk
            for each nibble p (unrolled):
              q      [BLOCK_N, BLOCK_C, 4]        made fp32 without I2F (below)
              w      = scale * q + min             fp32, dequantized in registers
              x_p    [BLOCK_M, 1, BLOCK_C, 4]      the activations those codes meet
              acc   += w * x_p                     [BLOCK_M, BLOCK_N, BLOCK_C, 4] fp32
      end:  y[m, n] = sum of acc over (C, 4)       one reduction per program

BLOCK_C = 32 * num_warps, so a thread holds one whole chunk (16 contiguous
bytes: one vector load) of each of its BLOCK_N rows, and the activations it
needs for nibble p are 4 floats shared by all those rows. They come from
x_perm (permute_activations: x reordered to the nibbles' order, in fp32, once
per call), where those 4 floats are contiguous: one vector load per nibble and
token, in the words' own register layout (no layout conversion in the loop).

Nibbles become floats with the exponent trick instead of an int-to-float
conversion (a quarter-rate instruction on NVIDIA GPUs, the bottleneck of a
naive dequantize at decode rates): AND-ing the nibble at bit position s <= 12
into the bit pattern of 2^23 gives the float 2^23 + q * 2^s; one FMA,
f * 2^-s - 2^23 * 2^-s, gives q exactly (a power-of-two scale, then the
difference of two floats of one binade). The upper four nibbles come from the
word shifted right by 16, so a nibble costs one LOP3 and one FMA.

With S > 1 each slice writes an fp32 partial [S, M, N] and the wrapper sums
them (deterministic, no atomics); the heuristic only splits when the row
blocks alone cannot fill the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from gpu_node.quant.int4 import Int4Weight

MAX_M = 8  # the largest batch this kernel is meant for (acc grows with M)
CHUNK_VALUES = 32  # values per 16-byte chunk of a packed row

# Only core builtins inside the kernel (tl.full, tl.reduce with the standard sum
# combiner; no tl.sum / tl.zeros / tl.cdiv): the standard library's @jit helpers
# stay compiled-mode when Triton was imported before TRITON_INTERPRET was set, and
# the interpreter cannot call them (it recognises the sum combiner and uses numpy).


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # fp32 [BLOCK_M, 8, Kp / 8]: x_perm, see permute_activations
    words_ptr,  # int32 [N, K / 8]: the packed codes, four bytes at a time
    scales_ptr,  # fp16 [N, K / G]
    mins_ptr,  # fp16 [N, K / G]
    out_ptr,  # [S, M, N]
    M,
    N,
    K,
    stride_xm,
    stride_xp,
    stride_wn,
    stride_sn,
    stride_os,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_C * 32: no masks in the loop
):
    CHUNKS_PER_GROUP: tl.constexpr = GROUP_SIZE // 32
    MAGIC: tl.constexpr = 0x4B000000  # bit pattern of the float 2^23
    MAGIC_F: tl.constexpr = 8388608.0  # 2^23
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, 4)
    # Rows past N read row N - 1 instead of being masked (loads stay unpredicated
    # vectors); the store drops them.
    rows = tl.minimum(offs_n, N - 1)
    # [BLOCK_N, BLOCK_C, 4] words of the first step; [BLOCK_N, 1] scale rows
    w_ptrs = (
        words_ptr
        + rows[:, None, None] * stride_wn
        + offs_c[None, :, None] * 4
        + offs_j[None, None, :]
    )
    s_rows = rows[:, None] * stride_sn
    # [BLOCK_M, 1, BLOCK_C, 4] activations, contiguous along the words like the codes,
    # so they get the words' register layout and broadcast over the rows for free
    # (BLOCK_C = 32 * num_warps: a thread holds one chunk of each of its BLOCK_N rows).
    # x_perm is zero-padded to BLOCK_M rows and whole steps: no masks.
    x_ptrs = (
        x_ptr
        + offs_m[:, None, None, None] * stride_xm
        + offs_c[None, None, :, None] * 4
        + offs_j[None, None, None, :]
    )
    num_chunks = K // 32
    num_steps = (num_chunks + BLOCK_C - 1) // BLOCK_C
    steps_per_split = (num_steps + SPLIT_K - 1) // SPLIT_K
    step_begin = pid_s * steps_per_split
    step_end = tl.minimum(step_begin + steps_per_split, num_steps)
    acc = tl.full((BLOCK_M, BLOCK_N, BLOCK_C, 4), 0.0, tl.float32)
    for step in range(step_begin, step_end):
        c0 = step * BLOCK_C  # first chunk of the step
        chunks = c0 + offs_c  # [BLOCK_C]
        s_ptrs = s_rows + (chunks // CHUNKS_PER_GROUP)[None, :]  # [BLOCK_N, BLOCK_C]
        if EVEN_K:
            words = tl.load(w_ptrs + c0 * 4)  # int32 [BLOCK_N, BLOCK_C, 4]
            scale = tl.load(scales_ptr + s_ptrs).to(tl.float32)
            min_ = tl.load(mins_ptr + s_ptrs).to(tl.float32)
        else:
            # Chunks past K: codes, scale and min 0, so w = 0 (and x is 0 there too).
            mask_c = (chunks < num_chunks)[None, :]
            words = tl.load(w_ptrs + c0 * 4, mask=mask_c[:, :, None], other=0)
            scale = tl.load(scales_ptr + s_ptrs, mask=mask_c, other=0.0).to(tl.float32)
            min_ = tl.load(mins_ptr + s_ptrs, mask=mask_c, other=0.0).to(tl.float32)
        for half in tl.static_range(2):
            # Nibbles 4*half.. of each word at bits 0..15, under the exponent bits of 2^23.
            src = ((words >> (16 * half)) & 0xFFFF) | MAGIC
            for nib in tl.static_range(4):
                p = 4 * half + nib  # nibble of the word: byte p // 2, high half if p is odd
                bits = src & ((15 << (4 * nib)) | MAGIC)  # 2^23 + q * 16^nib, as bits
                # -> q in one exact FMA: a power-of-two scale, then a difference of two
                # floats of the same binade
                unit = 1.0 / (1 << (4 * nib))
                q = bits.to(tl.float32, bitcast=True) * unit - MAGIC_F * unit
                w = q * scale[:, :, None] + min_[:, :, None]  # [BLOCK_N, BLOCK_C, 4]
                x_p = tl.load(x_ptrs + (p * stride_xp + c0 * 4))  # [BLOCK_M, 1, BLOCK_C, 4]
                acc += w[None, :, :, :] * x_p
    # [BLOCK_M, BLOCK_N]: the one cross-thread reduction of the program
    y = tl.reduce(tl.reduce(acc, 3, tl.standard._sum_combine), 2, tl.standard._sum_combine)
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(
        out, y.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


def _is_interpreted(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or t.device.type == "cpu"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def permute_activations(x: torch.Tensor, block_m: int, padded_k: int) -> torch.Tensor:
    """x [M, K] -> fp32 [block_m, 8, padded_k / 8] in the order the codes are packed.

    x_perm[m, p, 4c + j] = x[m, 32c + 16 * (p % 2) + 4j + p // 2]: nibble p of word
    4c + j meets x_perm[:, p, 4c + j], so a thread's activations for nibble p of its
    chunk are 4 contiguous floats (one vector load), like its words. Rows past M and
    values past K are zero, so the kernel never masks them.
    """
    m, k = x.shape
    x_perm = x.new_empty(block_m, 4, 2, padded_k // 32, 4, dtype=torch.float32)  # [m, b, hi, c, j]
    if block_m > m or padded_k > k:
        x_perm.zero_()
    # x viewed as [m, c, hi, j, b] -> [m, b, hi, c, j]: p = 2b + hi, word = 4c + j
    x_perm[:m, :, :, : k // 32].copy_(x.reshape(m, k // 32, 2, 4, 4).permute(0, 4, 2, 1, 3))
    return x_perm.view(block_m, 8, padded_k // 8)


def w4a16_gemv_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int]:
    """Tile sizes, warps and split-K ways for one problem (a heuristic, not autotuned).

    BLOCK_C is always 32 * num_warps (one chunk per thread per row); BLOCK_N is the
    rows each thread streams, so it also sets how often an activation load is reused
    and, with BLOCK_M, the accumulator's registers (BLOCK_M * BLOCK_N * 4 per thread).
    """
    num_chunks = k // CHUNK_VALUES
    num_warps = 4
    while num_warps > 1 and num_chunks < 32 * num_warps:  # small K: no idle lanes
        num_warps //= 2
    block_c = 32 * num_warps
    block_m = triton.next_power_of_2(m)
    block_n = 4 if block_m <= 2 else 2
    num_steps = triton.cdiv(num_chunks, block_c)
    blocks = triton.cdiv(n, block_n)
    split_k = 1
    # Split K only when the row blocks alone cannot give every SM four programs.
    while blocks * split_k < 4 * num_sms and split_k * 2 <= num_steps // 2:
        split_k *= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_C": block_c,
        "SPLIT_K": split_k,
        "num_warps": num_warps,
    }


def w4a16_gemv(
    x: torch.Tensor, weight: Int4Weight, config: Mapping[str, int] | None = None
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, 1 <= M <= 8) @ W^T for W [N, K] INT4 -> [M, N] in x's dtype.

    `config` (BLOCK_N, BLOCK_C, SPLIT_K, num_warps, ...) overrides the heuristic;
    benchmarks use it to sweep. BLOCK_C must stay 32 * num_warps.
    """
    if len(weight.shape) != 2:
        raise ValueError(f"w4a16_gemv takes a 2-D weight, got shape {weight.shape}")
    if x.dim() != 2:
        raise ValueError(f"w4a16_gemv takes x [M, K], got shape {tuple(x.shape)}")
    n, k = weight.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, weight expects {k}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"w4a16_gemv takes 1..{MAX_M} rows, got {m}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.device != weight.packed.device:
        raise ValueError(f"x on {x.device}, weight on {weight.packed.device}")
    if weight.packed.dtype != torch.uint8 or tuple(weight.packed.shape) != (n, k // 2):
        raise ValueError(
            f"packed must be uint8 [{n}, {k // 2}], got {weight.packed.dtype} "
            f"{tuple(weight.packed.shape)}"
        )
    cfg = w4a16_gemv_config(m, n, k, _num_sms(x.device))
    cfg.update(config or {})
    if cfg["BLOCK_C"] != 32 * cfg["num_warps"]:
        raise ValueError(f"BLOCK_C must be 32 * num_warps, got {cfg}")
    if cfg["BLOCK_M"] < m:
        raise ValueError(f"BLOCK_M {cfg['BLOCK_M']} < M = {m}")
    step_values = cfg["BLOCK_C"] * CHUNK_VALUES
    padded_k = triton.cdiv(k, step_values) * step_values
    x_perm = permute_activations(x, cfg["BLOCK_M"], padded_k)
    words = weight.packed.contiguous().view(torch.int32)  # [N, K/8]
    scales = weight.scales.contiguous()
    mins = weight.mins.contiguous()
    splits = cfg["SPLIT_K"]
    # Partials stay fp32; so does the interpreter's output, whose bf16 cast truncates.
    direct = splits == 1 and not _is_interpreted(x)
    out = torch.empty(splits, m, n, device=x.device, dtype=x.dtype if direct else torch.float32)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _w4a16_gemv_kernel[grid](
        x_perm,
        words,
        scales,
        mins,
        out,
        m,
        n,
        k,
        x_perm.stride(0),
        x_perm.stride(1),
        words.stride(0),
        scales.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=weight.group_size,
        EVEN_K=padded_k == k,
        **cfg,
    )
    return out[0] if direct else out.sum(dim=0).to(x.dtype)
