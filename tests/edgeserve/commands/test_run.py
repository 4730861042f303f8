"""`edgeserve run`: one prompt, its answer streamed, bad input one message."""

import subprocess
import sys

import pytest


def edgeserve(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "edgeserve", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.usefixtures("smollm2_path")
def test_run_streams_the_answer():
    result = edgeserve("run", "smollm2", "What is the capital of France?", "--max-tokens", "20")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The capital of France is Paris.\n"


def test_run_rejects_bad_input_with_a_message():
    result = edgeserve("run", "smollm2", "Hi", "--max-tokens", "0")
    assert result.returncode == 2
    assert "max_tokens must be positive, got 0" in result.stderr
    result = edgeserve("run", "/nonexistent/model.gguf", "Hi")
    assert result.returncode == 2 and "no GGUF file at /nonexistent/model.gguf" in result.stderr
