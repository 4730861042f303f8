"""The thread layout of a process that runs an engine beside an event loop (`up`'s node
process, `edgeserve node`), chosen from the machine (figures: docs/benchmarks.md, "CPU
against llama.cpp").

On the CPU the engine computes on every core but one, and the event loops (the node's, and
`up`'s gateway in its own process) run on the core left over. Were the compute on every core,
a loop that wakes for a token would wait for a core, and a loop descheduled while it holds
the interpreter lock stalls the engine thread as well; torch's OpenMP workers, spinning
between two parallel regions, make that wait long. On a GPU the CPU threads have little to
do and keep torch's defaults.
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
    return {"OMP_NUM_THREADS": str(max(1, num_cores - 1))}


def apply_environment(device: str) -> None:
    """thread_environment into this process's environment, under what is already set."""
    for name, value in thread_environment(device).items():
        os.environ.setdefault(name, value)
