"""The node engine's config (config.py): what it refuses, naming the field."""

import pytest

from gpu_node.config import EngineConfig


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"activations": "fp8"}, "activations must be one of auto, bf16, fp16, got 'fp8'"),
        (
            {"activations": "fp16", "weights": "bf16"},
            "activations fp16 takes int4 weights (they run the fp16 W4A16 kernels); bf16 "
            "weights compute in their own dtype: use activations auto",
        ),
    ],
)
def test_engine_config_refuses_activations_it_cannot_serve(options, message):
    with pytest.raises(ValueError) as info:
        EngineConfig(**options)
    assert str(info.value) == f"invalid EngineConfig: {message}"
