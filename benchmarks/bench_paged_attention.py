"""Paged attention and the KV cache it reads: fp8 scale granularity, accuracy, kernels, speed.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_paged_attention.py scales       # any machine
    PYTHONPATH=. python benchmarks/bench_paged_attention.py accuracy     # SmolLM2, CPU is fine
    PYTHONPATH=. python benchmarks/bench_paged_attention.py integrity-host   # any machine
    PYTHONPATH=. python benchmarks/bench_paged_attention.py check        # GPU: kernels vs refs
    PYTHONPATH=. python benchmarks/bench_paged_attention.py mma --rounds 3   # GPU: decode table
    PYTHONPATH=. python benchmarks/bench_paged_attention.py step-cost --rounds 5  # GPU
    PYTHONPATH=. python benchmarks/bench_paged_attention.py prefill      # GPU: prefill chunks
    PYTHONPATH=. python benchmarks/bench_paged_attention.py --smoke      # CPU, seconds (CI)

scales: the error of each fp8 scale granularity on SmolLM2-shaped K/V with outliers.
accuracy: SmolLM2's perplexity, KL and greedy answers with fp32, bf16 and fp8 KV.
integrity-host: the host side of the ownership check, ms per engine step.
mma: one layer's decode attention per call under CUDA-graph replay, rotating over enough
independent KV pools that no point is served from L2: the default fp8 kernel beside bf16
pages, against a device-to-device copy measured in the same run, ownership check on vs off.
step-cost: the check's share of one decoder layer's decode work.
prefill: time to the first token of a long prompt with each chunk's attention through SDPA's
fused kernels (what the engine runs on a GPU) against the materialised-mask reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
import triton

from gpu_node.cache.kv_cache import HEAD_MAJOR, KVCache
from gpu_node.cache.kv_quant import (
    FP8_DTYPE,
    SCALE_DTYPE,
    bytes_per_token,
    kv_pool,
    scale_shape,
)
from gpu_node.engine.attention import PagedAttention, StepMetadata
from gpu_node.engine.model_runner import find_violations_host
from gpu_node.kernels.kv_write.kernel import kv_write
from gpu_node.kernels.kv_write.reference import kv_write_ref
from gpu_node.kernels.paged_attention.dot import DotTuning, paged_decode_attention
from gpu_node.kernels.paged_attention.mma import MmaTuning, paged_decode_attention_mma
from gpu_node.kernels.paged_attention.reference import paged_decode_attention_ref
from gpu_node.models import model_store
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.models.weights import load_llama
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


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize to e4m3 with `scale` (broadcast against x) and back, in fp32."""
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
    bf16_scale = (token_amax / FP8_MAX).clamp_min(2.0**-126).to(SCALE_DTYPE).float()
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
        "per token and head (amax, bf16 scale) [chosen]": fake_quant(x, bf16_scale),
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
    cases = [  # shape, cache dtype, context lengths, dot dtype (None: the default)
        ("smollm2", FP8_DTYPE, [1, 17, 100, 4097, 33, 2000, 15, 16], None),
        ("smollm2", FP8_DTYPE, [1, 17, 100, 4097, 33, 2000, 15, 16], torch.float32),
        ("smollm2", torch.bfloat16, [1, 17, 100, 4097, 33, 2000, 15, 16], None),
        ("smollm2", torch.float32, [300, 1, 5000], None),
        ("llama8b", FP8_DTYPE, [700, 1, 9000, 64], None),
        ("llama8b", torch.bfloat16, [700, 1, 9000, 64], None),
    ]
    for seed, (shape_name, cache_dtype, lens, dot_dtype) in enumerate(cases):
        try:
            batch = random_batch(lens, SHAPES[shape_name], cache_dtype, device, seed)
            # the default kernel, or the tl.dot kernel where the case names an option of it
            tuning = None
            if dot_dtype is not None:
                tuning = DotTuning(dot_dtype=dot_dtype)
            out, flags = paged_decode_attention(**batch, max_context_len=max(lens), tuning=tuning)
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
                "rel_err": err,
            }
        )
        log(
            f"decode attention {shape_name} {cache_dtype} dot={dot_dtype} "
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
    """`options`: check_owner and tuning (DotTuning, MmaTuning), as the attention takes them."""
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
    """fp8 pages through the register-resident mma kernel (paged_attention/mma.py), with
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
                tuning = MmaTuning(
                    max_registers=regs, waves=waves, min_split=min_split, max_splits=max_splits
                )
                us = time_calls(calls, paged_decode_attention_mma, tuning=tuning)
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
        tuning = MmaTuning()
        if best_config[shape_name] is not None:
            regs, waves, min_split, max_splits = best_config[shape_name]
            tuning = MmaTuning(
                max_registers=regs, waves=waves, min_split=min_split, max_splits=max_splits
            )
        bf16_us = bf16_pages_us(batch, length, shape)
        calls, moved = timing_pool(batch, length, shape, FP8_DTYPE)
        dot_us = time_calls(calls, tuning=DotTuning())
        on, off, cost, low, high = paired_check_timings(
            calls, rounds, paged_decode_attention_mma, tuning=tuning
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
             "options": dataclasses.asdict(tuning)}
        )  # fmt: skip
    log("\n| shape | B | L | register cap | µs check on | µs check off | check cost (IQR) |")
    log("|---|---|---|---|---|---|---|")
    for shape_name, batch, length in CHECK_COST_POINTS:
        shape = SHAPES[shape_name]
        cap = CHECK_COST_CAPS[shape[2]]
        calls, _ = timing_pool(batch, length, shape, FP8_DTYPE)
        on, off, cost, low, high = paired_check_timings(
            calls, rounds, paged_decode_attention_mma, tuning=MmaTuning(max_registers=cap)
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


def part_mma_check(results: dict) -> bool:
    """The mma kernel against the fp32 reference on random_batch sequences (both shapes)."""
    ok = True
    lens = [1, 15, 16, 17, 33, 64, 100, 700, 2000, 4097, 9000]
    for shape_name in ("smollm2", "llama8b"):
        batch = random_batch(lens, SHAPES[shape_name], FP8_DTYPE, "cuda", seed=7)
        scales = {"k_scale": batch.pop("k_scale"), "v_scale": batch.pop("v_scale")}
        out, flags = paged_decode_attention_mma(**batch, **scales, tuning=MmaTuning(min_split=32))
        ref, _ = paged_decode_attention_ref(**batch, **scales)
        dot, _ = paged_decode_attention(**batch, **scales, tuning=DotTuning())
        err, dot_err = rel_err(out, ref), rel_err(dot, ref)
        ok &= err < CHECK_TOLERANCE and not flags.any()
        log(
            f"mma check {shape_name}: rel err {err:.2e} (tl.dot kernel {dot_err:.2e}), flags {flags.any()}"
        )
        results.setdefault("mma_check", []).append(
            {"shape": shape_name, "err": err, "dot_err": dot_err}
        )
    return ok


def parse_points(text: str | None) -> list[tuple[str, int, int]] | None:
    """`shape:batch:length,...` -> points (None: the part's own)."""
    if not text:
        return None
    return [
        (name, int(batch), int(length))
        for name, batch, length in (p.split(":") for p in text.split(","))
    ]


# --------------------------------------------------------------------------- accuracy

ACCURACY_KV_DTYPES = ("fp32", "bf16", "fp8")


class OneSequence:
    """One sequence on its own KV pool: feed tokens, get logits for every one of them."""

    def __init__(self, model, kv_dtype: str, max_tokens: int, device: str):
        config = model.config
        self.model = model
        self.device = device
        num_pages = math.ceil(max_tokens / PAGE_SIZE)
        self.kv = KVCache(
            config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim,
            kv_dtype, device,
        )  # fmt: skip
        tag = owner_tag(1, 0)
        self.tags = torch.tensor([tag], device=device)
        self.page_owner = torch.full((num_pages,), tag, device=device)
        self.block_table = torch.arange(num_pages, dtype=torch.int32, device=device)[None, :]
        self.scale = config.head_dim**-0.5
        self.length = 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Appends tokens [T]; returns their next-token logits [T, V] (fp32)."""
        count = len(token_ids)
        positions = torch.arange(self.length, self.length + count, device=self.device)
        metadata = StepMetadata(
            query_lens=[count],
            context_lens=[self.length + count],
            block_tables=self.block_table,
            slot_mapping=positions,  # the block table is the identity: slot == position
            seq_tags=self.tags,
            token_seq=torch.zeros(count, dtype=torch.long, device=self.device),
            page_owner=self.page_owner,
        )
        attention = PagedAttention(self.kv, metadata, self.scale)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        logits = self.model(ids, positions, attention)
        if bool((attention.violations > 0).any()):
            raise RuntimeError("ownership violation on a sequence that owns every page")
        self.length += count
        return logits


def text_windows(tokenizer: ChatTokenizer, num_windows: int, window: int) -> list[list[int]]:
    text = "\n\n".join(topics[key] for key in sorted(topics))
    # a prefix of the text twice the length the windows need (about 4 characters a token):
    # the same first tokens as the whole text, without tokenizing a megabyte
    ids = tokenizer.encode(text[: 8 * num_windows * window], add_special_tokens=False)
    if len(ids) < num_windows * window:
        raise ValueError(f"pydoc_data.topics has {len(ids)} tokens, fewer than asked for")
    return [ids[i * window : (i + 1) * window] for i in range(num_windows)]


def window_log_probs(model, kv_dtype, ids, chunk, device) -> torch.Tensor:
    """log-softmax of the next-token logits at every position but the last: [L - 1, V]."""
    sequence = OneSequence(model, kv_dtype, len(ids), device)
    logits = torch.cat([sequence.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)])
    return torch.log_softmax(logits[:-1].double(), dim=-1)


def greedy(model, tokenizer, kv_dtype, prompt, max_new_tokens, device) -> list[int]:
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    sequence = OneSequence(model, kv_dtype, len(ids) + max_new_tokens, device)
    logits = sequence.feed(ids)[-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
        logits = sequence.feed([token])[-1]
    return out


def part_accuracy(
    results: dict, windows_n: int, window: int, chunk: int, max_new_tokens: int,
    num_prompts: int, device: str,
) -> None:  # fmt: skip
    """SmolLM2 (fp32 compute) with its KV stored in fp32, bf16 and fp8: perplexity over
    `pydoc_data.topics` windows (each one sequence, prefilled through the paged cache in
    chunks, so every position attends to K/V as the cache stores them), mean KL against fp32
    KV, and greedy agreement with fp32 KV over chat prompts."""
    from bench_engine import PROMPTS

    torch.manual_seed(0)
    prompts = PROMPTS[:num_prompts]
    started = time.time()
    gguf = GGUFModel(model_store.pull("smollm2", quiet=True))
    model = load_llama(gguf, torch.float32, device=device).eval()
    tokenizer = ChatTokenizer(gguf)

    windows = text_windows(tokenizer, windows_n, window)
    accuracy: dict = {"windows": windows_n, "window": window, "chunk": chunk}
    reference = None
    for kv_dtype in ACCURACY_KV_DTYPES:
        nll, kl, count = 0.0, 0.0, 0
        for index, ids in enumerate(windows):
            log_probs = window_log_probs(model, kv_dtype, ids, chunk, device)
            targets = torch.tensor(ids[1:], device=log_probs.device)
            nll -= float(log_probs.gather(1, targets[:, None]).sum())
            count += len(targets)
            if kv_dtype == "fp32":
                reference = reference or []
                reference.append(log_probs)
            else:
                assert reference is not None
                ref = reference[index]
                kl += float((ref.exp() * (ref - log_probs)).sum())
        accuracy[kv_dtype] = {"perplexity": math.exp(nll / count), "mean_kl": kl / count}

    answers = {
        kv: [greedy(model, tokenizer, kv, p, max_new_tokens, device) for p in prompts]
        for kv in ACCURACY_KV_DTYPES
    }
    for kv_dtype in ACCURACY_KV_DTYPES:
        same = [a == b for a, b in zip(answers[kv_dtype], answers["fp32"], strict=True)]
        accuracy[kv_dtype]["greedy_identical"] = f"{sum(same)}/{len(prompts)}"
        accuracy[kv_dtype]["answers"] = [tokenizer.decode(a) for a in answers[kv_dtype]]
    accuracy["seconds"] = round(time.time() - started, 1)

    log(
        f"SmolLM2-135M-Instruct, fp32 compute, {windows_n} windows x {window} tokens of "
        f"pydoc_data.topics, chunk {chunk}, device {device}\n"
    )
    log("| KV | perplexity | mean KL vs fp32 KV (nats) | greedy identical to fp32 KV |")
    log("|---|---|---|---|")
    for kv_dtype in ACCURACY_KV_DTYPES:
        row = accuracy[kv_dtype]
        log(
            f"| {kv_dtype} | {row['perplexity']:.4f} | {row['mean_kl']:.2e} | "
            f"{row['greedy_identical']} |"
        )
    log(f"\nfp8 answer to {prompts[0]!r}: {accuracy['fp8']['answers'][0]!r}")
    results["accuracy"] = accuracy


# --------------------------------------------------------------------------- integrity-host

INTEGRITY_POINTS = [(1, 32768), (8, 32768), (64, 8192), (64, 32768), (256, 4096)]


def median_host_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def part_integrity_host(results: dict, points: list[tuple[int, int]], repeats: int) -> None:
    """The host side of the ownership check (`find_violations_host`), which runs before every
    step's launch: ms per step over full block tables of random page ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows = []
    log("\n| batch | context | table entries | check ms |")
    log("|---|---|---|---|")
    for batch, context in points:
        width = context // PAGE_SIZE
        num_pages = batch * width + 100
        tables = rng.permutation(num_pages)[: batch * width].reshape(batch, width)
        tags = (np.arange(batch, dtype=np.int64) + 1) << 16
        owner = np.zeros(num_pages, dtype=np.int64)
        owner[tables] = np.repeat(tags, width).reshape(batch, width)
        column = np.zeros(num_pages, dtype=np.int64)
        column[tables] = np.arange(width)
        lens = np.full(batch, context, dtype=np.int64)
        table_lens = np.full(batch, width, dtype=np.int64)
        args = (tables, table_lens, lens, PAGE_SIZE, owner, column, tags)
        assert not find_violations_host(*args).any()
        ms = median_host_ms(lambda a=args: find_violations_host(*a), repeats)
        rows.append({"batch": batch, "context": context, "ms": ms})
        log(f"| {batch} | {context} | {batch * width} | {ms:.3f} |")
    results["integrity_host"] = rows


# --------------------------------------------------------------------------- prefill


def part_prefill(
    results: dict, model_name: str, prompt_tokens: int, budgets: list[int], rounds: int,
    device: str,
) -> None:  # fmt: skip
    """Time to the first token of one prompt prefilled in chunks of each step budget, each
    chunk's attention through `attend_fused` (what PagedAttention calls on a GPU) or through
    the reference, alternated in one engine; whether the 8 greedy tokens agree."""
    from bench_engine import MODEL_SHAPES, TINY, first_token_s, make_engine, seeded_model

    import gpu_node.engine.attention as attention
    from gpu_node.quant.linear import quantize_model

    variants = {"fused": attention.attend_fused, "reference": attention.attend_ref}
    shape = TINY if device == "cpu" else MODEL_SHAPES[model_name]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = seeded_model(shape, device, dtype)
    quantize_model(model, group_size=32 if device == "cpu" else 128,
                   skip=("lm_head", "embed_tokens"))  # fmt: skip
    prompt = [(13 * j) % 5000 + 100 for j in range(prompt_tokens)]
    pages = -(-(prompt_tokens + 64) // 16)
    kv = "fp32" if device == "cpu" else "bf16"
    log(f"{model_name} (seeded, INT4, {kv} KV) on {device}, prompt {prompt_tokens} tokens")
    rows = []
    for budget in budgets:
        engine = make_engine(
            model, device, kv_dtype=kv, num_pages=pages, max_num_batched_tokens=budget
        )
        times: dict[str, list[float]] = {v: [] for v in variants}
        answers: dict[str, list[int]] = {}
        try:
            for r in range(rounds + 1):  # the first round warms up
                for name, attend in variants.items():
                    attention.attend_fused = attend
                    seconds, tokens = first_token_s(engine, prompt, f"{name}-{budget}-{r}")
                    if r:
                        times[name].append(seconds)
                    answers[name] = tokens
        finally:
            attention.attend_fused = variants["fused"]
        fused, ref = (statistics.median(times[v]) for v in ("fused", "reference"))
        agree = answers["fused"] == answers["reference"]
        rows.append({"budget": budget, "fused_s": fused, "reference_s": ref, "agree": agree})
        log(
            f"  budget {budget:5d}: first token fused {fused * 1e3:7.1f} ms, reference "
            f"{ref * 1e3:7.1f} ms, {ref / fused:.2f}x; 8 greedy tokens agree: {agree}"
        )
    results["prefill"] = rows


# --------------------------------------------------------------------------- main

PARTS = ("scales", "accuracy", "integrity-host", "check", "mma", "step-cost", "prefill")


def smoke(results: dict) -> bool:
    """Every part's code on the CPU at tiny sizes; the GPU-only timing parts (check, mma,
    step-cost: CUDA graphs and device copies) are imported and their tables built, not run."""
    part_scales(results)
    part_accuracy(results, windows_n=1, window=48, chunk=16, max_new_tokens=4, num_prompts=1,
                  device="cpu")  # fmt: skip
    part_integrity_host(results, [(2, 1024), (8, 256)], repeats=3)
    part_prefill(results, "llama-1b", prompt_tokens=48, budgets=[32], rounds=1, device="cpu")
    assert callable(part_check) and callable(part_mma) and callable(part_step_cost)
    assert len(MMA_POINTS) == 12 and len(STEP_POINTS) == 6 and set(SHAPES) == set(LAYER_DIMS)
    log("smoke: scales, accuracy, integrity-host and prefill ran on the CPU; check, mma and "
        "step-cost need a GPU (imported, tables checked)")  # fmt: skip
    return True


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", nargs="?", choices=PARTS)
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes, CPU")
    parser.add_argument("--rounds", type=int, default=11, help="mma, step-cost, prefill")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    parser.add_argument("--points", default=None, help="mma: shape:batch:length,...")
    parser.add_argument("--tune", action="store_true", help="mma: tune the config per shape")
    parser.add_argument("--device", default=None, help="check, accuracy, prefill (cpu, cuda)")
    parser.add_argument("--trials", type=int, default=100, help="check: fault trials")
    parser.add_argument("--windows", type=int, default=4, help="accuracy")
    parser.add_argument("--window", type=int, default=512, help="accuracy: tokens")
    parser.add_argument("--chunk", type=int, default=128, help="accuracy: prefill chunk")
    parser.add_argument("--model", default="llama-1b", help="prefill: a bench_engine shape")
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="prefill")
    parser.add_argument("--budgets", default="2048,512", help="prefill: step budgets")
    args = parser.parse_args()
    if not (args.part or args.smoke):
        parser.error("name a part or give --smoke")
    gpu = "cuda" if torch.cuda.is_available() else "cpu"

    def save() -> None:  # after every part: a run cut short still leaves its figures
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
        if args.smoke:
            ok = smoke(results)
        elif args.part == "scales":
            part_scales(results)
        elif args.part == "accuracy":
            part_accuracy(results, args.windows, args.window, args.chunk, max_new_tokens=24,
                          num_prompts=8, device=args.device or "cpu")  # fmt: skip
        elif args.part == "integrity-host":
            part_integrity_host(results, INTEGRITY_POINTS, repeats=30)
        elif args.part == "check":
            ok = part_check(results, args.device or "cuda", args.trials)
        elif args.part == "mma":
            ok = part_mma_check(results)
            save()
            part_mma(results, args.rounds, args.tune, parse_points(args.points))
        elif args.part == "step-cost":
            part_step_cost(results, args.rounds)
        elif args.part == "prefill":
            budgets = [int(b) for b in args.budgets.split(",")]
            part_prefill(results, args.model, args.prompt_tokens, budgets, args.rounds,
                         args.device or gpu)  # fmt: skip
    finally:
        save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
