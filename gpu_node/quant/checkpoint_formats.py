"""Checkpoints that arrive already quantized (config.json's `quantization_config`).

We import a format only where its arithmetic maps exactly onto our INT4 (codes 0..15,
one scale and one min per group along the input); anything else is refused with a
message, never approximated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_node.errors import ModelNotFoundError


def refuse_unless_importable(quantization: Mapping[str, Any]) -> None:
    method = quantization.get("quant_method", "unknown")
    raise ModelNotFoundError(
        f"checkpoints quantized with {method!r} are not imported; serve the original "
        f"(bf16/fp16) checkpoint with --weights int4 to quantize it on load"
    )
