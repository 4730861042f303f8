"""W4A16 GEMM on the GPU: our Triton kernel vs torch bf16 matmul vs torch's int4 kernel.

    python benchmarks/bench_w4a16.py [--json out.json] [--gemv-only] [--no-sweep]
                                     [--shapes 8192x8192,8192x28672 | 70b]

For each real layer shape (K in -> N out) and M = 1, 4, 16, 64 it times:
  bf16        F.linear(x, W) with W bf16 [N, K]            (cuBLAS)
  torch-int4  torch._weight_int4pack_mm (tinygemm), group 128
  ours-mma    the tensor-core kernel of gpu_node.kernels.w4a16 over Int4Weight's
              layout (the MoE kernel's step), split-K at its heuristic's value
  ours-kn     what Int4Linear runs on CUDA: w4a16_kn_matmul over Int4WeightKN,
              i.e. the split-K GEMV for M <= 8 and its tensor-core kernel above
and prints the speedups and each kernel's achieved bandwidth as a fraction of a
device-to-device copy measured in the same run. --gemv-only skips M > 8 and the
tensor-core sweeps; --no-sweep skips all config sweeps. Needs only torch, triton,
numpy.

Timing: each variant is captured in a CUDA graph that calls it once on each of R
copies of the weights (R copies together span >= 4x the 60 MB L2, so every call
reads its weights from HBM), and the graph replay time is divided by R: what a
decode step run as a CUDA graph pays, without Python launch overhead (which on
the benchmark host exceeded the kernels' own time).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_node.config import ACTIVATIONS
from gpu_node.kernels.w4a16 import w4a16_config, w4a16_matmul, w4a16_matmul_ref
from gpu_node.kernels.w4a16_gemv import MAX_M, gemv_config, w4a16_gemv, w4a16_kn_matmul
from gpu_node.kv_quant import KV_DTYPES
from gpu_node.quant.int4 import Int4Weight, Int4WeightKN, quantize_int4, to_kn, unpack_int4

SHAPES = [  # (K, N): llama-3-8B q/o, up/gate, down; DeepSeek-V3 hidden -> expert
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (7168, 2048),
]
LARGE_SHAPES = [(8192, 8192), (8192, 28672), (28672, 8192)]  # llama-3-70B q/o, up/gate, down
BATCHES = [1, 4, 16, 64]
GROUP = 128
# The activation dtypes an INT4 model computes in on a GPU (--activations), by name
ACTIVATION_DTYPES = {name: KV_DTYPES[name] for name in ACTIVATIONS if name != "auto"}


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


def sweep_configs(k: int, n: int, qs: list[Int4Weight]) -> None:
    """Tile/split sweep on one shape, to check the heuristic against the best found."""
    for m in (1, 16, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        results = []
        for block_n in (32, 64, 128):
            for split in (1, 2, 4, 8, 16):
                cfg = {"BLOCK_N": block_n, "SPLIT_K": split}
                calls = [lambda x=x, q=q, c=cfg: w4a16_matmul(x, q, config=c) for q in qs]
                results.append((bench_graph(calls, replays=10) * 1e3, block_n, split))
        results.sort()
        best = ", ".join(f"{us:.1f} (BN {bn}, S {sp})" for us, bn, sp in results[:4])
        print(f"  sweep {k}x{n} M={m}: best {best}; worst {results[-1][0]:.1f}", flush=True)


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


def sweep_gemv(k: int, n: int, kns: list[Int4WeightKN], num_sms: int) -> None:
    """GEMV sweep at M = 1 (rows per lane x warps x unroll x groups per split) vs the heuristic."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    chosen = gemv_config(1, n, k, GROUP, num_sms)
    results = []
    for rows in (4,):
        for warps in (1, 2, 4, 8):
            for unroll in (8, 16):
                for per_split in (1, 2):
                    cfg = {"BLOCK_N": rows * 32 * warps, "num_warps": warps}
                    cfg |= {"UNROLL": unroll, "GROUPS_PER_SPLIT": per_split}
                    calls = [lambda x=x, q=q, c=cfg: w4a16_gemv(x, q, config=c) for q in kns]
                    key = (cfg["BLOCK_N"], warps, unroll, per_split)
                    results.append((bench_graph(calls, replays=10) * 1e3, key))
    heur_key = (
        chosen["BLOCK_N"],
        chosen["num_warps"],
        chosen["UNROLL"],
        chosen["GROUPS_PER_SPLIT"],
    )
    heur = [us for us, key in results if key == heur_key]
    # The heuristic's structure without the arithmetic: what the loads, the split-K
    # reduction and the launch cost alone.
    loads_only = {key: value for key, value in chosen.items() if key != "BLOCK_M"}
    loads_only["DEQUANT"] = False
    t_loads = bench_graph([lambda q=q: w4a16_gemv(x, q, config=loads_only) for q in kns])
    results.sort()
    best = ", ".join(f"{us:.1f} (BN/W/U/GPS {key})" for us, key in results[:4])
    print(
        f"  gemv sweep {k}x{n} M=1: best {best}; worst {results[-1][0]:.1f}; heuristic "
        f"{heur_key} {heur[0] if heur else float('nan'):.1f}; its loads alone (no math) "
        f"{t_loads * 1e3:.1f}",
        flush=True,
    )


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'4096x4096,8192x28672' -> [(4096, 4096), (8192, 28672)] (K x N); '70b': LARGE_SHAPES."""
    if text == "70b":
        return LARGE_SHAPES
    try:
        return [(int(k), int(n)) for k, n in (item.split("x") for item in text.split(","))]
    except ValueError:
        message = f"shapes must look like 4096x4096,8192x28672 (or 70b), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gemv-only", action="store_true", help="M <= 8, no tensor-core sweeps")
    parser.add_argument("--no-sweep", action="store_true", help="skip every config sweep")
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=SHAPES,
        help="comma-separated KxN layer shapes (default: the llama-3-8B and DeepSeek ones)",
    )
    args = parser.parse_args()
    batches = [b for b in BATCHES if b <= MAX_M] if args.gemv_only else BATCHES
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    print(
        f"device {props.name}, {props.multi_processor_count} SMs; copy bandwidth {bw / 1e12:.2f} TB/s"
    )
    rows = []
    for k, n in args.shapes:
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        q0 = quantize_int4(w0, GROUP)
        ws = [w0] + [torch.randn_like(w0) / k**0.5 for _ in range(copies_for(2 * n * k) - 1)]
        qs = [q0] + [quantize_int4(w, GROUP) for w in ws[1 : copies_for(q0.nbytes)]]
        qs += [
            quantize_int4(torch.randn_like(w0), GROUP)
            for _ in range(copies_for(q0.nbytes) - len(qs))
        ]
        try:
            tgs = [to_tinygemm(q) for q in qs]
        except (RuntimeError, TypeError) as exc:
            print(f"torch int4pack unavailable: {exc}")
            tgs = []
        kns = [to_kn(q) for q in qs]
        q_bytes = q0.nbytes
        floor_us = read_floor_us(q_bytes)
        print(
            f"{k}x{n}: reading the INT4 weight's {q_bytes / 1e6:.1f} MB takes {floor_us:.1f} us at best"
        )
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = w4a16_matmul_ref(x, q0).float()
            split = w4a16_config(m, n, k, GROUP, props.multi_processor_count)["SPLIT_K"]
            ours = w4a16_matmul(x, q0, split_k=split).float()
            err = float((ours - ref).norm() / ref.norm())
            t_bf16 = bench_graph([lambda x=x, w=w: F.linear(x, w) for w in ws])
            t_ours = bench_graph(
                [lambda x=x, q=q, s=split: w4a16_matmul(x, q, split_k=s) for q in qs]
            )
            out_gemv = w4a16_kn_matmul(x, kns[0]).float()
            gemv_err = float((out_gemv - ref).norm() / ref.norm())
            t_gemv = bench_graph([lambda x=x, q=q: w4a16_kn_matmul(x, q) for q in kns])
            t_tg = tg_err = None
            if tgs:
                out_tg = torch._weight_int4pack_mm(x, tgs[0][0], GROUP, tgs[0][1]).float()
                tg_err = float((out_tg - ref).norm() / ref.norm())
                t_tg = bench_graph(
                    [
                        lambda x=x, p=p, sz=sz: torch._weight_int4pack_mm(x, p, GROUP, sz)
                        for p, sz in tgs
                    ]
                )
            io = 2 * m * (k + n)
            row = {
                "K": k,
                "N": n,
                "M": m,
                "split_k": split,
                "bf16_us": t_bf16 * 1e3,
                "torch_int4_us": None if t_tg is None else t_tg * 1e3,
                "ours_us": t_ours * 1e3,
                "speedup_vs_bf16": t_bf16 / t_ours,
                "speedup_vs_torch_int4": None if t_tg is None else t_tg / t_ours,
                "gemv_us": t_gemv * 1e3,
                "gemv_speedup_vs_bf16": t_bf16 / t_gemv,
                "gemv_speedup_vs_torch_int4": None if t_tg is None else t_tg / t_gemv,
                "gemv_bw_frac": (q_bytes + io) / (t_gemv * 1e-3) / bw,
                "rel_err_gemv": gemv_err,
                "ours_bw_frac": (q_bytes + io) / (t_ours * 1e-3) / bw,
                "bf16_bw_frac": (2 * n * k + io) / (t_bf16 * 1e-3) / bw,
                "ideal_speedup": (2 * n * k + io) / (q_bytes + io),
                "read_floor_us": floor_us,
                "floor_speedup_vs_bf16": t_bf16 * 1e3 / floor_us,
                "rel_err_ours": err,
                "rel_err_torch_int4": tg_err,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not args.no_sweep:
            sweep_gemv(k, n, kns, props.multi_processor_count)
        if not args.gemv_only and not args.no_sweep:
            # Split-K sweep at M = 1: does the heuristic pick well?
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            sweep = {
                s: bench_graph([lambda s=s, x=x, q=q: w4a16_matmul(x, q, split_k=s) for q in qs])
                * 1e3
                for s in (1, 2, 4, 8, 16)
            }
            print(
                f"split-K sweep M=1 K={k} N={n} (us): "
                + ", ".join(f"{s}: {t:.1f}" for s, t in sweep.items())
            )
            if (k, n) in SHAPES[:2]:
                sweep_configs(k, n, qs)
        del ws, qs, tgs, kns
    print()
    print(
        "| K x N | M | bf16 us | torch int4 us | ours-mma us | ours-kn us | kn vs bf16 "
        "| kn vs torch int4 | mma vs bf16 | kn BW frac | mma BW frac | bf16 BW frac "
        "| ideal vs bf16 | read floor us | floor vs bf16 | split-K (mma) | rel err kn | rel err mma |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def fmt(value: float | None, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    for r in rows:
        print(
            f"| {r['K']}x{r['N']} | {r['M']} | {r['bf16_us']:.1f} | "
            f"{fmt(r['torch_int4_us'], '.1f')} | {r['ours_us']:.1f} | {fmt(r['gemv_us'], '.1f')} | "
            f"{fmt(r['gemv_speedup_vs_bf16'], '.2f', 'x')} | "
            f"{fmt(r['gemv_speedup_vs_torch_int4'], '.2f', 'x')} | "
            f"{r['speedup_vs_bf16']:.2f}x | {fmt(r['gemv_bw_frac'], '.2f')} | "
            f"{r['ours_bw_frac']:.2f} | {r['bf16_bw_frac']:.2f} | {r['ideal_speedup']:.2f}x | "
            f"{r['read_floor_us']:.1f} | {r['floor_speedup_vs_bf16']:.2f}x | "
            f"{r['split_k']} | {fmt(r['rel_err_gemv'], '.1e')} | {r['rel_err_ours']:.1e} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
