"""The W4A16 GEMV kernel equals its torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import gpu_node.kernels.w4a16 as w4a16_module
import gpu_node.kernels.w4a16_gemv as gemv_module
from gpu_node.quant.int4 import quantize_int4

# Triton fixes interpreted-or-compiled when a kernel is decorated, and another test or
# conftest may have imported the kernels before TRITON_INTERPRET was set: decorate them
# again (the GEMV first, so that the matmul module's dispatch sees the fresh one).
gemv_module = importlib.reload(gemv_module)
w4a16_module = importlib.reload(w4a16_module)
permute_activations = gemv_module.permute_activations
w4a16_gemv = gemv_module.w4a16_gemv
w4a16_gemv_config = gemv_module.w4a16_gemv_config
w4a16_matmul = w4a16_module.w4a16_matmul
w4a16_matmul_ref = w4a16_module.w4a16_matmul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max |kernel - reference| over max |reference|: both accumulate in fp32, so what is
# left is the summation order plus one rounding of the output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize(
    ("m", "n", "k", "group_size"),
    [
        (1, 37, 64, 32),  # one partial step (2 of 32 chunks), N off the row block
        (3, 50, 4096, 128),  # one full step of 4 warps; BLOCK_M 4 with a padded row
        (8, 21, 2048, 64),  # 64 chunks: 2 warps, one step
        (1, 66, 4160, 32),  # 4096 + 64: a full step and a masked one
        (3, 19, 576, 64),  # SmolLM2's hidden size: 18 chunks, one warp, masked
        (8, 6, 256, 128),  # N smaller than a row block
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(
    m: int, n: int, k: int, group_size: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = quantize_int4(torch.randn(n, k, generator=gen), group_size).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    y = w4a16_gemv(x, weight)
    ref = w4a16_matmul_ref(x, weight)
    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    assert bool(torch.isfinite(y).all())
    assert relative_error(y, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    "config",
    [
        {"SPLIT_K": 3},  # 5 steps over 3 splits: 2, 2, 1
        {"SPLIT_K": 8},  # more splits than steps: the last ones add nothing
        {"BLOCK_N": 8},
        {"BLOCK_N": 1, "BLOCK_M": 8},  # M = 2 in a BLOCK_M of 8: six zero rows
        {"BLOCK_C": 64, "num_warps": 2, "SPLIT_K": 2},
    ],
)
def test_config_overrides_keep_the_result(config: dict[str, int]) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = quantize_int4(torch.randn(24, 160 * 32, generator=gen), 128).to(DEVICE)
    x = torch.randn(2, 160 * 32, generator=gen).to(DEVICE)
    cfg = {"BLOCK_C": 32, "num_warps": 1, **config}  # 160 chunks: 5 steps of 32
    y = w4a16_gemv(x, weight, config=cfg)
    assert relative_error(y, w4a16_matmul_ref(x, weight)) <= TOLERANCE[torch.float32]


def test_fp16_and_symmetric_weights() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = quantize_int4(torch.randn(40, 512, generator=gen), 64, symmetric=True).to(DEVICE)
    x = torch.randn(4, 512, generator=gen).to(DEVICE, torch.float16)
    y = w4a16_gemv(x, weight)
    assert y.dtype == torch.float16
    assert relative_error(y, w4a16_matmul_ref(x, weight)) <= TOLERANCE[torch.float16]


def test_extreme_codes_and_scales() -> None:
    # Every code 15 (all bits of every word set, the sign bit too) and 0, with fp16
    # scales at both ends of their range: the exponent trick must stay exact.
    n, k = 8, 256
    weight = quantize_int4(torch.randn(n, k), 32)
    packed = weight.packed.clone()
    packed[:4] = 0xFF
    packed[4:] = 0x00
    scales = torch.full_like(weight.scales, 2.0**-24)  # the smallest fp16 subnormal
    scales[::2] = 60000.0
    mins = torch.full_like(weight.mins, -3.0)
    extreme = type(weight)(packed, scales, mins, weight.shape, weight.group_size).to(DEVICE)
    x = torch.linspace(0.5, 1, k).reshape(1, k).to(DEVICE)  # one sign: no cancellation
    y = w4a16_gemv(x, extreme)
    torch.testing.assert_close(y, w4a16_matmul_ref(x, extreme), rtol=1e-6, atol=1e-3)


def test_permute_activations_follows_the_packing() -> None:
    # x_perm[m, p, 4c + j] = x[m, 32c + 16 * (p % 2) + 4j + p // 2], zero-padded.
    x = torch.arange(2 * 64, dtype=torch.float32).reshape(2, 64)
    x_perm = permute_activations(x, block_m=4, padded_k=128)
    assert x_perm.shape == (4, 8, 16) and x_perm.dtype == torch.float32
    assert x_perm[0, 0, :8].tolist() == [0.0, 4.0, 8.0, 12.0, 32.0, 36.0, 40.0, 44.0]
    assert x_perm[1, 1, :4].tolist() == [80.0, 84.0, 88.0, 92.0]  # row 1: +64, high: +16
    assert x_perm[0, 7, :4].tolist() == [19.0, 23.0, 27.0, 31.0]  # byte 3, high nibble
    assert int(torch.count_nonzero(x_perm[:, :, 8:])) == 0  # past K
    assert int(torch.count_nonzero(x_perm[2:])) == 0  # past M
    assert sorted(x_perm[:2, :, :8].flatten().tolist()) == x.flatten().tolist()


def test_matmul_dispatches_decode_batches_to_the_gemv() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = quantize_int4(torch.randn(48, 256, generator=gen), 32).to(DEVICE)
    x = torch.randn(2, 3, 256, generator=gen).to(DEVICE, torch.bfloat16)  # M = 6
    y = w4a16_matmul(x, weight)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y, w4a16_gemv(x.reshape(6, 256), weight).reshape(2, 3, 48))
    assert relative_error(y, w4a16_matmul_ref(x, weight)) <= TOLERANCE[torch.bfloat16]
    # An explicit split-K still asks for the tensor-core kernel; M = 9 goes there too.
    nine = torch.randn(9, 256, generator=gen).to(DEVICE)
    assert relative_error(w4a16_matmul(nine, weight), w4a16_matmul_ref(nine, weight)) <= 1e-5
    one = torch.randn(1, 256, generator=gen).to(DEVICE)
    y_mma = w4a16_matmul(one, weight, split_k=2)
    assert relative_error(y_mma, w4a16_matmul_ref(one, weight)) <= 1e-5


def test_bad_input_is_refused() -> None:
    weight = quantize_int4(torch.randn(64, 128), 32).to(DEVICE)
    with pytest.raises(ValueError, match=r"1\.\.8 rows, got 9"):
        w4a16_gemv(torch.randn(9, 128, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"1\.\.8 rows, got 0"):
        w4a16_gemv(torch.randn(0, 128, device=DEVICE), weight)
    with pytest.raises(ValueError, match="x has 64 features, weight expects 128"):
        w4a16_gemv(torch.randn(2, 64, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        w4a16_gemv(torch.randn(2, 3, 128, device=DEVICE), weight)
    with pytest.raises(TypeError, match=r"torch\.int32"):
        w4a16_gemv(torch.ones(2, 128, dtype=torch.int32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="2-D"):
        w4a16_gemv(torch.randn(2, 128), quantize_int4(torch.randn(2, 64, 128), 32))
    with pytest.raises(ValueError, match="BLOCK_C must be 32 \\* num_warps"):
        w4a16_gemv(torch.randn(2, 128, device=DEVICE), weight, config={"BLOCK_C": 64})
    with pytest.raises(ValueError, match="BLOCK_M 2 < M = 3"):
        w4a16_gemv(torch.randn(3, 128, device=DEVICE), weight, config={"BLOCK_M": 2})


def test_config_for_decode_shapes() -> None:
    # 4096 x 4096 at M = 1 on 132 SMs: 4 warps span a whole row (128 chunks) in one
    # step; 1024 row blocks of 4 rows fill the GPU without splitting K.
    assert w4a16_gemv_config(1, 4096, 4096, num_sms=132) == {
        "BLOCK_M": 1,
        "BLOCK_N": 4,
        "BLOCK_C": 128,
        "SPLIT_K": 1,
        "num_warps": 4,
    }
    # M = 3 pads to 4 rows and halves the row block (the accumulator grows with M).
    assert w4a16_gemv_config(3, 4096, 4096, num_sms=132)["BLOCK_M"] == 4
    assert w4a16_gemv_config(3, 4096, 4096, num_sms=132)["BLOCK_N"] == 2
    # 128 row blocks cannot give 132 SMs four programs each, but a split keeps at
    # least 2 steps: K = 7168 (2 steps) stays whole, K = 14336 (4 steps) splits 2 ways.
    assert w4a16_gemv_config(1, 512, 7168, num_sms=132)["SPLIT_K"] == 1
    assert w4a16_gemv_config(1, 512, 14336, num_sms=132)["SPLIT_K"] == 2
    # Small K: fewer warps, so that no lane holds a chunk past K.
    assert w4a16_gemv_config(1, 4096, 2048, num_sms=132)["num_warps"] == 2
    assert w4a16_gemv_config(1, 576, 576, num_sms=132)["num_warps"] == 1
