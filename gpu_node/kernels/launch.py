"""How kernels may be launched on a device: what the launch wrappers share."""

from __future__ import annotations

import functools
import os

import torch


def check_operands(x: torch.Tensor, k: int, device: torch.device) -> None:
    """The checks the W4A16 launch wrappers share: x [M, K] on the weight's device."""
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"x on {x.device}, weight on {device}")


def int32_pairs(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 rows [M, K] (K even) as int32 pairs [M, K / 2], for kernels that load
    two activations a word. A view starting at an odd element, or whose rows are an odd
    number of elements apart, has no such pairs and is copied (into fresh row-major
    memory: `clone` would keep a one-row view's odd stride)."""
    if x.storage_offset() % 2 or x.stride(0) % 2 or x.stride(1) != 1:
        x = torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
    return x.view(torch.int32)


@functools.cache
def has_mma_sync(device: torch.device) -> bool:
    """Whether `device` runs the bf16/fp16 `mma.sync.m16n8k16` of the tensor-core W4A16 and
    MoE kernels: a CUDA GPU of compute capability 8.0 (Ampere) or newer."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def launches_early(device: torch.device) -> bool:
    """Whether kernels may launch early behind the previous one on `device`: programmatic
    dependent launch needs Hopper (sm_90) or newer, and compiled kernels (the interpreter
    cannot run the griddepcontrol instructions, whatever the tensors' device)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


# Whether the small kernels between a decode step's products (RMSNorm, silu-and-multiply,
# the attention merge) let the next kernel launch from their start. The next one, where it
# is launched early (the W4A16 GEMV, the MoE kernel), puts its first weight loads in flight
# and waits (griddepcontrol.wait: the whole previous grid done, its writes visible) before
# it reads what the small kernel wrote; a kernel launched normally waits as it always did.
# So this moves when weights start streaming, never what anyone reads.
SMALL_KERNELS_RELEASE_NEXT = True


def releases_next(device: torch.device) -> bool:
    """Whether a small kernel on `device` lets the next kernel launch from its start."""
    return SMALL_KERNELS_RELEASE_NEXT and launches_early(device)
