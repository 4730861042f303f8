"""Issue 8's W4A16 table in one run: what Int4Linear serves against bf16 and torch's int4.

    TRITON_INTERPRET=0 python3 benchmarks/bench_int4_summary.py [--shapes 8b,70b,dsv3 | KxN,...]
        [--batches 1,4,16,64] [--rounds 3] [--json out.json]

For each real layer shape (K in -> N out) and batch M it times, side by side, in rounds
that alternate the variants (the machine is shared and noisy; each figure is the median
of its rounds), with the CUDA-graph harness of bench_w4a16.py (each call on R weight
copies that together span 4x the L2, replay time / R):
  bf16      F.linear(x, W), W bf16 [N, K] (cuBLAS)
  tinygemm  torch._weight_int4pack_mm, torch's own int4 kernel, same codes, group 128
  served    w4a16_mma_matmul over Int4WeightMMA: what Int4Linear runs on a GPU (the
            tensor-core GEMV to 8 rows, the GEMMs to 64, with the tuned table's entries)
and at M = 1 also
  ceiling   cuBLAS over a dense bf16 matrix of N rows holding as many bytes as the INT4
            weight: what a kernel streaming INT4's bytes as well as cuBLAS streams its own
            would take, so bf16 / ceiling bounds the ratio such a kernel reaches.
It prints each one's speedup over bf16, the served kernel's bandwidth as a fraction of a
device-to-device copy measured in the same run, and the ideal ratio (bf16's bytes over
INT4's). Group 128, asymmetric (a scale and a minimum per group), bf16 activations.
Needs torch, triton and numpy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import bench_graph, copies_for, copy_bandwidth, to_tinygemm
from bench_w4a16_gemm import parse_shapes

from gpu_node.kernels.w4a16_mma import w4a16_mma_matmul
from gpu_node.quant.int4 import Int4WeightMMA, dequantize_int4, quantize_int4, to_mma

GROUP = 128


def median_rounds(variants: dict[str, list[Callable[[], object]]], rounds: int) -> dict[str, float]:
    """Microseconds a call of each variant: the median over rounds that alternate them."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, calls in variants.items():
            times[name].append(bench_graph(calls) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8b,70b,dsv3")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
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
    if args.json:
        args.json.write_text(json.dumps({"copy_bandwidth": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
