"""The tensor-core W4A16 GEMV of an earlier revision against the working tree's, at M = 1,
each under its own launch heuristic, side by side in one run.

    git show REV:gpu_node/kernels/w4a16_mma.py > /tmp/w4a16_mma_rev.py
    TRITON_INTERPRET=0 python3 benchmarks/ab_w4a16_mma_revision.py /tmp/w4a16_mma_rev.py \\
        [--shapes 7168x18432,18432x7168] [--rounds 5] [--symmetric]

For each layer shape (K in -> N out, groups of 128) it alternates, round by round, bf16
cuBLAS (F.linear), the earlier module's w4a16_mma_gemv and the current one (over
asymmetric tiles, or with --symmetric over symmetric ones: scales alone), timed by
bench_w4a16.py's CUDA-graph harness (weight copies spanning 4x the L2), and prints the
medians, the speedups over bf16, current over earlier, each side's config, and whether
both gave the same bits. The earlier module must import against today's gpu_node (its
helpers are shared). Needs torch, triton, numpy.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import bench_graph, copies_for, parse_shapes

from gpu_node.kernels import w4a16_mma as current
from gpu_node.quant.int4 import quantize_int4, to_mma

GROUP = 128


def load_module(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("w4a16_mma_earlier", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("earlier", type=Path, help="an earlier revision's w4a16_mma.py")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("70b"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--symmetric", action="store_true", help="symmetric tiles (scales alone)")
    args = parser.parse_args()
    earlier = load_module(args.earlier)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    for k, n in args.shapes:
        dense = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            for _ in range(copies_for(2 * n * k))
        ]
        weights = [
            to_mma(
                quantize_int4(
                    torch.randn(n, k, device="cuda") / k**0.5, GROUP, symmetric=args.symmetric
                ),
                symmetric=args.symmetric,
            )
            for _ in range(copies_for(n * k // 2))
        ]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        same = torch.equal(
            current.w4a16_mma_gemv(x, weights[0]), earlier.w4a16_mma_gemv(x, weights[0])
        )
        times: dict[str, list[float]] = {"bf16": [], "earlier": [], "current": []}
        for _ in range(args.rounds):
            times["bf16"].append(
                bench_graph([lambda w=w, x=x: F.linear(x, w) for w in dense]) * 1e3
            )
            for name, module in (("earlier", earlier), ("current", current)):
                calls = [lambda q=q, m=module, x=x: m.w4a16_mma_gemv(x, q) for q in weights]
                times[name].append(bench_graph(calls) * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        configs = {
            name: module.mma_gemv_config(n, k, GROUP, sms, args.symmetric)
            for name, module in (("earlier", earlier), ("current", current))
        }
        print(
            f"{k}x{n} M=1{' symmetric' if args.symmetric else ''}: bf16 {med['bf16']:.1f} us, earlier {med['earlier']:.1f} "
            f"({med['bf16'] / med['earlier']:.2f}x), current {med['current']:.1f} "
            f"({med['bf16'] / med['current']:.2f}x); current over earlier "
            f"{med['earlier'] / med['current']:.3f}; same bits {same}\n"
            f"  earlier {configs['earlier']}\n  current {configs['current']}\n"
            f"  rounds { ({name: [round(t, 1) for t in v] for name, v in times.items()}) }",
            flush=True,
        )
        del dense, weights


if __name__ == "__main__":
    main()
