"""Fused INT4 MoE on the GPU, single-stream MoE decode, and the memory table (CPU).

    python benchmarks/bench_moe.py [--layers 26] [--json out.json]     # GPU
    python benchmarks/bench_moe.py --memory [SMOLLM2.gguf]             # CPU only
    .venv/bin/python benchmarks/bench_moe.py --smoke     # CPU: memory table, INT4 layer (CI)

GPU part, config `moe-medium` (hidden 2048, 64 experts, top-8, expert hidden
1408, one shared expert; DeepSeek-V2-Lite's layer):
  1. routed experts at decode batch sizes T: the fused INT4 kernels (group 128, or
     --group-size 32 / 64;
     the tensor-core one over expert slots, moe/mma.py, and the CUDA-core one,
     moe/grouped.py) vs the bf16 torch reference (loop over the experts that got tokens), and
     vs the time a bf16 kernel would take at copy bandwidth (active experts'
     bytes / measured copy bandwidth);
  2. single-stream decode (T = 1) through a stack of `--layers` MoE blocks
     (RMSNorm, router, routed + shared experts, residual; attention left out):
     tokens/s with bf16 weights vs INT4 weights, eager, and INT4 in a CUDA graph
     (with either MoE kernel; the tensor-core one with the shared expert folded into the
     expert stack, and without).
Needs only torch, triton and numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_node.models.moe import MOE_CONFIGS, MoeConfig, MoeMLP, moe_experts_ref
from gpu_node.quant.linear import model_bytes, quantize_model

GROUP = 128
BATCHES = [1, 2, 4, 8, 16, 32, 64]


def int4_bytes(numel: int, group_size: int) -> int:
    """Packed codes + fp16 scale + fp16 min per group."""
    return numel // 2 + 4 * (numel // group_size)


class MoeBlock(nn.Module):
    """x + MoE(RMSNorm(x)): the MLP half of a decoder layer."""

    def __init__(self, mlp: MoeMLP) -> None:
        super().__init__()
        self.norm = nn.Parameter(
            torch.ones(mlp.config.hidden_size, device=mlp.router.weight.device)
        )
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        h = F.rms_norm(x.float(), (x.shape[-1],), self.norm, 1e-6).to(x.dtype)
        return x + self.mlp(h)


def cuda_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean milliseconds per call of a whole step (host time included), after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def copy_bandwidth() -> float:
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def bench_experts(
    config: MoeConfig, bw: float, num_copies: int = 4, group: int = GROUP
) -> list[dict]:
    """Routed experts only. INT4: CUDA-graph replays over `num_copies` layers (1.2 GB,
    so experts come from HBM, not L2); bf16 reference: eager (it syncs on the host)."""
    import triton.testing

    from benchmarks.bench_w4a16 import bench_graph
    from gpu_node.kernels.moe.grouped import fused_moe_int4
    from gpu_node.kernels.moe.mma import fused_moe_mma
    from gpu_node.quant.int4 import experts_to_mma

    mlp = MoeMLP.dummy(config, seed=0, dtype=torch.bfloat16, device="cuda")
    w13_bf16, w2_bf16 = mlp.experts.w13, mlp.experts.w2
    routers = [mlp.router]
    layers = [mlp.experts.to_int4(group).weights()]
    for seed in range(1, num_copies):
        other = MoeMLP.dummy(config, seed=seed, dtype=torch.bfloat16, device="cuda")
        routers.append(other.router)
        layers.append(other.experts.to_int4(group).weights())
        del other
    layers_mma = [(experts_to_mma(w13, gated=True), experts_to_mma(w2)) for w13, w2 in layers]
    w13, w2 = layers[0]
    per_expert_bf16 = 2 * (w13_bf16[0].numel() + w2_bf16[0].numel())
    per_expert_int4 = (w13.nbytes + w2.nbytes) // config.num_experts
    rows = []
    for t in BATCHES:
        xs = [
            torch.randn(t, config.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in layers
        ]
        routings = [router(x) for router, x in zip(routers, xs, strict=True)]
        actives = [int(torch.unique(r.topk_ids).numel()) for r in routings]
        ref = moe_experts_ref(xs[0], w13_bf16, w2_bf16, routings[0]).float()
        ours = fused_moe_mma(xs[0], *layers_mma[0], routings[0]).float()
        err = float((ours - ref).norm() / ref.norm())
        core = fused_moe_int4(xs[0], w13, w2, routings[0]).float()
        err_kernels = float((ours - core).norm() / core.norm())
        calls = [
            lambda x=x, w=w, r=r: fused_moe_mma(x, w[0], w[1], r)
            for x, w, r in zip(xs, layers_mma, routings, strict=True)
        ]
        t_ours = bench_graph(calls)
        calls_core = [
            lambda x=x, w=w, r=r: fused_moe_int4(x, w[0], w[1], r)
            for x, w, r in zip(xs, layers, routings, strict=True)
        ]
        t_core = bench_graph(calls_core)
        t_ref = triton.testing.do_bench(
            lambda x=xs[0], r=routings[0]: moe_experts_ref(x, w13_bf16, w2_bf16, r),
            return_mode="median",
        )
        active = sum(actives) / len(actives)
        ideal_bf16_ms = active * per_expert_bf16 / bw * 1e3
        row = {
            "T": t,
            "active_experts": active,
            "int4_us": t_ours * 1e3,
            "int4_cuda_core_us": t_core * 1e3,
            "mma_vs_cuda_core": t_core / t_ours,
            "bf16_ref_us": t_ref * 1e3,
            "bf16_at_copy_bw_us": ideal_bf16_ms * 1e3,
            "speedup_vs_bf16_ref": t_ref / t_ours,
            "speedup_vs_bf16_at_copy_bw": ideal_bf16_ms / t_ours,
            "int4_bw_frac": active * per_expert_int4 / (t_ours * 1e-3) / bw,
            "rel_err_vs_bf16": err,
            "rel_diff_mma_vs_cuda_core": err_kernels,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_parts(
    config: MoeConfig, batches: tuple[int, ...] = (1, 8), group: int = GROUP
) -> list[dict]:
    """Microseconds of each launch of the tensor-core MoE layer (CUDA-graph replays over
    4 layers' copies), so the layer's time can be read against its parts. The router is
    timed with one always-on expert appended (the folded shared expert); the GEMMs
    without it (routed experts only)."""
    from benchmarks.bench_w4a16 import bench_graph
    from gpu_node.kernels.moe.mma import _grouped_gemv
    from gpu_node.kernels.moe.slots import expert_slots
    from gpu_node.quant.int4 import experts_to_mma

    layers, routers = [], []
    for seed in range(4):
        mlp = MoeMLP.dummy(config, seed=seed, dtype=torch.bfloat16, device="cuda")
        w13, w2 = mlp.experts.to_int4(group).weights()
        layers.append((experts_to_mma(w13, gated=True), experts_to_mma(w2)))
        routers.append(mlp.router)
        del mlp
    rows = []
    for t in batches:
        xs = [
            torch.randn(t, config.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in layers
        ]
        routings = [router(x) for router, x in zip(routers, xs, strict=True)]
        slots = [expert_slots(r.topk_ids, config.num_experts) for r in routings]
        acts = [
            _grouped_gemv(x, w[0], s, None, config.top_k)
            for x, w, s in zip(xs, layers, slots, strict=True)
        ]
        weights = [r.topk_weights.reshape(-1).contiguous() for r in routings]
        ys = [
            _grouped_gemv(a, w[1], s, wt, 1)
            for a, w, s, wt in zip(acts, layers, slots, weights, strict=True)
        ]
        parts = {
            "router": [lambda r=r, x=x: r(x, 1) for r, x in zip(routers, xs, strict=True)],
            "slots": [lambda r=r: expert_slots(r.topk_ids, config.num_experts) for r in routings],
            "gemm1": [
                lambda x=x, w=w, s=s: _grouped_gemv(x, w[0], s, None, config.top_k)
                for x, w, s in zip(xs, layers, slots, strict=True)
            ],
            "gemm2": [
                lambda a=a, w=w, s=s, wt=wt: _grouped_gemv(a, w[1], s, wt, 1)
                for a, w, s, wt in zip(acts, layers, slots, weights, strict=True)
            ],
            "sum": [lambda y=y, t=t: y.view(t, config.top_k, -1).sum(dim=1) for y in ys],
        }
        row: dict = {"T": t}
        for name, calls in parts.items():
            row[f"{name}_us"] = bench_graph(calls) * 1e3
        # Groups per split (the heuristic's choice is among them): 16 groups in GEMM 1, 11 in 2.
        for per_split in (16, 8, 4, 2, 1):
            row[f"gemm1_split{per_split}_us"] = 1e3 * bench_graph(
                [
                    lambda x=x, w=w, s=s, p=per_split: _grouped_gemv(
                        x, w[0], s, None, config.top_k, p
                    )
                    for x, w, s in zip(xs, layers, slots, strict=True)
                ]
            )
            row[f"gemm2_split{per_split}_us"] = 1e3 * bench_graph(
                [
                    lambda a=a, w=w, s=s, wt=wt, p=per_split: _grouped_gemv(a, w[1], s, wt, 1, p)
                    for a, w, s, wt in zip(acts, layers, slots, weights, strict=True)
                ]
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


@contextlib.contextmanager
def cuda_core_moe_kernel() -> Iterator[None]:
    """Int4MoeExperts runs the fused CUDA-core kernel (the tensor-core one declines)."""
    from gpu_node.kernels.moe import mma as moe_mma

    takes = moe_mma.takes
    moe_mma.takes = lambda x, group_size: False  # type: ignore[assignment]
    try:
        yield
    finally:
        moe_mma.takes = takes  # type: ignore[assignment]


def graph_ms(model: nn.Module, x: torch.Tensor) -> float | None:
    """Milliseconds per replay of the model captured in a CUDA graph (None: cannot capture)."""
    try:
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(static_x)
        return cuda_ms(graph.replay, iters=100)
    except RuntimeError as exc:
        print(f"CUDA graph capture failed: {exc}")
        return None


def bench_decode(config: MoeConfig, num_layers: int, bw: float, group: int = GROUP) -> dict:
    torch.manual_seed(0)
    bf16 = nn.Sequential(
        *(
            MoeBlock(MoeMLP.dummy(config, seed=i, dtype=torch.bfloat16, device="cuda"))
            for i in range(num_layers)
        )
    )
    int4_unfolded = quantize_model(copy.deepcopy(bf16), group_size=group)
    int4_core = quantize_model(copy.deepcopy(bf16), group_size=group)
    int4 = quantize_model(copy.deepcopy(bf16), group_size=group)
    for block in int4:  # the shared expert as one more expert of the fused call
        assert block.mlp.fold_shared_experts()
    x = torch.randn(1, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y_bf16, y_int4 = bf16(x).float(), int4(x).float()
        rel = float((y_int4 - y_bf16).norm() / y_bf16.norm())
        ms_bf16 = cuda_ms(lambda: bf16(x), iters=20)
        ms_int4 = cuda_ms(lambda: int4(x), iters=50)
        ms_graph = graph_ms(int4, x)
        ms_unfolded_graph = graph_ms(int4_unfolded, x)
        with cuda_core_moe_kernel():
            y_core = int4_core(x).float()
            ms_core = cuda_ms(lambda: int4_core(x), iters=50)
            ms_core_graph = graph_ms(int4_core, x)
        rel_core = float((y_int4 - y_core).norm() / y_core.norm())
    b_bf16, b_int4 = model_bytes(bf16), model_bytes(int4)
    # The best any bf16 decode could do: read each layer's active weights once at copy bandwidth.
    c = config
    active_bf16 = (c.top_k + c.num_shared_experts) * 3 * c.hidden_size * c.expert_hidden_size * 2
    bf16_ceiling = bw / (num_layers * active_bf16)

    def tok_s(ms: float | None) -> float | None:
        return None if ms is None else 1e3 / ms

    result = {
        "layers": num_layers,
        "bf16_tok_s": tok_s(ms_bf16),
        "int4_tok_s": tok_s(ms_int4),
        "int4_graph_tok_s": tok_s(ms_graph),
        "int4_shared_not_folded_graph_tok_s": tok_s(ms_unfolded_graph),
        "int4_cuda_core_kernel_tok_s": tok_s(ms_core),
        "int4_cuda_core_kernel_graph_tok_s": tok_s(ms_core_graph),
        "bf16_at_copy_bw_tok_s": bf16_ceiling,
        "bf16_GB": b_bf16.total / 1e9,
        "int4_GB": b_int4.total / 1e9,
        "rel_err_int4_vs_bf16_after_stack": rel,
        "rel_diff_mma_vs_cuda_core_after_stack": rel_core,
    }
    print(json.dumps(result), flush=True)
    return result


def mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.1f} MB" if num_bytes >= 1e6 else f"{num_bytes / 1e3:.1f} kB"


def memory_table(gguf_path: str | None) -> None:
    """Bytes of SmolLM2 and of one layer of each MoE config, per weight format."""
    print("| model | part | fp32 | bf16 | INT4 (g32) | INT4 (g128) |")
    print("|---|---|---|---|---|---|")
    if gguf_path:
        import gguf

        reader = gguf.GGUFReader(gguf_path)
        quantizable = unquantized = 0
        for t in reader.tensors:
            numel = int(t.n_elements)
            if t.name.startswith("blk.") and len(t.shape) == 2:
                quantizable += numel
            else:
                unquantized += numel  # token_embd (tied output head), norms
        # SmolLM2: K = 576 or 1536 is a multiple of 64 but 576 is not of 128 -> g128 n/a.
        for part, n in (("2-D layer weights", quantizable), ("embeddings + norms", unquantized)):
            q32 = int4_bytes(n, 32) if part.startswith("2-D") else 2 * n
            print(f"| SmolLM2-135M | {part} | {mb(4 * n)} | {mb(2 * n)} | {mb(q32)} | n/a |")
        total32 = int4_bytes(quantizable, 32) + 2 * unquantized
        n = quantizable + unquantized
        print(f"| SmolLM2-135M | **total** | {mb(4 * n)} | {mb(2 * n)} | {mb(total32)} | n/a |")
    for name in ("moe-small", "moe-medium", "moe-large"):
        c = MOE_CONFIGS[name]
        routed = c.num_experts * 3 * c.hidden_size * c.expert_hidden_size
        shared = c.num_shared_experts * 3 * c.hidden_size * c.expert_hidden_size
        router = c.num_experts * c.hidden_size
        for part, n, quantized in (
            ("routed experts", routed, True),
            ("shared expert", shared, True),
            ("router", router, False),
        ):
            g32 = int4_bytes(n, 32) if quantized else 2 * n
            g128 = int4_bytes(n, 128) if quantized else 2 * n
            print(
                f"| {name} (1 layer) | {part} | {mb(4 * n)} | {mb(2 * n)} | {mb(g32)} | {mb(g128)} |"
            )
        q = routed + shared
        print(
            f"| {name} (1 layer) | **total** | {mb(4 * (q + router))} | {mb(2 * (q + router))} | "
            f"{mb(int4_bytes(q, 32) + 2 * router)} | {mb(int4_bytes(q, 128) + 2 * router)} |"
        )
    # Cross-check the arithmetic against the modules' own accounting on moe-small.
    mlp = quantize_model(MoeMLP.dummy(MOE_CONFIGS["moe-small"], seed=0), group_size=32)
    print(f"\nmoe-small INT4 g32 measured by model_bytes: {model_bytes(mlp)}")


def smoke() -> None:
    """What runs without a GPU: the memory table, and one moe-small layer in INT4 (the CPU
    path of the same module) against its float self. The timings need a GPU: not run."""
    memory_table(None)
    torch.manual_seed(0)
    config = MOE_CONFIGS["moe-small"]
    mlp = MoeMLP.dummy(config, seed=0).float()
    x = torch.randn(3, config.hidden_size)
    with torch.inference_mode():
        want = mlp(x)
        quantize_model(mlp, group_size=32)
        got = mlp(x)
    err = float((got - want).norm() / want.norm())
    assert err < 0.5, err
    print(f"smoke: moe-small INT4 g32 layer on the CPU, relative error {err:.3f} against "
          "float weights; kernel timings need a GPU: not run")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU: memory table, INT4 layer")
    parser.add_argument(
        "--memory", nargs="?", const="", default=None, help="print the memory table (CPU)"
    )
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=GROUP)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if args.memory is not None:
        memory_table(args.memory or None)
        return
    config = MOE_CONFIGS["moe-medium"]
    bw = copy_bandwidth()
    print(
        f"device {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; config {config}"
        f"; INT4 group {args.group_size}"
    )
    parts = bench_parts(config, group=args.group_size)
    rows = bench_experts(config, bw, group=args.group_size)
    decode = bench_decode(config, args.layers, bw, group=args.group_size)
    print()
    print(
        "| T | active experts (mean) | INT4 tensor-core us | INT4 CUDA-core us | tensor-core gain "
        "| bf16 ref us (eager) | bf16 at copy BW us | vs bf16 ref | vs bf16 at copy BW "
        "| INT4 BW frac | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['T']} | {r['active_experts']:.1f} | {r['int4_us']:.1f} | "
            f"{r['int4_cuda_core_us']:.1f} | {r['mma_vs_cuda_core']:.2f}x | {r['bf16_ref_us']:.1f} | "
            f"{r['bf16_at_copy_bw_us']:.1f} | {r['speedup_vs_bf16_ref']:.2f}x | "
            f"{r['speedup_vs_bf16_at_copy_bw']:.2f}x | {r['int4_bw_frac']:.2f} | "
            f"{r['rel_err_vs_bf16']:.1e} |"
        )
    d = decode
    print(
        f"\ndecode, {d['layers']} MoE layers, T=1: bf16 {d['bf16_tok_s']:.1f} tok/s (eager); INT4 "
        f"tensor-core kernel {d['int4_tok_s']:.1f} eager, {d['int4_graph_tok_s']} graph "
        f"({d['int4_shared_not_folded_graph_tok_s']} with the shared expert apart); INT4 "
        f"CUDA-core kernel {d['int4_cuda_core_kernel_tok_s']:.1f} eager, "
        f"{d['int4_cuda_core_kernel_graph_tok_s']} graph; bf16 at copy bandwidth (ceiling) "
        f"{d['bf16_at_copy_bw_tok_s']:.1f} tok/s; weights {d['bf16_GB']:.2f} GB vs "
        f"{d['int4_GB']:.2f} GB"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"copy_bw": bw, "parts": parts, "experts": rows, "decode": decode}, indent=1)
        )


if __name__ == "__main__":
    main()
