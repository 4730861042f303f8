"""The thread layout of an engine's process, chosen from the machine (edgeserve/threads.py)."""

from __future__ import annotations

import os

import pytest

from edgeserve.threads import apply_environment, thread_environment


@pytest.mark.parametrize(
    ("device", "num_cores", "expected"),
    [
        ("cpu", 2, {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}),
        ("auto", 16, {"OMP_NUM_THREADS": "16", "OMP_WAIT_POLICY": "PASSIVE"}),
        ("cuda", 2, {}),
    ],
)
def test_the_compute_takes_every_core_and_its_workers_wait_passively(
    device: str, num_cores: int, expected: dict[str, str]
) -> None:
    assert thread_environment(device, num_cores) == expected


def test_a_variable_the_user_set_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("edgeserve.threads.usable_cores", lambda: 2)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    apply_environment("cpu")
    assert (os.environ["OMP_WAIT_POLICY"], os.environ["OMP_NUM_THREADS"]) == ("ACTIVE", "2")
