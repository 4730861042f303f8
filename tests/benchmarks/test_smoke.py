"""Every benchmark's `--smoke`: its code paths at tiny sizes on the CPU, so none rots unseen.

Each script runs as a subprocess, as a person would run it; GPU-only timings run their
harness on CPU tensors or check their tables and imports (each script says which). No
smoke needs Triton's interpreter, which would make the engine's CPU steps take a minute.
The fault suite's smoke has its own test (tests/integration/test_fault_suite.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = (
    "bench_admission.py",
    "bench_billing.py",
    "bench_checkpoints.py",
    "bench_cpu_llamacpp.py",
    "bench_embeddings.py",
    "bench_engine.py",
    "bench_gateway.py",
    "bench_grammar.py",
    "bench_handoff.py",
    "bench_moe.py",
    "bench_paged_attention.py",
    "bench_prefix_cache.py",
    "bench_w4a16.py",
    "cpu_accuracy.py",
    "kv_accuracy.py",
    "tune_w4a16_mma.py",
)

pytestmark = pytest.mark.timeout(180)


def test_every_benchmark_has_a_smoke_run() -> None:
    on_disk = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"fault_suite.py"}
    assert on_disk == set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_exits_0(script: str, smollm2_path: Any) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
