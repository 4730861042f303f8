"""W4A16 (INT4 weights, 16-bit activations) on a GPU: what Int4Linear serves against bf16
cuBLAS and torch's own int4 kernel, and past the decode GEMV, the GEMMs against the dense copy.

    TRITON_INTERPRET=0 python3 benchmarks/bench_w4a16.py [summary] [--shapes 8b,70b,dsv3 | KxN,...]
        [--batches 1,4,16,64] [--rounds 3] [--json out.json]
    TRITON_INTERPRET=0 python3 benchmarks/bench_w4a16.py gemm [--shapes 1b,8b]
        [--batches 16,32,64,128,256] [--symmetric] [--dtype bf16|fp16]
    .venv/bin/python benchmarks/bench_w4a16.py --smoke     # CPU: shapes, quantization, imports

Every time comes from CUDA-graph replays of one call over R weight copies that together span
4x the L2 (replay time / R), so no weight is served from L2.

summary, for each layer shape (K in -> N out) and batch M, in rounds that alternate the
variants (each figure the median of its rounds):
  bf16      F.linear(x, W), W bf16 [N, K] (cuBLAS)
  tinygemm  torch._weight_int4pack_mm, torch's int4 kernel, same codes, group 128
  served    w4a16_mma_matmul over Int4WeightMMA: what Int4Linear runs on a GPU (the
            tensor-core GEMV to 8 rows, the GEMMs to 64, with the tuned table's entries)
  ceiling   (M = 1) cuBLAS over a dense bf16 matrix of N rows holding as many bytes as the
            INT4 weight: bf16 / ceiling bounds what a kernel streaming INT4's bytes as well
            as cuBLAS streams its own can reach
with the served kernel's bandwidth as a fraction of a device-to-device copy measured in the
same run, and the ideal ratio (bf16's bytes over INT4's). Group 128, asymmetric, bf16.

gemm, for batches past the GEMV:
  dense     F.linear(x, W) in the activations' dtype
  copy      torch.matmul(x, dequantize_mma(W)): a dense W written, then read by cuBLAS
  tc, dot   w4a16_mma_gemm's two kernels with their heuristic configs
  served    w4a16_mma_matmul (GEMV, tc, dot or the copy, by rows)
with each kernel's error against the fp32 reference.

bench_graph, copies_for, copy_bandwidth and read_floor_us are shared with tune_w4a16_mma.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_node.cache.kv_quant import KV_DTYPES
from gpu_node.config import ACTIVATIONS
from gpu_node.kernels.w4a16.mma import w4a16_mma_matmul
from gpu_node.kernels.w4a16.mma_dequant import dequantize_mma
from gpu_node.kernels.w4a16.mma_gemm import MAX_M, TC_MAX_M, gemm_config, w4a16_mma_gemm
from gpu_node.quant.int4 import (
    Int4Weight,
    Int4WeightMMA,
    dequantize_int4,
    from_mma,
    quantize_int4,
    to_mma,
    unpack_int4,
)

# (K, N) of the products of a decoder layer: qkv, o, gate_up, down
SHAPES = {
    "1b": [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)],
    "8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
    "70b": [(8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)],
    "dsv3": [(7168, 18432), (18432, 7168)],  # DeepSeek-V3's dense MLP
}
GROUP = 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The activation dtypes an INT4 model computes in on a GPU (--activations), by name
ACTIVATION_DTYPES = {name: KV_DTYPES[name] for name in ACTIVATIONS if name != "auto"}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'8b,4096x4096' -> the named sets' and the given (K, N) shapes."""
    shapes: list[tuple[int, int]] = []
    try:
        for part in text.split(","):
            if part in SHAPES:
                shapes += SHAPES[part]
            else:
                k, n = part.lower().split("x")
                shapes.append((int(k), int(n)))
    except ValueError:
        message = f"shapes are KxN or one of {', '.join(SHAPES)}, comma-separated; got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    return shapes


