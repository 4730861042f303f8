"""`benchmarks/fault_suite.py --smoke`: a fleet of its own (Redis, a database, a node, a
gateway, a billing worker, all real processes on loopback) whose gateway is SIGKILLed
mid-stream and restarted. Nothing its clients got goes unbilled, nothing is billed twice,
and `edgeserve billing reconcile` agrees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(480)


def test_a_gateway_killed_mid_stream_loses_and_doubles_nothing(
    smollm2_path: Any, tmp_path: Path
) -> None:
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fault_suite.py"), "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert (result["lost"], result["double"], result["mismatched"]) == (0, 0, 0)
    assert result["reconcile"]["exit_code"] == 0
    # The kill bites: a stream is cut mid-answer, and the restarted gateway answers again.
    assert result["overall"]["cut"] >= 1, done.stdout
    (phase,) = result["phases"]
    assert any(
        r["status"] == 200 and r["sent_at"] > phase["mended_at"] for r in result["requests"]
    ), done.stdout
