"""FP8 paged KV: scale-granularity error, GPU correctness, decode attention speed.

Run from the repository root (needs only torch, triton and numpy):

    PYTHONPATH=. python benchmarks/bench_paged_attention.py scales   # any machine
    PYTHONPATH=. python benchmarks/bench_paged_attention.py check    # GPU: kernels vs refs
    PYTHONPATH=. python benchmarks/bench_paged_attention.py decode   # GPU: timing tables
    PYTHONPATH=. python benchmarks/bench_paged_attention.py prefetch # GPU: fp8 page-id prefetch
    PYTHONPATH=. python benchmarks/bench_paged_attention.py check-cost  # GPU: paired on/off
    PYTHONPATH=. python benchmarks/bench_paged_attention.py layout --rounds 3  # GPU: pool order
    PYTHONPATH=. python benchmarks/bench_paged_attention.py early-merge --rounds 3  # GPU: PDL
    PYTHONPATH=. python benchmarks/bench_paged_attention.py sweep --rounds 3  # GPU: launch options
    PYTHONPATH=. ncu --clock-control none -k regex:split_kernel -c 2 --section WarpStateStats \
        python benchmarks/bench_paged_attention.py profile            # GPU: one call each, for ncu
    PYTHONPATH=. python benchmarks/bench_paged_attention.py all --out DIR

`decode` times one layer's decode attention (both kernels) per call with CUDA-graph
replay, rotating over enough independent KV pools that no point is served from L2,
and reports bytes moved (K, V, scales, q, out) per second against a device-to-device
copy measured in the same run (bytes read + written), fp8 vs bf16 pages, and the
ownership check on vs off.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from gpu_node.kernels.kv_write import kv_write, kv_write_ref
from gpu_node.kernels.paged_attention import paged_decode_attention
from gpu_node.kernels.paged_attention_mma import paged_decode_attention_mma
from gpu_node.kernels.paged_attention_ref import paged_decode_attention_ref
from gpu_node.kv_cache import HEAD_MAJOR
from gpu_node.kv_quant import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_DTYPE,
    bytes_per_token,
    dequantize_fp8,
    kv_pool,
    quantize_fp8,
    scale_shape,
)
from scheduler.block_manager import FREE, owner_tag

SHAPES = {  # name -> (query heads, kv heads, head dim)
    "smollm2": (9, 3, 64),
    "llama8b": (32, 8, 128),
}
PAGE_SIZE = 16
ROTATE_BYTES = 256 << 20  # > 4x the H200's 60 MB L2


def log(*parts: object) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------- scales


def realistic_kv(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int = 0):
    """K with a few loud channels (as LLM keys have) and rare loud tokens (attention
    sinks); V with per-token magnitudes spread over ~2 decades and rare loud tokens."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    channel_gain = torch.ones(head_dim)
    loud = torch.randperm(head_dim, generator=gen)[:4]
    channel_gain[loud] = torch.tensor([3.0, 4.0, 6.0, 8.0])
    k *= channel_gain
    sinks = torch.rand(num_tokens, generator=gen) < 0.01
    k[sinks] *= 4.0
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v *= torch.exp(torch.randn(num_tokens, num_kv_heads, 1, generator=gen))
    v[torch.rand(num_tokens, generator=gen) < 0.01] *= 10.0
    return k, v


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize to fp8 with `scale` (broadcast against x) and back, in fp32."""
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.float() * scale


def granularities(x: torch.Tensor, page_size: int) -> dict[str, torch.Tensor]:
    """x [L, H, D] -> what each scale granularity gives back after fp8 storage."""
    length, heads, dim = x.shape
    pages = x.view(length // page_size, page_size, heads, dim)
    page_amax = pages.abs().amax(dim=(1, 3), keepdim=True)  # [P, 1, H, 1]
    # Decode appends: a page's scale is fixed when its first token is written.
    first_amax = pages[:, :1].abs().amax(dim=3, keepdim=True)  # [P, 1, H, 1]
    token_amax = x.abs().amax(dim=-1, keepdim=True)
    power_of_two = torch.exp2(torch.ceil(torch.log2(token_amax / FP8_MAX)))
    q, scale = quantize_fp8(x)
    return {
        "per layer (amax of the whole tensor, fp32)": fake_quant(x, x.abs().amax() / FP8_MAX),
        "per page and head (amax of the full page, fp32)": fake_quant(
            pages, page_amax / FP8_MAX
        ).view_as(x),
        "per page and head, fixed at the page's first token": fake_quant(
            pages, first_amax / FP8_MAX
        ).view_as(x),
        "per token and head (amax, fp32 scale)": fake_quant(x, token_amax / FP8_MAX),
        "per token and head (power of two, int8 exponent)": fake_quant(x, power_of_two),
        "per token and head (amax, bf16 scale) [chosen]": dequantize_fp8(q, scale, torch.float32),
    }


SCALE_BYTES = {  # extra bytes per (token, head) row at page size 16, for the table
    "per layer (amax of the whole tensor, fp32)": 0.0,
    "per page and head (amax of the full page, fp32)": 4 / PAGE_SIZE,
    "per page and head, fixed at the page's first token": 4 / PAGE_SIZE,
    "per token and head (amax, fp32 scale)": 4.0,
    "per token and head (power of two, int8 exponent)": 1.0,
    "per token and head (amax, bf16 scale) [chosen]": 2.0,
}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q [N, Q, D], k/v [L, H, D] -> [N, Q, D]; causal over the last N positions.
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("nqd,lqd->qnl", q, k) / q.shape[-1] ** 0.5
    length, n = k.shape[0], q.shape[0]
    is_future = torch.arange(length)[None, :] > (length - n + torch.arange(n))[:, None]
    probs = torch.softmax(scores.masked_fill(is_future, float("-inf")), dim=-1)
    return torch.einsum("qnl,lqd->nqd", probs, v)


def part_scales(results: dict) -> None:
    num_heads, num_kv_heads, head_dim = SHAPES["smollm2"]
    length = 4096
    k, v = realistic_kv(length, num_kv_heads, head_dim)
    q = torch.randn(256, num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    exact = attention(q, k, v)
    ks, vs = granularities(k, PAGE_SIZE), granularities(v, PAGE_SIZE)
    bf16_row = head_dim * 2
    rows = []
    log("\n## fp8 scale granularity (SmolLM2 kv shape, 4096 tokens, page 16)\n")
    log(
        "| granularity | K rel. err | V rel. err | attention out rel. err | bytes/row | tokens vs bf16 |"
    )
    log("|---|---|---|---|---|---|")
    for name in ks:
        k_err = float((ks[name] - k).norm() / k.norm())
        v_err = float((vs[name] - v).norm() / v.norm())
        out = attention(q, ks[name], vs[name])
        out_err = float((out - exact).norm() / exact.norm())
        row_bytes = head_dim + SCALE_BYTES[name]
        rows.append(
            {
                "granularity": name,
                "k_rel_err": k_err,
                "v_rel_err": v_err,
                "out_rel_err": out_err,
                "bytes_per_row": row_bytes,
                "capacity_vs_bf16": bf16_row / row_bytes,
            }
        )
        log(
            f"| {name} | {k_err:.4f} | {v_err:.4f} | {out_err:.4f} | {row_bytes:.2f} | "
            f"{bf16_row / row_bytes:.3f}x |"
        )
    bf16_err = float(
        (attention(q, k.bfloat16().float(), v.bfloat16().float()) - exact).norm() / exact.norm()
    )
    log(f"| bf16 pages, for scale | - | - | {bf16_err:.4f} | {bf16_row} | 1.000x |")
    results["scales"] = [*rows, {"granularity": "bf16", "out_rel_err": bf16_err}]


# --------------------------------------------------------------------------- check


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def random_batch(lens, shape, cache_dtype, device, seed, spare_pages=4) -> dict[str, Any]:
    """Sequences on shuffled pages of a random pool (one KV layer), written with kv_write_ref."""
    num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / PAGE_SIZE) for n in lens]
    num_pages = sum(needed) + spare_pages
    cache_shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_cache = kv_pool(*cache_shape, cache_dtype, device, head_major=HEAD_MAJOR)
    v_cache = kv_pool(*cache_shape, cache_dtype, device, head_major=HEAD_MAJOR)
    k_scale = v_scale = None
    if cache_dtype == FP8_DTYPE:
        k_scale = torch.zeros(
            scale_shape(num_pages, PAGE_SIZE, num_kv_heads), dtype=SCALE_DTYPE, device=device
        )
        v_scale = torch.zeros_like(k_scale)
    owner = torch.full((num_pages,), FREE, device=device)
    tags = torch.tensor([owner_tag(i + 1, 1) for i in range(len(lens))], device=device)
    tables = torch.zeros(len(lens), max(needed) + 1, dtype=torch.int32, device=device)
    order = torch.randperm(num_pages, generator=gen).to(device)
    used = 0
    for seq, (length, count) in enumerate(zip(lens, needed, strict=True)):
        pages = order[used : used + count]
        used += count
        tables[seq, :count] = pages.int()
        owner[pages] = tags[seq]
        k, v = realistic_kv(length, num_kv_heads, head_dim, seed=seed * 1000 + seq)
        pos = torch.arange(length, device=device)
        slots = pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        kv_write_ref(
            k.to(device),
            v.to(device),
            k_cache,
            v_cache,
            slots,
            owner,
            tags[seq].expand(length).contiguous(),
            k_scale,
            v_scale,
        )
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "context_lens": lens_t,
        "page_owner": owner,
        "seq_tags": tags,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }


CHECK_TOLERANCE = 8e-3


def part_check(results: dict, device: str, trials: int) -> bool:
    ok = True
    rows = []
    log("\n## GPU correctness: kernels vs torch references\n")
    # KV write: bit-exact, including ownership flags.
    gen = torch.Generator().manual_seed(5)
    for cache_dtype in (FP8_DTYPE, torch.bfloat16):
        num_pages, heads, dim, tokens = 512, 3, 64, 4000
        x = torch.randn(tokens, heads, dim, generator=gen)
        x *= torch.exp(2 * torch.randn(tokens, heads, 1, generator=gen))
        x[:5, 0, :8] = torch.tensor([31.88, -7.87, 1.9686, 0.2499, 447.9, 1e-3, -3e-4, 15.99])
        x = x.to(device, torch.bfloat16)
        slots = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:tokens].to(device)
        owner = torch.randint(0, 4, (num_pages,), generator=gen).to(device)
        tags = owner[slots // PAGE_SIZE].clone()
        tags[::10] = 7  # every 10th token writes a page it does not own
        outs: list[list[Any]] = []
        # The kernel, the reference on the same device, and the reference on the CPU.
        writers: list[tuple[Callable[..., torch.Tensor], str]] = [
            (kv_write, device),
            (kv_write_ref, device),
            (kv_write_ref, "cpu"),
        ]
        for write, where in writers:
            # pools in the engine's memory order (kv_cache.HEAD_MAJOR)
            kc = kv_pool(num_pages, PAGE_SIZE, heads, dim, cache_dtype, where, HEAD_MAJOR)
            kc.copy_(torch.full(kc.shape, 0.5, device=where))
            vc = kv_pool(num_pages, PAGE_SIZE, heads, dim, cache_dtype, where, HEAD_MAJOR)
            vc.copy_(kc)
            ks = vs = None
            if cache_dtype == FP8_DTYPE:
                ks = torch.zeros(
                    scale_shape(num_pages, PAGE_SIZE, heads), dtype=SCALE_DTYPE, device=where
                )
                vs = ks.clone()
            args = [t.to(where) for t in (x, -x)]
            args += [kc, vc] + [t.to(where) for t in (slots, owner, tags)]
            flags = write(*args, ks, vs)
            outs.append([t if t is None else t.cpu() for t in (flags, kc, vc, ks, vs)])
        same = True
        for name, ref_index in (("same-device ref", 1), ("cpu ref", 2)):
            for label, a, b_ in zip(
                ("flags", "k_cache", "v_cache", "k_scale", "v_scale"),
                outs[0],
                outs[ref_index],
                strict=True,
            ):
                if a is None:
                    continue
                a_bits = a.view(torch.uint8) if a.dtype == FP8_DTYPE else a
                b_bits = b_.view(torch.uint8) if b_.dtype == FP8_DTYPE else b_
                differ = a_bits != b_bits
                if differ.any():
                    same = False
                    where_ = differ.nonzero()[:3].tolist()
                    log(
                        f"  kv_write {cache_dtype} vs {name}: {label} differs in "
                        f"{int(differ.sum())} places, e.g. {where_}: "
                        f"{a[differ][:3].float().tolist()} vs {b_[differ][:3].float().tolist()}"
                    )
        flagged = int(outs[0][0].sum())
        passed = same and flagged == tokens // 10
        ok &= passed
        rows.append(
            {"kernel": "kv_write", "cache": str(cache_dtype), "bit_exact": same, "flagged": flagged}
        )
        log(
            f"kv_write {cache_dtype}: bit-exact vs both references={same} "
            f"flagged={flagged}/{tokens // 10} {'PASS' if passed else 'FAIL'}"
        )
    # Decode attention: relative error against the fp32 reference. The outputs are bf16
    # (2**-8 relative rounding) and the kernel's dots run in TF32 on the GPU.
    cases = [  # shape, cache dtype, context lengths, dot dtype (None: the default), q_fp8
        ("smollm2", FP8_DTYPE, [1, 17, 100, 4097, 33, 2000, 15, 16], None, None),
        ("smollm2", FP8_DTYPE, [1, 17, 100, 4097, 33, 2000, 15, 16], None, True),
        ("smollm2", FP8_DTYPE, [1, 17, 100, 4097, 33, 2000, 15, 16], torch.float32, None),
        ("smollm2", torch.bfloat16, [1, 17, 100, 4097, 33, 2000, 15, 16], None, None),
        ("smollm2", torch.float32, [300, 1, 5000], None, None),
        ("llama8b", FP8_DTYPE, [700, 1, 9000, 64], None, None),
        ("llama8b", FP8_DTYPE, [700, 1, 9000, 64], None, True),
        ("llama8b", torch.bfloat16, [700, 1, 9000, 64], None, None),
    ]
    for seed, (shape_name, cache_dtype, lens, dot_dtype, q_fp8) in enumerate(cases):
        try:
            batch = random_batch(lens, SHAPES[shape_name], cache_dtype, device, seed)
            options = {} if q_fp8 is None else {"q_fp8": q_fp8}
            out, flags = paged_decode_attention(
                **batch, max_context_len=max(lens), dot_dtype=dot_dtype, **options
            )
            ref, ref_flags = paged_decode_attention_ref(**batch)
            err = rel_err(out, ref)
            passed = err < CHECK_TOLERANCE and not flags.any() and not ref_flags.any()
            passed &= bool(torch.isfinite(out).all())
        except Exception as error:
            log(f"decode attention {shape_name} {cache_dtype}: {type(error).__name__}: {error}")
            err, passed = float("nan"), False
        ok &= passed
        rows.append(
            {
                "kernel": "paged_decode_attention",
                "shape": shape_name,
                "cache": str(cache_dtype),
                "dot": str(dot_dtype),
                "q_fp8": str(q_fp8),
                "rel_err": err,
            }
        )
        log(
            f"decode attention {shape_name} {cache_dtype} dot={dot_dtype} q_fp8={q_fp8} "
            f"lens={lens}: rel err {err:.2e} {'PASS' if passed else 'FAIL'}"
        )
    # Injected faults: 100 randomized trials each, the bad sequence and only it flagged.
    detected = {"foreign page": 0, "freed page": 0, "page given to two sequences": 0}
    for trial in range(trials):
        gen = torch.Generator().manual_seed(10_000 + trial)
        lens = torch.randint(1, 3000, (6,), generator=gen).tolist()
        batch = random_batch(lens, SHAPES["smollm2"], FP8_DTYPE, device, seed=trial)
        needed = [math.ceil(n / PAGE_SIZE) for n in lens]
        for fault in detected:
            b: dict[str, Any] = {
                k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
            }
            victim, other = torch.randperm(6, generator=gen)[:2].tolist()
            column = int(torch.randint(0, needed[victim], (1,), generator=gen))
            other_page = b["block_tables"][
                other, int(torch.randint(0, needed[other], (1,), generator=gen))
            ]
            if fault == "foreign page":
                b["block_tables"][victim, column] = other_page
            elif fault == "freed page":
                b["page_owner"][b["block_tables"][victim, column]] = FREE
            else:  # the allocator hands victim's page to `other` as well
                b["page_owner"][b["block_tables"][victim, column]] = b["seq_tags"][other]
            _, flags = paged_decode_attention(**b, max_context_len=max(lens))
            expected = [i == victim for i in range(6)]
            detected[fault] += flags.tolist() == expected
    for fault, count in detected.items():
        ok &= count == trials
        log(f"fault '{fault}': detected exactly in {count}/{trials} randomized trials")
    results["check"] = {"rows": rows, "faults": detected, "passed": ok}
    return ok


# --------------------------------------------------------------------------- decode


def copy_bandwidth() -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * (4 << 30) / (ms * 1e-3)  # bytes read + written per second


def copy_us(moved: float) -> float:
    """µs a device-to-device copy takes to move `moved` bytes (half read, half written)
    under CUDA-graph replay, rotating over buffers that exceed the L2 as timing_pool does:
    what one kernel of this size can reach, for calls too short for the copy bandwidth."""
    half = max(16, int(moved) // 2)
    count = max(1, min(512, math.ceil(ROTATE_BYTES / half)))
    src = torch.empty(count, half, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)

    def run() -> None:
        for i in range(count):
            dst[i].copy_(src[i])

    run()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")
    return ms * 1e3 / count


SWEEP_CONFIGS = [  # max registers, waves, full steps
    (regs, waves, full) for regs in (128, 144) for waves in (1, 1.5, 2, 3) for full in (False, True)
]


def part_sweep(results: dict, rounds: int, points=None) -> None:
    """The mma kernel's launch options (register cap, waves, unguarded full steps) at a few
    points, interleaved over `rounds` rounds, check on (median µs per call)."""
    record = results.setdefault("sweep", [])
    log("\n| shape | B | L | regs | waves | full steps | µs |")
    log("|---|---|---|---|---|---|---|")
    default_points = [("smollm2", 8, 32768), ("smollm2", 64, 8192), ("smollm2", 1, 32768)]
    for shape_name, batch, length in points or default_points:
        calls, _ = timing_pool(batch, length, SHAPES[shape_name], FP8_DTYPE)
        times: dict = {config: [] for config in SWEEP_CONFIGS}
        for _ in range(rounds):
            for regs, waves, full in SWEEP_CONFIGS:
                times[(regs, waves, full)].append(
                    time_calls(calls, paged_decode_attention_mma, max_registers=regs,
                               waves=waves, full_steps=full)
                )  # fmt: skip
        del calls
        torch.cuda.empty_cache()
        for (regs, waves, full), values in sorted(
            times.items(), key=lambda kv: statistics.median(kv[1])
        ):
            log(f"| {shape_name} | {batch} | {length} | {regs} | {waves} | {full} | "
                f"{statistics.median(values):.1f} |")  # fmt: skip
            record.append({"shape": shape_name, "batch": batch, "length": length, "regs": regs,
                           "waves": waves, "full_steps": full, "us": values})  # fmt: skip


def timing_pool(batch: int, length: int, shape, cache_dtype, head_major: bool = HEAD_MAJOR):
    """Enough independent copies of one decode batch that their KV exceeds ROTATE_BYTES, in
    the engine's pool memory order (kv_cache.HEAD_MAJOR) unless `head_major` says."""
    num_heads, num_kv_heads, head_dim = shape
    kv_bytes = (
        batch
        * length
        * bytes_per_token(
            "fp8" if cache_dtype == FP8_DTYPE else "bf16", num_kv_heads, head_dim, PAGE_SIZE
        )
    )
    copies = max(1, min(512, math.ceil(ROTATE_BYTES / kv_bytes)))
    pages_per_seq = math.ceil(length / PAGE_SIZE)
    num_pages = copies * batch * pages_per_seq
    cache_shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_cache = kv_pool(*cache_shape, cache_dtype, "cuda", head_major=head_major)
    v_cache = kv_pool(*cache_shape, cache_dtype, "cuda", head_major=head_major)
    for pool in (k_cache, v_cache):
        pool.copy_(torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda"))
    k_scale = v_scale = None
    if cache_dtype == FP8_DTYPE:
        sshape = scale_shape(num_pages, PAGE_SIZE, num_kv_heads)
        k_scale = torch.rand(sshape, device="cuda").add(0.01).to(SCALE_DTYPE)
        v_scale = torch.rand(sshape, device="cuda").add(0.01).to(SCALE_DTYPE)
    order = torch.randperm(num_pages, device="cuda").int()
    tables = order.view(copies, batch, pages_per_seq)
    tags = (torch.arange(copies * batch, device="cuda").view(copies, batch) + 1) << 16
    owner = torch.empty(num_pages, dtype=torch.int64, device="cuda")
    owner[order.long()] = tags.view(-1, 1).expand(-1, pages_per_seq).reshape(-1)
    q = torch.randn(copies, batch, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    calls = [
        {
            "q": q[c],
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_tables": tables[c],
            "context_lens": lens,
            "page_owner": owner,
            "seq_tags": tags[c].contiguous(),
            "k_scale": k_scale,
            "v_scale": v_scale,
            "max_context_len": length,
        }
        for c in range(copies)
    ]
    moved = kv_bytes + 2 * batch * num_heads * head_dim * 2  # + q and out in bf16
    return calls, moved


def time_calls(calls, attention=None, **options) -> float:
    """Mean µs per call under CUDA-graph replay (launch overhead out, as in a real step)."""
    attention = attention or paged_decode_attention

    def run() -> None:
        for call in calls:
            attention(**call, **options)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run, rep=60, return_mode="median")
    return ms * 1e3 / len(calls)


def bf16_pages_us(batch: int, length: int, shape) -> float:
    """µs per call of the default decode attention over bf16 pages (the baseline)."""
    calls, _ = timing_pool(batch, length, shape, torch.bfloat16)
    us = time_calls(calls)
    del calls
    torch.cuda.empty_cache()
    return us


FP8_CONFIGS = [  # block_n, num_warps, num_stages, programs per SM, q_fp8, tokens_m, max regs
    (128, 4, 2, 8, False, True, 0),  # fp16 q, tokens as the MMA's M side
    (128, 4, 2, 8, False, False, 0),  # fp16 q, query heads as M (the second session's)
    (128, 4, 3, 8, False, True, 0),
    (64, 4, 2, 8, False, True, 0),
    (64, 4, 2, 8, False, True, 128),  # 128 registers: 4 programs per SM instead of 3
    (64, 4, 2, 8, False, False, 128),
    (64, 4, 2, 16, False, True, 128),
    (128, 4, 2, 8, True, True, 0),  # q as three e4m3 parts, K read as it is (fp8 wgmma)
    (64, 4, 2, 8, True, True, 128),
    (64, 4, 2, 8, True, True, 96),
]
# q_fp8 costs accuracy (3-7x the relative error of fp16 q on the GPU, see `check`): it is
# picked only when it beats the best exact-q config by this factor.
Q_FP8_MIN_GAIN = 1.05


def tune(shape, cache_dtype) -> dict:
    """Pick the fp8 tile config with the least total time at 32K context, batch 1 and 64.

    16-bit pages keep their defaults (tuned in the first two sessions, unchanged since).
    """
    if cache_dtype != FP8_DTYPE:
        return {}
    best, best_total = None, float("inf")
    points = [timing_pool(b, 32768, shape, cache_dtype) for b in (1, 64)]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    candidates: list[dict[str, Any]] = [
        {
            "block_n": n,
            "num_warps": w,
            "num_stages": st,
            "target_programs": p * num_sms,
            "q_fp8": q_fp8,
            "tokens_m": tokens_m,
            "max_registers": max_registers,
        }
        for n, w, st, p, q_fp8, tokens_m, max_registers in FP8_CONFIGS
    ]
    for options in candidates:
        try:
            times = [time_calls(calls, **options) for calls, _ in points]
        except Exception as error:  # a config the compiler rejects (registers, smem)
            log(f"  config {options} failed: {type(error).__name__}: {error}")
            continue
        total = sum(times)
        log(
            f"  {cache_dtype} {options}: B=1 {times[0]:.1f} µs + B=64 {times[1]:.1f} µs "
            f"= {total:.1f} µs (32K)"
        )
        if options["q_fp8"]:
            total *= Q_FP8_MIN_GAIN
        if total < best_total:
            best, best_total = options, total
    del points
    torch.cuda.empty_cache()
    assert best is not None
    return best


def part_decode(results: dict, shapes: list[str], quick: bool, save) -> None:
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    log(f"\ncopy bandwidth (device-to-device, read + write): {copy_bw / 1e12:.3f} TB/s")
    results["copy_bandwidth_Bps"] = copy_bw
    batches = (1, 8, 64)
    lengths = (1024, 8192, 32768)
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        tuned = {}
        for cache_dtype in (torch.bfloat16, FP8_DTYPE):
            tuned[cache_dtype] = tune(shape, cache_dtype) if not quick else {}
            log(f"{shape_name} {cache_dtype}: tuned {tuned[cache_dtype]}")
        rows = []
        log(f"\n## decode attention, {shape_name} (Q, H, D = {shape}), page {PAGE_SIZE}\n")
        log(
            "| B | L | pages | µs check on | µs check off | check cost | TB/s | % of copy | fp8 speedup |"
        )
        log("|---|---|---|---|---|---|---|---|---|")
        for batch in batches:
            for length in lengths:
                times = {}
                for cache_dtype in (torch.bfloat16, FP8_DTYPE):
                    calls, moved = timing_pool(batch, length, shape, cache_dtype)
                    on, off = [], []
                    try:
                        for _ in range(3):  # interleaved, medians: the difference is small
                            on.append(time_calls(calls, check_owner=True, **tuned[cache_dtype]))
                            off.append(time_calls(calls, check_owner=False, **tuned[cache_dtype]))
                    except Exception as error:
                        log(
                            f"| {batch} | {length} | {cache_dtype} | {type(error).__name__}: {error}"
                        )
                        times[cache_dtype] = float("nan")
                        continue
                    t_on, t_off = statistics.median(on), statistics.median(off)
                    times[cache_dtype] = t_on
                    bw = moved / (t_on * 1e-6)
                    name = "fp8" if cache_dtype == FP8_DTYPE else "bf16"
                    speedup = times[torch.bfloat16] / t_on if cache_dtype == FP8_DTYPE else 1.0
                    row = {
                        "shape": shape_name,
                        "batch": batch,
                        "length": length,
                        "kv": name,
                        "us_check_on": t_on,
                        "us_check_off": t_off,
                        "check_cost": t_on / t_off - 1,
                        "bytes": moved,
                        "Bps": bw,
                        "frac_copy": bw / copy_bw,
                        "fp8_speedup": speedup,
                        "on_runs": on,
                        "off_runs": off,
                    }
                    rows.append(row)
                    save()
                    log(
                        f"| {batch} | {length} | {name} | {t_on:.1f} | {t_off:.1f} | "
                        f"{100 * (t_on / t_off - 1):+.2f}% | {bw / 1e12:.2f} | "
                        f"{100 * bw / copy_bw:.0f}% | {speedup:.2f}x |"
                    )
                    del calls
                    torch.cuda.empty_cache()
        results.setdefault("decode", {})[shape_name] = {
            "tuned": {str(k): v for k, v in tuned.items()},
            "rows": rows,
        }


PREFETCH_POINTS = [  # shape, batch, context
    ("llama8b", 64, 32768),
    ("smollm2", 64, 32768),
    ("llama8b", 8, 32768),
    ("smollm2", 8, 32768),
    ("llama8b", 64, 8192),
    ("llama8b", 1, 32768),
    ("smollm2", 1, 32768),
]
PREFETCH_VARIANTS = {  # name -> options over the fp8 tile defaults
    "defaults": {},
    "no prefetch, 2 stages": {"prefetch_pages": False, "num_stages": 2},
    "prefetch, 2 stages": {"prefetch_pages": True, "num_stages": 2},
    "prefetch, 3 stages": {"prefetch_pages": True, "num_stages": 3},
    "scales ahead, 2 stages": {"prefetch_scales": True, "num_stages": 2},
    "scales ahead, 3 stages": {"prefetch_scales": True, "num_stages": 3},
    "scales ahead, 3 stages, block 64, 16/SM": {
        "prefetch_scales": True, "num_stages": 3, "block_n": 64, "programs": 16,
    },
    "scales ahead, 2 stages, block 128, 8/SM": {
        "prefetch_scales": True, "num_stages": 2, "block_n": 128, "programs": 8,
    },
}  # fmt: skip


def part_prefetch(results: dict) -> None:
    """fp8 pages: each full block's page ids loaded a block ahead (`prefetch_pages`), or
    two ahead with the scales one ahead (`prefetch_scales`), and deeper pipelines, side by side with bf16 pages, ownership check on; the check's cost
    for the fastest variant (check off)."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    log(f"\ncopy bandwidth (device-to-device, read + write): {copy_bw / 1e12:.3f} TB/s")
    rows: list[dict[str, Any]] = []
    results["prefetch"] = {"copy_bandwidth_Bps": copy_bw, "rows": rows}

    def timed(calls, name, **options) -> float:
        try:
            return time_calls(calls, **options)
        except Exception as error:  # a config the compiler rejects (shared memory)
            log(f"  {name}: {type(error).__name__}: {str(error)[:160]}")
            return math.nan

    def options_of(name: str) -> dict[str, Any]:
        options = dict(PREFETCH_VARIANTS[name])
        if "programs" in options:
            options["target_programs"] = options.pop("programs") * num_sms
        return options

    for shape_name, batch, length in PREFETCH_POINTS:
        shape = SHAPES[shape_name]
        calls, bf16_moved = timing_pool(batch, length, shape, torch.bfloat16)
        bf16_us = timed(calls, "bf16")
        del calls
        torch.cuda.empty_cache()
        calls, moved = timing_pool(batch, length, shape, FP8_DTYPE)
        timings = {}
        for name in PREFETCH_VARIANTS:
            timings[name] = timed(calls, name, **options_of(name))
        best = min(
            timings, key=lambda name: math.inf if math.isnan(timings[name]) else timings[name]
        )
        check_off_us = timed(calls, "check off", check_owner=False, **options_of(best))
        del calls
        torch.cuda.empty_cache()
        log(
            f"\n{shape_name} B={batch} L={length}: bf16 {bf16_us:.1f} µs "
            f"({100 * bf16_moved / (bf16_us * 1e-6) / copy_bw:.0f}% of copy); fp8:"
        )
        for name, us in timings.items():
            log(
                f"  {us:8.1f} µs  {100 * moved / (us * 1e-6) / copy_bw:3.0f}% of copy  "
                f"{bf16_us / us:.2f}x bf16  {name}"
            )
        log(
            f"  best: {best}; check off {check_off_us:.1f} µs, check cost "
            f"{100 * (timings[best] / check_off_us - 1):+.1f}%"
        )
        rows.append(
            {"shape": shape_name, "batch": batch, "length": length, "bf16_us": bf16_us,
             "bf16_bytes": bf16_moved, "fp8_bytes": moved, "fp8_us": timings, "best": best,
             "best_check_off_us": check_off_us}
        )  # fmt: skip


CHECK_COST_POINTS = [  # shape, batch, context
    (shape, batch, 32768) for shape in ("smollm2", "llama8b") for batch in (1, 8, 64)
]


def cost_text(cost: float, low: float, high: float) -> str:
    """A median cost and its quartiles (fractions) as the tables print them."""
    return f"{100 * cost:+.2f}% ({100 * low:+.2f}..{100 * high:+.2f})"


def paired_check_timings(calls, rounds: int, attention=None, **options):
    """`rounds` pairs of timings, check on and off back to back (the order alternating by
    round) -> (on µs, off µs, median per-pair cost, its 25% and 75% quantiles)."""
    on, off = [], []
    for r in range(rounds):
        for check in (True, False) if r % 2 == 0 else (False, True):
            (on if check else off).append(
                time_calls(calls, attention, check_owner=check, **options)
            )
    ratios = sorted(a / b - 1 for a, b in zip(on, off, strict=True))
    low, high = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    return on, off, statistics.median(ratios), low, high


def part_check_cost(results: dict, rounds: int) -> None:
    """The ownership check's cost, measured harder than `decode` does: per point,
    `rounds` pairs of timings (check on, check off; the order alternates by round), and
    the median and spread of the per-pair ratios, so that drift between the two halves
    of a pair mostly cancels."""
    log(f"\n## ownership check cost, {rounds} paired rounds per point (tile defaults)\n")
    log("| shape | B | L | pages | µs check on | µs check off | cost (median) | cost (25%-75%) |")
    log("|---|---|---|---|---|---|---|---|")
    rows = results.setdefault("check_cost", [])
    for shape_name, batch, length in CHECK_COST_POINTS:
        for cache_dtype in (torch.bfloat16, FP8_DTYPE):
            calls, _ = timing_pool(batch, length, SHAPES[shape_name], cache_dtype)
            on, off, median, low, high = paired_check_timings(calls, rounds)
            name = "fp8" if cache_dtype == FP8_DTYPE else "bf16"
            log(
                f"| {shape_name} | {batch} | {length} | {name} | {statistics.median(on):.1f} | "
                f"{statistics.median(off):.1f} | {100 * median:+.2f}% | "
                f"{100 * low:+.2f}% .. {100 * high:+.2f}% |"
            )
            rows.append(
                {"shape": shape_name, "batch": batch, "length": length, "kv": name,
                 "on_us": on, "off_us": off, "median_cost": median}
            )  # fmt: skip
            del calls
            torch.cuda.empty_cache()


MMA_POINTS = [  # shape, batch, context
    (shape, batch, length)
    for shape in ("smollm2", "llama8b")
    for batch, length in ((1, 32768), (8, 32768), (64, 8192), (64, 32768), (1, 1024), (8, 1024))
]


MMA_TUNE_POINTS = [(1, 32768), (8, 32768), (64, 32768)]
# Register caps at which the mma kernel compiles without spills with the check on and
# off alike (offline, Triton 3.6 for sm_90): head dim 64 137/138 registers, 128 211/211.
CHECK_COST_CAPS = {64: 144, 128: 216}
MMA_CONFIGS = {  # head dim -> [(max registers, waves, min split, max splits)]
    64: [(r, w, 64, 512) for r in (128, 144) for w in (1, 2, 3)],
    128: [(r, w, 64, 128) for r in (216,) for w in (1, 2, 3, 4)],
}


def part_mma(results: dict, rounds: int, tune: bool, points=None) -> None:
    """fp8 pages through the register-resident mma kernel (paged_attention_mma.py), with
    its defaults or (`tune`) the config of least total time over MMA_TUNE_POINTS per
    shape, timed beside the tl.dot kernel on fp8 and on bf16 pages, check on; its check
    cost in `rounds` alternating on/off pairs (median of the per-pair ratios); then the
    check cost at a register cap under which neither variant spills (CHECK_COST_CAPS),
    so both run at the same occupancy."""
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    log(f"\ncopy bandwidth (device-to-device, read + write): {copy_bw / 1e12:.3f} TB/s\n")
    record = results.setdefault("mma", {"copy_bandwidth_Bps": copy_bw, "rows": [], "tune": {}})
    best_config = {name: None for name in ("smollm2", "llama8b")}  # None: the kernel's defaults
    for shape_name in ("smollm2", "llama8b") if tune else ():
        shape = SHAPES[shape_name]
        totals: dict = {}
        for batch, length in MMA_TUNE_POINTS:
            calls, _ = timing_pool(batch, length, shape, FP8_DTYPE)
            for config in MMA_CONFIGS[shape[2]]:
                regs, waves, min_split, max_splits = config
                us = time_calls(
                    calls, paged_decode_attention_mma, max_registers=regs, waves=waves,
                    min_split=min_split, max_splits=max_splits,
                )  # fmt: skip
                totals[config] = totals.get(config, 0.0) + us
                log(f"tune {shape_name} B={batch} L={length} regs={regs} waves={waves} "
                    f"min_split={min_split} max_splits={max_splits}: {us:.1f} µs")  # fmt: skip
            del calls
            torch.cuda.empty_cache()
        best_config[shape_name] = min(totals, key=totals.get)
        record["tune"][shape_name] = {str(k): v for k, v in totals.items()}
        log(f"best {shape_name}: regs, waves, min split, max splits = {best_config[shape_name]}")
    log("\n| shape | B | L | bf16 µs | fp8 tl.dot µs | fp8 mma µs | mma % of copy | mma vs bf16 "
        "| mma vs fp8 tl.dot | mma check cost (IQR) | same-bytes copy µs |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape_name, batch, length in points or MMA_POINTS:
        shape = SHAPES[shape_name]
        options = {}
        if best_config[shape_name] is not None:
            regs, waves, min_split, max_splits = best_config[shape_name]
            options = {"max_registers": regs, "waves": waves, "min_split": min_split,
                       "max_splits": max_splits}  # fmt: skip
        bf16_us = bf16_pages_us(batch, length, shape)
        calls, moved = timing_pool(batch, length, shape, FP8_DTYPE)
        dot_us = time_calls(calls, kernel="dot")
        on, off, cost, low, high = paired_check_timings(
            calls, rounds, paged_decode_attention_mma, **options
        )
        mma_us = statistics.median(on)
        same_us = copy_us(moved)
        del calls
        torch.cuda.empty_cache()
        log(
            f"| {shape_name} | {batch} | {length} | {bf16_us:.1f} | {dot_us:.1f} | {mma_us:.1f} | "
            f"{100 * moved / (mma_us * 1e-6) / copy_bw:.0f}% | {bf16_us / mma_us:.2f}x | "
            f"{dot_us / mma_us:.2f}x | {cost_text(cost, low, high)} | {same_us:.1f} |"
        )
        record["rows"].append(
            {"shape": shape_name, "batch": batch, "length": length, "bf16_us": bf16_us,
             "fp8_dot_us": dot_us, "mma_on_us": on, "mma_off_us": off, "fp8_bytes": moved,
             "same_bytes_copy_us": same_us,
             "options": options}
        )  # fmt: skip
    log("\n| shape | B | L | register cap | µs check on | µs check off | check cost (IQR) |")
    log("|---|---|---|---|---|---|---|")
    for shape_name, batch, length in CHECK_COST_POINTS:
        shape = SHAPES[shape_name]
        cap = CHECK_COST_CAPS[shape[2]]
        calls, _ = timing_pool(batch, length, shape, FP8_DTYPE)
        on, off, cost, low, high = paired_check_timings(
            calls, rounds, paged_decode_attention_mma, max_registers=cap
        )
        del calls
        torch.cuda.empty_cache()
        log(
            f"| {shape_name} | {batch} | {length} | {cap} | {statistics.median(on):.1f} | "
            f"{statistics.median(off):.1f} | {cost_text(cost, low, high)} |"
        )
        record.setdefault("check_cost_equal_caps", []).append(
            {"shape": shape_name, "batch": batch, "length": length, "cap": cap, "on_us": on,
             "off_us": off}
        )  # fmt: skip


MMA_VARIANT_POINTS = [
    (shape, batch, 32768) for shape in ("smollm2", "llama8b") for batch in (1, 8, 64)
]


def mma_variant(linear: bool, full: bool, regs: int, deferred: bool = False):
    """(table name, kernel options) of an mma kernel variant."""
    name = f"{'full' if full else 'guarded'} {'linear' if linear else 'log2'} r{regs}"
    options = {"linear_v": linear, "full_steps": full, "max_registers": regs,
               "defer_owners": deferred}  # fmt: skip
    return name + (" deferred" if deferred else ""), options


MMA_VARIANTS = {  # head dim -> [(name, kernel options)]
    64: [
        mma_variant(linear=False, full=False, regs=128),
        mma_variant(linear=False, full=True, regs=128),
        mma_variant(linear=False, full=True, regs=144),
        mma_variant(linear=True, full=True, regs=128),
        mma_variant(linear=True, full=True, regs=144),
        mma_variant(linear=True, full=True, regs=144, deferred=True),
        mma_variant(linear=True, full=False, regs=128),
        mma_variant(linear=True, full=False, regs=128, deferred=True),
        mma_variant(linear=True, full=True, regs=128, deferred=True),
    ],
    128: [
        mma_variant(linear=False, full=False, regs=216),
        mma_variant(linear=False, full=True, regs=216),
        mma_variant(linear=True, full=True, regs=216),
        mma_variant(linear=True, full=True, regs=232, deferred=True),
    ],
}


def part_mma_variants(results: dict, rounds: int, points=None) -> None:
    """The mma kernel's variants side by side (MMA_VARIANTS: softmax form of the V scale,
    unguarded full steps, register cap, owners compared after the loop), each with the
    check on and off in `rounds` alternating pairs, beside bf16 pages."""
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    log(f"\ncopy bandwidth (device-to-device, read + write): {copy_bw / 1e12:.3f} TB/s\n")
    log("| shape | B | L | variant | µs check on | vs bf16 | % of copy | check cost (IQR) |")
    log("|---|---|---|---|---|---|---|---|")
    rows = results.setdefault("mma_variants", {"copy_bandwidth_Bps": copy_bw, "rows": []})
    for shape_name, batch, length in points or MMA_VARIANT_POINTS:
        shape = SHAPES[shape_name]
        bf16_us = bf16_pages_us(batch, length, shape)
        log(f"| {shape_name} | {batch} | {length} | bf16 pages | {bf16_us:.1f} | 1.00x | | |")
        calls, moved = timing_pool(batch, length, shape, FP8_DTYPE)
        for name, options in MMA_VARIANTS[shape[2]]:
            on, off, cost, low, high = paired_check_timings(
                calls, rounds, paged_decode_attention_mma, **options
            )
            us = statistics.median(on)
            log(
                f"| {shape_name} | {batch} | {length} | {name} | {us:.1f} | "
                f"{bf16_us / us:.2f}x | {100 * moved / (us * 1e-6) / copy_bw:.0f}% | "
                f"{cost_text(cost, low, high)} |"
            )
            rows["rows"].append(
                {"shape": shape_name, "batch": batch, "length": length, "variant": name,
                 "options": options, "bf16_us": bf16_us, "on_us": on, "off_us": off,
                 "fp8_bytes": moved}
            )  # fmt: skip
        del calls
        torch.cuda.empty_cache()


def decoder_layer(x: torch.Tensor, num_heads: int, head_dim: int):
    """A decoder layer's decode work around paged attention, called as the attention
    function is (q from the call is replaced by x's projection)."""
    batch = x.shape[0]

    def layer(q, weights, check_owner, **call):
        w_qkv, w_o, w_gate_up, w_down = weights
        q = (x @ w_qkv)[:, : num_heads * head_dim].reshape(batch, num_heads, head_dim)
        out, _ = paged_decode_attention(q, **call, check_owner=check_owner)
        h = x + out.reshape(batch, -1) @ w_o
        gate, up = (h @ w_gate_up).chunk(2, dim=-1)
        return h + (torch.nn.functional.silu(gate) * up) @ w_down

    return layer


SPLIT_SWEEP_POINTS = [("smollm2", 1, 32768), ("smollm2", 8, 32768), ("llama8b", 1, 32768)]
SPLIT_SWEEP = {  # head dim -> [(max registers, max splits)]
    64: [(r, n) for r in (128, 144) for n in (128, 256, 512)],
    128: [(216, n) for n in (64, 128, 256)],
}


def part_split_sweep(results: dict, rounds: int) -> None:
    """Small batches: the mma kernel's time and check cost by register cap and split cap
    (SPLIT_SWEEP), `rounds` alternating on/off pairs each, beside bf16 pages."""
    log("\n| shape | B | L | regs | max splits | µs check on | vs bf16 | check cost (IQR) |")
    log("|---|---|---|---|---|---|---|---|")
    rows = results.setdefault("split_sweep", [])
    for shape_name, batch, length in SPLIT_SWEEP_POINTS:
        shape = SHAPES[shape_name]
        bf16_us = bf16_pages_us(batch, length, shape)
        calls, _ = timing_pool(batch, length, shape, FP8_DTYPE)
        for regs, max_splits in SPLIT_SWEEP[shape[2]]:
            on, off, cost, low, high = paired_check_timings(
                calls, rounds, paged_decode_attention_mma, max_registers=regs,
                max_splits=max_splits,
            )  # fmt: skip
            us = statistics.median(on)
            log(
                f"| {shape_name} | {batch} | {length} | {regs} | {max_splits} | {us:.1f} | "
                f"{bf16_us / us:.2f}x | {cost_text(cost, low, high)} |"
            )
            rows.append(
                {"shape": shape_name, "batch": batch, "regs": regs, "max_splits": max_splits,
                 "bf16_us": bf16_us, "on_us": on, "off_us": off}
            )  # fmt: skip
        del calls
        torch.cuda.empty_cache()


STEP_POINTS = [(shape, batch, 32768) for shape in ("smollm2", "llama8b") for batch in (1, 8, 64)]
LAYER_DIMS = {"smollm2": (576, 1536), "llama8b": (4096, 14336)}  # hidden, MLP hidden


def part_step_cost(results: dict, rounds: int) -> None:
    """The ownership check's share of a decode step: one decoder layer (q/k/v and output
    projections, gated MLP, bf16 weights rotated over copies that exceed the L2, and the
    default fp8 decode attention) timed with the check on and off in `rounds` alternating
    pairs under CUDA-graph replay. Every layer of a step is this one, so the ratio is the
    step's (embedding and logits aside, which would only dilute it)."""
    log("\n## decode step (one layer) with the ownership check on vs off\n")
    log("| shape | B | L | layer µs check on | check off | attention µs | check cost (IQR) |")
    log("|---|---|---|---|---|---|---|")
    rows = results.setdefault("step_cost", [])
    for shape_name, batch, length in STEP_POINTS:
        num_heads, num_kv_heads, head_dim = SHAPES[shape_name]
        hidden, mlp = LAYER_DIMS[shape_name]
        calls, _ = timing_pool(batch, length, SHAPES[shape_name], FP8_DTYPE)
        shapes = [
            (hidden, (num_heads + 2 * num_kv_heads) * head_dim),
            (num_heads * head_dim, hidden),
            (hidden, 2 * mlp),
            (mlp, hidden),
        ]
        layer_bytes = 2 * sum(a * b for a, b in shapes)
        copies = max(1, math.ceil(ROTATE_BYTES / layer_bytes))
        weights = [
            [torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02 for shape in shapes]
            for _ in range(copies)
        ]
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        layer_calls = [dict(call, weights=weights[i % copies]) for i, call in enumerate(calls)]

        layer = decoder_layer(x, num_heads, head_dim)
        attention_us = time_calls(calls)
        on, off, cost, low, high = paired_check_timings(layer_calls, rounds, layer)
        log(
            f"| {shape_name} | {batch} | {length} | {statistics.median(on):.1f} | "
            f"{statistics.median(off):.1f} | {attention_us:.1f} | "
            f"{cost_text(cost, low, high)} |"
        )
        rows.append(
            {"shape": shape_name, "batch": batch, "length": length, "on_us": on, "off_us": off,
             "attention_us": attention_us, "weight_copies": copies}
        )  # fmt: skip
        del calls, layer_calls, weights
        torch.cuda.empty_cache()


def head_major_calls(calls: list[dict]) -> list[dict]:
    """The same calls over head-major copies of their pools (kv_pool(head_major=True))."""
    pools = {}
    for name in ("k_cache", "v_cache"):
        cache = calls[0][name]
        pools[name] = kv_pool(*cache.shape, cache.dtype, cache.device, head_major=True)
        pools[name].copy_(cache)
    return [{**call, **pools} for call in calls]


def part_layout(results: dict, rounds: int, points=None) -> None:
    """Token-major against head-major pools (kv_quant.kv_pool), side by side: bf16 pages
    through the default kernel and fp8 pages through the mma kernel, check on, in
    `rounds` interleaved rounds (median µs per call)."""
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    log(f"\ncopy bandwidth (device-to-device, read + write): {copy_bw / 1e12:.3f} TB/s\n")
    record = results.setdefault("layout", {"copy_bandwidth_Bps": copy_bw, "rows": []})
    log("| shape | B | L | bf16 token-major µs | bf16 head-major µs | fp8 token-major µs "
        "| fp8 head-major µs | fp8 % of copy (tm / hm) | fp8 vs bf16 (tm / hm) |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|")
    for shape_name, batch, length in points or MMA_POINTS:
        shape = SHAPES[shape_name]
        times: dict[str, list[float]] = {}
        moved = 0
        for cache_dtype, name in ((torch.bfloat16, "bf16"), (FP8_DTYPE, "fp8")):
            calls, moved_here = timing_pool(batch, length, shape, cache_dtype, head_major=False)
            moved = moved_here if cache_dtype == FP8_DTYPE else moved
            layouts = {"tm": calls, "hm": head_major_calls(calls)}
            attention = paged_decode_attention_mma if cache_dtype == FP8_DTYPE else None
            for _ in range(rounds):
                for layout, layout_calls in layouts.items():
                    times.setdefault(f"{name}_{layout}", []).append(
                        time_calls(layout_calls, attention)
                    )
            del calls, layouts
            torch.cuda.empty_cache()
        us = {key: statistics.median(values) for key, values in times.items()}
        share = [100 * moved / (us[f"fp8_{x}"] * 1e-6) / copy_bw for x in ("tm", "hm")]
        log(
            f"| {shape_name} | {batch} | {length} | {us['bf16_tm']:.1f} | {us['bf16_hm']:.1f} | "
            f"{us['fp8_tm']:.1f} | {us['fp8_hm']:.1f} | {share[0]:.0f}% / {share[1]:.0f}% | "
            f"{us['bf16_tm'] / us['fp8_tm']:.2f}x / {us['bf16_hm'] / us['fp8_hm']:.2f}x |"
        )
        record["rows"].append(
            {"shape": shape_name, "batch": batch, "length": length, "fp8_bytes": moved,
             "times_us": times}
        )  # fmt: skip


def part_early_merge(results: dict, rounds: int, points=None) -> None:
    """The mma kernel with its merge kernel launched early (programmatic dependent launch,
    merge_splits) and after it, in `rounds` interleaved rounds (median µs per call)."""
    record = results.setdefault("early_merge", [])
    log("\n| shape | B | L | merge after µs | merge early µs | gain |")
    log("|---|---|---|---|---|---|")
    for shape_name, batch, length in points or MMA_POINTS:
        calls, _ = timing_pool(batch, length, SHAPES[shape_name], FP8_DTYPE)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for early in (False, True):
                times[early].append(
                    time_calls(calls, paged_decode_attention_mma, early_merge=early)
                )
        del calls
        torch.cuda.empty_cache()
        after, early = statistics.median(times[False]), statistics.median(times[True])
        log(f"| {shape_name} | {batch} | {length} | {after:.1f} | {early:.1f} | "
            f"{100 * (after / early - 1):+.1f}% |")  # fmt: skip
        record.append({"shape": shape_name, "batch": batch, "length": length,
                       "after_us": times[False], "early_us": times[True]})  # fmt: skip


def part_mma_check(results: dict) -> bool:
    """The mma kernel against the fp32 reference on random_batch sequences (both shapes)."""
    ok = True
    lens = [1, 15, 16, 17, 33, 64, 100, 700, 2000, 4097, 9000]
    for shape_name in ("smollm2", "llama8b"):
        batch = random_batch(lens, SHAPES[shape_name], FP8_DTYPE, "cuda", seed=7)
        scales = {"k_scale": batch.pop("k_scale"), "v_scale": batch.pop("v_scale")}
        out, flags = paged_decode_attention_mma(**batch, **scales, min_split=32)
        ref, _ = paged_decode_attention_ref(**batch, **scales)
        dot, _ = paged_decode_attention(**batch, **scales, kernel="dot")
        err, dot_err = rel_err(out, ref), rel_err(dot, ref)
        ok &= err < CHECK_TOLERANCE and not flags.any()
        log(
            f"mma check {shape_name}: rel err {err:.2e} (tl.dot kernel {dot_err:.2e}), flags {flags.any()}"
        )
        results.setdefault("mma_check", []).append(
            {"shape": shape_name, "err": err, "dot_err": dot_err}
        )
    return ok


def part_profile(shape_name: str, batch: int, length: int) -> None:
    """One decode call on bf16 pages, then one on fp8 pages (tile defaults, check on), for a
    profiler such as Nsight Compute to capture; prints their times from a second call."""
    for cache_dtype in (torch.bfloat16, FP8_DTYPE):
        calls, _ = timing_pool(batch, length, SHAPES[shape_name], cache_dtype)
        paged_decode_attention(**calls[0])
        torch.cuda.synchronize()
        log(f"{shape_name} B={batch} L={length} {cache_dtype}: one call made")
        del calls
        torch.cuda.empty_cache()


def part_kv_write(results: dict) -> None:
    """KV write throughput: a decode step (64 tokens) and a prefill chunk (8192 tokens)."""
    log("\n## KV write (SmolLM2 kv shape), fp8 vs bf16\n")
    log("| tokens | cache | µs | GB/s (in + out) |")
    log("|---|---|---|---|")
    rows = []
    heads, dim = 3, 64
    for tokens in (64, 8192):
        for cache_dtype in (torch.bfloat16, FP8_DTYPE):
            num_pages = 4 * math.ceil(tokens / PAGE_SIZE)
            shape = (num_pages, PAGE_SIZE, heads, dim)
            kc = kv_pool(*shape, cache_dtype, "cuda", head_major=HEAD_MAJOR)  # the engine's
            vc = kv_pool(*shape, cache_dtype, "cuda", head_major=HEAD_MAJOR)
            ks = vs = None
            if cache_dtype == FP8_DTYPE:
                ks = torch.zeros(
                    scale_shape(num_pages, PAGE_SIZE, heads), dtype=SCALE_DTYPE, device="cuda"
                )
                vs = ks.clone()
            x = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
            slots = torch.randperm(num_pages * PAGE_SIZE, device="cuda")[:tokens]
            owner = torch.zeros(num_pages, dtype=torch.int64, device="cuda")
            tags = torch.zeros(tokens, dtype=torch.int64, device="cuda")
            args = (x, x, kc, vc, slots, owner, tags, ks, vs)
            kv_write(*args)
            us = 1e3 * triton.testing.do_bench_cudagraph(
                lambda args=args: kv_write(*args), rep=50, return_mode="median"
            )
            out_bytes = (
                2 * tokens * heads * (dim * kc.element_size() + (1 if ks is not None else 0))
            )
            moved = 2 * x.numel() * 2 + out_bytes
            rows.append({"tokens": tokens, "cache": str(cache_dtype), "us": us})
            log(f"| {tokens} | {cache_dtype} | {us:.1f} | {moved / us / 1e3:.0f} |")
    results["kv_write"] = rows


def parse_points(text: str | None) -> list[tuple[str, int, int]] | None:
    """`shape:batch:length,...` -> points (None: the part's own)."""
    if not text:
        return None
    return [
        (name, int(batch), int(length))
        for name, batch, length in (p.split(":") for p in text.split(","))
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part",
        choices=[
            "scales",
            "check",
            "decode",
            "prefetch",
            "check-cost",
            "profile",
            "mma",
            "mma-variants",
            "step-cost",
            "split-sweep",
            "layout",
            "early-merge",
            "sweep",
            "all",
        ],
    )
    parser.add_argument("--rounds", type=int, default=11, help="check-cost: paired rounds")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    parser.add_argument("--shapes", default="smollm2,llama8b")
    parser.add_argument(
        "--points", default=None, help="mma-variants, layout: shape:batch:length,... (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="skip tuning (default config)")
    parser.add_argument("--tune", action="store_true", help="mma: tune the config per shape")
    parser.add_argument(
        "--device", default="cuda", help="for `check`: cpu needs TRITON_INTERPRET=1"
    )
    parser.add_argument("--trials", type=int, default=100, help="randomized fault trials")
    args = parser.parse_args()

    def save() -> None:  # after every row: a run cut short still leaves its figures
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name(0)
        log(f"device: {results['device']}, torch {torch.__version__}, triton {triton.__version__}")
    ok = True
    try:
        if args.part in ("scales", "all"):
            part_scales(results)
        save()
        if args.part in ("check", "all"):
            ok = part_check(results, args.device, args.trials)
            save()
        if args.part in ("decode", "all"):
            part_kv_write(results)
            save()
            part_decode(results, args.shapes.split(","), args.quick, save)
        if args.part == "prefetch":
            part_prefetch(results)
        if args.part == "mma":
            ok = part_mma_check(results)
            save()
            part_mma(results, args.rounds, args.tune)
        if args.part == "mma-variants":
            ok = part_mma_check(results)
            save()
            part_mma_variants(results, args.rounds, parse_points(args.points))
        if args.part == "sweep":
            part_sweep(results, args.rounds, parse_points(args.points))
        if args.part == "early-merge":
            part_early_merge(results, args.rounds, parse_points(args.points))
        if args.part == "layout":
            part_layout(results, args.rounds, parse_points(args.points))
        if args.part == "split-sweep":
            part_split_sweep(results, args.rounds)
        if args.part == "step-cost":
            part_step_cost(results, args.rounds)
        if args.part == "check-cost":
            part_check_cost(results, args.rounds)
        if args.part == "profile":
            for shape_name in args.shapes.split(","):
                part_profile(shape_name, batch=64, length=32768)
    finally:
        save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