L2_BYTES = 60 * 2**20


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds, L2 flushed before each call."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copies_for(nbytes: int) -> int:
    """How many weight copies span 4x the L2."""
    return max(2, min(64, -(-4 * L2_BYTES // nbytes)))


def bench_graph(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median milliseconds per call, from CUDA-graph replays of all `calls` in a row."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm up: compile, allocate
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting read + write."""
    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def to_tinygemm(q: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (scale, min) INT4 -> torch's int4pack layout: w = (q - 8) * scale + zero."""
    codes = unpack_int4(q.packed).to(torch.int32)  # [N, K]
    as_uint8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # [N, K/2]
    packed = torch._convert_weight_to_int4pack(as_uint8, 8)
    scales = q.scales.float()
    zeros = q.mins.float() + 8 * scales
    scales_and_zeros = (
        torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    )  # [K/G, N, 2]
    return packed, scales_and_zeros.to(torch.bfloat16)


@triton.jit
def _stream_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Reads BLOCK int32 and writes their sum: the bytes of a weight, and nothing else."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(words, axis=0))


def read_floor_us(nbytes: int) -> float:
    """The fastest one-kernel read of `nbytes` found here (µs): what no GEMV beats."""
    n = nbytes // 4
    srcs = [torch.randint(0, 7, (n,), device="cuda", dtype=torch.int32)]
    srcs += [torch.randint_like(srcs[0], 0, 7) for _ in range(copies_for(nbytes) - 1)]
    best = float("inf")
    for block, warps in ((2048, 4), (4096, 8), (8192, 8), (16384, 16)):
        out = torch.empty(triton.cdiv(n, block), device="cuda", dtype=torch.int32)
        calls = [
            lambda s=s, o=out, b=block, w=warps: _stream_kernel[(triton.cdiv(n, b),)](
                s, o, n, BLOCK=b, num_warps=w
            )
            for s in srcs
        ]
        best = min(best, bench_graph(calls) * 1e3)
    return best


def median_rounds(variants: dict[str, list[Callable[[], object]]], rounds: int) -> dict[str, float]:
    """Microseconds a call of each variant: the median over rounds that alternate them."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, calls in variants.items():
            times[name].append(bench_graph(calls) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def summary(args: argparse.Namespace) -> dict:
    """The served kernel against bf16, tinygemm and the ceiling (see the module's docstring)."""
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, bf16, INT4 "
          f"group {GROUP} asymmetric; copy {bw / 1e12:.2f} TB/s; times in us, median of "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"{'K x N':>12} {'M':>3} {'bf16':>7} {'tinygemm':>8} {'served':>7} {'/bf16':>6} "
          f"{'/tiny':>6} {'bw':>5} {'ceiling':>8} {'ideal':>6} {'err':>8} {'tiny err':>8}")  # fmt: skip
    rows = []
    for k, n in parse_shapes(args.shapes):
        gen = torch.Generator(device=device).manual_seed(0)
        q = quantize_int4(torch.randn(n, k, device=device, generator=gen), GROUP)
        mma = to_mma(q)
        w_ref = dequantize_int4(q)  # fp32 [N, K]: the function every variant computes
        dense = w_ref.to(torch.bfloat16)
        int4_bytes = mma.nbytes
        mmas = [mma] + [
            Int4WeightMMA(mma.tiles.clone(), mma.shape, mma.group_size, mma.symmetric)
            for _ in range(copies_for(int4_bytes) - 1)
        ]
        denses = [dense] + [dense.clone() for _ in range(copies_for(2 * n * k) - 1)]
        try:
            packed, scales_zeros = to_tinygemm(q)
            tinys = [(packed, scales_zeros)] + [
                (packed.clone(), scales_zeros.clone()) for _ in range(copies_for(int4_bytes) - 1)
            ]
        except (RuntimeError, TypeError) as exc:
            print(f"# {k}x{n}: torch's int4 kernel unavailable: {exc}")
            tinys = []
        for m in batches:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            ref = x.float() @ w_ref.T
            served_y = w4a16_mma_matmul(x, mma)
            err = float((served_y.float() - ref).norm() / ref.norm())
            variants: dict[str, list[Callable[[], object]]] = {
                "bf16": [lambda x=x, w=w: F.linear(x, w) for w in denses],
                "served": [lambda x=x, w=w: w4a16_mma_matmul(x, w) for w in mmas],
            }
            tiny_err = float("nan")
            if tinys:
                tiny_y = torch._weight_int4pack_mm(x, tinys[0][0], GROUP, tinys[0][1])
                tiny_err = float((tiny_y.float() - ref).norm() / ref.norm())
                variants["tinygemm"] = [
                    lambda x=x, p=p, s=s: torch._weight_int4pack_mm(x, p, GROUP, s)
                    for p, s in tinys
                ]
            k_eq = 0
            if m == 1:  # as many bf16 bytes as the INT4 weight holds, in N rows
                k_eq = max(64, round(int4_bytes / (2 * n) / 64) * 64)
                eqs = [torch.randn(n, k_eq, device=device, dtype=torch.bfloat16)
                       for _ in range(copies_for(2 * n * k_eq))]  # fmt: skip
                x_eq = torch.randn(1, k_eq, device=device, dtype=torch.bfloat16)
                variants["ceiling"] = [lambda x=x_eq, w=w: F.linear(x, w) for w in eqs]
            t = median_rounds(variants, args.rounds)
            io = 2 * m * (k + n)  # activations in and out, bf16
            row = {
                "k": k,
                "n": n,
                "m": m,
                **{f"{name}_us": value for name, value in t.items()},
                "served_vs_bf16": t["bf16"] / t["served"],
                "served_vs_tinygemm": t.get("tinygemm", float("nan")) / t["served"],
                "served_bw": (int4_bytes + io) / (t["served"] * 1e-6) / bw,
                "bf16_bw": (2 * n * k + io) / (t["bf16"] * 1e-6) / bw,
                "ideal_vs_bf16": (2 * n * k + io) / (int4_bytes + io),
                "ceiling_vs_bf16": t["bf16"] / t["ceiling"] if "ceiling" in t else None,
                "err": err,
                "tinygemm_err": tiny_err,
            }
            rows.append(row)
            ceiling = f"{row['ceiling_vs_bf16']:7.2f}x" if k_eq else f"{'':>8}"
            print(f"{k:>5}x{n:<6} {m:>3} {t['bf16']:7.1f} {t.get('tinygemm', float('nan')):8.1f} "
                  f"{t['served']:7.1f} {row['served_vs_bf16']:5.2f}x "
                  f"{row['served_vs_tinygemm']:5.2f}x {row['served_bw']:5.0%} {ceiling} "
                  f"{row['ideal_vs_bf16']:5.2f}x {err:8.1e} {tiny_err:8.1e}", flush=True)  # fmt: skip
            if k_eq:
                del variants["ceiling"], eqs
        del mmas, denses, tinys, dense, w_ref
        torch.cuda.empty_cache()
    return {"copy_bandwidth": bw, "rows": rows}


def timed(calls: list[Callable[[], object]]) -> float:
    """Microseconds a call, from graph replays of the calls in a row."""
    return bench_graph(calls) * 1e3


def timed_int4(mmas: list[Int4WeightMMA], fn: Callable[[Int4WeightMMA], object]) -> float:
    return timed([functools.partial(fn, q) for q in mmas])


def error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def gemm(args: argparse.Namespace) -> dict:
    """The GEMMs and the served path against the dense copy and dense bf16."""
    dtype = DTYPES[args.dtype]
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.dtype}, "
          f"group {args.group_size}{' symmetric' if args.symmetric else ''}; times in us")  # fmt: skip
    print(f"{'K x N':>13} {'M':>4} {'dense':>7} {'copy':>7} {'tc':>7} {'dot':>7} {'served':>7} "
          f"{'/dense':>7} {'/copy':>6} {'err tc':>8} {'err dot':>8}")  # fmt: skip
    rows = []
    for k, n in parse_shapes(args.shapes):
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.float32)
        mma = to_mma(quantize_int4(w, args.group_size, symmetric=args.symmetric), args.symmetric)
        del w
        w_ref = dequantize_int4(from_mma(mma))
        dense = w_ref.to(dtype)
        mmas = [mma] + [
            Int4WeightMMA(mma.tiles.clone(), mma.shape, mma.group_size, mma.symmetric)
            for _ in range(copies_for(mma.tiles.numel() * 4) - 1)
        ]
        denses = [dense] + [
            dense.clone() for _ in range(copies_for(dense.numel() * dense.element_size()) - 1)
        ]
        for m in batches:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.float32).to(dtype)
            ref = x.float() @ w_ref.T
            row: dict[str, object] = {"k": k, "n": n, "m": m}
            row["dense_us"] = timed([functools.partial(F.linear, x, d) for d in denses])
            row["copy_us"] = timed_int4(
                mmas, lambda q, x=x: torch.matmul(x, dequantize_mma(q, dtype))
            )
            for kernel in ("tc", "dot"):
                if m > MAX_M or (kernel == "tc" and m > TC_MAX_M):
                    row[f"{kernel}_us"] = row[f"err_{kernel}"] = float("nan")
                    continue
                config = gemm_config(kernel, m, n, k, args.group_size, sms)
                row[f"{kernel}_us"] = timed_int4(
                    mmas, lambda q, x=x, c=config: w4a16_mma_gemm(x, q, c)
                )
                row[f"err_{kernel}"] = error(w4a16_mma_gemm(x, mma, config), ref)
                row[f"{kernel}_config"] = dataclasses.asdict(config)
            row["served_us"] = timed_int4(mmas, lambda q, x=x: w4a16_mma_matmul(x, q))
            rows.append(row)
            served, dense_us, copy_us = row["served_us"], row["dense_us"], row["copy_us"]
            assert isinstance(served, float) and isinstance(dense_us, float)
            assert isinstance(copy_us, float)
            print(f"{k:>6}x{n:<6} {m:>4} {dense_us:7.1f} {copy_us:7.1f} {row['tc_us']:7.1f} "
                  f"{row['dot_us']:7.1f} {served:7.1f} {dense_us / served:6.2f}x "
                  f"{copy_us / served:5.2f}x {row['err_tc']:8.1e} {row['err_dot']:8.1e}",
                  flush=True)  # fmt: skip
        del mmas, denses, dense, w_ref
        torch.cuda.empty_cache()
    return {"rows": rows}


