"""The W4A16 Triton kernel equals its torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import pytest
import torch

import gpu_node.kernels.w4a16.dot as w4a16_module
from gpu_node.kernels.w4a16.reference import w4a16_matmul_ref
from gpu_node.quant.int4 import quantize_int4

w4a16_config = w4a16_module.w4a16_config
w4a16_matmul = w4a16_module.w4a16_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max |kernel - reference| over max |reference|: both accumulate in fp32, so what is
# left is the summation order plus one rounding of the output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize(
    ("m", "n", "k", "group_size", "split_k"),
    [
        (1, 64, 256, 32, None),
        (1, 80, 512, 128, 3),  # N off the tile, uneven split-K
        (4, 128, 256, 64, 2),
        (17, 64, 128, 32, None),  # BLOCK_M 32
        (33, 96, 256, 128, 1),  # BLOCK_M 64, one K step per group
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_reference(
    m: int, n: int, k: int, group_size: int, split_k: int | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = quantize_int4(torch.randn(n, k, generator=gen), group_size).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    y = w4a16_matmul(x, weight, None if split_k is None else {"SPLIT_K": split_k})
    ref = w4a16_matmul_ref(x, weight)
    assert y.shape == (m, n) and y.dtype == dtype
    assert bool(torch.isfinite(y).all())
    err = (y.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert float(err) <= TOLERANCE[dtype]


def test_symmetric_weights_and_leading_dims() -> None:
    gen = torch.Generator().manual_seed(11)
    weight = quantize_int4(torch.randn(64, 128, generator=gen), 64, symmetric=True).to(DEVICE)
    x = torch.randn(2, 3, 128, generator=gen).to(DEVICE)
    y = w4a16_matmul(x, weight)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y, w4a16_matmul_ref(x, weight), rtol=1e-5, atol=1e-4)


def test_empty_batch_and_bad_shapes() -> None:
    weight = quantize_int4(torch.randn(64, 128), 32).to(DEVICE)
    assert w4a16_matmul(torch.empty(0, 128, device=DEVICE), weight).shape == (0, 64)
    with pytest.raises(ValueError, match="128"):
        w4a16_matmul(torch.randn(2, 64, device=DEVICE), weight)
    stacked = quantize_int4(torch.randn(2, 64, 128), 32)
    with pytest.raises(ValueError, match="2-D"):
        w4a16_matmul(torch.randn(2, 128), stacked)


def test_decode_sizes_split_k_to_fill_the_gpu() -> None:
    # 4096 x 4096 at M = 1 on 132 SMs: 64 output tiles; 8 ways (4 K steps each) give 512 programs.
    assert w4a16_config(1, 4096, 4096, 128, num_sms=132) == {
        "BLOCK_M": 16,
        "BLOCK_N": 64,
        "BLOCK_K": 128,
        "SPLIT_K": 8,
    }
    assert w4a16_config(64, 14336, 4096, 128, num_sms=132)["SPLIT_K"] == 2  # 224 tiles
    assert w4a16_config(128, 14336, 4096, 128, num_sms=132)["SPLIT_K"] == 1  # 448 tiles
