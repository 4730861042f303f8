"""The tensor-core W4A16 GEMV's load and layout variants side by side, at M = 1.

    python benchmarks/bench_w4a16_variants.py [--shapes 70b] [--rounds 2] [--dtype bf16]
        [--variants 'name=JSON;name=JSON'] [--json out.json]

For each layer shape (K in -> N out) it times, in one run and in rounds that alternate
the variants (the machine is shared and noisy: each round is a fresh pass over all of
them), bf16 cuBLAS (F.linear) and w4a16_mma_gemv over the same weight laid out two ways:

  asym      Int4WeightMMA with a scale and a min per group and row (Q4_1's arithmetic)
  sym       the scales alone (a symmetric weight: every min is -8 * scale), 3% fewer
            bytes at groups of 128

each under its heuristic config and the variants' config overrides (PIPE: 0 the
one-buffer loop, 2 the two-buffer loop, which symmetric tiles always take; R, CHAINS,
GROUPS_PER_SPLIT: the launch; any key of w4a16_mma_gemv's config). A variant a layout
refuses (PIPE 0 on symmetric tiles) is skipped for it. Timing is
bench_w4a16.py's CUDA-graph harness (weight copies spanning 4x the L2). It prints each
variant's median over the rounds, its spread, its speedup over bf16 and its bandwidth as a
fraction of a device-to-device copy measured in the same run. `--dtype fp16` runs the
kernels from fp16 activations (`--activations fp16`); the baseline stays bf16 cuBLAS, the
engine's default. Needs torch, triton, numpy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import (
    ACTIVATION_DTYPES,
    GROUP,
    bench_graph,
    copies_for,
    copy_bandwidth,
    parse_shapes,
)
from bench_w4a16_mma import rel_err

from gpu_node.kernels.w4a16_mma import mma_gemv_config, w4a16_mma_gemv
from gpu_node.quant.int4 import dequantize_int4, from_mma, quantize_int4, to_mma

DEFAULT_VARIANTS = {"heuristic": {}, "two buffers": {"PIPE": 2}}


def parse_variants(text: str) -> dict[str, dict]:
    out = {}
    for part in text.split(";"):
        if part.strip():
            name, _, cfg = part.partition("=")
            out[name.strip()] = json.loads(cfg)
    return out


def takes(weight: object, x: torch.Tensor, config: dict) -> bool:
    try:
        w4a16_mma_gemv(x, weight, config=config)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("70b"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", type=parse_variants, default=DEFAULT_VARIANTS)
    parser.add_argument("--layouts", default="asym,sym")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=GROUP)
    parser.add_argument("--dtype", choices=tuple(ACTIVATION_DTYPES), default="bf16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = ACTIVATION_DTYPES[args.dtype]
    group = args.group_size
    layouts = args.layouts.split(",")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(
        f"device {props.name}, {props.multi_processor_count} SMs; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s; {args.dtype} activations (bf16 cuBLAS); INT4 group {group}; "
        f"rounds {args.rounds}",
        flush=True,
    )
    rows = []
    for k, n in args.shapes:
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        dense = [w0] + [torch.randn_like(w0) / k**0.5 for _ in range(copies_for(2 * n * k) - 1)]
        # Symmetric weights, so both layouts hold the same values (the asym tiles store the
        # mins, -8 * scale, that the sym tiles leave out).
        quants = [quantize_int4(w, group, symmetric=True) for w in dense[:1]]
        copies = copies_for(to_mma(quants[0]).nbytes)
        quants += [
            quantize_int4(torch.randn_like(w0) / k**0.5, group, symmetric=True)
            for _ in range(copies - 1)
        ]
        weights = {
            "asym": [to_mma(q) for q in quants],
            "sym": [to_mma(q, symmetric=True) for q in quants],
        }
        x_bf16 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)  # cuBLAS's
        x = x_bf16.to(dtype)
        ref = x.float() @ dequantize_int4(from_mma(weights["sym"][0])).T
        sms = props.multi_processor_count
        bases = {  # each layout's own heuristic
            "asym": mma_gemv_config(n, k, group, sms),
            "sym": mma_gemv_config(n, k, group, sms, symmetric=True),
        }
        configs = {  # the variants each layout takes (PIPE 0 is refused for symmetric tiles)
            f"{layout} {name}": (layout, name, {**bases[layout], **cfg})
            for layout in layouts
            for name, cfg in args.variants.items()
            if takes(weights[layout][0], x, {**bases[layout], **cfg})
        }
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            times.setdefault("bf16", []).append(
                bench_graph([lambda w=w, x=x_bf16: F.linear(x, w) for w in dense]) * 1e3
            )
            for key, (layout, _, c) in configs.items():
                t = bench_graph(
                    [lambda q=q, c=c, x=x: w4a16_mma_gemv(x, q, config=c) for q in weights[layout]]
                )
                times.setdefault(key, []).append(t * 1e3)
        t_dense = statistics.median(times["bf16"])
        print(f"\n{k}x{n} M=1 (heuristics {bases}); bf16 {t_dense:.1f} us {times['bf16']}")
        for key, (layout, name, c) in configs.items():
            nbytes = weights[layout][0].nbytes
            t = statistics.median(times[key])
            # A benchmark-only variant (MODE: the math left out; NO_SUM: y never written) has
            # no result to check.
            timing_only = c.get("MODE", 0) != 0 or c.get("NO_SUM", False)
            err = (
                float("nan")
                if timing_only
                else rel_err(w4a16_mma_gemv(x, weights[layout][0], config=c), ref)
            )
            row = {
                "K": k,
                "N": n,
                "layout": layout,
                "variant": name,
                "config": c,
                "us": t,
                "us_rounds": times[key],
                "bf16_us": t_dense,
                "vs_bf16": t_dense / t,
                "bw": (nbytes + 2 * (k + n)) / (t * 1e-6) / bw,
                "int4_mb": nbytes / 1e6,
                "rel_err": err,
            }
            rows.append(row)
            spread = max(times[key]) - min(times[key])
            print(
                f"  {key:28s} {t:6.1f} us (spread {spread:.1f}) {t_dense / t:5.2f}x bf16"
                f"  {row['bw']:.2f} of copy  {nbytes / 1e6:.1f} MB  err {err:.1e}",
                flush=True,
            )
        del dense, quants, weights
    if args.json:
        args.json.write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
