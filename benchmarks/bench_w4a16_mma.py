"""Decode GEMV on the GPU: tensor-core W4A16 (Int4WeightMMA) vs the CUDA-core GEMV vs dense.

    python benchmarks/bench_w4a16_mma.py [--shapes 70b | 4096x4096,...] [--batches 1,4,8]
                                         [--sweep] [--json out.json]

For each layer shape (K in -> N out) and decode batch M it times, side by side in one
run, with the CUDA-graph harness of bench_w4a16.py (each call on R weight copies that
together span 4x the L2, replay time / R):
  dense     F.linear(x, W), W [N, K] in the activations' dtype (cuBLAS): bf16, or fp16
            with --dtype fp16 (JSON rows say which; before the ninth session's last runs
            the keys were named bf16_*)
  gemv      w4a16_gemv over Int4WeightKN (CUDA cores; what Int4Linear runs for fp32
            activations, and for groups of 32 before the twelfth session)
  gemv fp32 the same with fp32 activations (what the service's INT4 layers ran on a GPU
            before the twelfth session)
  mma       w4a16_mma_gemv over Int4WeightMMA (tensor cores), its heuristic config; on
            Hopper each call launches early behind the one before (PDL), as consecutive
            layers of a decode step would, and waits for it before reading x
  mma not early   the same, each call launched after the previous one completes
and prints speedups, each kernel's bandwidth as a fraction of a device-to-device copy
measured in the same run, and the relative error against the fp32 reference.
--equal-bytes also times, at M = 1, cuBLAS over a dense matrix of the same N and as
many bytes as the INT4 weight (K cut to match): the time a kernel reading INT4's bytes
as efficiently as cuBLAS reads its own would take, so the ratio over the dense baseline
a GEMV of INT4 weights could reach at that size without beating cuBLAS's efficiency.
--sweep also times the mma kernel over warps x row blocks per warp x accumulator chains
x register caps x groups per split at M = 1. INT4 is group 128 (--group-size 32 or 64
for others; a group of 32 is SmolLM2's GGUF Q4_1), fp16 scale and min per group. Needs
torch, triton, numpy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import (
    ACTIVATION_DTYPES,
    GROUP,
    SHAPES,
    bench_graph,
    copies_for,
    copy_bandwidth,
    parse_shapes,
    read_floor_us,
)

from gpu_node.kernels.w4a16_gemv import w4a16_gemv
from gpu_node.kernels.w4a16_mma import mma_gemv_config, w4a16_mma_gemv
from gpu_node.quant.int4 import dequantize_int4, mma_step, quantize_int4, to_kn, to_mma


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def sweep(
    k: int,
    n: int,
    mmas: list,
    num_sms: int,
    warp_list: tuple[int, ...] = (2, 4, 8),
    split_list: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    rows_list: tuple[int, ...] = (1, 2),
    chain_list: tuple[int, ...] = (1,),
    maxnreg_list: tuple[int, ...] = (0,),
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = GROUP,
) -> None:
    """M = 1: warps x row blocks per warp x chains x caps x splits, then the best
    config with its loads alone (MODE 1) and without the activation sums (MODE 2)."""
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    groups = k // mma_step(group_size)  # loop steps
    results = []
    if group_size == 32:
        chain_list = (2,)  # groups of 32 take two chains (one accumulator a group)
    for warps, rows, chains, maxnreg, per_split in itertools.product(
        warp_list, rows_list, chain_list, maxnreg_list, split_list
    ):
        if per_split > groups:
            continue
        cfg = {
            "WARPS": warps,
            "R": rows,
            "CHAINS": chains,
            "MAXNREG": maxnreg,
            "GROUPS_PER_SPLIT": per_split,
        }
        t = bench_graph([lambda q=q, c=cfg: w4a16_mma_gemv(x, q, config=c) for q in mmas])
        results.append((t * 1e3, cfg))
    heuristic = mma_gemv_config(n, k, group_size, num_sms)
    t_h = bench_graph([lambda q=q: w4a16_mma_gemv(x, q) for q in mmas]) * 1e3
    results.sort(key=lambda r: r[0])
    best_t, best = results[0]
    print(f"sweep {k}x{n} M=1: best {best_t:.1f} us {best}; heuristic {t_h:.1f} us {heuristic}")
    for t, cfg in results[:16]:
        print(f"  {t:.1f} us {cfg}")
    for mode, what in ((1, "loads alone"), (2, "no activation sums")):
        cfg = {**best, "MODE": mode}
        t = bench_graph([lambda q=q, c=cfg: w4a16_mma_gemv(x, q, config=c) for q in mmas]) * 1e3
        print(f"  best config, {what}: {t:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--equal-bytes", action="store_true", help="see the docstring")
    parser.add_argument("--sweep-warps", default="2,4,8")
    parser.add_argument("--sweep-splits", default="1,2,4,8,16,32", help="groups per split")
    parser.add_argument("--sweep-rows", default="1,2", help="row blocks per warp")
    parser.add_argument("--sweep-chains", default="1", help="accumulators per mma chain")
    parser.add_argument("--sweep-maxnreg", default="0", help="register caps (0: none)")
    parser.add_argument(
        "--dtype",
        choices=tuple(ACTIVATION_DTYPES),
        default="bf16",
        help="activations and the dense baseline",
    )
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=GROUP)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    group = args.group_size
    batches = [int(b) for b in args.batches.split(",")]
    dtype = ACTIVATION_DTYPES[args.dtype]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(
        f"device {props.name}, {props.multi_processor_count} SMs; copy bandwidth {bw / 1e12:.2f} TB/s"
        f"; activations and dense baseline {args.dtype}; INT4 group {group}"
    )
    rows = []
    for k, n in args.shapes:
        w0 = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        ws = [w0] + [torch.randn_like(w0) / k**0.5 for _ in range(copies_for(2 * n * k) - 1)]
        q0 = quantize_int4(w0, group)
        qs = [q0] + [
            quantize_int4(torch.randn_like(w0), group) for _ in range(copies_for(q0.nbytes) - 1)
        ]
        kns = [to_kn(q) for q in qs]
        mmas = [to_mma(q) for q in qs]
        del qs[1:]
        w_ref = dequantize_int4(q0)  # fp32 [N, K]
        floor_us = read_floor_us(q0.nbytes)
        print(f"{k}x{n}: INT4 {q0.nbytes / 1e6:.1f} MB, read floor {floor_us:.1f} us")
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = x.float() @ w_ref.T
            err_gemv = rel_err(w4a16_gemv(x, kns[0]), ref)
            err_mma = rel_err(w4a16_mma_gemv(x, mmas[0]), ref)
            t_dense = bench_graph([lambda x=x, w=w: F.linear(x, w) for w in ws]) * 1e3
            t_gemv = bench_graph([lambda x=x, q=q: w4a16_gemv(x, q) for q in kns]) * 1e3
            x32 = x.float()
            t_gemv32 = bench_graph([lambda x=x32, q=q: w4a16_gemv(x, q) for q in kns]) * 1e3
            t_mma = bench_graph([lambda x=x, q=q: w4a16_mma_gemv(x, q) for q in mmas]) * 1e3
            late = {"EARLY": 0}
            t_late = (
                bench_graph([lambda x=x, q=q, c=late: w4a16_mma_gemv(x, q, config=c) for q in mmas])
                * 1e3
            )
            io = 2 * m * (k + n)
            row = {
                "K": k,
                "N": n,
                "M": m,
                "dtype": args.dtype,
                "group_size": group,
                "dense_us": t_dense,
                "gemv_fp32_us": t_gemv32,
                "mma_vs_gemv_fp32": t_gemv32 / t_mma,
                "gemv_us": t_gemv,
                "mma_us": t_mma,
                "mma_not_early_us": t_late,
                "mma_not_early_vs_dense": t_dense / t_late,
                "mma_vs_dense": t_dense / t_mma,
                "gemv_vs_dense": t_dense / t_gemv,
                "mma_vs_gemv": t_gemv / t_mma,
                "dense_bw": (2 * n * k + io) / (t_dense * 1e-6) / bw,
                "gemv_bw": (q0.nbytes + io) / (t_gemv * 1e-6) / bw,
                "mma_bw": (mmas[0].nbytes + io) / (t_mma * 1e-6) / bw,
                "read_floor_us": floor_us,
                "ideal_vs_dense": (2 * n * k + io) / (q0.nbytes + io),
                "err_gemv": err_gemv,
                "err_mma": err_mma,
            }
            if args.equal_bytes and m == 1:
                k_eq = max(64, round(mmas[0].nbytes / (2 * n) / 64) * 64)
                copies = copies_for(2 * n * k_eq)
                eqs = [torch.randn(n, k_eq, device="cuda", dtype=dtype) for _ in range(copies)]
                x_eq = torch.randn(1, k_eq, device="cuda", dtype=dtype)
                t_eq = bench_graph([lambda x=x_eq, w=w: F.linear(x, w) for w in eqs]) * 1e3
                row["dense_equal_bytes_K"] = k_eq
                row["dense_equal_bytes_us"] = t_eq
                row["equal_bytes_vs_dense"] = t_dense / t_eq
                row["us_for_3x"] = t_dense / 3
                del eqs
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.sweep:

            def ints(text: str) -> tuple[int, ...]:
                return tuple(int(v) for v in text.split(",") if v)

            sweep(
                k,
                n,
                mmas,
                props.multi_processor_count,
                ints(args.sweep_warps),
                ints(args.sweep_splits),
                ints(args.sweep_rows),
                ints(args.sweep_chains),
                ints(args.sweep_maxnreg),
                dtype,
                group,
            )
        del ws, kns, mmas, w_ref
    print()
    print(
        f"| K x N | M | {args.dtype} us | GEMV us | MMA us | MMA not early us | MMA vs {args.dtype} "
        f"| GEMV vs {args.dtype} "
        "| MMA vs GEMV | GEMV fp32 us | MMA vs GEMV fp32 "
        f"| {args.dtype} BW | GEMV BW | MMA BW | ideal | read floor us | rel err GEMV | rel err MMA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['K']}x{r['N']} | {r['M']} | {r['dense_us']:.1f} | {r['gemv_us']:.1f} | "
            f"{r['mma_us']:.1f} | {r['mma_not_early_us']:.1f} | **{r['mma_vs_dense']:.2f}x** | "
            f"{r['gemv_vs_dense']:.2f}x | "
            f"{r['mma_vs_gemv']:.2f}x | {r['gemv_fp32_us']:.1f} | {r['mma_vs_gemv_fp32']:.2f}x | "
            f"{r['dense_bw']:.2f} | {r['gemv_bw']:.2f} | "
            f"{r['mma_bw']:.2f} | {r['ideal_vs_dense']:.2f}x | {r['read_floor_us']:.1f} | "
            f"{r['err_gemv']:.1e} | {r['err_mma']:.1e} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
