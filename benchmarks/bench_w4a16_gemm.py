"""W4A16 past the decode GEMV, on the GPU: the GEMMs vs the dense copy + cuBLAS vs dense bf16.

    TRITON_INTERPRET=0 python3 benchmarks/bench_w4a16_gemm.py [--shapes 1b,8b | KxN,...]
        [--batches 16,32,64,128,256,512] [--group 128] [--symmetric] [--dtype bf16|fp16]
        [--sweep] [--json out.json]

For each layer shape (K in -> N out) and batch M it times, side by side in one run, with
the CUDA-graph harness of bench_w4a16.py (each call on R weight copies that together span
4x the L2, replay time / R):
  dense     F.linear(x, W), W [N, K] in the activations' dtype (cuBLAS)
  copy      torch.matmul(x, dequantize_mma(W)): a dense W written, then read by cuBLAS
            (what Int4Linear runs past w4a16_mma_gemm.MAX_M rows)
  tc, dot   w4a16_mma_gemm's two kernels with their heuristic configs (tc up to
            TC_MAX_M rows)
  served    w4a16_mma_matmul: what Int4Linear runs (GEMV, tc, dot or the copy)
and prints the served path's speedup over dense and over the copy, and each kernel's
error against the fp32 reference. --sweep also times a grid of configs of each kernel and
prints the fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import bench_graph, copies_for

from gpu_node.kernels.w4a16_mma import w4a16_mma_matmul
from gpu_node.kernels.w4a16_mma_dequant import dequantize_mma
from gpu_node.kernels.w4a16_mma_gemm import (
    MAX_M,
    TC_MAX_M,
    DotConfig,
    GemmConfig,
    TcConfig,
    gemm_config,
    w4a16_mma_gemm,
)
from gpu_node.quant.int4 import Int4WeightMMA, dequantize_int4, from_mma, quantize_int4, to_mma

# (K, N) of the products of a decoder layer: qkv, o, gate_up, down
SHAPES = {
    "1b": [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)],
    "8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
    "70b": [(8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)],
    "dsv3": [(7168, 18432), (18432, 7168)],  # DeepSeek-V3's dense MLP
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    for part in text.split(","):
        if part in SHAPES:
            shapes += SHAPES[part]
        else:
            k, n = part.lower().split("x")
            shapes.append((int(k), int(n)))
    return shapes


def tc_grid(m: int) -> list[GemmConfig]:
    return [
        TcConfig(mt=mt, r=r, warps=4, split_k=split)
        for mt, r, split in itertools.product((1, 2, 4), (1, 2), (1, 2, 4, 8))
        if 8 * mt <= max(8, m)
    ]


def dot_grid(m: int) -> list[GemmConfig]:
    grid: list[GemmConfig] = []
    for block_m, rb, split, warps in itertools.product(
        (16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 4), (4, 8)
    ):
        rows = block_m * rb * 16
        if block_m <= max(16, m) and rows <= 128 * 128 and not (warps == 8 and rows < 64 * 64):
            grid.append(
                DotConfig(block_m=block_m, rb=rb, split_k=split, num_warps=warps, num_stages=3)
            )
    return grid


def timed(calls: list[Callable[[], object]]) -> float:
    """Microseconds a call, from graph replays of the calls in a row."""
    return bench_graph(calls) * 1e3


def timed_int4(mmas: list[Int4WeightMMA], fn: Callable[[Int4WeightMMA], object]) -> float:
    return timed([functools.partial(fn, q) for q in mmas])


def error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--batches", default="16,32,64,128,256,512")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--symmetric", action="store_true")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.dtype}, "
          f"group {args.group}{' symmetric' if args.symmetric else ''}; times in us")  # fmt: skip
    print(f"{'K x N':>13} {'M':>4} {'dense':>7} {'copy':>7} {'tc':>7} {'dot':>7} {'served':>7} "
          f"{'/dense':>7} {'/copy':>6} {'err tc':>8} {'err dot':>8}")  # fmt: skip
    rows = []
    for k, n in parse_shapes(args.shapes):
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.float32)
        mma = to_mma(quantize_int4(w, args.group, symmetric=args.symmetric), args.symmetric)
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
                config = gemm_config(kernel, m, n, k, args.group, sms)
                row[f"{kernel}_us"] = timed_int4(
                    mmas, lambda q, x=x, c=config: w4a16_mma_gemm(x, q, c)
                )
                row[f"err_{kernel}"] = error(w4a16_mma_gemm(x, mma, config), ref)
                row[f"{kernel}_config"] = dataclasses.asdict(config)
            row["served_us"] = timed_int4(mmas, lambda q, x=x: w4a16_mma_matmul(x, q))
            note = ""
            if args.sweep:
                for kernel, grid in (("tc", tc_grid(m)), ("dot", dot_grid(m))):
                    if m > MAX_M or (kernel == "tc" and m > TC_MAX_M):
                        continue
                    steps = k // (max(64, args.group) if kernel == "tc" else args.group)
                    best = min(
                        (timed_int4(mmas, lambda q, x=x, c=cfg: w4a16_mma_gemm(x, q, c)), i)
                        for i, cfg in enumerate(grid)
                        if cfg.split_k <= steps
                    )
                    fastest = dataclasses.asdict(grid[best[1]])
                    row[f"best_{kernel}_us"], row[f"best_{kernel}"] = best[0], fastest
                    note += f" | {kernel} {best[0]:.1f} " + " ".join(
                        f"{key}={v}" for key, v in fastest.items()
                    )
            rows.append(row)
            served, dense_us, copy_us = row["served_us"], row["dense_us"], row["copy_us"]
            assert isinstance(served, float) and isinstance(dense_us, float)
            assert isinstance(copy_us, float)
            print(f"{k:>6}x{n:<6} {m:>4} {dense_us:7.1f} {copy_us:7.1f} {row['tc_us']:7.1f} "
                  f"{row['dot_us']:7.1f} {served:7.1f} {dense_us / served:6.2f}x "
                  f"{copy_us / served:5.2f}x {row['err_tc']:8.1e} {row['err_dot']:8.1e}{note}",
                  flush=True)  # fmt: skip
        del mmas, denses, dense, w_ref
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
