"""`edgeserve gateway` and `edgeserve node` refuse bad settings before they start anything."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.conftest import INTERNAL_TOKEN


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


@pytest.mark.parametrize(
    ("command", "device", "message"),
    [
        ("node", "gpu", "must be auto, cpu or cuda (CUDA_VISIBLE_DEVICES chooses the GPU)"),
        ("up", "cuda:1", "must be auto, cpu or cuda (CUDA_VISIBLE_DEVICES chooses the GPU)"),
        ("node", "cuda", "cuda: no CUDA GPU is visible here"),  # this machine has none
        ("up", "cuda", "cuda: no CUDA GPU is visible here"),
        ("run", "tpu", "must be auto, cpu or cuda (CUDA_VISIBLE_DEVICES chooses the GPU)"),
        ("run", "cuda", "cuda: no CUDA GPU is visible here"),
    ],
)
def test_node_up_and_run_refuse_a_device_they_cannot_use(command, device, message) -> None:
    import torch

    if torch.cuda.is_available() and "visible" in message:
        pytest.skip("this machine has a CUDA GPU: the device is usable")  # never on CI
    extra = {"node": ["--internal-token", INTERNAL_TOKEN], "run": ["smollm2", "Hello"]}.get(
        command, []
    )
    result = CliRunner().invoke(build_app(), [command, *extra, "--device", device])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.replace("│", " ").split())


@pytest.mark.parametrize("command", ["node", "up", "run"])
def test_a_kv_dtype_the_engine_does_not_have_is_refused(command) -> None:
    extra = {"node": ["--internal-token", INTERNAL_TOKEN], "run": ["smollm2", "Hello"]}.get(
        command, []
    )
    result = CliRunner().invoke(
        build_app(), [command, *extra, "--device", "cpu", "--kv-dtype", "int8"]
    )
    assert result.exit_code == 2
    assert "must be auto, fp32, bf16, fp16, fp8" in " ".join(
        result.stderr.replace("│", " ").split()
    )


def test_auto_kv_dtype_is_fp32_on_the_cpu_and_bf16_on_a_gpu() -> None:
    from edgeserve.engine_options import resolve_kv_dtype

    assert resolve_kv_dtype("auto", "cpu") == "fp32"
    assert resolve_kv_dtype("auto", "cuda") == "bf16"
    assert resolve_kv_dtype("fp8", "cuda") == "fp8" and resolve_kv_dtype("fp8", "cpu") == "fp8"


@pytest.mark.parametrize("command", ["node", "up", "run"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--activations", "fp8"], "must be one of auto, bf16, fp16"),
        (
            ["--activations", "fp16"],
            "activations fp16 takes int4 weights on a CUDA GPU of compute capability 8.0 or "
            "newer (the tensor-core W4A16 kernels); int4 weights on cpu compute in fp32: use "
            "activations auto",
        ),
        (
            ["--activations", "fp16", "--weights", "bf16"],
            "bf16 weights on cpu compute in bf16: use activations auto",
        ),
    ],
)
def test_activations_the_node_cannot_compute_in_are_refused_before_it_starts(
    command, args, message
) -> None:
    extra = {"node": ["--internal-token", INTERNAL_TOKEN], "run": ["smollm2", "Hello"]}.get(
        command, []
    )
    result = CliRunner().invoke(build_app(), [command, *extra, "--device", "cpu", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.replace("│", " ").split())


def test_auto_kv_dtype_follows_fp16_activations_on_a_gpu() -> None:
    from edgeserve.engine_options import resolve_kv_dtype

    assert resolve_kv_dtype("auto", "cuda", "fp16") == "fp16"
    assert resolve_kv_dtype("auto", "cuda", "auto") == "bf16"
    assert resolve_kv_dtype("auto", "cpu", "fp16") == "fp32"
    assert resolve_kv_dtype("fp8", "cuda", "fp16") == "fp8"


@pytest.mark.parametrize(
    "command",
    [
        ["up", "--device", "cpu"],
        ["node", "--internal-token", INTERNAL_TOKEN, "--device", "cpu"],
        ["gateway", "--internal-token", INTERNAL_TOKEN],
    ],
)
def test_a_port_in_use_is_one_line_before_any_banner(command: list[str]) -> None:
    """`up` had printed its banner (a new API key that would never work), then ~10 KB of
    tracebacks; each command now binds its port before it prints or loads anything."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(build_app(), [*command, "--port", str(port)])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_host_that_does_not_resolve_is_one_readable_line() -> None:
    """getaddrinfo's errors carry negative codes: they had read "Unknown error -2"."""
    result = CliRunner().invoke(
        build_app(),
        ["gateway", "--internal-token", INTERNAL_TOKEN, "--host", "no-such-host.invalid"],
    )
    assert (result.exit_code, result.stdout) == (1, "")
    [line] = result.stderr.splitlines()
    assert line.startswith("error: cannot listen on no-such-host.invalid:8080: ")
    assert "Unknown error" not in line


def test_every_address_of_the_host_is_bound() -> None:
    """A host of several addresses ("" for all, a dual-stack name) had had only the first
    bound, where uvicorn had bound every one."""
    import socket

    from edgeserve.servers import listen
    from tests.conftest import free_port

    port = free_port()
    sockets = listen("", port)
    try:
        bound = sorted((s.family, s.getsockname()[:2]) for s in sockets)
    finally:
        for s in sockets:
            s.close()
    expected = [(socket.AF_INET, ("0.0.0.0", port))]
    if socket.has_ipv6:
        expected.append((socket.AF_INET6, ("::", port)))
    assert bound == expected
