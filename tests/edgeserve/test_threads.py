"""The thread layout of an engine's process, chosen from the machine (edgeserve/threads.py)."""

from __future__ import annotations

import os

import pytest

from edgeserve.threads import apply_environment, thread_environment


@pytest.mark.parametrize(
    ("device", "num_cores", "expected"),
    [
        ("cpu", 1, {"OMP_NUM_THREADS": "1"}),
        ("cpu", 2, {"OMP_NUM_THREADS": "1"}),
        ("auto", 16, {"OMP_NUM_THREADS": "15"}),
        ("cuda", 2, {}),
    ],
)
def test_the_compute_leaves_one_core_to_the_event_loops(
    device: str, num_cores: int, expected: dict[str, str]
) -> None:
    assert thread_environment(device, num_cores) == expected


def test_a_variable_the_user_set_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("edgeserve.threads.usable_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    apply_environment("cpu")
    assert os.environ["OMP_NUM_THREADS"] == "2"
