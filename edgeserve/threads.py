"""The thread layout of a process that runs an engine beside an event loop (`up`'s node
process, `edgeserve node`), chosen from the machine (figures: docs/benchmarks.md, "CPU
against llama.cpp").

On the CPU the engine computes on every core, and its OpenMP workers wait passively (they
sleep at the end of a parallel region instead of spinning). Spinning workers hold every
core between two regions: an event loop that wakes for a token (the node's, or `up`'s
gateway in its own process) then waits for a core, and the barrier of the next region
waits for the worker the loop displaced. On a loaded machine that stalls each region for a
scheduler slice. On a GPU the CPU threads have little to do and keep torch's defaults.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_environment(device: str, num_cores: int | None = None) -> dict[str, str]:
    """Environment for the process of an engine on `device` (cpu, cuda, or auto: the flag as
    given, known before torch loads), to be set before torch loads (OpenMP reads it once).
    A variable the user has set wins: callers merge these under the environment."""
    if device == "cuda":
        return {}
    num_cores = usable_cores() if num_cores is None else num_cores
    return {"OMP_NUM_THREADS": str(num_cores), "OMP_WAIT_POLICY": "PASSIVE"}


def apply_environment(device: str) -> None:
    """thread_environment into this process's environment, under what is already set."""
    for name, value in thread_environment(device).items():
        os.environ.setdefault(name, value)
