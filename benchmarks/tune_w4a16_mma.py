"""Tunes the tensor-core W4A16 GEMV's launch per layer shape on this GPU, at M = 1, and
writes the winners into the tuning table the serving path reads
(gpu_node/kernels/w4a16/mma_tuned.json, keyed by the GPU's name).

    TRITON_INTERPRET=0 python3 benchmarks/tune_w4a16_mma.py [--shapes 8192x8192,...]
        [--group-size 128] [--layouts asym] [--rounds 4] [--keep 3] [--min-gain 0.03]
        [--dtype bf16] [--out gpu_node/kernels/w4a16/mma_tuned.json]
    TRITON_INTERPRET=0 python3 benchmarks/tune_w4a16_mma.py --check [--shapes ...] [--rounds 5]
        [--dtypes bf16,fp16]
    .venv/bin/python benchmarks/tune_w4a16_mma.py --smoke      # CPU: table, candidates (CI)

For each shape (K in -> N out) it times, by bench_w4a16.py's CUDA-graph harness (weight
copies spanning 4x the L2), the heuristic's launch and a fixed set of others: one- and
two-row-block warps on splits of 4 to 32 steps, the two-buffer loop, and KWARPS launches
(4 or 8 warps, one or two row blocks, 4 to 32 steps a warp, either loop). One pass over all
of them picks the `--keep` fastest; those and the heuristic are then timed again in
`--rounds` rounds that alternate them (the machine is shared and noisy). A launch enters the
table only if its median beats the heuristic's by `--min-gain` and it is faster in every one
of those rounds; otherwise the shape's entry is removed and the heuristic stands. Entries of
other GPUs and shapes are kept. With --check it tunes nothing: it times bf16 cuBLAS, the
heuristic and what the serving path runs (the table's config, where it has one) side by
side, in alternating rounds. Needs torch, triton, numpy.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Sequence
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import (
    ACTIVATION_DTYPES,
    bench_graph,
    copies_for,
    copy_bandwidth,
    parse_shapes,
    read_floor_us,
)

from gpu_node.kernels.w4a16 import mma_plan as plan_module
from gpu_node.kernels.w4a16.mma import w4a16_mma_gemv
from gpu_node.quant.int4 import mma_step, quantize_int4, to_mma


def candidates(
    n: int, k: int, group: int, symmetric: bool, device: torch.device
) -> dict[str, dict[str, int]]:
    """The launches tried at a shape (each one the plan accepts), the heuristic first."""
    base = plan_module.mma_gemv_config(n, k, group, plan_module.num_sms(device), symmetric)
    steps = k // mma_step(group)
    out: dict[str, dict[str, int]] = {"heuristic": base}
    chains = functools.partial(plan_module.default_chains, group_size=group)
    for rows, per_split in ((1, 4), (1, 8), (1, 16), (1, 32), (2, 8), (2, 16)):
        if per_split <= steps:
            cfg = {"WARPS": 4, "R": rows, "GROUPS_PER_SPLIT": per_split, "CHAINS": chains(rows)}
            out[f"R{rows} s{per_split}"] = cfg
    if not symmetric:
        out["two buffers"] = {**base, "PIPE": 2}
        for warps in (4, 8):
            for rows in (1, 2):
                for per_warp in (4, 8, 16, 32):
                    for pipe in (0, 2):
                        cfg = {"KWARPS": 1, "WARPS": warps, "R": rows, "CHAINS": chains(rows),
                               "GROUPS_PER_SPLIT": per_warp, "PIPE": pipe}  # fmt: skip
                        out[f"KW{warps} R{rows} w{per_warp} P{pipe}"] = cfg
    taken = {}
    for name, cfg in out.items():
        try:
            plan_module.plan_launch(n, k, group, torch.bfloat16, device, symmetric, cfg)
        except ValueError:
            continue
        taken[name] = cfg
    return taken


def time_all(calls: dict[str, list], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fns in calls.items():
            times[name].append(bench_graph(fns) * 1e3)
    return times


def make_weights(n: int, k: int, group: int, symmetric: bool, device: torch.device) -> list:
    """Enough weight copies of one shape to span 4x the L2 (each call reads from DRAM)."""
    weights = []
    while not weights or len(weights) < copies_for(weights[0].nbytes):
        q = quantize_int4(torch.randn(n, k, device=device) / k**0.5, group, symmetric)
        weights.append(to_mma(q, symmetric=symmetric))
    return weights


def check(
    shapes: list[tuple[int, int]],
    group: int,
    layouts: list[str],
    rounds: int,
    device: torch.device,
    dtypes: Sequence[str] = ("bf16",),
) -> None:
    """bf16 cuBLAS, the heuristic and the serving path's plan, side by side, per layout.

    Beside them, what bounds the ratio at the shape: cuBLAS bf16 over a dense [N, K'] with
    as many bytes as the INT4 tiles (the time a GEMV reading INT4's bytes as well as cuBLAS
    reads its own would take; its ratio over bf16 is "ceiling"), the fastest plain read of
    those bytes ("read floor") and the served kernel's share of the copy bandwidth. With
    `dtypes` bf16,fp16 the served kernel runs from fp16 activations too (the same weights;
    the ratio is still over cuBLAS bf16, whose fp16 time is the same bytes).
    """
    others = [name for name in dtypes if name != "bf16"]  # activations timed beside bf16's
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for k, n in shapes:
        dense = [
            torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
            for _ in range(copies_for(2 * n * k))
        ]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        calls = {"bf16": [lambda w=w, x=x: F.linear(x, w) for w in dense]}
        for name in others:  # cuBLAS over the same matrices in that dtype, for its ratio
            dtype = ACTIVATION_DTYPES[name]
            x_as, dense_as = x.to(dtype), [w.to(dtype) for w in dense]
            calls[name] = [lambda w=w, x=x_as: F.linear(x, w) for w in dense_as]
        weights = {layout: make_weights(n, k, group, layout == "sym", device) for layout in layouts}
        for layout, qs in weights.items():
            calls[f"{layout} heuristic"] = [
                lambda q=q, x=x: w4a16_mma_gemv(x, q, config={}) for q in qs
            ]
            calls[f"{layout} served"] = [lambda q=q, x=x: w4a16_mma_gemv(x, q) for q in qs]
            for name in others:
                x_as = x.to(ACTIVATION_DTYPES[name])
                calls[f"{layout} served {name}"] = [
                    lambda q=q, x=x_as: w4a16_mma_gemv(x, q) for q in qs
                ]
        nbytes = weights[layouts[0]][0].nbytes
        k_eq = max(64, round(nbytes / (2 * n) / 64) * 64)
        same_bytes = [
            torch.randn(n, k_eq, device=device, dtype=torch.bfloat16)
            for _ in range(copies_for(2 * n * k_eq))
        ]
        x_eq = torch.randn(1, k_eq, device=device, dtype=torch.bfloat16)
        calls["bf16, INT4 bytes"] = [lambda w=w, x=x_eq: F.linear(x, w) for w in same_bytes]
        times = time_all(calls, rounds)
        med = {c: statistics.median(t) for c, t in times.items()}
        floor = read_floor_us(nbytes)
        bf16, same = med["bf16"], med["bf16, INT4 bytes"]
        print(
            f"{k}x{n} g{group} M=1: bf16 {bf16:.1f} us; bf16 over {layouts[0]} INT4's bytes "
            f"(K {k_eq}) {same:.1f} us, ceiling {bf16 / same:.2f}x; read floor {floor:.1f} us",
            flush=True,
        )
        for layout, qs in weights.items():
            served = med[f"{layout} served"]
            heuristic = med[f"{layout} heuristic"]
            tuned = plan_module.tuned_config(n, k, group, device, layout == "sym")
            print(
                f"  {layout}: heuristic {heuristic:.1f} ({bf16 / heuristic:.2f}x), served "
                f"{served:.1f} us ({bf16 / served:.2f}x, {qs[0].nbytes / (served * 1e-6) / bandwidth:.0%}"
                f" of copy bandwidth); served over heuristic {heuristic / served:.3f}; "
                f"table {tuned}",
                flush=True,
            )
            for name in others:
                other = med[f"{layout} served {name}"]
                print(
                    f"  {layout} from {name} activations: served {other:.1f} us "
                    f"({bf16 / other:.2f}x over bf16 cuBLAS, {med[name] / other:.2f}x over "
                    f"{name} cuBLAS {med[name]:.1f} us; {served / other:.3f}x over bf16 "
                    f"activations)",
                    flush=True,
                )
        print(f"  rounds: { {c: [round(t, 1) for t in v] for c, v in times.items()} }", flush=True)
        del weights, dense, same_bytes, calls


def smoke(shapes: Sequence[tuple[int, int]]) -> None:
    """What runs without a GPU: the serving table reads back and each entry's launch is one
    the plan accepts, and the candidates at each shape are planned. Timing needs a GPU."""
    cpu = torch.device("cpu")
    table = json.loads(plan_module.TUNED_PATH.read_text())
    entries = 0
    for device in table["devices"].values():
        for key, entry in device["configs"].items():
            assert isinstance(entry["config"], dict) and entry["us"] > 0, key
            entries += 1
    for k, n in shapes:
        for symmetric in (False, True):
            configs = candidates(n, k, 128, symmetric, cpu)
            assert "heuristic" in configs, (k, n, symmetric)
    print(f"smoke: {entries} tuned entries over {len(table['devices'])} GPUs read back; "
          f"{len(shapes)} shapes' candidates planned; timing needs a GPU: not run")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU: the table and candidates")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("70b"))
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=128)
    parser.add_argument("--layouts", default="asym", help="asym, sym or asym,sym")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--min-gain", type=float, default=0.03)
    parser.add_argument("--out", type=Path, help="default: the serving table (bf16 only)")
    parser.add_argument("--check", action="store_true", help="time the table against the heuristic")
    parser.add_argument("--dtypes", default="bf16", help="--check: bf16 or bf16,fp16")
    parser.add_argument(
        "--dtype", choices=tuple(ACTIVATION_DTYPES), default="bf16", help="tuning's activations"
    )
    args = parser.parse_args()
    if args.smoke:
        return smoke(args.shapes)
    unknown = sorted(set(args.dtypes.split(",")) - set(ACTIVATION_DTYPES))
    if unknown:
        parser.error(f"--dtypes takes {', '.join(ACTIVATION_DTYPES)}, got {', '.join(unknown)}")
    if args.out is None:
        if args.dtype != "bf16":
            # the table is keyed without the activations' dtype: it holds bf16's launches
            parser.error(f"--dtype {args.dtype} needs --out (the serving table is bf16's)")
        args.out = plan_module.TUNED_PATH
    device = torch.device("cuda")
    if args.check:
        dtypes = args.dtypes.split(",")
        check(args.shapes, args.group_size, args.layouts.split(","), args.rounds, device, dtypes)
        return
    name = plan_module.device_name(device)
    group = args.group_size
    table = json.loads(args.out.read_text()) if args.out.is_file() else {"devices": {}}
    table.setdefault("about", "w4a16_mma launch configs by GPU name and K x N/group/layout, "
                     "measured at M = 1 by benchmarks/tune_w4a16_mma.py")  # fmt: skip
    entry = table["devices"].setdefault(name, {"configs": {}})
    entry.update(tuned=date.today().isoformat(), triton=triton.__version__, torch=torch.__version__)
    torch.manual_seed(0)
    print(f"device {name}; group {group}; rounds {args.rounds}; keep {args.keep}", flush=True)
    for k, n in args.shapes:
        if k % mma_step(group) or n % 16:
            print(f"{k}x{n}: not a shape of INT4 tiles in groups of {group}; skipped", flush=True)
            continue
        for layout in args.layouts.split(","):
            symmetric = layout == "sym"
            weights = make_weights(n, k, group, symmetric, device)
            x = torch.randn(1, k, device=device, dtype=ACTIVATION_DTYPES[args.dtype])
            configs = candidates(n, k, group, symmetric, device)
            calls = {
                label: [lambda q=q, c=c, x=x: w4a16_mma_gemv(x, q, config=c) for q in weights]
                for label, c in configs.items()
            }
            first_pass = {label: t[0] for label, t in time_all(calls, 1).items()}
            ranked = sorted(first_pass, key=first_pass.__getitem__)
            finalists = ["heuristic", *[c for c in ranked if c != "heuristic"][: args.keep]]
            times = time_all({c: calls[c] for c in finalists}, args.rounds)
            med = {c: statistics.median(t) for c, t in times.items()}
            best = min(finalists, key=med.__getitem__)
            key = plan_module.tuned_key(n, k, group, symmetric)
            wins_every_round = all(
                b < h for b, h in zip(times[best], times["heuristic"], strict=True)
            )
            gain = med["heuristic"] / med[best] - 1
            ref = w4a16_mma_gemv(x, weights[0], config=configs["heuristic"])
            got = w4a16_mma_gemv(x, weights[0], config=configs[best])
            close = torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
            if best != "heuristic" and gain >= args.min_gain and wins_every_round and close:
                entry["configs"][key] = {
                    "config": configs[best],
                    "us": round(med[best], 2),
                    "heuristic_us": round(med["heuristic"], 2),
                }
                verdict = f"tuned: {best} {configs[best]}"
            else:
                entry["configs"].pop(key, None)
                verdict = "heuristic stands"
            print(
                f"{key}: heuristic {med['heuristic']:.1f} us, best {best} {med[best]:.1f} us "
                f"({gain:+.1%}, every round {wins_every_round}) -> {verdict}\n"
                f"  first pass: {', '.join(f'{c} {first_pass[c]:.1f}' for c in ranked)}\n"
                f"  rounds: { {c: [round(t, 1) for t in v] for c, v in times.items()} }",
                flush=True,
            )
            args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            del weights


if __name__ == "__main__":
    main()
