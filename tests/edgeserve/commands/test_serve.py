"""`edgeserve up | node | gateway` refuse bad settings before they start anything (the
internal token's floor, connection limits, admission, role, node id), and pass the graph
options on to the engine they build."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.conftest import INTERNAL_TOKEN


def _stderr(result) -> str:
    return " ".join(result.stderr.replace("│", " ").split())  # rich boxes and wraps it


@pytest.mark.parametrize("command", [["node", "--device", "cpu"], ["gateway"]])
def test_an_internal_token_shorter_than_16_characters_is_refused(command: list[str]) -> None:
    result = CliRunner().invoke(build_app(), [*command, "--internal-token", "a"])
    assert result.exit_code == 2
    assert "Invalid value for --internal-token: the internal token must be at least 16 " \
        "characters, got 1 (`openssl rand -hex 24` makes one)" in _stderr(result)  # fmt: skip


def test_up_refuses_a_short_internal_token_from_its_environment(monkeypatch) -> None:
    monkeypatch.setenv("EDGESERVE_INTERNAL_TOKEN", "fifteen-chars-x")
    result = CliRunner().invoke(build_app(), ["up", "--device", "cpu"])
    assert result.exit_code == 2
    assert "Invalid value for EDGESERVE_INTERNAL_TOKEN: the internal token must be at least " \
        "16 characters, got 15" in _stderr(result)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--header-timeout-s", "0"], "header_timeout_s must be a positive number of seconds, got 0.0"),
        (["--max-header-bytes", "100"], "max_header_bytes must be at least 1024, got 100"),
        (["--keep-alive-timeout-s", "20"], "keep_alive_timeout_s must be at most header_timeout_s (10.0), got 20.0"),
        (["--max-connections", "0"], "max_connections must be at least 1, got 0"),
        (["--body-deadline-s", "5"], "body_deadline_s must be at least body_timeout_s (10.0), got 5.0"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", [["gateway"], ["node", "--device", "cpu"]])
def test_connection_limits_are_refused_before_anything_starts(command, args, message) -> None:
    result = CliRunner().invoke(build_app(), [*command, "--internal-token", INTERNAL_TOKEN, *args])
    assert result.exit_code == 2
    assert message in _stderr(result)


# -- the gateway's and the node's own settings ---------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--redis-timeout-s", "0"], "must be a positive number of seconds, got 0.0"),
        (["--redis-timeout-s", "-1"], "must be a positive number of seconds, got -1.0"),
        (["--on-redis-error", "maybe"], "must be 'open' or 'closed'"),
        (["--admin-token", "short"], "admin_token must be at least 16 characters"),
    ],
)
def test_gateway_refuses_bad_admission_settings(args: list[str], message: str) -> None:
    result = CliRunner().invoke(build_app(), ["gateway", "--internal-token", INTERNAL_TOKEN, *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.replace("│", " ").split())  # rich boxes and wraps it


def test_up_refuses_a_short_admin_token_before_it_loads_anything(monkeypatch) -> None:
    monkeypatch.setenv("EDGESERVE_ADMIN_TOKEN", "short")
    result = CliRunner().invoke(build_app(), ["up", "--device", "cpu"])
    assert result.exit_code == 2
    assert "admin_token must be at least 16 characters" in " ".join(
        result.stderr.replace("│", " ").split()
    )


def test_node_refuses_a_role_it_does_not_know() -> None:
    result = CliRunner().invoke(
        build_app(), ["node", "--internal-token", INTERNAL_TOKEN, "--role", "both"]
    )
    assert result.exit_code == 2
    assert "must be one of mixed, prefill, decode" in " ".join(
        result.stderr.replace("│", " ").split()
    )


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_refuses_tensor_parallelism_for_a_role_that_hands_kv_over(role: str) -> None:
    args = ["node", "--internal-token", INTERNAL_TOKEN, "--role", role, "--tensor-parallel", "2"]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 2
    assert (
        f"Invalid value for --tensor-parallel: a {role} node hands KV over, which is not "
        "served under tensor parallelism: run it with --role mixed"
    ) in _stderr(result)


@pytest.mark.parametrize("node_id", ["", "node 1", "n" * 257, "a{b}"])
def test_node_refuses_an_id_billing_could_not_store(node_id: str) -> None:
    # Every usage event names its node; billing dead-letters an id past 256 characters.
    result = CliRunner().invoke(
        build_app(), ["node", "--internal-token", INTERNAL_TOKEN, "--node-id", node_id]
    )
    assert result.exit_code == 2
    assert "must be 1-256 characters of letters, digits and @/_.:+=-" in " ".join(
        result.stderr.replace("│", " ").split()
    )


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
