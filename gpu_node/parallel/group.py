"""A node's process group: one process per device, rank 0 the one that runs the engine.

Collectives on the model's tensors go through `device_group` (NCCL on CUDA, gloo on the
CPU); the host-side part of each step's broadcast goes through `cpu_group` (gloo), so a
rank never waits on its device to learn a step's shape. On the CPU both are one group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process stands in its node's group, and where rank 0 listens."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 600.0  # how long a collective waits for a rank that does not come

    def __post_init__(self) -> None:
        problems = []
        if self.world_size < 1:
            problems.append(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < max(1, self.world_size):
            problems.append(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not 0 < self.master_port < 65536:
            problems.append(f"master_port must be in (0, 65536), got {self.master_port}")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s must be positive, got {self.timeout_s}")
        if problems:
            raise ValueError("invalid ParallelConfig: " + "; ".join(problems))


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place in the group it joined, and the groups its collectives use."""

    rank: int
    world_size: int
    device: torch.device
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup


def backend_for(device: torch.device) -> str:
    """NCCL where the tensors are on CUDA, gloo where they are on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel(config: ParallelConfig, device: torch.device | str = "cpu") -> ParallelGroup:
    """Joins the node's process group (blocks until every rank has joined); one per process."""
    device = torch.device(device)
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host = f"[{config.master_addr}]" if ":" in config.master_addr else config.master_addr
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{config.master_port}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.timeout_s),
    )
    device_group = dist.group.WORLD
    assert device_group is not None  # just initialised
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo")
    return ParallelGroup(config.rank, config.world_size, device, device_group, cpu_group)


def destroy_parallel() -> None:
    """Leaves the process group this process joined (a no-op where it joined none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
