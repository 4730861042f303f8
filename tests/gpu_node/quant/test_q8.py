"""Q8_0 linears: GGUF's blocks kept as they are, float weights quantized as GGUF does, and
the product inside and outside the CPU kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu_node.kernels import cpu as cpu_kernels
from gpu_node.quant.q8 import Q8Linear


def gguf_q8_0(weight: torch.Tensor) -> np.ndarray:
    return quantize(weight.numpy(), GGMLQuantizationType.Q8_0)


def test_gguf_blocks_are_kept_as_the_file_holds_them():
    weight = torch.randn(48, 96)
    raw = gguf_q8_0(weight)
    linear = Q8Linear.from_gguf(raw, (48, 96))
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)).view(48, 96)
    assert torch.equal(linear.dequantized(), expected)
    assert linear.codes.dtype == torch.int8 and linear.scales.dtype == torch.float16


def test_a_float_weight_is_quantized_as_gguf_quantizes_it():
    weight = torch.randn(40, 64)
    mine = Q8Linear.from_weight(weight)
    theirs = Q8Linear.from_gguf(gguf_q8_0(weight), (40, 64))
    assert torch.equal(mine.scales, theirs.scales)
    assert (mine.codes.int() - theirs.codes.int()).abs().max().item() <= 1  # ties may round apart
    error = (mine.dequantized() - weight).abs()
    assert bool((error <= mine.scales.float().repeat_interleave(32, 1) / 2 + 1e-6).all())


def test_outside_the_kernels_the_product_is_the_dequantized_weights():
    linear = Q8Linear.from_weight(torch.randn(24, 64))
    x = torch.randn(3, 64)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.dequantized()))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build the kernels")
def test_inside_the_kernels_rows_past_one_call_are_split_and_joined():
    linear = Q8Linear.from_weight(torch.randn(24, 64))
    x = torch.randn(cpu_kernels.MAX_ROWS + 5, 64)
    with cpu_kernels.active():
        y = linear(x)
    rows = cpu_kernels.MAX_ROWS
    parts = [cpu_kernels.q8_matmul(x[:rows], linear.codes, linear.scales)]
    parts.append(cpu_kernels.q8_matmul(x[rows:], linear.codes, linear.scales))
    assert torch.equal(y, torch.cat(parts))
    exact = x @ linear.dequantized().t()
    assert ((y - exact).norm() / exact.norm()).item() < 1e-4  # int16 activations' rounding


def test_shapes_that_do_not_hold_blocks_of_32_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Linear(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="does not hold"):
        Q8Linear.from_gguf(np.zeros(10, dtype=np.uint8), (4, 64))
