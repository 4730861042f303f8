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


def test_model_pull_is_idempotent(smollm2_path):
    before = smollm2_path.stat().st_mtime_ns
    result = edgeserve("model", "pull", "smollm2")
    assert result.returncode == 0 and result.stdout.strip() == f"smollm2: {smollm2_path}"
    assert smollm2_path.stat().st_mtime_ns == before
    result = edgeserve("model", "pull", "llama-9000")
    assert result.returncode == 1 and "unknown model 'llama-9000'" in result.stderr


def test_the_graph_options_of_up_and_node_reach_the_engine_config() -> None:
    """`--cuda-graph-batch` and `--cuda-graph-tokens` as `up` and `node` pass them on (the
    engine is built for real, on the CPU, where neither kind of graph runs), and the
    engine's defaults when they are not given."""
    from edgeserve.commands.serve import _engine_factory

    for given, expected in (((4, 128), (4, 128)), ((None, None), (32, 2048))):
        batch, tokens = given
        engine = _engine_factory(
            "smollm2", "fp32", None, None, None, device="cpu", cuda_graph_batch=batch,
            cuda_graph_tokens=tokens,
        )()  # fmt: skip
        try:
            config = engine.engine.config
            assert (config.cuda_graph_batch, config.cuda_graph_tokens) == expected
            assert engine.engine.runner.step_graphs is None  # a CPU engine
        finally:
            engine.shutdown()
