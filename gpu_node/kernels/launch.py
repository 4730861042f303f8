"""How kernels may be launched on a device: what the launch wrappers share."""

from __future__ import annotations

import functools
import os

import torch


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
