"""W4A16 GEMMs over Int4WeightMMA: y = x @ W^T for more rows than the decode GEMV takes.

Letters: M tokens, N out features, K in features, S split-K ways.

Past 8 rows the tensor-core GEMV (w4a16/mma.py) stops. Dequantizing the weights into a
dense copy for cuBLAS (w4a16/mma_dequant.py) writes 2 bytes a weight and reads them
again, where these kernels read the 0.5 of the INT4 tiles. Two kernels, each the faster
over part of the range (H200, docs/benchmarks.md):

- `tc` (w4a16/mma_gemm_tc.py, up to TC_MAX_M rows, GPU only): the GEMV's LOP3
  dequantization, each word multiplied by token tiles on mma.sync (inline PTX).
- `dot` (w4a16/mma_gemm_dot.py, more rows, and the interpreter): a group dequantized in
  registers, then Triton's tl.dot.

A config's type picks the kernel (TcConfig or DotConfig); without one, `default_kernel`
and the kernel's heuristic decide. Split K (grid dim 2, for too few row blocks to fill the
GPU): each split writes an fp32 partial [S, M, N] and the splits are summed here in a fixed
order, so the result does not depend on timing (CUDA-graph replays give the bits of eager
calls).
"""

from __future__ import annotations

import os

import torch

from gpu_node.kernels.launch import check_operands, has_mma_sync
from gpu_node.kernels.w4a16.dot import is_interpreted, num_sms
from gpu_node.kernels.w4a16.mma_asm import MAGIC
from gpu_node.kernels.w4a16.mma_gemm_dot import DotConfig, dot_config, launch_dot
from gpu_node.kernels.w4a16.mma_gemm_tc import TcConfig, launch_tc, tc_config
from gpu_node.quant.int4 import MMA_GROUP_SIZES, Int4WeightMMA

__all__ = [
    "MAX_M",
    "MIN_WEIGHTS",
    "TC_MAX_M",
    "DotConfig",
    "GemmConfig",
    "TcConfig",
    "default_kernel",
    "gemm_config",
    "serves",
    "supports",
    "w4a16_mma_gemm",
]

# Where the GEMMs beat the dense copy + cuBLAS (H200, docs/benchmarks.md): up to
# MAX_M rows (at 128 the copy was faster at five of eight layer shapes) and weights of
# MIN_WEIGHTS or more (smaller ones' copy is cheap: 2048 x 3072 took 10.6 us against the
# tc kernel's 10.9 at 16 rows). tc up to TC_MAX_M rows, dot above.
TC_MAX_M = 32
MAX_M = 64
MIN_WEIGHTS = 1 << 24

GemmConfig = TcConfig | DotConfig


def supports(x: torch.Tensor, weight: object) -> bool:
    """Whether w4a16_mma_gemm takes this call: 2-D bf16/fp16 (or fp32 interpreted) x of
    1..MAX_M rows on CUDA or under TRITON_INTERPRET=1, over Int4WeightMMA tiles whose
    offsets (fp16 ones twice the int32) stay within int32."""
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if interpreter else ())
    return (
        isinstance(weight, Int4WeightMMA)
        and (x.is_cuda or interpreter)
        and x.dtype in dtypes
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and weight.group_size in MMA_GROUP_SIZES
        and 2 * weight.tiles.numel() < 2**31
    )


def serves(x: torch.Tensor, weight: object) -> bool:
    """Whether w4a16_mma_matmul sends this call here: what `supports`, on a weight of at
    least MIN_WEIGHTS (read at call time, so tests and benchmarks can move it)."""
    if not supports(x, weight):
        return False
    n, k = weight.shape  # type: ignore[attr-defined]
    return n * k >= MIN_WEIGHTS


def _tensor_cores(x: torch.Tensor) -> bool:
    return x.is_cuda and not is_interpreted(x) and has_mma_sync(x.device) and x.dtype in MAGIC


def default_kernel(x: torch.Tensor) -> str:
    """tc up to TC_MAX_M rows where the GPU runs it, else dot."""
    return "tc" if _tensor_cores(x) and x.shape[0] <= TC_MAX_M else "dot"


def gemm_config(kernel: str, m: int, n: int, k: int, group_size: int, sms: int) -> GemmConfig:
    """The heuristic launch of `kernel` ("tc" or "dot") for M rows of an [N, K] weight on a
    GPU of `sms` multiprocessors."""
    if kernel == "tc":
        return tc_config(m, n, k, group_size, sms)
    if kernel == "dot":
        return dot_config(m, n, k, group_size, sms)
    raise ValueError(f"kernel is tc or dot, got {kernel!r}")


def w4a16_mma_gemm(
    x: torch.Tensor, weight: Int4WeightMMA, config: GemmConfig | None = None
) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_M) @ W^T -> [M, N] in x's dtype, the weights dequantized in
    registers. `config` (a TcConfig or DotConfig: its type picks the kernel) overrides the
    heuristic's; benchmarks sweep it."""
    n, k = weight.shape
    check_operands(x, k, weight.tiles.device)
    if not supports(x, weight):
        raise ValueError(
            f"w4a16_mma_gemm takes bf16/fp16 x (fp32 interpreted) of 1..{MAX_M} rows on CUDA "
            f"or under TRITON_INTERPRET=1, a group size in {MMA_GROUP_SIZES} and tiles of "
            f"under 2^30 int32; got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}, group {weight.group_size}"
        )
    if config is None:  # default_kernel picks tc only where it runs
        sms = 4 if is_interpreted(x) else num_sms(x.device)
        config = gemm_config(default_kernel(x), x.shape[0], n, k, weight.group_size, sms)
    elif not isinstance(config, (TcConfig, DotConfig)):
        raise TypeError(f"config is a TcConfig or a DotConfig, got {type(config).__name__}")
    elif isinstance(config, TcConfig) and not _tensor_cores(x):
        raise ValueError(
            f"the tc kernel takes bf16/fp16 on CUDA sm_80+, got {x.dtype} on {x.device}"
        )
    # tc splits whole steps of max(64, G) k, dot whole groups.
    splits_max = weight.tiles.shape[1] if isinstance(config, TcConfig) else k // weight.group_size
    if config.split_k > splits_max:
        raise ValueError(f"split_k must be 1..{splits_max}, got {config.split_k}")
    # Partials in fp32; the interpreter's fp32 -> bf16 store truncates, so it keeps fp32
    # and rounds in torch.
    fp32 = config.split_k > 1 or is_interpreted(x)
    out = torch.empty(
        config.split_k, x.shape[0], n, device=x.device, dtype=torch.float32 if fp32 else x.dtype
    )
    x = x.contiguous()
    if isinstance(config, TcConfig):
        launch_tc(x, weight, config, out)
    else:
        launch_dot(x, weight, config, out)
    # The splits' partials added in a fixed order: the same bits every call.
    return (out.sum(0) if config.split_k > 1 else out[0]).to(x.dtype)