def smoke() -> None:
    """What runs without a GPU: the shape tables, the arguments, the INT4 layouts every
    variant is built from (quantize, tensor-core tiles, tinygemm's packing order) on a tiny
    weight, and the imports. The timings need CUDA graphs and the kernels' PTX: not run."""
    parser = build_parser()
    for argv in (["summary", "--shapes", "8b,70b,dsv3"], ["gemm", "--shapes", "1b,4096x4096"]):
        parser.parse_args(argv)
    assert len(parse_shapes("8b,70b,dsv3")) == 10 and parse_shapes("64x128") == [(64, 128)]
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    q = quantize_int4(w, GROUP)
    mma = to_mma(q)
    back = dequantize_int4(from_mma(mma))
    assert torch.equal(back, dequantize_int4(q)), "tensor-core tiles lost codes"
    err = float((back - w).norm() / w.norm())
    codes = unpack_int4(q.packed)
    assert codes.shape == (128, 256) and int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert callable(w4a16_mma_matmul) and callable(w4a16_mma_gemm) and MAX_M >= TC_MAX_M
    print(f"smoke: {len(parse_shapes('1b,8b,70b,dsv3'))} layer shapes; INT4 g{GROUP} round trip "
          f"through the tensor-core tiles exact, quantization error {err:.3f}; timings need a "
          "GPU (CUDA graphs, mma.sync): not run")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=("summary", "gemm"), default="summary")
    parser.add_argument("--smoke", action="store_true", help="CPU: shapes, layouts, imports")
    parser.add_argument("--shapes", default=None, help="default: summary 8b,70b,dsv3; gemm 1b,8b")
    parser.add_argument("--batches", default=None, help="default: summary 1,4,16,64; gemm 16-256")
    parser.add_argument("--rounds", type=int, default=3, help="summary: alternating rounds")
    parser.add_argument("--group-size", type=int, default=GROUP, help="gemm")
    parser.add_argument("--symmetric", action="store_true", help="gemm: scales alone")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="gemm: activations")
    parser.add_argument("--json", type=Path)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.smoke:
        return smoke()
    summary_mode = args.mode == "summary"
    args.shapes = args.shapes or ("8b,70b,dsv3" if summary_mode else "1b,8b")
    args.batches = args.batches or ("1,4,16,64" if summary_mode else "16,32,64,128,256")
    result = summary(args) if summary_mode else gemm(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
