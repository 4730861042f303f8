"""One call each of the W4A16 tensor-core GEMV, its loads alone, a plain read of the same
bytes and bf16 cuBLAS, for Nsight Compute to profile (the counters behind the benchmark).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/ncu_w4a16_mma.py [--shape 8192x28672]

Only the four calls run between cudaProfilerStart and Stop. Needs torch, triton, numpy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_w4a16 import GROUP, _stream_kernel, parse_shapes

from gpu_node.kernels.w4a16_mma import mma_gemv_config, w4a16_mma_gemv
from gpu_node.quant.int4 import quantize_int4, to_mma


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=parse_shapes, default=parse_shapes("8192x28672"))
    args = parser.parse_args()
    ((k, n),) = args.shape
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    q = to_mma(quantize_int4(w, GROUP))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    words = q.tiles.reshape(-1)
    block = 8192
    sums = torch.empty(triton.cdiv(words.numel(), block), device="cuda", dtype=torch.int32)
    config = mma_gemv_config(n, k, GROUP, torch.cuda.get_device_properties(0).multi_processor_count)
    calls = {
        "mma": lambda: w4a16_mma_gemv(x, q),
        "mma loads alone": lambda: w4a16_mma_gemv(x, q, config={**config, "MODE": 1}),
        "read": lambda: _stream_kernel[(sums.numel(),)](
            words, sums, words.numel(), BLOCK=block, num_warps=8
        ),
        "bf16": lambda: F.linear(x, w),
    }
    for fn in calls.values():  # compile outside the profiled range
        fn()
    torch.cuda.synchronize()
    print(f"{k}x{n} M=1, config {config}; profiled in order: {', '.join(calls)}", flush=True)
    torch.cuda.profiler.start()
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
