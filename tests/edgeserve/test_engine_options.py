"""The engine options `up`, `node` and `run` share (edgeserve/engine_options.py): a device, KV
dtype or activations the node cannot use is refused before it starts; what auto resolves to."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.conftest import INTERNAL_TOKEN


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
