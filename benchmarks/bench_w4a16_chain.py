"""Square W4A16 GEMVs chained, one launch a layer against one persistent launch a chain.

    python benchmarks/bench_w4a16_chain.py [--shapes 4096x4096,8192x8192] [--rounds 3]
        [--dtype bf16] [--json out.json]

For each square layer shape it builds R weight copies spanning 4x the L2 (as
bench_w4a16.py's harness does) and times, per layer, in rounds that alternate them (the
machine is shared and noisy):

  bf16           cuBLAS (F.linear), one call a layer, as bench_w4a16.py times it
  gemv           w4a16_mma_gemv one call a layer, every call on the same x (the harness's
                 figure; programmatic dependent launch orders them all the same)
  gemv chained   the same, each call reading the last one's y (a decode step's order)
  chain L        w4a16_mma_chain, the R layers in launches of L layers each (L = R: one)

and the chain's variants (`PREFETCH`: the next layer's other steps asked of L2 before the
wait; `NEXT_FIRST` 0: the next layer's first step loaded after the split sum; `NO_WAIT`, timing only: no layer waits for the last, what streaming the layers
costs without the barrier). Every figure is microseconds a layer (a launch's time
over its layers) and its ratio to bf16 cuBLAS in the same round. Before timing, each chain
launch is checked bit for bit against the GEMV one layer at a time at the split count the
chain ran with. Needs torch, triton, numpy.
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

from bench_w4a16 import ACTIVATION_DTYPES, GROUP, bench_graph, copies_for, copy_bandwidth

from gpu_node.kernels.w4a16_mma import w4a16_mma_gemv
from gpu_node.kernels.w4a16_mma_chain import (
    MMAChain,
    launch_info,
    launch_splits,
    w4a16_mma_chain,
)
from gpu_node.kernels.w4a16_mma_plan import mma_gemv_config
from gpu_node.quant.int4 import quantize_int4, to_mma

SQUARE = "2048x2048,3072x3072,4096x4096,5120x5120,8192x8192"
VARIANTS = {
    "": {},
    " l2": {"PREFETCH": 1},
    " next after": {"NEXT_FIRST": 0},
    " no wait": {"NO_WAIT": 1},
}


def parse_square(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        k, n = (int(v) for v in part.lower().split("x"))
        if k != n:
            raise argparse.ArgumentTypeError(f"a chain takes square layers, got {part}")
        sizes.append(n)
    return sizes


def chained(x: torch.Tensor, weights: list, config: dict | None = None):
    def run() -> torch.Tensor:
        y = x
        for w in weights:
            y = w4a16_mma_gemv(y, w, config=config)
        return y

    return run


def through(x: torch.Tensor, chains: list[MMAChain], config: dict):
    def run() -> torch.Tensor:
        y = x
        for chain in chains:
            y = w4a16_mma_chain(y, chain, config=config)[-1]
        return y

    return run


def check_exact(x: torch.Tensor, chains: list[MMAChain], config: dict) -> tuple[bool | None, int]:
    """Every layer of the first launch against the GEMV one layer at a time with the
    launch the chain ran (its rows a warp, chains and fitted splits)."""
    chain = chains[0]
    ys = w4a16_mma_chain(x, chain, config=config, check=True)
    splits = launch_splits(x, chain, config)
    n = chain.shape[0]
    base = mma_gemv_config(
        n, n, chain.group_size, torch.cuda.get_device_properties(0).multi_processor_count
    )
    gemv_config = {"WARPS": 4, "R": base["R"], "CHAINS": base["CHAINS"], "SPLITS": splits}
    if config.get("NO_WAIT"):  # timing only: the layers read y before it is written
        return None, splits
    y = x
    exact = True
    for index in range(chain.layers):
        y = w4a16_mma_gemv(y, chain.layer(index), config=gemv_config)
        exact &= torch.equal(ys[index], y)
    return exact, splits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=parse_square, default=parse_square(SQUARE))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=tuple(ACTIVATION_DTYPES), default="bf16")
    parser.add_argument("--lengths", default="0,8,4,2", help="layers a launch (0: all R)")
    parser.add_argument(
        "--variants", default=",".join(v.strip() or "plain" for v in VARIANTS),
        help="the chain's variants to run: plain, l2, next after, no wait",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = ACTIVATION_DTYPES[args.dtype]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(
        f"device {props.name}, {props.multi_processor_count} SMs; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s; {args.dtype} activations (bf16 cuBLAS); INT4 group {GROUP}, "
        f"asymmetric; rounds {args.rounds}",
        flush=True,
    )
    rows = []
    for n in args.shapes:
        dense = [
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5
            for _ in range(copies_for(2 * n * n))
        ]
        first = to_mma(quantize_int4(dense[0], GROUP))
        copies = copies_for(first.nbytes)
        weights = [first] + [
            to_mma(quantize_int4(torch.randn_like(dense[0]) / n**0.5, GROUP))
            for _ in range(copies - 1)
        ]
        x_bf16 = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
        x = x_bf16.to(dtype)
        lengths = [int(v) or copies for v in args.lengths.split(",")]
        lengths = [length for length in dict.fromkeys(lengths) if length <= copies]
        runs = {
            "bf16": ([lambda w=w, x=x_bf16: F.linear(x, w) for w in dense], 1),
            "gemv": ([lambda w=w, x=x: w4a16_mma_gemv(x, w) for w in weights], 1),
            "gemv chained": ([chained(x, weights)], copies),
        }
        exact = {}
        for length in lengths:
            usable = copies // length * length
            chains = [
                MMAChain.from_weights(weights[i : i + length]) for i in range(0, usable, length)
            ]
            chosen = {v.strip() for v in args.variants.split(",")}
            for suffix, config in VARIANTS.items():
                if (suffix.strip() or "plain") not in chosen:
                    continue
                name = f"chain {length}{suffix}"
                try:
                    exact[name] = check_exact(x, chains, config)
                except RuntimeError as err:  # a barrier gave up: say so, time the rest
                    print(f"  {name}: {err}", flush=True)
                    continue
                print(f"  {name}: {launch_info(x, chains[0], config)}", flush=True)
                runs[name] = ([through(x, chains, config)], usable)
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, (calls, layers) in runs.items():
                times.setdefault(name, []).append(bench_graph(calls) * 1e3 / layers)
        t_dense = statistics.median(times["bf16"])
        print(
            f"\n{n}x{n} M=1: {copies} INT4 layers of {first.nbytes / 1e6:.1f} MB "
            f"({len(dense)} bf16 copies); bf16 {t_dense:.1f} us a layer {times['bf16']}",
            flush=True,
        )
        for name, per_round in times.items():
            t = statistics.median(per_round)
            nbytes = first.nbytes if name != "bf16" else 2 * n * n
            ok, splits = exact.get(name, (None, None))
            row = {
                "N": n,
                "K": n,
                "variant": name,
                "us_per_layer": t,
                "us_rounds": per_round,
                "bf16_us": t_dense,
                "vs_bf16": t_dense / t,
                "bw": nbytes / (t * 1e-6) / bw,
                "splits": splits,
                "exact": ok,
            }
            rows.append(row)
            bits = {None: "not checked", True: "equal", False: "DIFFER"}[ok]
            extra = "" if splits is None else f"  splits {splits}  bits {bits}"
            print(
                f"  {name:22s} {t:6.2f} us (spread {max(per_round) - min(per_round):.2f}) "
                f"{t_dense / t:5.2f}x bf16  {row['bw']:.2f} of copy{extra}",
                flush=True,
            )
        del dense, weights, runs
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(
            json.dumps({"copy_bw": bw, "dtype": args.dtype, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
