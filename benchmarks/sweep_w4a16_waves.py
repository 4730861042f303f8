"""Split counts that fill one wave, for the tensor-core decode GEMV at M = 1.

    python benchmarks/sweep_w4a16_waves.py [--shapes 70b | 4096x4096,...] [--group-size 128]

For each layer shape (K in -> N out) and each kind of warp (row blocks a warp R, mma
chains C), the compiled kernel's register count gives how many programs a
multiprocessor holds; S_fit is the most splits along K whose programs all fit in one
wave (programs along N x S <= programs a multiprocessor x multiprocessors). It times
S_fit - 1, S_fit and S_fit + 1 splits (SPLITS, the steps shared evenly) beside the
heuristic config (mma_gemv_config), all in one run, with bench_w4a16.py's CUDA-graph
harness (each call on weight copies spanning 4x the L2), and the dense bf16 F.linear
for the ratio. Needs torch, triton, numpy.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import GROUP, SHAPES, bench_graph, copies_for, parse_shapes

from gpu_node.kernels import w4a16_mma
from gpu_node.kernels.w4a16_mma import mma_gemv_config, w4a16_mma_gemv
from gpu_node.quant.int4 import MMA_ROWS, mma_step, quantize_int4, to_mma

REGS_PER_SM = 65536
REG_UNIT = 256  # registers are handed to a warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32


def programs_per_sm(regs_per_thread: int, warps: int) -> int:
    per_warp = -(-regs_per_thread * 32 // REG_UNIT) * REG_UNIT
    return min(REGS_PER_SM // (per_warp * warps), MAX_WARPS_PER_SM // warps, MAX_PROGRAMS_PER_SM)


def compiled_regs(call: Callable[[], object]) -> int:
    """Registers a thread of the GEMV kernel that `call` launches: the kernel cache is
    emptied first, so the one compiled entry is that launch's."""
    cache = w4a16_mma._gemv_mma_kernel.device_caches[torch.cuda.current_device()][0]
    cache.clear()
    call()
    (kernel,) = cache.values()
    return int(kernel.n_regs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES)
    parser.add_argument("--group-size", type=int, choices=(64, 128), default=GROUP)
    args = parser.parse_args()
    group = args.group_size
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {sms} SMs; bf16; INT4 group {group}")
    for k, n in args.shapes:
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ws = [w0] + [torch.randn_like(w0) for _ in range(copies_for(2 * n * k) - 1)]
        q0 = quantize_int4(w0, group)
        mmas = [to_mma(q0)] + [
            to_mma(quantize_int4(torch.randn_like(w0), group))
            for _ in range(copies_for(q0.nbytes) - 1)
        ]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        steps = k // mma_step(group)
        t_dense = bench_graph([lambda x=x, w=w: F.linear(x, w) for w in ws]) * 1e3
        heuristic = mma_gemv_config(n, k, group, sms)
        t_h = bench_graph([lambda x=x, q=q: w4a16_mma_gemv(x, q) for q in mmas]) * 1e3
        print(
            f"{k}x{n}: {steps} steps; bf16 {t_dense:.1f} us; heuristic {t_h:.1f} us "
            f"({t_dense / t_h:.2f}x) {heuristic}"
        )
        results = []
        for rows, chains in ((1, 1), (1, 2), (2, 1), (2, 2)):
            warps = 4
            along_n = triton.cdiv(triton.cdiv(n, MMA_ROWS), warps * rows)
            base = {"WARPS": warps, "R": rows, "CHAINS": chains, "GROUPS_PER_SPLIT": steps}
            one_split = {**base, "SPLITS": 1}
            regs = compiled_regs(functools.partial(w4a16_mma_gemv, x, mmas[0], config=one_split))
            fit = programs_per_sm(regs, warps) * sms // along_n
            for splits in sorted({max(1, min(steps, s)) for s in (fit - 1, fit, fit + 1)}):
                cfg = {**base, "SPLITS": splits}
                t = bench_graph(
                    [lambda x=x, q=q, c=cfg: w4a16_mma_gemv(x, q, config=c) for q in mmas]
                )
                t *= 1e3
                waves = along_n * splits / (programs_per_sm(regs, warps) * sms)
                results.append((t, rows, chains, splits, regs, waves))
                print(
                    f"  R {rows} C {chains} ({regs} regs, {programs_per_sm(regs, warps)} "
                    f"programs/SM) S {splits} ({waves:.2f} waves): {t:.1f} us "
                    f"({t_dense / t:.2f}x)" + ("  <- fit" if splits == fit else ""),
                    flush=True,
                )
        best = min(results)
        print(
            f"  best {best[0]:.1f} us ({t_dense / best[0]:.2f}x): R {best[1]} C {best[2]} S {best[3]}"
        )
        del ws, mmas


if __name__ == "__main__":
    main()
